"""completions.parquet's prompt_logprobs column, built from a request's arrays, equals the column Arrow makes of the
same entries as dicts (the Python API's form, and the Ray runner's); the writer takes both in one part."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.core.prompt_logprobs import PromptLogprobs
from batchgen.engine.detokenizer import Detokenizer
from batchgen.engine.logprob_entries import PromptLogprobEntries, TokenTexts
from batchgen.engine.outputs import RequestOutput
from batchgen.io.prompt_rows import PromptRow
from batchgen.io.schema import COMPLETIONS_SCHEMA, LOGPROB_ENTRY
from batchgen.io.writers import CompletionWriter
from batchgen.job.run import completion_values, prompt_logprobs_value

ENTRIES = pa.list_(LOGPROB_ENTRY)


class CountingTokenizer:
    """decode([id]) -> "t<id>", counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def decode(self, token_ids: list[int]) -> str:
        self.calls += 1
        return f"t{token_ids[0]}"


def scored_entries(num_tokens: int, first: int, k: int, texts: TokenTexts, seed: int = 0) -> PromptLogprobEntries:
    """A request's prompt logprobs of random values, recorded in two steps."""
    rng = np.random.default_rng(seed)
    scored = PromptLogprobs(rng.integers(0, 50, num_tokens), first, k)
    count = num_tokens - first
    logprobs, ranks = -rng.random(count, dtype=np.float32) * 5, rng.integers(1, 50, count)
    logprobs[:1] = -np.inf  # a token the distribution rules out
    top_ids, top_logprobs = rng.integers(0, 50, (count, 4)), -rng.random((count, 4), dtype=np.float32)
    half = count // 2
    scored.record(first, logprobs[:half], ranks[:half], top_ids[:half], top_logprobs[:half])
    scored.record(first + half, logprobs[half:], ranks[half:], top_ids[half:], top_logprobs[half:])
    return PromptLogprobEntries(scored, texts)


@pytest.mark.parametrize("with_texts", [False, True])
@pytest.mark.parametrize(("num_tokens", "first", "k"), [(30, 1, 1), (30, 1, 0), (30, 1, 3), (12, 7, 0), (1, 1, 2)],
                         ids=str)
def test_the_column_built_from_arrays_equals_the_dicts(num_tokens, first, k, with_texts):
    texts = TokenTexts(Detokenizer(CountingTokenizer()) if with_texts else None)
    entries = scored_entries(num_tokens, first, k, texts)

    built = prompt_logprobs_value(entries)

    expected = pa.array([list(entries)], type=ENTRIES)
    assert built.type == ENTRIES and built.equals(expected)
    assert built.to_pylist() == expected.to_pylist()
    assert len(entries) == num_tokens and entries[:first] == [None] * first
    assert all(len(entry["top"]) == k for entry in entries[first:])


def test_entries_are_made_only_when_read():
    tokenizer = CountingTokenizer()
    entries = scored_entries(30, 1, 1, TokenTexts(Detokenizer(tokenizer)))
    assert len(entries) == 30 and tokenizer.calls == 0
    prompt_logprobs_value(entries)  # the writer's column looks each distinct token's text up once
    assert tokenizer.calls == len(np.unique(np.concatenate([entries.scored.token_ids,
                                                            entries.scored.top_ids.reshape(-1)])))
    first = entries[1]
    assert first["token_id"] == entries.scored.token_ids[0] and first["text"] == f"t{first['token_id']}"
    assert entries == list(entries) and entries[1:3] == list(entries)[1:3]


def test_a_writer_part_takes_built_columns_lists_and_nulls(tmp_path):
    texts = TokenTexts(None)
    entries = [scored_entries(20, 1, 1, texts, seed) for seed in range(2)]
    writer = CompletionWriter(tmp_path, {})
    base = {"finish_reason": "length"}
    writer.write({**base, "index": 0, "id": "a", "prompt_logprobs": prompt_logprobs_value(entries[0])})
    writer.write({**base, "index": 1, "id": "b", "prompt_logprobs": list(entries[1])})  # the Ray runner's form
    writer.write({**base, "index": 2, "id": "c"})
    table = pq.read_table(writer.close())
    assert table.column("prompt_logprobs").to_pylist() == [list(entries[0]), list(entries[1]), None]
    assert table.column("id").to_pylist() == ["a", "b", "c"]


def expected_entries(scored_values: dict[str, np.ndarray], first: int, k: int, with_texts: bool) -> list[dict | None]:
    """A row's prompt_logprobs entries built from the values recorded, in Python: the per-position form."""
    def text(token_id: int) -> str | None:
        return f"t{token_id}" if with_texts else None

    entries: list[dict | None] = [None] * first
    for position in range(len(scored_values["logprobs"])):
        top_ids = scored_values["top_ids"][position, :k].tolist()
        top_logprobs = scored_values["top_logprobs"][position, :k].tolist()
        token_id = int(scored_values["token_ids"][position])
        entries.append({"token_id": token_id, "text": text(token_id),
                        "logprob": float(scored_values["logprobs"][position]),
                        "rank": int(scored_values["ranks"][position]),
                        "top": [{"token_id": t, "text": text(t), "logprob": lp}
                                for t, lp in zip(top_ids, top_logprobs, strict=True)]})
    return entries


@pytest.mark.parametrize("with_texts", [False, True])
@pytest.mark.parametrize("parts", ["one in order", "one out of order", "two attempts"])
def test_completions_written_from_arrays_equal_the_rows_built_per_position(tmp_path, with_texts, parts):
    """Rows with prompt logprobs (k 1 and 3, a scored context's null entries, -inf, n = 2) among rows without them,
    through completion_values and the writer (one part renamed into the file, one part sorted, or the parts of a killed
    attempt and its resume merged): completions.parquet equals the table built from the same values as Python lists."""
    rng = np.random.default_rng(7)
    texts = TokenTexts(Detokenizer(CountingTokenizer()) if with_texts else None)
    written, expected = [], []
    for index in range(12):
        prompt = rng.integers(0, 300, int(rng.integers(2, 40))).tolist()
        row = PromptRow(index, f"row-{index}", None, prompt, {})
        for sample_index in range(1 + index % 2):
            entries = None
            expected_logprobs = None
            if index % 3:
                first, k = (1, 1) if index % 3 == 1 else (min(5, len(prompt)), 3)
                scored = PromptLogprobs(np.array(prompt), first, k)
                count = len(prompt) - first
                values = {"token_ids": np.array(prompt[first:]), "logprobs": -rng.random(count, dtype=np.float32),
                          "ranks": rng.integers(1, 300, count),
                          "top_ids": rng.integers(0, 300, (count, 4)),
                          "top_logprobs": -rng.random((count, 4), dtype=np.float32) * 3}
                values["logprobs"][count // 2:count // 2 + 1] = -np.inf
                values["top_logprobs"][:1, -1] = -np.inf
                scored.record(first, values["logprobs"], values["ranks"], values["top_ids"], values["top_logprobs"])
                entries = PromptLogprobEntries(scored, texts)
                expected_logprobs = expected_entries(values, first, k, with_texts)
            output = RequestOutput(index, None, prompt, None, [5, 6], "length", sample_index=sample_index,
                                   prompt_logprobs=entries)
            written.append(completion_values(row, output))
            expected.append({"index": index, "id": row.id, "prompt_token_ids": prompt, "output_token_ids": [5, 6],
                             "num_prompt_tokens": len(prompt), "num_output_tokens": 2, "finish_reason": "length",
                             "sample_index": sample_index, "num_cached_tokens": 0,
                             "prompt_logprobs": expected_logprobs})
    if parts == "two attempts":
        killed = CompletionWriter(tmp_path, {}, flush_rows=4)
        for values in written[:10]:
            killed.write_values(values)
        killed.wait_for_parts()
        del killed  # two parts flushed, two rows buffered and lost: the resume writes them again
        writer = CompletionWriter(tmp_path, {}, flush_rows=4)
        for values in written[8:]:
            writer.write_values(values)
    else:
        writer = CompletionWriter(tmp_path, {})
        if parts == "one out of order":
            written[:4] = reversed(written[:4])
        for values in written:
            writer.write_values(values)

    table = pq.read_table(writer.close())

    expected_table = pa.Table.from_pylist(expected, schema=COMPLETIONS_SCHEMA)
    assert table.schema.equals(COMPLETIONS_SCHEMA)
    assert table.equals(expected_table)
    assert table.to_pylist() == expected_table.to_pylist()
    assert not writer.parts_dir.exists()
