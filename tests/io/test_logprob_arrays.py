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
from batchgen.io.schema import LOGPROB_ENTRY
from batchgen.io.writers import CompletionWriter
from batchgen.job.run import prompt_logprobs_value

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
