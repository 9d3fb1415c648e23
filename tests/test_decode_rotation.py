"""Decode attention that does the q/k norm, RoPE and K/V store itself (`rotate_store_and_decode`) against the two
kernels it replaces: `rotate_and_store`, then `decode_attention`.

Runs on CUDA; without a GPU, `TRITON_INTERPRET=1 pytest tests/test_decode_rotation.py` runs it through Triton's CPU
interpreter (it needs numpy<2.4; bf16 runs on CUDA only).
"""

from __future__ import annotations

import zlib

import pytest
import torch

pytest.importorskip("triton")

from test_attention_triton import _assert_close, _paged_cache, _skip_bf16_dot_in_interpreter  # noqa: E402
from triton_support import DEVICE, ON_GPU, TRITON_MARKS  # noqa: E402

from batchgen.layers import attention_triton
from batchgen.layers.attention import DecodeRotation
from batchgen.layers.rotary import RotaryEmbedding
from batchgen.layers.rotary_triton import rotate_and_store

pytestmark = TRITON_MARKS
f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16

# (batch, num_heads, num_kv_heads, head_dim, block_size, max_ctx, dtype, num_splits, qk_norm, window); batch > 1
# gets a padding row. Several KV tiles per split (the loop before the peeled last tile), one split (no merge), a
# head_dim below its power-of-two tile, a window.
CASES = [
    (1, 16, 8, 128, 16, 200, f32, 16, True, None),
    (3, 8, 4, 64, 16, 300, f32, 4, False, None),
    (5, 6, 2, 80, 16, 150, f16, 2, True, 50),
    (2, 4, 4, 64, 8, 100, f32, 1, True, None),
    (1, 16, 8, 128, 16, 2000, bf16, None, True, None),
    (4, 16, 8, 128, 16, 700, bf16, 8, False, 300),
]


def _slots(seq_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """The cache slot of each row's last position (its new token); -1 for padding rows."""
    last = (seq_lens - 1).clamp(min=0).long()
    blocks = block_tables.cpu().long().gather(1, (last // block_size)[:, None])[:, 0]
    return torch.where(seq_lens > 0, blocks * block_size + last % block_size, -1)


FP8_CASES = [(1, 16, 8, 128, 16, 2000, bf16, None, True, None), (3, 8, 4, 64, 16, 300, bf16, 4, False, None)]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_rotate_then_decode(case: tuple) -> None:
    _check_against_rotate_then_decode(case, None)


@pytest.mark.skipif(not ON_GPU, reason="the interpreter rounds some values wrongly when it writes fp8")
@pytest.mark.parametrize("case", FP8_CASES, ids=str)
def test_matches_rotate_then_decode_on_an_fp8_cache(case: tuple) -> None:
    _check_against_rotate_then_decode(case, torch.float8_e4m3fn)


def _check_against_rotate_then_decode(case: tuple, cache_dtype: torch.dtype | None) -> None:
    batch, num_heads, num_kv_heads, head_dim, block_size, max_ctx, dtype, num_splits, qk_norm, window = case
    _skip_bf16_dot_in_interpreter(dtype)
    gen = torch.Generator().manual_seed(zlib.crc32(str(case).encode()))
    seq_lens = torch.randint(1, max_ctx + 1, (batch,), generator=gen)
    seq_lens[0] = max_ctx
    if batch > 2:
        seq_lens[1] = 1  # only the new token
    if batch > 1:
        seq_lens[-1] = 0  # a padding row of the graph bucket
    k_cache, v_cache, block_tables = _paged_cache(seq_lens.tolist(), block_size, num_kv_heads, head_dim, dtype, gen)
    if cache_dtype is not None:
        k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    slots = _slots(seq_lens, block_tables, block_size)
    real = slots >= 0
    # The new tokens' slots were never written: whatever they hold must not be read.
    for cache in (k_cache, v_cache):
        cache.view(-1, num_kv_heads, head_dim)[slots[real].to(DEVICE)] = float("nan")
    rotary = RotaryEmbedding(head_dim, max_ctx, theta=1e6).to(DEVICE)
    qkv = (3 * torch.randn(batch, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)).to(dtype).to(DEVICE)
    norms = None
    if qk_norm:
        norms = (torch.rand(head_dim, generator=gen).add(0.5).to(dtype).to(DEVICE),
                 torch.rand(head_dim, generator=gen).add(0.5).to(dtype).to(DEVICE), 1e-6)
    positions = (seq_lens - 1).clamp(min=0).to(DEVICE)
    slots, seq_lens = slots.to(DEVICE), seq_lens.to(torch.int32).to(DEVICE)
    scale = head_dim**-0.5

    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    q = rotate_and_store(qkv, positions, rotary.cos, rotary.sin, norms, expected_k, expected_v, slots, num_heads,
                         num_kv_heads)
    expected = attention_triton.decode_attention(q, expected_k, expected_v, block_tables, seq_lens, scale, window,
                                                 num_splits=num_splits)

    arrivals = torch.zeros(batch * num_kv_heads, dtype=torch.int32, device=DEVICE)
    rotation = DecodeRotation(qkv, positions, rotary.cos, rotary.sin, norms, slots)
    out = attention_triton.rotate_store_and_decode(rotation, num_heads, k_cache, v_cache, block_tables, seq_lens,
                                                   scale, window, num_splits=num_splits, split_arrivals=arrivals)
    _assert_close(out, expected)
    if batch > 1:
        assert (out[-1] == 0).all()
    assert (arrivals == 0).all()
    atol = 0.5 if cache_dtype is not None else 2e-2 if dtype == bf16 else 1e-3
    torch.testing.assert_close(k_cache.float(), expected_k.float(), equal_nan=True, atol=atol, rtol=0)
    assert torch.equal(v_cache.float().nan_to_num(), expected_v.float().nan_to_num())  # V is copied, never rounded


def test_small_decode_batches_rotate_in_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """Switched on, decode attention takes the rotation where it splits the KV; with cascade, without splits or
    switched off, never."""
    device = torch.device(DEVICE)
    monkeypatch.setattr(attention_triton, "FUSE_ROTATION", True)
    assert not attention_triton.rotation_fuses(1, 8, device, cascade=True)
    splits_at_one = attention_triton._default_num_splits(1, 8, device) > 1
    assert attention_triton.rotation_fuses(1, 8, device, cascade=False) == splits_at_one
    assert not attention_triton.rotation_fuses(4096, 8, device, cascade=False)
    monkeypatch.setattr(attention_triton, "FUSE_ROTATION", False)
    assert not attention_triton.rotation_fuses(1, 8, device, cascade=False)
