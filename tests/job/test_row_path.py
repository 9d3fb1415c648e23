"""A finished row's completion written as a tuple of values (completion_values, CompletionWriter.write_values) is
what the job wrote as a dict per row."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from batchgen.engine.outputs import RequestOutput
from batchgen.io.readers import PromptRow
from batchgen.io.schema import COMPLETIONS_SCHEMA
from batchgen.io.writers import CompletionWriter
from batchgen.job.run import COMPLETION_COLUMNS, TASK_COLUMNS, completion_values, prompt_logprobs_value


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
