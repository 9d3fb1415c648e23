"""A row's path through the job in batches (rows added by LLMEngine.add_requests, completions written as tuples of
values) writes what the row-at-a-time path wrote: rows added one add_request at a time, each completion a dict."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.config import Config, DataConfig, EngineConfig, JobConfig, ModelConfig
from batchgen.engine.llm_engine import LLMEngine
from batchgen.engine.outputs import RequestOutput
from batchgen.io.readers import PromptRow
from batchgen.io.schema import COMPLETIONS_SCHEMA
from batchgen.io.writers import CompletionWriter
from batchgen.job.run import (
    COMPLETION_COLUMNS,
    TASK_COLUMNS,
    Job,
    completion_values,
    first_step_rows,
    prompt_logprobs_value,
    run,
)
from batchgen.sample.params import SamplingParams
from tests.helpers.common import TIMING_COLUMNS

MODEL_DIR = Path(__file__).resolve().parents[2] / "jobs" / "shakespeare" / "model"
PLAY = Path(__file__).resolve().parents[2] / "jobs" / "shakespeare" / "tinyshakespeare.txt"


def dict_record(row: PromptRow, output: RequestOutput | None = None) -> dict[str, Any]:
    """The completions row as the job built it before, one dict per row."""
    if output is None:
        return {"index": row.index, "id": row.id, "prompt": row.text, "finish_reason": "error", "error": row.error,
                "sample_index": 0}
    record = {
        "index": row.index, "sample_index": output.sample_index, "id": row.id, "prompt": row.text,
        "completion": output.text, "num_cached_tokens": output.num_cached_tokens,
        "prompt_token_ids": output.prompt_token_ids, "output_token_ids": output.token_ids,
        "num_prompt_tokens": len(output.prompt_token_ids), "num_output_tokens": len(output.token_ids),
        "finish_reason": output.finish_reason, "error": output.error,
        "ttft_ms": output.ttft_ms, "tpot_ms": output.tpot_ms, "latency_ms": output.latency_ms,
        "logprobs": output.logprobs, "prompt_logprobs": prompt_logprobs_value(output.prompt_logprobs),
    }
    record.update({name: getattr(output, name) for name in TASK_COLUMNS})
    return record


def add_one_by_one(self: Job, engine: Any, rows: Iterator[PromptRow], backlog: int) -> bool:
    """Job._add_requests as it was: a row at a time while fewer than the whole backlog wait (from the first step)."""
    while engine.num_waiting < self.config.engine.wanted_backlog:
        row = next(rows, None)
        if row is None:
            return False
        engine.add_request(row.index, row.prompt, row.prompt_token_ids, self.params[row.index],
                           self.missing_samples.get(row.index))
    return True


def test_completion_values_follow_the_schema():
    assert COMPLETION_COLUMNS == tuple(COMPLETIONS_SCHEMA.names)


def test_completion_values_hold_the_dict_records_values(tmp_path: Path):
    rows = [PromptRow(i, f"r{i}", f"prompt {i}", None, {}) for i in range(6)]
    rows[1].error = "prompts.jsonl: line 2: invalid JSON"
    logprob = {"token_id": 3, "text": "a", "logprob": -0.5, "rank": 1, "top": [{"token_id": 3, "text": "a",
                                                                               "logprob": -0.5}]}
    outputs = [
        RequestOutput(0, "prompt 0", [1, 2], "ab", [3, 4], "length", ttft_ms=1.0, tpot_ms=0.5, latency_ms=1.5,
                      num_cached_tokens=2),
        None,
        RequestOutput(2, "prompt 2", [1], None, [], "error", error="the prompt has 9 tokens"),
        RequestOutput(3, "prompt 3", [1, 2], "a", [3], "stop", sample_index=1, logprobs=[logprob],
                      prompt_logprobs=[None, logprob]),
        RequestOutput(4, "prompt 4", [1, 2], None, [], "length", continuation_logprob=-1.5, continuation_num_tokens=1,
                      continuation_is_greedy=True),
        RequestOutput(5, "prompt 5", [1, 2], None, [], "length", logits=[0.5, 1.5], probs=[0.25, 0.75], label="yes"),
    ]
    by_dict = CompletionWriter(tmp_path / "dict", {})
    by_values = CompletionWriter(tmp_path / "values", {})
    for row, output in zip(rows, outputs, strict=True):
        values = completion_values(row, output)
        record = dict_record(row, output)
        assert dict(zip(COMPLETION_COLUMNS, values, strict=True)) == {name: record.get(name)
                                                                      for name in COMPLETION_COLUMNS}
        by_dict.write(record)
        by_values.write_values(values)
    assert pq.read_table(by_values.close()).equals(pq.read_table(by_dict.close()))


def mixed_rows(count: int) -> list[str]:
    """JSONL lines: windows of the play, some with n=2, their own max_tokens, a stop string or logprobs; a line of
    invalid JSON, a row without a prompt, an over-long prompt and a row whose options conflict with the job's."""
    text = PLAY.read_text()
    lines = []
    for i in range(count):
        row: dict[str, Any] = {"id": f"r{i}", "prompt": text[37 * i:37 * i + 8 + i % 25]}
        if i % 7 == 3:
            row["n"] = 2
        if i % 11 == 5:
            row["max_tokens"] = 3
        if i % 13 == 6:
            row["stop"] = "e"
        if i % 17 == 8:
            row["logprobs"] = 2
        lines.append(json.dumps(row))
    lines[20] = '{"id": "r20", "prompt": "broken'
    lines[45] = json.dumps({"id": "r45"})
    lines[70] = json.dumps({"id": "r70", "prompt": "x" * 300})  # more tokens than max_model_len
    lines[95] = json.dumps({"id": "r95", "prompt": "KING:", "min_tokens": 9})  # more than max_tokens
    return lines


def job_config(prompts: Path, resume: bool = False) -> Config:
    return Config(
        job=JobConfig(progress=False, resume=resume, flush_rows=16),
        model=ModelConfig(path=str(MODEL_DIR)),
        engine=EngineConfig(device="cpu", max_num_seqs=8, max_model_len=256),
        data=DataConfig(path=str(prompts), id_field="id", on_error="skip"),
        sampling=SamplingParams(temperature=0.8, top_k=20, max_tokens=6, seed=None),
    )


def comparable_files(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """completions.parquet and steps.parquet without their timings."""
    completions = pq.read_table(run_dir / "completions.parquet").drop_columns(TIMING_COLUMNS)
    steps = pq.read_table(run_dir / "steps.parquet")
    steps = steps.drop_columns([name for name in steps.column_names if name.endswith("_ms")])
    return completions.to_pylist(), steps.to_pylist()


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(mixed_rows(240)) + "\n")
    return path


def test_a_job_of_mixed_rows_writes_what_rows_added_one_by_one_wrote(tmp_path, prompts, monkeypatch):
    batched = tmp_path / "batched"
    run(job_config(prompts), batched)
    monkeypatch.setattr(Job, "_add_requests", add_one_by_one)
    one_by_one = tmp_path / "one_by_one"
    run(job_config(prompts), one_by_one)

    completions, steps = comparable_files(batched)
    assert (completions, steps) == comparable_files(one_by_one)
    assert pq.read_schema(batched / "completions.parquet").names == COMPLETIONS_SCHEMA.names
    by_reason = {reason: sum(r["finish_reason"] == reason for r in completions) for reason in ("error", "stop")}
    assert len(completions) == 240 + 240 // 7 - 1 and by_reason["error"] == 4 and by_reason["stop"] > 0
    assert any(r["logprobs"] for r in completions) and any(r["num_cached_tokens"] for r in completions)


def test_a_resumed_job_generates_what_rows_added_one_by_one_generated(tmp_path, prompts, monkeypatch):
    """A killed attempt wrote every third row and sample 1 of some n=2 rows: the batches add the others, and only
    the missing samples of those rows."""
    reference = tmp_path / "reference"
    run(job_config(prompts), reference)
    written = pq.read_table(reference / "completions.parquet").to_pylist()
    resumed = {}
    for name in ("batched", "one_by_one"):
        run_dir = tmp_path / name
        partial = CompletionWriter(run_dir, {}, flush_rows=1)
        for record in written:
            if record["index"] % 3 == 0 or (record["index"] % 7 == 3 and record["sample_index"] == 1):
                partial.write(record)
        partial.wait_for_parts()  # flushed before the kill
        del partial
        if name == "one_by_one":
            monkeypatch.setattr(Job, "_add_requests", add_one_by_one)
        run(job_config(prompts, resume=True), run_dir)
        resumed[name] = comparable_files(run_dir)
    assert resumed["batched"] == resumed["one_by_one"]
    keys = [(r["index"], r["sample_index"]) for r in resumed["batched"][0]]
    assert keys == [(r["index"], r["sample_index"]) for r in written]
    table = pq.read_table(tmp_path / "batched" / "completions.parquet")
    assert table.schema.equals(pq.read_table(reference / "completions.parquet").schema, check_metadata=False)
    assert pa.types.is_list(table.schema.field("output_token_ids").type)


def test_first_step_rows_fill_one_steps_tokens() -> None:
    rows = [300, 500, 400, 100]
    assert first_step_rows(rows, 1000, 8) == 3  # the third row crosses the budget: the step takes part of it
    assert first_step_rows(rows, 800, 8) == 2
    assert first_step_rows(rows, 10_000, 8) == 4
    assert first_step_rows(rows, 10_000, 2) == 2
    untokenized = [0] * 5  # texts without a tokenizer
    assert first_step_rows(untokenized, 3, 8) == 3


def test_the_first_step_launches_before_the_rest_of_the_backlog_is_added(tmp_path, monkeypatch):
    """The rows of the first step go in and it launches; the backlog then grows by two steps' rows a step up to
    2 x max_num_seqs: 20-token prompts fill a 64-token step with 4 rows, which the next step takes again."""
    prompts = tmp_path / "prompts.jsonl"
    text = PLAY.read_text()
    prompts.write_text("".join(json.dumps({"id": f"r{i}", "prompt": text[20 * i:20 * i + 20]}) + "\n"
                               for i in range(40)))
    waiting = []
    step = LLMEngine.step
    monkeypatch.setattr(LLMEngine, "step", lambda engine: waiting.append(engine.num_waiting) or step(engine))
    config = job_config(prompts)
    config = replace(config, engine=replace(config.engine, max_num_batched_tokens=64))

    summary = run(config, tmp_path / "run")

    assert summary["rows"] == 40
    assert waiting[:3] == [4, 12, 2 * config.engine.max_num_seqs]
