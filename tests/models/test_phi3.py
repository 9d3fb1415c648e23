"""Phi-3/4 against transformers on the tiny checkpoint (partial rotary over 12 of 16 dims, LongRoPE from position
64): fused checkpoint tensors, and logits and greedy tokens across LongRoPE's original length."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, DynamicCache

from batchgen import LLM, SamplingParams
from tests.helpers.common import assert_logits_close, load_ours, random_tokens, reference_logits
from tests.helpers.paged import PagedTestCache

ARCHITECTURE = "Phi3ForCausalLM"
ORIGINAL = 64  # the tiny config's original_max_position_embeddings: long factors from this position on


@pytest.fixture(scope="module")
def checkpoint(tiny_model_dir: Callable[..., Path]) -> Path:
    return tiny_model_dir(ARCHITECTURE)


@torch.no_grad()
def decoded_reference_logits(directory: Path, tokens: list[int], prefill_len: int) -> torch.Tensor:
    """transformers' logits (len(tokens), vocab) when it prefills the first prefill_len tokens in one forward, then
    feeds the rest one at a time through its cache, as generate does."""
    model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").float().eval()
    cache = DynamicCache(config=model.config)
    logits = [model(torch.tensor([tokens[:prefill_len]]), cache=cache, use_cache=True).logits[0]]
    for token in tokens[prefill_len:]:
        logits.append(model(torch.tensor([[token]]), cache=cache, use_cache=True).logits[0])
    return torch.cat(logits)


def test_fused_checkpoint_tensors_load_as_they_are(checkpoint: Path) -> None:
    model = load_ours(checkpoint)
    ours = model.state_dict()
    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"} <= names
        for name in names:
            assert torch.equal(ours[name], f.get_tensor(name)), name
    assert "lm_head.weight" not in names and model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.layers[0].self_attn.rotary.rotary_dim == 12  # 0.75 of the 16-dim heads


def test_decoding_across_the_original_length_matches_transformers(checkpoint: Path) -> None:
    """A prompt within the original length, decoded past it: transformers switches to the long factors at the first
    step past it, and keeps the keys it cached with the short ones; our table does the same by position."""
    tokens = random_tokens(ORIGINAL + 24, seed=21)
    expected = decoded_reference_logits(checkpoint, tokens, prefill_len=40)
    # The factors matter here: one forward over all the tokens (long factors throughout) gives other logits.
    assert not torch.allclose(expected, reference_logits(checkpoint, tokens), atol=1e-3)
    model = load_ours(checkpoint)
    cache = PagedTestCache(model, block_size=4)
    steps = [tokens[:17], tokens[17:40]] + [[t] for t in tokens[40:]]
    start = 0
    for step in steps:
        (logits,) = cache.run(model, [(0, step)], num_padding_rows=2 if len(step) == 1 else 0)
        assert_logits_close(logits, expected[start : start + len(step)])
        start += len(step)


def test_prompt_past_the_original_length_takes_short_factors_below_it(checkpoint: Path) -> None:
    """The documented difference: transformers rotates every position of a prompt longer than the original length with
    the long factors; ours keeps the short ones below it, as if the prompt had been decoded past it."""
    tokens = random_tokens(ORIGINAL + 16, seed=22)
    model = load_ours(checkpoint)
    (logits,) = PagedTestCache(model, block_size=4).run(model, [(0, tokens)])
    assert_logits_close(logits, decoded_reference_logits(checkpoint, tokens, prefill_len=ORIGINAL))
    assert not torch.allclose(logits, reference_logits(checkpoint, tokens), atol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_and_eager_decode_across_the_original_length_equal_transformers_on_gpu(checkpoint: Path) -> None:
    """The fused partial-rotary kernel, eager and replayed in CUDA graphs, on generations that cross position 64.

    The reference is our engine on the CPU, which the tests above hold equal to transformers 5.24: the GPU machine's
    transformers (5.17) still rotates position 64 itself with the short factors, one position later than 5.24 and
    Phi-3's reference code switch to the long ones."""
    prompts = [random_tokens(n, seed=n) for n in (30, 41, 52, 63, 12, 47)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    cpu = LLM(str(checkpoint), device="cpu", dtype="float32", max_num_seqs=8, max_model_len=128)
    expected = [o.token_ids for o in cpu.generate(prompts, params, use_tqdm=False)]
    cpu.close()
    for setup in (dict(enforce_eager=True), dict(cuda_graph_capture_sizes=[1, 2, 4, 8]),
                  dict(cuda_graph_capture_sizes=[1, 2, 4, 8], max_num_batched_tokens=9, block_size=4)):
        llm = LLM(str(checkpoint), dtype="float32", max_num_seqs=8, max_model_len=128, **setup)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.token_ids for o in outputs] == expected, setup
        llm.close()
