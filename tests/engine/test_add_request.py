"""add_request checks a row's sampling parameters once for the rows that share them: the checks' results are those
of each row checked alone."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from batchgen import LLM, SamplingParams

SHAKESPEARE = Path(__file__).resolve().parents[2] / "jobs" / "shakespeare" / "model"
PROMPTS = ["ROMEO:\n", "JULIET:\nO ", "KING HENRY:\n"]


@pytest.fixture(scope="module")
def llm():
    engine = LLM(str(SHAKESPEARE), device="cpu", max_num_seqs=8)
    yield engine
    engine.close()


def test_every_row_sharing_refused_parameters_is_an_error_row(llm):
    shared = SamplingParams(max_tokens=4, logit_bias={1000: 1.0})
    outputs = llm.generate(PROMPTS, [shared, SamplingParams(max_tokens=2), shared], use_tqdm=False)
    assert [o.finish_reason for o in outputs] == ["error", "length", "error"]
    assert "sampling.logit_bias" in outputs[0].error and outputs[2].error == outputs[0].error


def test_the_prompt_is_checked_before_the_shared_parameters(llm):
    shared = SamplingParams(max_tokens=4, allowed_token_ids=[1000])
    outputs = llm.generate([[5, 6], [9999], [7]], shared, use_tqdm=False)
    assert "prompt token ids" in outputs[1].error
    assert all("sampling.allowed_token_ids" in outputs[i].error for i in (0, 2))


def test_parameters_changed_between_runs_are_checked_again(llm):
    params = SamplingParams(max_tokens=3, temperature=0, logit_bias={5: 1.0})
    assert [o.finish_reason for o in llm.generate(PROMPTS, params, use_tqdm=False)] == ["length"] * 3
    params.logit_bias[1000] = 1.0
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.finish_reason for o in outputs] == ["error"] * 3
    del params.logit_bias[1000]
    assert [o.finish_reason for o in llm.generate(PROMPTS, params, use_tqdm=False)] == ["length"] * 3


def test_rows_sharing_parameters_each_get_their_own_seed_and_the_model_stop_ids(llm):
    llm.engine.eos_token_ids = [*llm.engine.eos_token_ids, 7]  # a model with a second EOS id
    try:
        shared = SamplingParams(max_tokens=4, stop_token_ids=[3])
        for i, prompt in enumerate(PROMPTS):
            llm.engine.add_request(i, prompt, None, shared)
        requests = list(llm.engine.scheduler.waiting)
        assert [r.sampling_params.stop_token_ids for r in requests] == [[3, 7]] * 3 and shared.stop_token_ids == [3]
        assert len({r.seed for r in requests}) == 3 and shared.seed is None
        while llm.engine.has_unfinished_requests:
            llm.engine.step()
    finally:
        llm.engine.eos_token_ids = llm.engine.eos_token_ids[:-1]


def queued(engine) -> list[dict]:
    """A copy of the requests an engine holds (waiting, waiting for their first sample, finished on arrival), field
    by field; arrival times aside, a sibling's first sample by its key."""
    scheduler = engine.scheduler
    requests = [*scheduler.waiting, *(r for siblings in scheduler._siblings.values() for r in siblings),
                *engine._finished_on_arrival]
    fields = [name for name in type(requests[0]).__slots__ if name not in ("arrival_time", "first_sample",
                                                                          "prompt_logprobs", "finish_time",
                                                                          "_prompt_array")]
    return copy.deepcopy([{**{name: getattr(r, name) for name in fields}, "prompt": engine._prompts.get(r.key),
                           "prompt_array": None if r._prompt_array is None else r._prompt_array.tolist(),
                           "first_sample": r.first_sample and r.first_sample.key,
                           "prompt_logprobs": r.prompt_logprobs is not None} for r in requests])


def test_rows_added_in_one_call_are_the_requests_added_one_by_one(llm):
    """Shared and own parameters, n > 1, resumed samples, seeds, stop strings, logprobs and rows that finish at
    once as errors (an empty or over-long prompt, a token outside the vocabulary, refused parameters)."""
    shared = SamplingParams(max_tokens=4)
    rows = [
        (0, "ROMEO:\n", None, shared, None),
        (1, None, [5, 6, 7], shared, None),
        (2, "JULIET:\nO ", None, SamplingParams(max_tokens=3, n=3, stop=["e"], logprobs=1), None),
        (3, "KING:", None, SamplingParams(max_tokens=3, n=3, seed=11), [0, 2]),
        (4, None, [], shared, None),
        (5, None, [9999], shared, None),
        (6, None, [1] * 5000, shared, None),
        (7, "To be", None, SamplingParams(max_tokens=2, logit_bias={1000: 1.0}), None),
        (8, "HAMLET:", None, SamplingParams(max_tokens=2, prompt_logprobs=1, truncate_prompt_tokens=3), None),
        (9, "ROMEO:\n", None, shared, None),
    ]
    engine = llm.engine
    for row in rows:
        engine.add_request(*row)
    one_by_one = queued(engine)
    while engine.has_unfinished_requests:
        engine.step()
    engine.add_requests(rows)
    assert queued(engine) == one_by_one
    errors = {r["request_id"] for r in one_by_one if r["finish_reason"] == "error"}
    assert len(one_by_one) == 13 and errors == {4, 5, 6, 7}
    while engine.has_unfinished_requests:
        engine.step()


def test_outputs_carry_each_requests_text_and_timings_and_leave_no_state_behind(llm):
    """A completion's text is its tokens decoded, cut before the stop string that ended it; an error has none; tpot
    spreads the time after the first token over the tokens after it."""
    params = [SamplingParams(max_tokens=6, seed=1), SamplingParams(max_tokens=12, seed=2, stop=["e", "a"], n=2),
              SamplingParams(max_tokens=4, logit_bias={1000: 1.0})]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    samples = [outputs[0], *outputs[1].outputs, outputs[2]]
    decode = llm.engine.detokenizer.decode
    assert samples[0].text == decode(samples[0].token_ids) and samples[0].finish_reason == "length"
    stopped, unstopped = samples[1:3]
    assert (stopped.finish_reason, unstopped.finish_reason) == ("stop", "length")
    full = decode(stopped.token_ids)
    assert stopped.text == full[:min(i for i in (full.find("e"), full.find("a")) if i >= 0)] != full
    assert unstopped.text == decode(unstopped.token_ids)
    assert samples[3].finish_reason == "error" and samples[3].text is None and samples[3].ttft_ms is None
    for sample in samples[:3]:
        assert sample.latency_ms >= sample.ttft_ms > 0
        if len(sample.token_ids) > 1:
            assert sample.tpot_ms == pytest.approx((sample.latency_ms - sample.ttft_ms) / (len(sample.token_ids) - 1))
    detokenizer = llm.engine.detokenizer
    assert not detokenizer._stop_texts and not detokenizer.checks_stop_strings and not llm.engine._prompts
