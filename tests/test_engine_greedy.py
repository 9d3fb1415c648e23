"""Our engine's greedy tokens equal transformers' `generate` for every architecture, however the steps are cut."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from batchgen import LLM, SamplingParams
from tests.conftest import ARCHITECTURES

MAX_TOKENS = 12
# (engine options, what they force)
ENGINE_SETUPS = {
    "plain": dict(),
    "chunked_prefill": dict(max_num_batched_tokens=7),
    "preemption": dict(block_size=4, num_gpu_blocks_override=14, max_num_seqs=6),
    "mixed": dict(mixed_prefill_decode=True, max_num_batched_tokens=9),
}


def random_prompts(vocab_size: int, count: int = 6, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(rng.randint(1, 30))] for _ in range(count)]


def hf_greedy_on(model_dir, prompts: list[list[int]], max_tokens: int, device: str = "cpu") -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    model.generation_config.eos_token_id = None  # like ignore_eos: run every prompt to max_tokens
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        with torch.no_grad():
            generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                       do_sample=False, pad_token_id=0)
        outputs.append(generated[0, len(prompt):].tolist())
    return outputs


def hf_references(tiny_model_dir, prompts: list[list[int]], max_tokens: int):
    """references(architecture) -> (model dir, prompts, transformers' greedy tokens), each built once."""
    cache = {}

    def get(architecture: str):
        if architecture not in cache:
            model_dir = tiny_model_dir(architecture)
            cache[architecture] = (model_dir, prompts, hf_greedy_on(model_dir, prompts, max_tokens))
        return cache[architecture]

    return get


@pytest.fixture(scope="module")
def references(tiny_model_dir):
    return hf_references(tiny_model_dir, random_prompts(256), MAX_TOKENS)


@pytest.mark.parametrize("setup", list(ENGINE_SETUPS))
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_greedy_tokens_equal_transformers(references, architecture, setup):
    model_dir, prompts, expected = references(architecture)
    llm = LLM(str(model_dir), device="cpu", dtype="float32", **ENGINE_SETUPS[setup])
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outputs] == expected
    assert all(o.finish_reason == "length" for o in outputs)
    if setup == "preemption":
        assert sum(o.num_preemptions for o in outputs) > 0, "the small cache should have forced a preemption"
    llm.close()
