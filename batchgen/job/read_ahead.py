"""A job's input read on a thread from the moment its config is valid, beside the engine's imports (torch) and the
launch (the GPU check), which take a second or more of a GPU job's start-up: by the job's start most of its input is
read. Input problems still stop the job before the model loads: the read's error is raised where the job takes its
input, as a job that reads at its start raises it."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future
from pathlib import Path

from batchgen.config import Config
from batchgen.job.run import Job
from batchgen.runners.local import shard_run_dir


class ReadAhead:
    def __init__(self, config: Config, run_dir: Path):
        """Starts reading the input of the job that run_local runs for config and run_dir."""
        self.config, self.run_dir = config, shard_run_dir(config, run_dir)
        self._job: Future[Job] = Future()
        # A daemon: a process whose start fails exits without waiting for the read.
        threading.Thread(target=self._read, name="batchgen-read-ahead", daemon=True).start()

    @classmethod
    def start(cls, config: Config, run_dir: Path) -> ReadAhead | None:
        """The read, started where this process runs the job alone (run_local); None where the job is Ray's or
        its data-parallel ranks', each of which reads its own share."""
        if (config.runner.name != "local" or config.engine.data_parallel_size > 1
                or int(os.environ.get("WORLD_SIZE", "1")) > 1):
            return None
        return cls(config, run_dir)

    def _read(self) -> None:
        try:
            self._job.set_result(Job(self.config, self.run_dir, ahead=True))
        except BaseException as exc:  # raised where the job is taken
            self._job.set_exception(exc)

    def job(self, config: Config, run_dir: Path) -> Job | None:
        """The job read ahead, started now (Job.begin), once its read ends; None where it was read for another
        config or run directory. Raises what the read raised."""
        if config != self.config or Path(run_dir) != self.run_dir:
            return None
        started_at = time.perf_counter()
        job = self._job.result()
        job.begin(started_at)
        return job
