"""Penalties and limits through the engine: transformers' repetition penalty, min_tokens, logit_bias,
allowed_token_ids and bad_words, with async scheduling, chunked prefill and preemption."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from batchgen import LLM, SamplingParams
from tests.helpers.common import random_prompts

SHAKESPEARE = Path(__file__).resolve().parents[2] / "jobs" / "shakespeare" / "model"
MAX_TOKENS = 12


def hf_generate(model_dir, prompts: list[list[int]], **generate_options) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                       do_sample=False, pad_token_id=0, **generate_options)
        outputs.append(generated[0, len(prompt):].tolist())
    return outputs


@pytest.mark.parametrize("setup", [{}, dict(block_size=4, num_gpu_blocks_override=14, max_num_seqs=6),
                                   dict(mixed_prefill_decode=True, max_num_batched_tokens=9)],
                         ids=["plain", "preemption", "mixed-chunked"])
@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "GPT2LMHeadModel"])
def test_greedy_repetition_penalty_equals_transformers(tiny_model_dir, architecture, setup):
    model_dir = tiny_model_dir(architecture)
    prompts = random_prompts(256)
    expected = hf_generate(model_dir, prompts, repetition_penalty=1.8)
    llm = LLM(str(model_dir), device="cpu", dtype="float32", **setup)
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=1.8)
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.close()
    assert [o.token_ids for o in outputs] == expected
    plain = hf_generate(model_dir, prompts)
    assert expected != plain, "the penalty should change some greedy tokens"


@pytest.fixture(scope="module")
def shakespeare():
    llm = LLM(str(SHAKESPEARE), device="cpu", max_num_seqs=8)
    yield llm
    llm.close()


PROMPTS = ["ROMEO:\n", "JULIET:\nO ", "First Citizen:\nWe ", "KING HENRY:\n"]


def generate(llm: LLM, **options) -> list:
    return llm.generate(PROMPTS, SamplingParams(max_tokens=40, seed=3, **options), use_tqdm=False)


def test_bad_words_never_appear(shakespeare):
    for output in generate(shakespeare, temperature=0.9, bad_words=["e", "th"]):
        assert "e" not in output.text and "th" not in output.text and len(output.token_ids) == 40
    baseline = "".join(o.text for o in generate(shakespeare, temperature=0.9))
    assert "e" in baseline and "th" in baseline


def test_allowed_token_ids_and_logit_bias(shakespeare):
    tokenizer = shakespeare.engine.detokenizer
    allowed = [tokenizer.encode(c)[0] for c in "abc "]
    for output in generate(shakespeare, temperature=1.0, allowed_token_ids=allowed):
        assert set(output.token_ids) <= set(allowed)
    z = tokenizer.encode("z")[0]
    for output in generate(shakespeare, temperature=0, logit_bias={z: 100.0}):
        assert set(output.token_ids) == {z}


def test_min_tokens_masks_stop_tokens(shakespeare):
    greedy = generate(shakespeare, temperature=0)[0].token_ids
    stop = greedy[2]  # stops the greedy completion of the first prompt by its third token
    unlimited = generate(shakespeare, temperature=0, stop_token_ids=[stop])[0]
    assert len(unlimited.token_ids) <= 3 and unlimited.finish_reason == "stop"
    for output in generate(shakespeare, temperature=0, stop_token_ids=[stop], min_tokens=10):
        assert stop not in output.token_ids[:10] and len(output.token_ids) >= 10


def test_min_tokens_holds_back_stop_strings(shakespeare):
    text = generate(shakespeare, temperature=0)[0].text
    stop = text[1:3]  # the greedy completion of the first prompt would stop at its second character
    assert len(generate(shakespeare, temperature=0, stop=[stop])[0].token_ids) <= 3
    for output in generate(shakespeare, temperature=0, stop=[stop], min_tokens=10):
        assert len(output.token_ids) >= 10


def test_presence_and_frequency_penalties_diversify(shakespeare):
    plain = generate(shakespeare, temperature=0)
    penalized = generate(shakespeare, temperature=0, frequency_penalty=1.5, presence_penalty=1.0)
    distinct = [len(set(o.token_ids)) for o in plain], [len(set(o.token_ids)) for o in penalized]
    assert sum(distinct[1]) > sum(distinct[0])


@pytest.mark.parametrize("options", [{}, {"num_gpu_blocks_override": 12, "block_size": 4}],
                         ids=["plain", "preemption"])
def test_penalties_async_equals_sync(options):
    results = []
    for async_scheduling in (False, True):
        llm = LLM(str(SHAKESPEARE), device="cpu", max_num_seqs=4, async_scheduling=async_scheduling, **options)
        params = [SamplingParams(max_tokens=30, seed=i, temperature=0.8 * (i % 2), repetition_penalty=1.3,
                                 frequency_penalty=0.3 * (i % 3), bad_words=["the"], min_tokens=i % 5)
                  for i in range(8)]
        try:
            outputs = llm.generate(PROMPTS * 2, params, use_tqdm=False)
        finally:
            llm.close()
        results.append(([o.token_ids for o in outputs], sum(o.num_preemptions for o in outputs)))
    assert results[0][0] == results[1][0]
    assert (results[0][1] > 0) == ("num_gpu_blocks_override" in options)


def test_token_ids_outside_the_vocabulary_are_an_error_row(shakespeare):
    outputs = shakespeare.generate(PROMPTS[:2], [SamplingParams(logit_bias={1000: 1.0}), SamplingParams(max_tokens=2)],
                                   use_tqdm=False)
    assert outputs[0].finish_reason == "error" and "sampling.logit_bias" in outputs[0].error
    assert outputs[1].finish_reason == "length"
