"""Shards and their merge: the splits by estimated work and by row index, and the merge's every-row-once-in-order
check, its combined summary and its results.jsonl."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchgen.config import Config, ConfigError, DataConfig, EngineConfig, validate_data, validate_runner
from batchgen.io.shard_split import ShardSplit
from batchgen.io.writers import CompletionWriter, StepWriter, write_json_atomic
from batchgen.job.summary import AttemptStats, summarize
from batchgen.runners.merge import MergeError, merge_shards
from batchgen.runners.shards import ShardMarker, shard_dir_name
from tests.cli.test_config import composed

REPO = Path(__file__).resolve().parents[2]
STEP = dict(step=0, attempt=0, kind="decode", num_seqs=1, num_tokens=1, num_prefill_tokens=0, num_decode_tokens=1,
            padded_size=None, cuda_graph=False, cascade_attention=False, schedule_ms=1.0, prepare_ms=1.0,
            forward_ms=1.0, sample_ms=1.0, wait_ms=0.0, step_ms=4.0, kv_blocks_used=1, kv_blocks_total=8, num_waiting=0,
            num_running=1, num_preempted=0, num_cached_tokens=0)


def assignment(num_shards: int, by: str, works: list[int]) -> tuple[list[int], str]:
    """The shard of each row and the split's digest, as one shard computes them."""
    split = ShardSplit(num_shards, by)
    return [split.shard_of(index, work) for index, work in enumerate(works)], split.digest


def loads(num_shards: int, shards: list[int], works: list[int]) -> list[int]:
    return [sum(work for shard, work in zip(shards, works, strict=True) if shard == i) for i in range(num_shards)]


@pytest.mark.parametrize("num_shards", [1, 2, 3, 7])
def test_index_split_strides_rows_by_global_index(num_shards):
    shards, _ = assignment(num_shards, "index", [5] * 20)
    assert shards == [index % num_shards for index in range(20)]


@pytest.mark.parametrize("num_shards", [2, 3, 7])
def test_work_split_balances_estimated_work_where_the_index_split_does_not(num_shards):
    works = [1000 if index % num_shards == 0 else 10 for index in range(60)] + [7, 900, 3, 450, 1]
    by_index, _ = assignment(num_shards, "index", works)
    by_work, _ = assignment(num_shards, "work", works)
    assert max(loads(num_shards, by_index, works)) - min(loads(num_shards, by_index, works)) > 5000
    # Greedy list scheduling: the shards' loads end at most the largest row's work apart.
    assert max(loads(num_shards, by_work, works)) - min(loads(num_shards, by_work, works)) <= max(works)
    assert set(by_work) == set(range(num_shards))


def test_every_shard_computes_the_same_split_and_another_assignment_has_another_digest():
    works = [(index * 37) % 101 for index in range(50)]
    # Each shard (and each resume of it) computes the assignment on its own; they must agree row for row, so the
    # shards take every row exactly once.
    assert assignment(3, "work", works) == assignment(3, "work", list(works))
    assert assignment(3, "work", works)[1] != assignment(3, "work", [works[0] + 500, *works[1:]])[1]
    assert assignment(3, "work", works)[1] != assignment(3, "index", works)[1]


def write_prompts(path: Path, max_tokens: list[int]) -> Path:
    path.write_text("".join(json.dumps({"id": index, "prompt": f"ROMEO {index}:", "max_tokens": tokens}) + "\n"
                            for index, tokens in enumerate(max_tokens)))
    return path


@pytest.mark.parametrize("shard_by", ["work", "index"])
def test_a_job_keeps_only_its_shard_of_the_rows(tmp_path, shard_by):
    from batchgen.job.run import Job  # after tests.test_config: the job imports the engine's modules

    max_tokens = [64 if index % 2 == 0 else 1 for index in range(30)]
    prompts = write_prompts(tmp_path / "prompts.jsonl", max_tokens)
    jobs = [Job(composed("job=shakespeare", f"data.path={prompts}", "data.num_shards=2", f"data.shard_index={i}",
                         f"data.shard_by={shard_by}", "engine.device=cpu"), tmp_path / str(i)) for i in range(2)]
    indices = [[row.index for row in job.rows] for job in jobs]
    assert sorted(indices[0] + indices[1]) == list(range(30)) and all(job.num_input_rows == 30 for job in jobs)
    assert jobs[0].split_digest == jobs[1].split_digest
    works = [sum(len(job.work.detokenizer.encode(row.prompt)) + max_tokens[row.index] for row in job.rows)
             for job in jobs]
    if shard_by == "index":
        assert indices[0] == list(range(0, 30, 2)) and works[0] > 5 * works[1]
    else:
        assert abs(works[0] - works[1]) <= 64 + len("ROMEO 29:")


def test_the_work_split_weighs_rows_a_tokenizer_batch_at_a_time_as_one_at_a_time(tmp_path, monkeypatch):
    """Rows are tokenized for their weight a chunk at a time; the split must be the one each row's own encode gives,
    across chunk boundaries, with error rows (no prompt, an invalid override) weighing nothing."""
    import batchgen.job.row_work as row_work
    import batchgen.job.run as job_run

    monkeypatch.setattr(row_work, "TOKENIZE_CHUNK_ROWS", 4)
    lines = [{"id": index, "prompt": "ROMEO " * (1 + index % 5) + str(index), "max_tokens": 1 + 7 * (index % 3)}
             for index in range(23)]
    lines[5] = {"id": 5}  # no prompt: an error row
    lines[9]["max_tokens"] = -1  # an invalid override: an error row
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    jobs = [job_run.Job(composed("job=shakespeare", f"data.path={prompts}", "data.num_shards=3",
                                 f"data.shard_index={i}", "data.on_error=skip", "engine.device=cpu"),
                        tmp_path / str(i)) for i in range(3)]
    encode = jobs[0].work.detokenizer.encode
    works = [0 if index in (5, 9) else len(encode(line["prompt"])) + line["max_tokens"]
             for index, line in enumerate(lines)]
    expected, digest = assignment(3, "work", works)
    assert [[row.index for row in job.rows] for job in jobs] == [
        [index for index, shard in enumerate(expected) if shard == i] for i in range(3)]
    assert all(job.split_digest == digest and job.num_input_rows == 23 for job in jobs)
    errors = {row.index: row.error for job in jobs for row in job.rows if row.error is not None}
    assert sorted(errors) == [5, 9] and "max_tokens" in errors[9]


def fake_shard(root: Path, num_shards: int, index: int, rows: list[int], num_input_rows: int,
               times: tuple[float, float] = (100.0, 110.0), finished: bool = True, digest: str = "d",
               results: bool = False, unrun_errors: tuple[int, ...] = ()) -> Path:
    """A shard directory as a finished shard run leaves it, with 3 prompt and 2 output tokens per row (rows in
    `unrun_errors`: errors with a 5000-token prompt that never ran); its engine is ready 4 s after its start, waits
    1 s for the other ranks, then runs its loop to its end."""
    directory = root / shard_dir_name(num_shards, index)
    completions = CompletionWriter(directory, {})
    for row in rows:
        if row in unrun_errors:
            completions.write({"index": row, "id": f"r{row}", "finish_reason": "error", "error": "too long",
                               "num_prompt_tokens": 5000, "num_output_tokens": 0})
        else:
            completions.write({"index": row, "id": f"r{row}", "finish_reason": "length", "num_prompt_tokens": 3,
                               "num_output_tokens": 2, "num_cached_tokens": 1})
    steps = StepWriter(directory, {})
    steps.write({**STEP, "step_ms": 4.0 + index})
    ran = len(rows) - len(unrun_errors)
    stats = AttemptStats(0, rows=len(rows), prompt_tokens=3 * ran, output_tokens=2 * ran, engine_start_seconds=4.0,
                         wait_for_ranks_seconds=1.0, engine_loop_seconds=times[1] - times[0] - 5,
                         engine_ready_at=times[0] + 4, generation_started_at=times[0] + 5,
                         generation_finished_at=times[1])
    summary = summarize(completions.close(), steps.close(), stats, {"device": "cpu"}, {"job": {}})
    write_json_atomic(directory / "summary.json", summary)
    if results:
        (directory / "results.jsonl").write_text("".join(json.dumps({"custom_id": f"c{row}"}) + "\n" for row in rows))
    if finished:
        ShardMarker(num_shards, index, num_input_rows, *times, "work", digest).write(directory)
    return directory


# Maps whose keys are data (finish reasons, step groups) or copied whole from a shard: their own keys are not the
# summary's schema.
NOT_SCHEMA = ("finish_reasons", "step_medians", "engine", "versions", "config")


def key_paths(summary: dict, prefix: str = "") -> set[str]:
    """Every key of a summary, dotted, down through the nested figures (job, this_attempt, time_seconds, ...)."""
    paths = set()
    for key, value in summary.items():
        paths.add(f"{prefix}{key}")
        if isinstance(value, dict) and key not in NOT_SCHEMA:
            paths |= key_paths(value, f"{prefix}{key}.")
    return paths


def test_a_merged_summary_has_every_key_of_a_local_one(tmp_path):
    fake_shard(tmp_path, 2, 0, [0, 2, 3], 5, (100.0, 110.0), unrun_errors=(2,))
    fake_shard(tmp_path, 2, 1, [1, 4], 5, (101.0, 120.0))
    local = json.loads((tmp_path / "shard-00000-of-00002" / "summary.json").read_text())
    merged = merge_shards(tmp_path)
    assert key_paths(local) <= key_paths(merged)
    assert {"num_shards", "shards"} <= merged.keys()
    job, attempt = merged["job"], merged["this_attempt"]
    assert job["rows"] == merged["rows"] == 5 and job["error_rows"] == 1 and job["attempts"] == 1
    # The error row never ran: its 5000-token prompt counts in no total.
    assert job["prompt_tokens"] == attempt["prompt_tokens"] == merged["prompt_tokens"] == 12
    assert job["prefix_cache_hit_rate"] == merged["prefix_cache_hit_rate"] == pytest.approx(4 / 12)
    assert attempt["rows"] == 5 and attempt["output_tokens"] == 8 and attempt["wall_seconds"] == 20.0
    assert attempt["prompt_tokens_per_s"] == merged["prompt_tokens_per_s"] == pytest.approx(12 / 20)
    # Each phase is the shards' together: the shards ran 10 s and 19 s.
    assert attempt["time_seconds"]["engine_start"] == 8.0 and sum(attempt["time_seconds"].values()) == 29.0
    assert attempt["engine_ready_at"] == 105.0  # when the last shard's engine was ready
    assert attempt["generation"] == merged["generation"]


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
    # The generation phase: first engine loop start (105) to last engine loop end (120).
    assert summary["generation"]["seconds"] == 15.0 and summary["generation"]["output_tokens"] == 16
    assert summary["generation"]["output_tokens_per_s"] == pytest.approx(16 / 15)
    assert [s["rows"] for s in summary["shards"]] == [3, 3, 2]
    assert [s["engine_start_seconds"] for s in summary["shards"]] == [4.0] * 3
    assert [s["generation"]["started_at"] for s in summary["shards"]] == [105.0, 106.0, 107.0]
    assert not (tmp_path / "results.jsonl").exists()
    assert json.loads((tmp_path / "summary.json").read_text())["rows"] == 8


def test_merge_names_missing_duplicated_and_unexpected_rows(tmp_path):
    fake_shard(tmp_path, 2, 0, [0, 2, 3, 9], 6)
    fake_shard(tmp_path, 2, 1, [1, 3, 9], 6)
    with pytest.raises(MergeError, match=r"missing row indices 4, 5; duplicated row indices 3, 9; unexpected row "
                                         r"indices 9$"):
        merge_shards(tmp_path)
    assert not (tmp_path / "completions.parquet").exists()


def test_merge_refuses_shards_that_split_the_rows_differently(tmp_path):
    fake_shard(tmp_path, 2, 0, [0, 3], 4, digest="aaaa")
    fake_shard(tmp_path, 2, 1, [1, 2], 4, digest="bbbb")
    with pytest.raises(MergeError, match="split the rows differently .*shard 1: shard_by=work, assignment bbbb"):
        merge_shards(tmp_path)


def test_merge_writes_one_results_line_per_input_line_in_input_order(tmp_path):
    fake_shard(tmp_path, 3, 0, [0, 4], 6, results=True)
    fake_shard(tmp_path, 3, 1, [1, 2, 5], 6, results=True)
    fake_shard(tmp_path, 3, 2, [3], 6, results=True)
    merge_shards(tmp_path)
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert [json.loads(line)["custom_id"] for line in lines] == [f"c{row}" for row in range(6)]

    (tmp_path / "shard-00002-of-00003" / "results.jsonl").unlink()
    with pytest.raises(MergeError, match=r"shards \[2\] have no results.jsonl and the others do"):
        merge_shards(tmp_path)


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


def test_one_shard_hashes_each_row_as_shard_0() -> None:
    """A single shard keeps its rows' shard to hash at once; the digest is the one each row's 4 bytes give."""
    split = ShardSplit(1, "work")
    assert [split.shard_of(index, 5) for index in range(1000)] == [0] * 1000
    assert split.digest == hashlib.sha256(b"\0\0\0\0" * 1000).hexdigest()[:16]
    split.shard_of(1000, 5)
    assert split.digest == hashlib.sha256(b"\0\0\0\0" * 1001).hexdigest()[:16]
