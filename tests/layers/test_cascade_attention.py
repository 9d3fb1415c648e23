"""Cascade decode attention: the shared prefix read once for the whole batch gives the reference's output.

Runs on CUDA, or on CPU through Triton's interpreter (`TRITON_INTERPRET=1`; fp32 only there).
"""

from __future__ import annotations

import zlib

import pytest
import torch

pytest.importorskip("triton", reason="Triton kernels need triton (torch's CPU build has none)")

from batchgen.layers import attention_torch, attention_triton
from batchgen.layers.shared_prefix import shared_prefix_len
from tests.helpers.graph_replay import capture_graph  # noqa: E402
from tests.helpers.paged import KV_CACHE_DTYPES, assert_close, cache_dtype, paged_cache, skip_bf16_dot_in_interpreter
from tests.helpers.triton_support import DEVICE, ON_GPU, TRITON_MARKS  # noqa: E402

pytestmark = TRITON_MARKS

f32, bf16 = torch.float32, torch.bfloat16


def _shared_prefix_tables(block_tables: torch.Tensor, seq_lens: list[int], prefix_len: int,
                          block_size: int) -> torch.Tensor:
    """Each real row's leading prefix_len // block_size blocks become row 0's, as prefix caching shares them."""
    shared = prefix_len // block_size
    tables = block_tables.clone()
    for b, n in enumerate(seq_lens):
        if n > 0:
            tables[b, :shared] = block_tables[0, :shared]
    return tables


# (prefix len, suffix lens (None: a padding row), num_heads, num_kv_heads, dtype, num_splits, num_prefix_splits)
CASCADE_CASES = [
    (0, (5, 9, None), 4, 4, f32, 1, 1),  # nothing shared
    (10, (3, 20, 1, None), 8, 4, f32, 2, 1),  # less than one block
    (50, (3, 20, 1, None), 8, 2, f32, 1, 3),  # several blocks and a partial one
    (64, (5, 16, 1, 9), 8, 8, f32, 4, 2),  # all but each row's last block
    (48, (0, 7, 30, None), 16, 4, f32, 2, 4),  # the whole context of the first row
    (130, (0, 70, 3, None, None), 8, 2, f32, 8, 16),  # more prefix splits than prefix tiles
    (1000, tuple(range(0, 100, 7)) + (None,), 16, 8, bf16, 1, None),
    (1000, (100,) * 40 + (None,) * 8, 16, 4, bf16, 2, 2),
    (300, (1, 50, 200, 0, None), 32, 8, bf16, 4, 8),
]


@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
@pytest.mark.parametrize("case", CASCADE_CASES, ids=str)
def test_cascade_decode_matches_reference(case: tuple, kv_cache_dtype: str) -> None:
    prefix_len, suffixes, num_heads, num_kv_heads, dtype, num_splits, num_prefix_splits = case
    skip_bf16_dot_in_interpreter(dtype)
    head_dim, block_size = 64, 16
    seq_lens = [0 if s is None else prefix_len + s for s in suffixes]
    gen = torch.Generator().manual_seed(zlib.crc32(str(case).encode()))
    k_cache, v_cache, block_tables = paged_cache(seq_lens, block_size, num_kv_heads, head_dim,
                                                  cache_dtype(kv_cache_dtype, dtype), gen)
    block_tables = _shared_prefix_tables(block_tables, seq_lens, prefix_len, block_size)
    q = (2 * torch.randn(len(seq_lens), num_heads, head_dim, generator=gen)).to(dtype).to(DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    shared = shared_prefix_len(block_tables, lens, block_size)
    real_lens = [n for n in seq_lens if n > 0]
    assert shared.item() == min(prefix_len // block_size * block_size, *real_lens)
    args = (q, k_cache, v_cache, block_tables, lens, head_dim**-0.5)

    out = attention_triton.decode_attention(*args, num_splits=num_splits, shared_prefix_len=shared,
                                            num_prefix_splits=num_prefix_splits)
    assert_close(out, attention_torch.decode_attention(*args))
    assert (out[lens == 0] == 0).all()


@pytest.mark.parametrize("dtype", [f32, bf16])
def test_cascade_decode_with_softcap_matches_reference(dtype: torch.dtype) -> None:
    """Soft-capped scores (Gemma 2's global layers cascade) in both the shared-prefix and the per-row kernel."""
    skip_bf16_dot_in_interpreter(dtype)
    num_heads, num_kv_heads, head_dim, block_size, prefix_len, softcap = 8, 2, 64, 16, 50, 1.5
    seq_lens = [prefix_len + s for s in (3, 20, 1)] + [0]
    gen = torch.Generator().manual_seed(9)
    k_cache, v_cache, block_tables = paged_cache(seq_lens, block_size, num_kv_heads, head_dim, dtype, gen)
    block_tables = _shared_prefix_tables(block_tables, seq_lens, prefix_len, block_size)
    q = (2 * torch.randn(len(seq_lens), num_heads, head_dim, generator=gen)).to(dtype).to(DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    shared = shared_prefix_len(block_tables, lens, block_size)
    assert shared.item() == 48
    args = (q, k_cache, v_cache, block_tables, lens, head_dim**-0.5)

    out = attention_triton.decode_attention(*args, softcap=softcap, num_splits=2, shared_prefix_len=shared,
                                            num_prefix_splits=2)
    expected = attention_torch.decode_attention(*args, softcap=softcap)
    assert_close(out, expected)
    assert not torch.allclose(expected.float(), attention_torch.decode_attention(*args).float(), atol=5e-2)


def test_cascade_reads_the_prefix_through_row_zero() -> None:
    """The prefix kernel, not each row's own loop, covers [0, shared_len): with the shared length forced past the
    blocks that really are shared, rows other than 0 read row 0's K/V there and stop matching the reference."""
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 32, 16
    seq_lens = [64, 64]
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache, block_tables = paged_cache(seq_lens, block_size, num_kv_heads, head_dim, f32, gen)
    q = torch.randn(2, num_heads, head_dim, generator=gen).to(DEVICE)
    args = (q, k_cache, v_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
            head_dim**-0.5)
    expected = attention_torch.decode_attention(*args)
    forced = torch.tensor([32], dtype=torch.int32, device=DEVICE)
    out = attention_triton.decode_attention(*args, shared_prefix_len=forced, num_splits=2, num_prefix_splits=2)
    assert_close(out[:1], expected[:1])
    assert not torch.allclose(out[1], expected[1], atol=1e-3)


@pytest.mark.skipif(not ON_GPU, reason="CUDA-graph capture needs a GPU")
def test_cascade_decode_replays_in_cuda_graph() -> None:
    """Captured once, the shared length computed inside the graph follows new block tables written in place."""
    batch, num_heads, num_kv_heads, head_dim, block_size, prefix_len, suffix = 64, 16, 8, 128, 16, 512, 100
    seq_lens = [prefix_len + suffix] * batch
    gen = torch.Generator().manual_seed(7)
    k_cache, v_cache, own_tables = paged_cache(seq_lens, block_size, num_kv_heads, head_dim, bf16, gen)
    shared_tables = _shared_prefix_tables(own_tables, seq_lens, prefix_len, block_size)
    block_tables = shared_tables.clone()
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(batch, num_heads, head_dim, generator=gen).to(bf16).to(DEVICE)
    scale = head_dim**-0.5

    def step() -> torch.Tensor:
        shared = shared_prefix_len(block_tables, lens, block_size)
        return attention_triton.decode_attention(q, k_cache, v_cache, block_tables, lens, scale,
                                                 shared_prefix_len=shared)

    graph, out = capture_graph(step)
    for tables in (own_tables, shared_tables):
        block_tables.copy_(tables)
        q.copy_(torch.randn(q.shape, generator=gen).to(bf16))
        graph.replay()
        assert_close(out, attention_torch.decode_attention(q, k_cache, v_cache, block_tables, lens, scale))
