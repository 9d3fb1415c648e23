"""The KV cache is allocated with torch.empty: no attention path may read a slot before writing it.

A fresh cache full of NaN stands in for uninitialized memory: any unwritten slot read (even one multiplied by a zero
probability) turns the output into NaN.
"""

from __future__ import annotations

import pytest
import torch

from batchgen import LLM, SamplingParams
from tests.helpers.common import KV_SETUPS as SETUPS
from tests.helpers.common import hf_greedy_on, random_prompts
from tests.helpers.triton_support import DEVICE, TRITON_MARKS

MAX_TOKENS = 10


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "GPT2LMHeadModel"])
def test_nan_filled_cache_gives_transformers_tokens(tiny_model_dir, architecture: str, setup: str) -> None:
    model_dir = tiny_model_dir(architecture)
    prompts = random_prompts(256)
    llm = LLM(str(model_dir), device="cpu", dtype="float32", **SETUPS[setup])
    llm.engine.runner.kv_cache.fill_(float("nan"))
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                           use_tqdm=False)
    assert [o.token_ids for o in outputs] == hf_greedy_on(model_dir, prompts, MAX_TOKENS)
    llm.close()


def _caches_with_unwritten_nan(seq_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int,
                               device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache) where only each sequence's first seq_len slots hold values, NaN everywhere else (spare
    blocks and the tail of each sequence's last block), their zero-filled twins' union as (k_zero, v_zero), and
    block tables whose unused columns point at block 0."""
    gen = torch.Generator().manual_seed(0)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq) + 1, dtype=torch.int32)
    owners = torch.randperm(num_blocks, generator=gen).tolist()
    for b, (n, num) in enumerate(zip(seq_lens, blocks_per_seq, strict=True)):
        tables[b, :num] = torch.tensor(owners[:num], dtype=torch.int32)
        owners = owners[num:]
        for p in range(n):
            written[tables[b, p // block_size] * block_size + p % block_size] = True
    caches = []
    for _ in range(2):
        values = torch.randn(shape, generator=gen).view(-1, num_kv_heads, head_dim)
        values[~written] = float("nan")
        caches.append(values.view(shape).to(device))
    return caches[0], caches[1], tables.to(device)


def _on_triton(test):
    for mark in TRITON_MARKS:
        test = mark(test)
    return test


@_on_triton
def test_triton_kernels_never_read_unwritten_slots() -> None:
    pytest.importorskip("triton", reason="Triton kernels need triton (torch's CPU build has none)")
    from batchgen.layers import attention_torch, attention_triton

    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 32, 16
    seq_lens = [37, 5, 0]  # the last row is a padded CUDA-graph row: context 0
    k_cache, v_cache, tables = _caches_with_unwritten_nan(seq_lens, block_size, num_kv_heads, head_dim, DEVICE)
    zero_k, zero_v = k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0)
    gen = torch.Generator().manual_seed(1)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(DEVICE)
    expected = attention_torch.decode_attention(q, zero_k, zero_v, tables, lens, head_dim**-0.5)
    for num_splits in (1, 4):
        out = attention_triton.decode_attention(q, k_cache, v_cache, tables, lens, head_dim**-0.5,
                                                num_splits=num_splits)
        torch.testing.assert_close(out, expected, atol=1e-3, rtol=1e-3)

    query_lens = [12, 5, 0]  # chunks ending each sequence's context
    qsl = torch.tensor([0, 12, 17, 17], dtype=torch.int32, device=DEVICE)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(DEVICE)
    args = (tables, qsl, lens, head_dim**-0.5, max(query_lens), max(seq_lens))
    out = attention_triton.prefill_attention(q, k_cache, v_cache, *args)
    torch.testing.assert_close(out, attention_torch.prefill_attention(q, zero_k, zero_v, *args), atol=1e-3,
                               rtol=1e-3)
