"""Run directories with known numbers, written as a batchgen run writes them, for the report's tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.io.schema import COMPLETIONS_SCHEMA, KERNELS_SCHEMA, STEPS_SCHEMA


def step(index: int, kind: str, step_ms: float, num_seqs: int = 2, padded_size: int | None = None,
         **times: float) -> dict[str, Any]:
    return {"step": index, "attempt": 0, "kind": kind, "num_seqs": num_seqs, "num_tokens": num_seqs,
            "num_prefill_tokens": 0, "num_decode_tokens": num_seqs, "padded_size": padded_size,
            "cuda_graph": padded_size is not None, "cascade_attention": False, "schedule_ms": 0.0, "prepare_ms": 0.0,
            "forward_ms": 0.0, "sample_ms": 0.0, "wait_ms": 0.0, "step_ms": step_ms, "kv_blocks_used": 1,
            "kv_blocks_total": 8, "num_waiting": 0, "num_running": num_seqs, "num_preempted": 0, "num_cached_tokens": 0,
            **times}


def completion(index: int, tokens: list[int], ttft_ms: float = 1.0, finish_reason: str = "length") -> dict[str, Any]:
    return {"index": index, "id": str(index), "prompt": "p", "completion": "c", "prompt_token_ids": [1],
            "output_token_ids": tokens, "num_prompt_tokens": 1, "num_output_tokens": len(tokens),
            "finish_reason": finish_reason, "error": None, "ttft_ms": ttft_ms, "tpot_ms": 2.0, "latency_ms": 10.0}


def summary(output_tok_s: float, rows: int = 2, config: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"rows": rows, "finish_reasons": {"length": rows - 1, "error": 1}, "prompt_tokens": 10,
            "output_tokens": 20, "attempt": 0, "wall_seconds": 2.0, "steps": 4, "prompt_tokens_per_s": 5.0,
            "output_tokens_per_s": output_tok_s, "step_medians": {}, "engine": {"device": "cpu"},
            "config": config or {"engine": {"enforce_eager": True}, "sampling": {"temperature": 0.0}}}


def write_run(path: Path, overrides: list[str] | None, summary_data: dict[str, Any] | None,
              steps: list[dict[str, Any]] | None, completions: list[dict[str, Any]] | None,
              kernels: list[dict[str, Any]] | None = None) -> Path:
    path.mkdir(parents=True)
    if overrides is not None:
        (path / ".hydra").mkdir()
        (path / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    if summary_data is not None:
        (path / "summary.json").write_text(json.dumps(summary_data))
    for name, rows, schema in (("steps", steps, STEPS_SCHEMA), ("completions", completions, COMPLETIONS_SCHEMA),
                               ("kernels", kernels, KERNELS_SCHEMA)):
        if rows is not None:
            pq.write_table(pa.Table.from_pylist(rows, schema=schema), path / f"{name}.parquet")
    return path
