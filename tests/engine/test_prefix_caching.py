"""Automatic prefix caching: greedy tokens equal transformers' and the uncached engine's on every architecture,
for prompts that share a prefix not aligned to a block, a prompt that is entirely cached, and under preemption."""

from __future__ import annotations

import random

import pytest
import torch

from batchgen import LLM, SamplingParams
from tests.helpers.common import ARCHITECTURES, hf_greedy_on, hf_references

MAX_TOKENS = 8
BLOCK_SIZE = 4
SETUPS = {
    "plain": dict(),
    "preemption": dict(num_gpu_blocks_override=16, max_num_seqs=6),
    "mixed_chunked": dict(mixed_prefill_decode=True, max_num_batched_tokens=9),
}


def shared_prefix_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Prompts over one 10-token prefix (2.5 blocks), with suffixes of 0 to 9 tokens; then the first one again, and
    a prompt that is exactly the 8 tokens of its first two blocks (entirely cached, block-aligned)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab_size) for _ in range(10)]
    prompts = [prefix + [rng.randrange(vocab_size) for _ in range(n)] for n in (3, 0, 9, 5, 1, 6)]
    return prompts + [list(prompts[0]), prefix[:8]]


@pytest.fixture(scope="module")
def references(tiny_model_dir):
    return hf_references(tiny_model_dir, shared_prefix_prompts(256), MAX_TOKENS)


def generate(model_dir, prompts: list[list[int]], enable_prefix_caching: bool, device: str = "cpu", **options):
    """The first prompt alone, then all of them, so that the later ones find its blocks in the cache."""
    llm = LLM(str(model_dir), device=device, dtype="float32", block_size=BLOCK_SIZE,
              enable_prefix_caching=enable_prefix_caching, **options)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    try:
        first = llm.generate(prompts[:1], params, use_tqdm=False)
        return first + llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.close()


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_cached_greedy_tokens_equal_transformers_and_uncached(references, architecture, setup):
    model_dir, prompts, expected = references(architecture)
    cached = generate(model_dir, prompts, True, **SETUPS[setup])
    uncached = generate(model_dir, prompts, False, **SETUPS[setup])
    assert [o.token_ids for o in cached] == [o.token_ids for o in uncached] == expected[:1] + expected
    assert all(o.num_cached_tokens == 0 for o in uncached)
    hits = [o.num_cached_tokens for o in cached[1:]]
    # Every later prompt finds at least the two full blocks of the shared prefix, except when preemption evicted them.
    assert hits[0] == 12 if setup != "preemption" else sum(hits) > 0  # the first prompt again: all but its last block
    if setup != "preemption":
        assert all(hit >= 8 or len(p) <= 8 for hit, p in zip(hits, prompts, strict=True))
        assert hits[-1] == 4  # the block-aligned prompt recomputes its last block for the logits of its last token
    if setup == "preemption":
        assert sum(o.num_preemptions for o in cached) > 0, "the small cache should have forced a preemption"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_cached_greedy_tokens_equal_transformers_on_gpu(tiny_model_dir, architecture):
    model_dir = tiny_model_dir(architecture)
    prompts = shared_prefix_prompts(256)
    expected = hf_greedy_on(model_dir, prompts, MAX_TOKENS, device="cuda")
    graphs = dict(cuda_graph_capture_sizes=[1, 2, 4, 8, 16])
    for setup in (graphs, dict(**graphs, **SETUPS["preemption"]), dict(enforce_eager=True, **SETUPS["mixed_chunked"])):
        outputs = generate(model_dir, prompts, True, device="cuda", **setup)
        assert [o.token_ids for o in outputs] == expected[:1] + expected, setup
        assert sum(o.num_cached_tokens for o in outputs) > 0, setup
