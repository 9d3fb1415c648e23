"""runner=ray: the job's rows stream through Ray Data to runner.num_replicas engine actors; this driver writes the
same run directory as a local job (completions in input order, steps with a `shard` column per actor, summary).

Ray Data restarts an actor that dies and retries its batch (its defaults for actor pools: max_restarts and
max_task_retries unbounded), and a failed task's output is never emitted, so no row is lost or duplicated;
a killed driver resumes like a local job (job.resume=true), with the same configuration check, and SIGTERM/SIGINT
stop it like a local job: every finished row flushed, then JobStopped.

The input streams: the driver reads rows lazily and hands Ray one window of rows at a time (runner.window_rows), so
neither its memory nor Ray's object store ever holds more than a window of prompts, whatever the input's size.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from contextlib import closing
from itertools import chain
from pathlib import Path
from typing import Any

import ray
import ray.data

from batchgen.config import Config
from batchgen.engine.detokenizer import Detokenizer
from batchgen.engine.outputs import RequestOutput
from batchgen.io.errors import InputError
from batchgen.io.openai_batch import model_name
from batchgen.io.readers import PromptRow, iter_prompts
from batchgen.io.writers import CompletionWriter
from batchgen.job.progress import Progress
from batchgen.job.run import check_run_dir, completion_values
from batchgen.job.run_outputs import RunOutputs
from batchgen.job.stop_signals import JobStopped, StopRequested, StopSignals, run_stoppable
from batchgen.job.summary import AttemptStats
from batchgen.runners.ray_actor import INFO, OUTPUT, STEP, EngineActor
from batchgen.runners.ray_batches import iter_batches
from batchgen.runners.shards import SHARDED_STEPS_SCHEMA
from batchgen.sample.params import row_params

log = logging.getLogger(__name__)

def _connect() -> None:
    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init()
    else:
        ray.init(include_dashboard=False)


def _wants_gpu(config: Config) -> bool:
    if config.engine.device == "cpu":
        return False
    return config.engine.device == "cuda" or ray.cluster_resources().get("GPU", 0) > 0


def _windows(rows: Iterator[PromptRow], size: int) -> Iterator[list[PromptRow]]:
    window: list[PromptRow] = []
    for row in rows:
        window.append(row)
        if len(window) == size:
            yield window
            window = []
    if window:
        yield window


def _missing_samples(rows: list[PromptRow], config: Config, written: dict[int, set[int]]) -> dict[int, list[int]]:
    """The sample indices each row still lacks (sampling.n of them, or one for a row with an error)."""
    missing = {}
    for row in rows:
        if row.error is None:
            try:
                num_samples = row_params(config.sampling, row.overrides, row.index).n
            except ValueError as exc:
                row.error = str(exc)
        if row.error is not None:
            num_samples = 1
        missing[row.index] = [i for i in range(num_samples) if i not in written.get(row.index, ())]
    return missing


def _request_rows(rows: list[PromptRow], missing: dict[int, list[int]], completions: CompletionWriter,
                  progress: Progress) -> list[dict[str, str]]:
    """The rows to generate, as JSON; rows with input or sampling-option errors are written here as error rows."""
    requests = []
    for row in rows:
        if row.error is not None:
            completions.write_values(completion_values(row))
            progress.update([], errors=1)
            continue
        requests.append({"row": json.dumps({"index": row.index, "prompt": row.prompt, "samples": missing[row.index],
                                            "prompt_token_ids": row.prompt_token_ids, "overrides": row.overrides})})
    return requests


class RayDriver:
    """Streams the job's rows through Ray Data window by window and writes what the actors return.

    Driver memory is bounded by a window: it reads the next window only once Ray has returned every output of the
    previous one, and it keeps of the rows only the current window's (plus, like a local job, each row's index:
    the written samples and the sample counts). Ray holds no more: each window is its own `from_items` dataset.
    The price is that each window starts its actor pool anew, engines included; runner.window_rows keeps that rare.
    """

    def __init__(self, config: Config, run_dir: Path):
        self.config, self.run_dir = config, run_dir
        detokenizer = Detokenizer.load(config.model)
        rows = iter_prompts(config.data, detokenizer.tokenizer if detokenizer else None, model_name(config.model))
        self.windows = _windows(rows, config.runner.window_rows)
        self.first_window = next(self.windows, [])  # problems with the input or its config surface here
        if not self.first_window and config.data.on_empty == "fail":
            raise InputError(f"{config.data.path}: no rows to generate (data.on_empty=fail)")
        self.outputs = RunOutputs(config, run_dir, check_run_dir(config, run_dir), SHARDED_STEPS_SCHEMA)
        self.progress = Progress(0, 0, config.job)
        self.num_samples: dict[int, int] = {}  # by row index, for the rows read so far
        self.engine_info: dict[str, Any] = {}
        self.gpu: bool | None = None

    def run(self, signals: StopSignals) -> dict[str, Any]:
        start = time.perf_counter()
        already_done = 0
        try:
            for window in chain([self.first_window], self.windows):
                already_done += self._run_window(window, signals)
                if signals.received is not None:
                    break
        except BaseException as exc:
            self.outputs.flush()
            if isinstance(exc, StopRequested):
                raise self._stopped(exc.signum) from None
            log.error("Job stopped; finished rows are in %s (resume with job.resume=true)", self.run_dir)
            raise
        finally:
            self.progress.close()
        if signals.received is not None:
            self.outputs.flush()
            raise self._stopped(signals.received)
        wall = time.perf_counter() - start
        stats = AttemptStats(self.outputs.attempt, rows=self.progress.done - already_done,
                             prompt_tokens=self.progress.prompt_tokens, output_tokens=self.progress.output_tokens,
                             engine_loop_seconds=wall)
        summary = self.outputs.write_summary(self.outputs.close(), stats, self.engine_info)
        log.info("Done: %d rows through Ray actors in %.1f s -> %s", len(self.num_samples), wall, self.run_dir)
        return summary

    def _run_window(self, window: list[PromptRow], signals: StopSignals) -> int:
        """Generates the window's missing samples; returns how many of its samples an earlier attempt wrote.
        Signals are deferred only while rows are written, so a part file is never cut and waiting on Ray (actors
        loading their models) stops at once."""
        written = self.outputs.written
        missing = _missing_samples(window, self.config, written)
        for row in window:
            self.num_samples[row.index] = len(written.get(row.index, ())) + len(missing[row.index])
        total = sum(self.num_samples[row.index] for row in window)
        done = total - sum(len(samples) for samples in missing.values())
        self.progress.add_rows(total, done)
        pending = [row for row in window if missing[row.index]]
        signals.deferred = True
        requests = _request_rows(pending, missing, self.outputs.completions, self.progress)
        signals.deferred = False
        if not requests or signals.received is not None:
            return done
        _connect()
        if self.gpu is None:
            self.gpu = _wants_gpu(self.config)
        runner = self.config.runner
        dataset = ray.data.from_items(requests).map_batches(
            EngineActor, fn_constructor_kwargs={"config": self.config}, batch_size=runner.batch_size,
            compute=ray.data.ActorPoolStrategy(size=runner.num_replicas), num_gpus=1 if self.gpu else 0,
            num_cpus=0 if self.gpu else 1)
        rows_by_index = {row.index: row for row in pending}
        actor_numbers: dict[str, int] = {}  # a window's actors are shards 0 .. num_replicas - 1
        with closing(iter_batches(dataset)) as batches:
            for batch in batches:
                signals.deferred = True
                self._write_batch(batch, rows_by_index, actor_numbers)
                signals.deferred = False
                if signals.received is not None:
                    break
        return done

    def _write_batch(self, batch: dict[str, Any], rows_by_index: dict[int, PromptRow],
                     actor_numbers: dict[str, int]) -> None:
        for kind, actor, line in zip(batch["kind"], batch["actor"], batch["record"], strict=True):
            record = json.loads(line)
            if kind == OUTPUT:
                output = RequestOutput(**record)
                self.outputs.completions.write_values(completion_values(rows_by_index[output.request_id], output))
                self.progress.update([output])
            elif kind == STEP:
                shard = actor_numbers.setdefault(str(actor), len(actor_numbers))
                self.outputs.steps.write({**record, "attempt": self.outputs.attempt, "shard": shard})
            elif kind == INFO and not self.engine_info:
                self.engine_info = {**record, "runner": "ray", "num_replicas": self.config.runner.num_replicas}

    def _stopped(self, signum: int) -> JobStopped:
        """JobStopped counting the rows read so far (the input streams, so its length is not known)."""
        finished = self.outputs.completions.finished_indices(lambda index: self.num_samples.get(index, 1))
        return JobStopped(signum, len(finished & self.num_samples.keys()), len(self.num_samples))


def run_ray(config: Config, run_dir: Path) -> dict[str, Any]:
    return run_stoppable(lambda signals: RayDriver(config, Path(run_dir)).run(signals))
