"""Our engine's greedy tokens equal transformers' `generate` for every architecture, however the steps are cut."""

from __future__ import annotations

import pytest

from batchgen import LLM, SamplingParams
from tests.helpers.common import ARCHITECTURES, MAX_TOKENS, hf_references, random_prompts

# (engine options, what they force)
ENGINE_SETUPS = {
    "plain": dict(),
    "chunked_prefill": dict(max_num_batched_tokens=7),
    "preemption": dict(block_size=4, num_gpu_blocks_override=14, max_num_seqs=6),
    "mixed": dict(mixed_prefill_decode=True, max_num_batched_tokens=9),
}








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
