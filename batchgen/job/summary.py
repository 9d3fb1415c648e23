"""summary.json: totals, throughput, and where each step's time went, split by step kind and graph/eager."""

from __future__ import annotations

import platform
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from functools import cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchgen.engine.collector import Collections

TIME_COLUMNS = ("schedule_ms", "prepare_ms", "forward_ms", "sample_ms", "wait_ms", "step_ms")


def versions() -> dict[str, str | None]:
    return dict(_versions())


@cache  # each lookup searches the installed packages; a job records them twice (the files' metadata, the summary)
def _versions() -> dict[str, str | None]:
    import torch  # here, not at import: the job reads its inputs before the engine needs torch

    found: dict[str, str | None] = {"python": platform.python_version(), "cuda": torch.version.cuda}
    for package in ("batchgen", "torch", "transformers", "triton", "pyarrow"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = None
    return found


def step_medians(steps: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Median times per group "<kind>/<graph|eager>", with the group's step count and mean batch size."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for step in steps:
        groups[f"{step['kind']}/{'graph' if step['cuda_graph'] else 'eager'}"].append(step)
    return {
        name: {
            "steps": len(rows),
            "mean_num_seqs": statistics.fmean(r["num_seqs"] for r in rows),
            **{f"median_{c}": statistics.median(r[c] for r in rows) for c in TIME_COLUMNS},
        }
        for name, rows in sorted(groups.items())
    }


@dataclass
class AttemptStats:
    """What this attempt did. Its phases follow each other: the job's own (reading its input to its final files) add
    up to its wall time; before them, the process's start-up, where the process started at batchgen's entry point
    (batchgen/__main__.py) and this is its first job. The wall time leaves it out, so that the jobs of a multirun
    compare."""

    number: int  # 0 for the first run, +1 per resume
    rows: int = 0  # rows this attempt finished, error rows included
    prompt_tokens: int = 0  # of the rows the engine ran (RequestOutput.num_prompt_tokens_run)
    output_tokens: int = 0
    # The process's start until the job's (batchgen.job.process_clock): interpreter, imports, Hydra, config, launch.
    startup_phases: dict[str, float] = field(default_factory=dict)
    read_input_seconds: float = 0.0  # reading, validating and tokenizing the input
    open_outputs_seconds: float = 0.0  # checking the run dir, opening its writers (reading a resumed run's rows)
    engine_start_seconds: float = 0.0  # loading the model, allocating the KV cache, capturing CUDA graphs
    wait_for_ranks_seconds: float = 0.0  # a data-parallel rank: waiting for the other ranks' engines
    engine_loop_seconds: float = 0.0  # from the first request added to the last row written
    # Python's garbage collections during the engine loop: how many, and their seconds.
    engine_loop_collections: Collections = field(default_factory=Collections)
    # Releasing the model, KV cache and graphs (the device's memory); with job.profile_steps, kernels.parquet's write.
    engine_close_seconds: float = 0.0
    finish_seconds: float = 0.0  # merging the part files into the final files
    # Unix seconds, comparable across the processes of one machine: engine ready, engine loop start and end.
    engine_ready_at: float | None = None
    generation_started_at: float | None = None
    generation_finished_at: float | None = None

    @property
    def startup_seconds(self) -> float:
        return sum(self.startup_phases.values())

    @property
    def job_phases(self) -> dict[str, float]:
        """The job's phases in order, by name: their seconds add up to wall_seconds."""
        return {"read_input": self.read_input_seconds, "open_outputs": self.open_outputs_seconds,
                "engine_start": self.engine_start_seconds, "wait_for_ranks": self.wait_for_ranks_seconds,
                "engine_loop": self.engine_loop_seconds, "engine_close": self.engine_close_seconds,
                "finish": self.finish_seconds}

    @property
    def wall_seconds(self) -> float:
        return sum(self.job_phases.values())

    def time_line(self) -> str:
        """Where the process's time until the final files went, in one line for the log."""
        phases = self.job_phases
        if not self.wait_for_ranks_seconds:  # a data-parallel rank's only
            del phases["wait_for_ranks"]
        spans = [f"{name.replace('_', ' ')} {seconds:.2f} s" for name, seconds in phases.items()]
        if self.startup_phases:
            startup = ", ".join(f"{phase.replace('_', ' ')} {seconds:.2f}"
                                for phase, seconds in self.startup_phases.items())
            spans.insert(0, f"start-up {self.startup_seconds:.2f} s ({startup})")
        return f"Time to the final files {self.startup_seconds + self.wall_seconds:.1f} s: {', '.join(spans)}"


def generation_phase(started_at: float, finished_at: float, output_tokens: int) -> dict[str, float]:
    """The engine loop alone (no imports, model load or graph capture): output tokens over its span."""
    seconds = finished_at - started_at
    return {"started_at": started_at, "finished_at": finished_at, "seconds": seconds, "output_tokens": output_tokens,
            "output_tokens_per_s": output_tokens / seconds if seconds > 0 else 0.0}


def attempt_summary(stats: AttemptStats, steps: list[dict[str, Any]]) -> dict[str, Any]:
    """This attempt's figures; time_seconds splits the process's time until the final files: its start-up (split in
    startup_phases), then the job's phases, which add up to its wall time (see AttemptStats), with the engine loop
    split into the steps' step_ms and the loop time outside every step (adding the first requests, writing the last
    rows)."""
    wall = stats.wall_seconds
    step_seconds = sum(step["step_ms"] for step in steps) / 1000
    return {
        "attempt": stats.number,
        "rows": stats.rows,
        "prompt_tokens": stats.prompt_tokens,
        "output_tokens": stats.output_tokens,
        "steps": len(steps),
        "wall_seconds": wall,
        "prompt_tokens_per_s": stats.prompt_tokens / wall if wall > 0 else 0.0,
        "output_tokens_per_s": stats.output_tokens / wall if wall > 0 else 0.0,
        "time_seconds": {
            "startup": stats.startup_seconds,
            "read_input": stats.read_input_seconds,
            "open_outputs": stats.open_outputs_seconds,
            "engine_start": stats.engine_start_seconds,
            "wait_for_ranks": stats.wait_for_ranks_seconds,
            "steps": step_seconds,
            "outside_steps": stats.engine_loop_seconds - step_seconds,
            "engine_close": stats.engine_close_seconds,
            "finish": stats.finish_seconds,
        },
        "startup_phases": stats.startup_phases,
        # Inside the engine loop's time: Python's garbage collections while it ran.
        "engine_loop_collections": {"count": stats.engine_loop_collections.count,
                                    "seconds": stats.engine_loop_collections.seconds},
        "engine_ready_at": stats.engine_ready_at,
        # None where the runner has no engine loop of its own (runner=ray).
        "generation": None if stats.generation_finished_at is None else generation_phase(
            stats.generation_started_at, stats.generation_finished_at, stats.output_tokens),
    }


def ran_rows(completions: pa.Table) -> pa.Table:
    """The completions rows the engine ran: every row but the errors found before it ran (a malformed input row, a
    prompt longer than max_model_len), which have no output tokens. RequestOutput.num_prompt_tokens_run's rule."""
    failed_unrun = pc.and_(pc.equal(completions["finish_reason"], "error"),
                           pc.equal(pc.fill_null(completions["num_output_tokens"], 0), 0))
    return completions.filter(pc.invert(failed_unrun))


def job_totals(completions: pa.Table, steps: pa.Table, attempts: int) -> dict[str, Any]:
    """The `job` scope: every row and step on disk, over all `attempts`."""
    reasons = {r["values"]: r["counts"] for r in completions.column("finish_reason").value_counts().to_pylist()}
    ran = ran_rows(completions)
    prompt_tokens = pc.sum(ran["num_prompt_tokens"]).as_py() or 0
    cached_tokens = pc.sum(ran["num_cached_tokens"]).as_py() or 0
    return {
        "rows": completions.num_rows,
        "error_rows": reasons.get("error", 0),
        "finish_reasons": reasons,
        "prompt_tokens": prompt_tokens,
        "cached_prompt_tokens": cached_tokens,
        "prefix_cache_hit_rate": cached_tokens / prompt_tokens if prompt_tokens else 0.0,
        "output_tokens": pc.sum(completions["num_output_tokens"]).as_py() or 0,
        "attempts": attempts,
        "steps": steps.num_rows,
        "step_seconds": (pc.sum(steps["step_ms"]).as_py() or 0) / 1000,
    }


def summary_document(job: dict[str, Any], attempt: dict[str, Any], attempt_steps: list[dict[str, Any]],
                     engine_info: dict[str, Any] | None, config: dict[str, Any] | None) -> dict[str, Any]:
    """summary.json's keys, the same for a local run and a merge of shards: `job` and `this_attempt`, and at the top
    level the keys of earlier versions taken from them."""
    return {
        **{key: job[key] for key in ("rows", "finish_reasons", "prompt_tokens", "cached_prompt_tokens",
                                     "prefix_cache_hit_rate", "output_tokens")},
        **{key: attempt[key] for key in ("attempt", "wall_seconds", "steps", "prompt_tokens_per_s",
                                         "output_tokens_per_s")},
        "step_medians": step_medians(attempt_steps),
        "generation": attempt["generation"],
        "job": job,
        "this_attempt": attempt,
        "engine": engine_info,
        "versions": versions(),
        "config": config,
    }


def summarize(completions_path: Path, steps_path: Path, stats: AttemptStats, engine_info: dict[str, Any],
              config: dict[str, Any]) -> dict[str, Any]:
    """The top-level keys keep their first meaning: rows, finish_reasons and token totals are the whole job's;
    attempt, wall_seconds, steps, tok/s, step_medians and generation (the engine loop's span and tok/s) are this
    attempt's. `job` and `this_attempt` repeat them under names that say so, with the figures of the other scope.

    prompt_tokens (and prompt tok/s, cached_prompt_tokens, prefix_cache_hit_rate) count the prompt tokens that ran:
    an error row found before it ran adds none, though its completions row's num_prompt_tokens still says how long
    its prompt is (why a prompt longer than max_model_len failed)."""
    completions = pq.read_table(completions_path, columns=["finish_reason", "num_prompt_tokens", "num_output_tokens",
                                                           "num_cached_tokens"])
    steps = pq.read_table(steps_path)
    this_attempt = steps.filter(pc.equal(steps["attempt"], stats.number)).to_pylist()
    return summary_document(job_totals(completions, steps, stats.number + 1), attempt_summary(stats, this_attempt),
                            this_attempt, engine_info, config)
