"""runner=ray: the job's rows stream through Ray Data to runner.num_replicas engine actors; this driver writes the
same run directory as a local job (completions in input order, steps with a `shard` column per actor, summary).

Ray Data restarts an actor that dies and retries its batch (its defaults for actor pools: max_restarts and
max_task_retries unbounded), and a failed task's output is never emitted, so no row is lost or duplicated;
a killed driver resumes like a local job (job.resume=true).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import ray
import ray.data

from batchgen.config import Config, ConfigError
from batchgen.engine.detokenizer import Detokenizer
from batchgen.io.openai_batch import model_name
from batchgen.io.readers import PromptRow, read_prompts
from batchgen.io.schema import with_metadata
from batchgen.io.writers import CompletionWriter, StepWriter, write_json_atomic
from batchgen.job import STEP_FLUSH_ROWS, SUMMARY_FILE, completion_record
from batchgen.outputs import RequestOutput
from batchgen.progress import Progress
from batchgen.runners.ray_actor import INFO, OUTPUT, STEP, EngineActor
from batchgen.runners.shards import SHARDED_STEPS_SCHEMA
from batchgen.summary import AttemptStats, summarize, versions

log = logging.getLogger(__name__)


class ShardedStepWriter(StepWriter):
    """steps.parquet with the `shard` column: here the number of the actor that ran the step."""

    def __init__(self, run_dir: Path, metadata: dict[str, Any], flush_seconds: float) -> None:
        super(StepWriter, self).__init__(run_dir / self.FILE_NAME, with_metadata(SHARDED_STEPS_SCHEMA, metadata),
                                         None, STEP_FLUSH_ROWS, flush_seconds)


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


def _missing_samples(rows: list[PromptRow], config: Config, written: dict[int, set[int]]) -> dict[int, list[int]]:
    """The sample indices each row still lacks (sampling.n of them, or one for a row with an error)."""
    missing = {}
    for row in rows:
        if row.error is None:
            try:
                num_samples = config.sampling.with_overrides(row.overrides).n
            except ValueError as exc:
                row.error = f"row {row.index}: {exc}"
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
            completions.write(completion_record(row))
            progress.update([], errors=1)
            continue
        requests.append({"row": json.dumps({"index": row.index, "prompt": row.prompt, "samples": missing[row.index],
                                            "prompt_token_ids": row.prompt_token_ids, "overrides": row.overrides})})
    return requests


def run_ray(config: Config, run_dir: Path) -> dict[str, Any]:
    runner = config.runner
    detokenizer = Detokenizer.load(config.model)
    rows = read_prompts(config.data, detokenizer.tokenizer if detokenizer else None, model_name(config.model))
    if (run_dir / CompletionWriter.FILE_NAME).exists() and not config.job.resume:
        raise ConfigError(f"job.resume=false but {run_dir} already holds results; pass job.resume=true to continue")
    metadata = {"config": asdict(config), "versions": versions()}
    completions = CompletionWriter(run_dir, metadata, config.job.flush_rows, config.job.flush_seconds)
    steps = ShardedStepWriter(run_dir, metadata, config.job.flush_seconds)
    written = completions.finished_samples()
    attempt = max(steps.next_attempt(), 1 if written else 0)
    missing = _missing_samples(rows, config, written)
    pending = [row for row in rows if missing[row.index]]
    rows_by_index = {row.index: row for row in pending}
    total = sum(len(written.get(row.index, ())) + len(missing[row.index]) for row in rows)
    already_done = total - sum(len(samples) for samples in missing.values())
    progress = Progress(total, already_done, config.job)
    start = time.perf_counter()
    engine_info: dict[str, Any] = {}
    actor_numbers: dict[str, int] = {}
    try:
        requests = _request_rows(pending, missing, completions, progress)
        if requests:
            _connect()
            gpu = _wants_gpu(config)
            dataset = ray.data.from_items(requests).map_batches(
                EngineActor, fn_constructor_kwargs={"config": config}, batch_size=runner.batch_size,
                compute=ray.data.ActorPoolStrategy(size=runner.num_replicas), num_gpus=1 if gpu else 0,
                num_cpus=0 if gpu else 1)
            for batch in dataset.iter_batches(batch_size=None, batch_format="numpy"):
                for kind, actor, line in zip(batch["kind"], batch["actor"], batch["record"], strict=True):
                    record = json.loads(line)
                    if kind == OUTPUT:
                        output = RequestOutput(**record)
                        completions.write(completion_record(rows_by_index[output.request_id], output))
                        progress.update([output])
                    elif kind == STEP:
                        shard = actor_numbers.setdefault(str(actor), len(actor_numbers))
                        steps.write({**record, "attempt": attempt, "shard": shard})
                    elif kind == INFO:
                        engine_info = engine_info or {**record, "runner": "ray", "num_replicas": runner.num_replicas}
    except BaseException:
        completions.flush()
        steps.flush()
        log.error("Job stopped; finished rows are in %s (resume with job.resume=true)", run_dir)
        raise
    finally:
        progress.close()
    wall = time.perf_counter() - start
    stats = AttemptStats(attempt, rows=progress.done - already_done, prompt_tokens=progress.prompt_tokens,
                         output_tokens=progress.output_tokens, engine_loop_seconds=wall)
    summary = summarize(completions.close(), steps.close(), stats, engine_info, asdict(config))
    write_json_atomic(run_dir / SUMMARY_FILE, summary)
    log.info("Done: %d rows through %d Ray actors in %.1f s -> %s", len(rows), len(actor_numbers), wall, run_dir)
    return summary
