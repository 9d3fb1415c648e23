"""Merges the shards of a run into one run directory: the one place that guarantees every row once, in order.

<dir>/completions.parquet: every shard's rows sorted by global index, after checking that the shards split the input
alike and that each input index appears exactly once; <dir>/steps.parquet: every shard's steps with a `shard`
column; <dir>/summary.json: a local run's summary keys (combine_summaries) with totals over all shards, throughput over
the wall time of the whole (first shard start to last shard end) and over the generation phase (first engine loop
start to last engine loop end);
<dir>/results.jsonl when the shards wrote OpenAI Batch results.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.io.atomic import write_atomically
from batchgen.io.writers import CompletionWriter, StepWriter, dictionary_columns, write_json_atomic
from batchgen.job.run_outputs import SUMMARY_FILE
from batchgen.job.summary import generation_phase, job_totals, summary_document
from batchgen.runners.errors import MergeError
from batchgen.runners.merge_results import merge_results
from batchgen.runners.shards import MARKER_FILE, SHARD_DIR_PATTERN, SHARDED_STEPS_SCHEMA, ShardMarker

NAMED_AT_MOST = 20


def _listed(values: list[int]) -> str:
    shown = ", ".join(map(str, values[:NAMED_AT_MOST]))
    return shown + (f" and {len(values) - NAMED_AT_MOST} more" if len(values) > NAMED_AT_MOST else "")


def find_shards(root: Path) -> dict[int, Path]:
    """The shard directories under `root` (at any depth: a torchrun run or a multirun sweep), by shard index."""
    found = sorted(path for path in root.rglob("shard-*-of-*") if path.is_dir()
                   and SHARD_DIR_PATTERN.fullmatch(path.name))
    if not found:
        raise MergeError(f"{root}: no shard-<i>-of-<K> directories to merge")
    counts = {int(SHARD_DIR_PATTERN.fullmatch(path.name).group(2)) for path in found}
    if len(counts) > 1:
        raise MergeError(f"{root}: shards of different splits ({sorted(counts)} shards) are mixed: "
                         f"{', '.join(str(p) for p in found)}")
    num_shards = counts.pop()
    by_index: dict[int, list[Path]] = {}
    for path in found:
        by_index.setdefault(int(SHARD_DIR_PATTERN.fullmatch(path.name).group(1)), []).append(path)
    repeated = {index: paths for index, paths in by_index.items() if len(paths) > 1}
    if repeated:
        raise MergeError(f"{root}: shards found more than once: " + "; ".join(
            f"shard {index} in {', '.join(map(str, paths))}" for index, paths in sorted(repeated.items())))
    missing = sorted(set(range(num_shards)) - set(by_index))
    if missing:
        raise MergeError(f"{root}: shards {_listed(missing)} of {num_shards} have no directory; run them "
                         f"(data.num_shards={num_shards} data.shard_index=<i>) before merging")
    unfinished = sorted(index for index, (path,) in by_index.items() if not (path / MARKER_FILE).exists())
    if unfinished:
        raise MergeError(f"{root}: shards {_listed(unfinished)} did not finish (no {MARKER_FILE}); resume them with "
                         f"job.resume=true and the same hydra.run.dir, e.g. {by_index[unfinished[0]][0]}")
    return {index: paths[0] for index, paths in sorted(by_index.items())}


def check_indices(indices: np.ndarray, sample_indices: np.ndarray, num_input_rows: int, where: Path) -> None:
    """Every input row index appears, and each (index, sample_index) once (a row has sampling.n samples); the
    rows come sorted by (index, sample_index)."""
    repeated = (indices[1:] == indices[:-1]) & (sample_indices[1:] == sample_indices[:-1])
    duplicated = np.unique(indices[1:][repeated]).tolist()
    inside = (indices >= 0) & (indices < num_input_rows)
    seen = np.zeros(num_input_rows, dtype=bool)
    seen[indices[inside]] = True
    missing = np.flatnonzero(~seen).tolist()
    unexpected = np.unique(indices[~inside]).tolist()
    problems = [f"{label} row indices {_listed(values)}" for label, values in
                (("missing", missing), ("duplicated", duplicated), ("unexpected", unexpected)) if values]
    if problems:
        raise MergeError(f"{where}: cannot merge {num_input_rows} input rows: {'; '.join(problems)}")


def check_same_split(markers: dict[int, ShardMarker], where: Path) -> None:
    """The shards assigned the rows alike: the same data.shard_by, and the same assignment of the same input."""
    splits = {(marker.shard_by, marker.split_digest) for marker in markers.values()}
    if len(splits) > 1:
        described = "; ".join(f"shard {index}: shard_by={marker.shard_by}, assignment {marker.split_digest}"
                              for index, marker in sorted(markers.items()))
        raise MergeError(f"{where}: the shards split the rows differently ({described}); data.shard_by, the input "
                         "or the max_tokens it estimates work from changed between them: rerun the odd shards")


def _write_parquet(path: Path, table: pa.Table) -> None:
    write_atomically(path, lambda file: pq.write_table(table, file, use_dictionary=dictionary_columns(table.schema)))


def merge_shards(root: Path) -> dict[str, Any]:
    """Merges the finished shards under `root` into root's completions, steps and summary; returns the summary."""
    root = Path(root)
    shards = find_shards(root)
    markers = {index: ShardMarker.read(path) for index, path in shards.items()}
    input_rows = {marker.num_input_rows for marker in markers.values()}
    if len(input_rows) > 1:
        raise MergeError(f"{root}: the shards read inputs of different lengths {sorted(input_rows)}")
    check_same_split(markers, root)
    completions = [pq.read_table(path / CompletionWriter.FILE_NAME) for path in shards.values()]
    merged = pa.concat_tables([table.cast(completions[0].schema) for table in completions])
    merged = merged.sort_by([("index", "ascending"), ("sample_index", "ascending")])
    check_indices(merged.column("index").to_numpy(), merged.column("sample_index").to_numpy(), input_rows.pop(), root)
    _write_parquet(root / CompletionWriter.FILE_NAME, merged)
    merge_results(root, shards)

    steps = []
    for index, path in shards.items():
        table = pq.read_table(path / StepWriter.FILE_NAME)
        steps.append(table.append_column("shard", pa.array([index] * table.num_rows, pa.int32())))
    merged_steps = pa.concat_tables([t.cast(SHARDED_STEPS_SCHEMA.with_metadata(t.schema.metadata)) for t in steps])
    _write_parquet(root / StepWriter.FILE_NAME, merged_steps)

    summaries = {index: _read_json(path / SUMMARY_FILE) for index, path in shards.items()}
    summary = combine_summaries(merged, merged_steps, summaries, markers)
    write_json_atomic(root / SUMMARY_FILE, summary)
    return summary


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def combine_summaries(completions: pa.Table, steps: pa.Table, summaries: dict[int, dict[str, Any]],
                      markers: dict[int, ShardMarker]) -> dict[str, Any]:
    """A local run's summary (summary_document's keys) over every shard, plus `num_shards` and `shards` (each
    shard's own figures). `job` counts the merged rows and steps; `this_attempt` is the shards' last attempts
    together: their rows and tokens summed, wall_seconds and tok/s over the whole (first shard start to last shard
    end), steps and step_medians of those attempts, each phase of time_seconds and of startup_phases and the
    engine_loop_collections summed over the shards (so the job's phases add up to the shards' wall seconds together,
    not to the whole's), engine_ready_at when the last engine was ready, and generation (the top-level one too) from
    the first engine loop's start to the last one's end."""
    wall = max(m.finished_at for m in markers.values()) - min(m.started_at for m in markers.values())
    attempts = [summary["this_attempt"] for summary in summaries.values()]
    last_attempt_steps = [row for row in steps.to_pylist() if row["attempt"] == summaries[row["shard"]]["attempt"]]
    prompt_tokens = sum(attempt["prompt_tokens"] for attempt in attempts)
    output_tokens = sum(attempt["output_tokens"] for attempt in attempts)
    time_seconds: Counter[str] = Counter()
    startup_phases: Counter[str] = Counter()
    collections: Counter[str] = Counter()
    for attempt in attempts:
        time_seconds.update(attempt["time_seconds"])
        # Absent from shards of older versions:
        startup_phases.update(attempt.get("startup_phases", {}))
        collections.update(attempt.get("engine_loop_collections", {}))
    ready = [attempt.get("engine_ready_at") for attempt in attempts]
    # The ranks' engine loops together: null when a shard did not record its own (written by an older version).
    phases = [summary.get("generation") for summary in summaries.values()]
    this_attempt = {
        "attempt": max(attempt["attempt"] for attempt in attempts),
        "rows": sum(attempt["rows"] for attempt in attempts),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "steps": len(last_attempt_steps),
        "wall_seconds": wall,
        "prompt_tokens_per_s": prompt_tokens / wall,
        "output_tokens_per_s": output_tokens / wall,
        "time_seconds": dict(time_seconds),
        "startup_phases": dict(startup_phases),
        "engine_loop_collections": {"count": collections["count"], "seconds": collections["seconds"]},
        "engine_ready_at": None if None in ready else max(ready),
        "generation": None if None in phases else generation_phase(
            min(p["started_at"] for p in phases), max(p["finished_at"] for p in phases),
            sum(p["output_tokens"] for p in phases)),
    }
    job = job_totals(completions, steps, max(summary["job"]["attempts"] for summary in summaries.values()))
    first = summaries[min(summaries)]
    return {
        **summary_document(job, this_attempt, last_attempt_steps, first["engine"], first["config"]),
        "num_shards": len(summaries),
        "shards": [_shard_entry(index, summary) for index, summary in sorted(summaries.items())],
    }


def _shard_entry(index: int, summary: dict[str, Any]) -> dict[str, Any]:
    times = summary["this_attempt"]["time_seconds"]
    return {"shard": index, "rows": summary["rows"], "attempt": summary["attempt"],
            "wall_seconds": summary["wall_seconds"], "output_tokens_per_s": summary["output_tokens_per_s"],
            "engine_start_seconds": times.get("engine_start"), "wait_for_ranks_seconds": times.get("wait_for_ranks"),
            "generation": summary.get("generation")}
