"""A request's prompt logprobs are arrays filled a step's slice at a time; a recompute never records a position
twice."""

from __future__ import annotations

import numpy as np
import pytest

from batchgen.core.prompt_logprobs import PromptLogprobs


def values(start: int, count: int, k: int = 2) -> tuple[np.ndarray, ...]:
    """A step's values for positions start .. start + count - 1, each derived from its position; k alternatives."""
    positions = np.arange(start, start + count)
    alternatives = np.arange(k)
    return (-positions / 100, positions + 1, positions[:, None] * 10 + alternatives,
            -positions[:, None] / 100 - alternatives)


def expected(first: int, end: int, k: int) -> tuple[np.ndarray, ...]:
    logprobs, ranks, top_ids, top_logprobs = values(first, end - first, 3)
    return logprobs.astype(np.float32), ranks, top_ids[:, :k], top_logprobs[:, :k].astype(np.float32)


def assert_recorded(scored: PromptLogprobs, end: int) -> None:
    logprobs, ranks, top_ids, top_logprobs = expected(scored.first, end, scored.k)
    assert scored.next_position == end
    assert np.array_equal(scored.token_ids, scored.prompt[scored.first:end])
    assert np.array_equal(scored.logprobs, logprobs) and np.array_equal(scored.ranks, ranks)
    assert np.array_equal(scored.top_ids, top_ids) and np.array_equal(scored.top_logprobs, top_logprobs)


def test_slices_fill_the_positions_in_order_keeping_the_request_s_alternatives():
    scored = PromptLogprobs(np.arange(100, 120), first=1, k=2)
    assert scored.logprobs.shape == (0,) and scored.top_ids.shape == (0, 2)  # nothing allocated before a record
    scored.record(1, *values(1, 7, k=3))  # the step computed 3 alternatives for another row
    scored.record(8, *values(8, 12, k=3))
    assert_recorded(scored, 20)


def test_a_recompute_after_preemption_records_only_positions_not_yet_recorded():
    scored = PromptLogprobs(np.arange(100, 120), first=1, k=2)
    scored.record(1, *values(1, 9, k=2))
    scored.record(1, *values(1, 4, k=2))  # recomputed from the start: all recorded already
    scored.record(5, *values(5, 8, k=2))  # overlaps: positions 10 .. 12 are new
    assert_recorded(scored, 13)


def test_a_continuation_s_positions_start_after_its_context():
    scored = PromptLogprobs(np.arange(100, 110), first=6, k=0)
    scored.record(6, *values(6, 4, k=0))
    assert_recorded(scored, 10)
    assert scored.top_ids.shape == (4, 0)


def test_a_gap_in_the_positions_is_an_error():
    scored = PromptLogprobs(np.arange(100, 110), first=1, k=1)
    scored.record(1, *values(1, 3, k=1))
    with pytest.raises(RuntimeError, match="position 6 was scored before position 4"):
        scored.record(6, *values(6, 2, k=1))
