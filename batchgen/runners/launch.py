"""Picks how a job runs: Ray Data actors, N spawned ranks, a torchrun rank, or this process alone. Only a process
that runs an engine imports torch and the engine's modules: the parent of spawned ranks starts them first."""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

from batchgen.config import Config
from batchgen.io.atomic import DirectoryLock
from batchgen.job import process_clock
from batchgen.runners.data_parallel import run_data_parallel
from batchgen.runners.gpus import check_gpus, runs_on_cuda
from batchgen.runners.start_barrier import PARENT_MERGES_ENV


def launch(config: Config, run_dir: Path, task_overrides: list[str]) -> dict[str, Any]:
    """Returns the run's summary (a rank other than 0: its shard's). task_overrides: the command line's overrides,
    which spawned ranks repeat. A process that writes the run directory holds its lock (DirectoryLock) meanwhile:
    the Ray driver and the data-parallel parent here, a local job or rank (in its shard's directory) in Job.run."""
    if config.runner.name == "ray":
        from batchgen.runners.ray_data import run_ray  # Ray is an optional extra: imported only when chosen

        with DirectoryLock(run_dir):
            return run_ray(config, run_dir)
    if config.engine.data_parallel_size > 1:
        with DirectoryLock(run_dir):
            return run_data_parallel(config, run_dir, task_overrides)
    from batchgen.runners.local import run_local
    from batchgen.runners.ranks import Rank, run_rank
    from batchgen.worker.compile_pool import close_started, start_ahead
    from batchgen.worker.triton_start import start_triton_in_background

    process_clock.mark("engine_imports")
    freeze_imported_objects()
    if os.environ.get(PARENT_MERGES_ENV) != "1":  # a spawned rank's parent checked while its ranks started
        check_gpus(config)
    if runs_on_cuda(config):
        start_triton_in_background()  # first: its imports of Triton, before any thread's
        start_ahead(config.engine)  # on a fresh machine: compile processes that start up while the input is read
    else:
        close_started()  # the command line's, started ahead of torch for a GPU that torch does not find
    if (rank := Rank.from_env()) is not None:
        return run_rank(config, run_dir, rank)
    return run_local(config, run_dir)


def freeze_imported_objects() -> None:
    """The imported modules' objects (mostly torch's) live as long as the process: left out of every later
    collection, a full one (the engine's close, Python's own) goes over the job's objects only. Frozen objects
    are never collected, not even at exit, so only before a process's first job: in a multirun, a freeze before the
    next job would keep what the previous one imported (Triton) alive past the interpreter's end, where nanobind
    lists Triton's objects as leaked."""
    if gc.get_freeze_count() == 0:
        gc.freeze()
