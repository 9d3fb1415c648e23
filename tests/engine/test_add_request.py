"""add_request checks a row's sampling parameters once for the rows that share them: the checks' results are those
of each row checked alone."""

from __future__ import annotations

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
        assert len({r.sampling_params.seed for r in requests}) == 3 and shared.seed is None
        while llm.engine.has_unfinished_requests:
            llm.engine.step()
    finally:
        llm.engine.eos_token_ids = llm.engine.eos_token_ids[:-1]
