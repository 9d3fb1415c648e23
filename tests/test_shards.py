"""Shards and their merge: the split by row index, and the merge's every-row-once-in-order check."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchgen.config import Config, ConfigError, DataConfig, EngineConfig, validate_data, validate_runner
from batchgen.io.writers import CompletionWriter, StepWriter, write_json_atomic
from batchgen.runners.merge import MergeError, merge_shards
from batchgen.runners.shards import ShardMarker, shard_dir_name, shard_indices, shard_rows

REPO = Path(__file__).resolve().parent.parent
STEP = dict(step=0, attempt=0, kind="decode", num_seqs=1, num_tokens=1, num_prefill_tokens=0, num_decode_tokens=1,
            padded_size=None, cuda_graph=False, cascade_attention=False, schedule_ms=1.0, prepare_ms=1.0,
            forward_ms=1.0, sample_ms=1.0, wait_ms=0.0, step_ms=4.0, kv_blocks_used=1, kv_blocks_total=8, num_waiting=0,
            num_running=1, num_preempted=0, num_cached_tokens=0)


@pytest.mark.parametrize("num_shards", [1, 2, 3, 7])
def test_shards_split_every_row_once_by_global_index(num_shards):
    rows = list(range(20))
    shards = [shard_rows(rows, num_shards, i) for i in range(num_shards)]
    assert sorted(sum(shards, [])) == rows
    assert all(shard == list(shard_indices(20, num_shards, i)) for i, shard in enumerate(shards))


def fake_shard(root: Path, num_shards: int, index: int, rows: list[int], num_input_rows: int,
               times: tuple[float, float] = (100.0, 110.0), finished: bool = True) -> Path:
    """A shard directory as a finished shard run leaves it, with 2 output tokens per row."""
    directory = root / shard_dir_name(num_shards, index)
    completions = CompletionWriter(directory, {})
    for row in rows:
        completions.write({"index": row, "id": f"r{row}", "finish_reason": "length", "num_prompt_tokens": 3,
                           "num_output_tokens": 2})
    completions.close()
    steps = StepWriter(directory, {})
    steps.write({**STEP, "step_ms": 4.0 + index})
    steps.close()
    wall = times[1] - times[0]
    write_json_atomic(directory / "summary.json", {
        "rows": len(rows), "attempt": 0, "wall_seconds": wall, "prompt_tokens_per_s": 3 * len(rows) / wall,
        "output_tokens_per_s": 2 * len(rows) / wall, "engine": {"device": "cpu"}, "config": {"job": {}},
    })
    if finished:
        ShardMarker(num_shards, index, num_input_rows, *times).write(directory)
    return directory


def test_merge_writes_rows_in_input_order_steps_per_shard_and_a_combined_summary(tmp_path):
    fake_shard(tmp_path, 3, 0, [0, 3, 6], 8, (100.0, 110.0))
    fake_shard(tmp_path, 3, 1, [1, 4, 7], 8, (101.0, 120.0))
    fake_shard(tmp_path, 3, 2, [2, 5], 8, (102.0, 105.0))
    summary = merge_shards(tmp_path)
    completions = pq.read_table(tmp_path / "completions.parquet").to_pydict()
    assert completions["index"] == list(range(8)) and completions["id"] == [f"r{i}" for i in range(8)]
    steps = pq.read_table(tmp_path / "steps.parquet").to_pydict()
    assert steps["shard"] == [0, 1, 2] and steps["step_ms"] == [4.0, 5.0, 6.0]
    assert summary["rows"] == 8 and summary["output_tokens"] == 16 and summary["num_shards"] == 3
    assert summary["wall_seconds"] == 20.0  # first start 100 to last end 120
    assert summary["output_tokens_per_s"] == pytest.approx(16 / 20)
    assert [s["rows"] for s in summary["shards"]] == [3, 3, 2]
    assert json.loads((tmp_path / "summary.json").read_text())["rows"] == 8


def test_merge_names_missing_and_duplicated_rows(tmp_path):
    fake_shard(tmp_path, 2, 0, [0, 2, 3], 6)
    fake_shard(tmp_path, 2, 1, [1, 3], 6)
    with pytest.raises(MergeError, match=r"missing row indices 4, 5; duplicated row indices 3"):
        merge_shards(tmp_path)
    assert not (tmp_path / "completions.parquet").exists()


def test_merge_names_missing_and_unfinished_shards(tmp_path):
    fake_shard(tmp_path, 3, 0, [0], 3)
    with pytest.raises(MergeError, match="shards 1, 2 of 3 have no directory"):
        merge_shards(tmp_path)
    fake_shard(tmp_path, 3, 1, [1], 3)
    fake_shard(tmp_path, 3, 2, [2], 3, finished=False)
    with pytest.raises(MergeError, match=r"shards 2 did not finish .*job.resume=true"):
        merge_shards(tmp_path)


def test_merge_finds_shards_of_a_sweep_and_rejects_mixed_splits(tmp_path):
    fake_shard(tmp_path / "0", 2, 0, [0], 2)
    fake_shard(tmp_path / "1", 2, 1, [1], 2)
    assert merge_shards(tmp_path)["rows"] == 2
    fake_shard(tmp_path / "2", 3, 0, [0], 3)
    with pytest.raises(MergeError, match="different splits"):
        merge_shards(tmp_path)


def test_merge_command_exits_nonzero_naming_the_problem(tmp_path):
    fake_shard(tmp_path, 2, 0, [0], 2)
    command = [sys.executable, "-m", "batchgen.merge", str(tmp_path)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "shards 1 of 2 have no directory" in result.stderr
    fake_shard(tmp_path, 2, 1, [1], 2)
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert pq.read_table(tmp_path / "completions.parquet").column("index").to_pylist() == [0, 1]


def test_shard_and_parallel_options_are_validated(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a"}\n')
    with pytest.raises(ConfigError, match=r"data.shard_index=2 .* \[0, data.num_shards=2\)"):
        validate_data(DataConfig(path=str(prompts), num_shards=2, shard_index=2))
    both = Config(engine=EngineConfig(data_parallel_size=2), data=DataConfig(num_shards=2))
    with pytest.raises(ConfigError, match="engine.data_parallel_size and data.num_shards"):
        validate_runner(both)
