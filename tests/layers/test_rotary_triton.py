"""The fused Triton q/k-norm + RoPE + K/V-store kernel against the reference ops it replaces, on random inputs.

Runs on CUDA; without a GPU, `TRITON_INTERPRET=1 pytest tests/layers/test_rotary_triton.py` runs it through Triton's CPU
interpreter (it needs numpy<2.4; bf16 runs on CUDA only).
"""

from __future__ import annotations

import zlib

import pytest
import torch

pytest.importorskip("triton", reason="Triton kernels need triton (torch's CPU build has none)")

from batchgen.layers import attention_torch
from batchgen.layers.rotary import RotaryEmbedding
from batchgen.layers.rotary_triton import rotate_and_store
from batchgen.models.gemma import gemma_norm_and_rotate
from batchgen.models.llama import norm_and_rotate
from tests.helpers.paged import KV_CACHE_DTYPES, cache_dtype
from tests.helpers.triton_support import DEVICE, TRITON_MARKS  # noqa: E402
from tests.layers.test_attention_triton import same_bits, skip_fp8_store_in_interpreter

pytestmark = TRITON_MARKS
f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
# bf16/fp16: the reference rounds after every op, the kernel once at the end: about one unit in the last place.
TOLERANCE = {f32: (1e-5, 1e-5), bf16: (3e-2, 1.6e-2), f16: (4e-3, 2e-3)}
# An fp8 cache: those differences may flip K's rounding to fp8, one fp8 step (at most 1/8 of the value), on top of
# the differences themselves near 0.
FP8_K_RTOL = 2**-3

# (tokens, num_heads, num_kv_heads, head_dim, rotary_dim, qk_norm, dtype); every case has padding rows (slot -1).
# rotary_dim < head_dim: partial rotary (Phi-3/4), the dims after the rotary ones pass through (and are normed).
CASES = [
    (1, 16, 8, 128, 128, True, bf16),
    (1, 16, 8, 128, 128, False, f32),
    (5, 4, 4, 64, 64, True, f32),
    (7, 12, 4, 80, 80, False, f16),
    (33, 6, 2, 80, 80, True, f32),
    (64, 32, 8, 128, 128, False, bf16),
    (300, 16, 8, 128, 128, True, bf16),
    (9, 8, 1, 32, 32, True, f16),
    (3, 8, 2, 128, 96, True, f32),
    (6, 12, 4, 96, 48, False, bf16),
    (5, 4, 4, 64, 24, True, f16),
    (4, 6, 2, 80, 60, False, f32),
]


@pytest.mark.parametrize("gemma_style", [False, True], ids=["qwen3_norm", "gemma_norm"])
@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_rotate_and_store_matches_reference(case: tuple, kv_cache_dtype: str, gemma_style: bool) -> None:
    """gemma_style: the q/k norms as Gemma 3 computes them (a zero-centred weight, scaled by 1 + weight)."""
    num_tokens, num_heads, num_kv_heads, head_dim, rotary_dim, qk_norm, dtype = case
    if DEVICE == "cpu" and dtype == bf16:
        pytest.skip("bf16 runs on CUDA only")
    if gemma_style and (not qk_norm or rotary_dim != head_dim):
        pytest.skip("Gemma's q/k norms come with full rotary only")
    skip_fp8_store_in_interpreter(kv_cache_dtype)
    gen = torch.Generator().manual_seed(zlib.crc32(str(case).encode()))
    block_size, num_blocks, max_positions = 16, 64, 4096
    rotary = RotaryEmbedding(rotary_dim, max_positions, theta=1e6).to(DEVICE)
    qkv = (3 * torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)).to(dtype)
    positions = torch.randint(0, max_positions, (num_tokens,), generator=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::3] = -1
    norms = None
    if qk_norm:
        offset = -0.5 if gemma_style else 0.5
        norms = (torch.rand(head_dim, generator=gen).add(offset).to(dtype).to(DEVICE),
                 torch.rand(head_dim, generator=gen).add(offset).to(dtype).to(DEVICE), 1e-6)
    qkv, positions, slots = qkv.to(DEVICE), positions.to(DEVICE), slots.to(DEVICE)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = (torch.randn(cache_shape, generator=gen).to(cache_dtype(kv_cache_dtype, dtype)).to(DEVICE)
                        for _ in range(2))
    expected_k, expected_v = k_cache.clone(), v_cache.clone()

    q = rotate_and_store(qkv, positions, rotary.cos, rotary.sin, norms, k_cache, v_cache, slots, num_heads,
                         num_kv_heads, gemma_style=gemma_style)

    q_ref, k_ref, v_ref = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
    reference = gemma_norm_and_rotate if gemma_style else norm_and_rotate
    q_ref, k_ref = reference(positions, q_ref.view(num_tokens, num_heads, head_dim),
                             k_ref.view(num_tokens, num_kv_heads, head_dim), norms, rotary.cos, rotary.sin)
    attention_torch.store_kv(k_ref, v_ref.view(num_tokens, num_kv_heads, head_dim), expected_k, expected_v, slots)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(q.float(), q_ref.float(), atol=atol, rtol=rtol)
    k_atol, k_rtol = (max(atol, 2**-9), max(rtol, FP8_K_RTOL)) if kv_cache_dtype == "fp8" else (atol, rtol)
    torch.testing.assert_close(k_cache.float(), expected_k.float(), atol=k_atol, rtol=k_rtol)
    assert same_bits(v_cache, expected_v)  # V is copied (or rounded to fp8) like the reference does
