"""summary.json: totals, throughput, and where each step's time went, split by step kind and graph/eager."""

from __future__ import annotations

import platform
import statistics
from collections import defaultdict
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

TIME_COLUMNS = ("schedule_ms", "prepare_ms", "forward_ms", "sample_ms", "wait_ms", "step_ms")


def versions() -> dict[str, str | None]:
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


def summarize(completions_path: Path, steps_path: Path, attempt: int, wall_seconds: float,
              attempt_tokens: tuple[int, int], engine_info: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """attempt_tokens: (prompt, output) tokens of the rows finished by this attempt, for its throughput."""
    completions = pq.read_table(completions_path, columns=["finish_reason", "num_prompt_tokens", "num_output_tokens",
                                                           "num_cached_tokens"])
    steps = pq.read_table(steps_path)
    this_attempt = steps.filter(pc.equal(steps["attempt"], attempt)).to_pylist()
    prompt_tokens, output_tokens = attempt_tokens
    reasons = completions.column("finish_reason").value_counts().to_pylist()
    all_prompt_tokens = pc.sum(completions["num_prompt_tokens"]).as_py() or 0
    cached_tokens = pc.sum(completions["num_cached_tokens"]).as_py() or 0
    return {
        "rows": completions.num_rows,
        "finish_reasons": {r["values"]: r["counts"] for r in reasons},
        "prompt_tokens": all_prompt_tokens,
        "cached_prompt_tokens": cached_tokens,
        "prefix_cache_hit_rate": cached_tokens / all_prompt_tokens if all_prompt_tokens else 0.0,
        "output_tokens": pc.sum(completions["num_output_tokens"]).as_py() or 0,
        "attempt": attempt,
        "wall_seconds": wall_seconds,
        "steps": len(this_attempt),
        "prompt_tokens_per_s": prompt_tokens / wall_seconds,
        "output_tokens_per_s": output_tokens / wall_seconds,
        "step_medians": step_medians(this_attempt),
        "engine": engine_info,
        "versions": versions(),
        "config": config,
    }
