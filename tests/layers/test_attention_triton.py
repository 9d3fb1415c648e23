"""The Triton paged-attention ops against the plain-PyTorch reference, on fresh random inputs of many shapes.

Runs on CUDA; without a GPU,
`TRITON_INTERPRET=1 pytest tests/layers/test_attention_triton.py` runs the same cases, scaled
down, through Triton's CPU interpreter (it needs numpy<2.4; bf16 attention over a bf16 cache, fp8 stores and
CUDA-graph capture run on CUDA only).
"""

from __future__ import annotations

import random
import zlib

import pytest
import torch

from tests.helpers.paged import (
    KV_CACHE_DTYPES,
    assert_close,
    cache_dtype,
    paged_cache,
    skip_bf16_dot_in_interpreter,
)

pytest.importorskip("triton", reason="Triton kernels need triton (torch's CPU build has none)")

from batchgen.layers import attention_torch, attention_triton, pdl
from tests.helpers.graph_replay import capture_graph  # noqa: E402
from tests.helpers.triton_support import DEVICE, ON_GPU, TRITON_MARKS  # noqa: E402

pytestmark = TRITON_MARKS

f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16




def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, for fp8 too (torch.equal has no float8 kernel on CPU)."""
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _scaled(batch: int, ctx: int) -> tuple[int, int]:
    """The interpreter runs each Triton program in Python: keep its cases small but with several KV tiles."""
    return (batch, ctx) if ON_GPU else (min(batch, 6), min(ctx, 200))




def skip_fp8_store_in_interpreter(kv_cache_dtype: str) -> None:
    """Triton 3.9's interpreter reads fp8 exactly but rounds some values wrongly when it writes fp8: a rounding
    carry into the exponent is lost (7.97 -> 4.0, where CUDA and torch give 8.0)."""
    if not ON_GPU and kv_cache_dtype == "fp8":
        pytest.skip("the interpreter's fp32 -> fp8 conversion loses rounding carries; fp8 stores run on CUDA only")






# (batch, num_heads, num_kv_heads, head_dim, block_size, max_ctx, dtype, num_splits); batch > 1 gets padding rows
DECODE_CASES = [
    (1, 4, 4, 64, 16, 1, f32, 1),
    (1, 16, 8, 128, 16, 2000, bf16, None),
    (1, 16, 8, 128, 16, 2000, bf16, 16),
    (3, 8, 4, 32, 16, 300, f32, 1),
    (5, 16, 4, 64, 32, 700, f32, 4),
    (8, 32, 4, 128, 16, 1500, bf16, 1),
    (8, 32, 4, 128, 32, 1500, bf16, 2),
    (7, 6, 2, 80, 16, 500, f32, 8),
    (7, 6, 2, 80, 16, 500, bf16, 1),
    (4, 8, 1, 64, 8, 257, f16, 1),
    (4, 8, 8, 64, 1, 130, f32, 2),
    (16, 16, 8, 128, 16, 2000, bf16, None),
    (33, 16, 2, 128, 32, 1200, f16, None),
    (64, 16, 8, 128, 16, 1000, bf16, 1),
    (64, 8, 2, 64, 32, 2000, f32, 1),
    (64, 4, 4, 32, 16, 64, bf16, 4),
]


@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
@pytest.mark.parametrize("case", DECODE_CASES, ids=str)
def test_decode_matches_reference(case: tuple, kv_cache_dtype: str) -> None:
    batch, num_heads, num_kv_heads, head_dim, block_size, max_ctx, dtype, num_splits = case
    skip_bf16_dot_in_interpreter(dtype, kv_cache_dtype)
    batch, max_ctx = _scaled(batch, max_ctx)
    gen = torch.Generator().manual_seed(zlib.crc32(str(case).encode()))
    seq_lens = torch.randint(1, max_ctx + 1, (batch,), generator=gen)
    seq_lens[0] = max_ctx
    if batch > 1:
        seq_lens[-1] = 0  # a padding row of the graph bucket
    k_cache, v_cache, block_tables = paged_cache(seq_lens.tolist(), block_size, num_kv_heads, head_dim,
                                                  cache_dtype(kv_cache_dtype, dtype), gen)
    q = (2 * torch.randn(batch, num_heads, head_dim, generator=gen)).to(dtype).to(DEVICE)  # peaky softmax
    seq_lens = seq_lens.to(torch.int32).to(DEVICE)
    scale = head_dim**-0.5

    # One set of split counters for two launches, as the engine shares it across layers and steps: the last split
    # of each (sequence, kv head) to finish merges and resets its counter, so the second launch starts from zeros.
    arrivals = torch.zeros(batch * num_kv_heads, dtype=torch.int32, device=DEVICE)
    outs = [attention_triton.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                              num_splits=num_splits, split_arrivals=arrivals) for _ in range(2)]
    assert (arrivals == 0).all()
    expected = attention_torch.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)
    for out in outs:
        assert_close(out, expected)
        if batch > 1:
            assert (out[-1] == 0).all()


# (query lens, cached prefix lens, num_heads, num_kv_heads, head_dim, block_size, dtype)
PREFILL_CASES = [
    ((1,), (0,), 4, 4, 64, 16, f32),
    ((37,), (0,), 8, 4, 64, 16, f32),
    ((130, 5, 64), (0, 0, 0), 16, 8, 128, 16, bf16),
    ((100, 17, 1), (250, 3, 999), 8, 2, 64, 16, f32),
    ((256, 64), (1000, 1744), 16, 8, 128, 32, bf16),
    ((65, 1, 200), (31, 800, 0), 32, 4, 128, 16, f16),
    ((90, 33), (0, 77), 6, 2, 80, 16, f32),
    ((90, 33), (0, 77), 6, 2, 80, 16, bf16),
    ((50, 0, 20), (10, 40, 0), 8, 1, 32, 8, bf16),  # a sequence with no query tokens this step
    ((40, 9), (23, 0), 4, 4, 64, 1, f32),
    ((512, 300, 7, 128), (0, 1500, 60, 400), 16, 8, 128, 16, bf16),
    ((1,) * 12, tuple(range(0, 1200, 100)), 8, 4, 64, 32, f32),
    # prefill_config's other launches on a GPU: 64-position KV tiles for four or more query heads a kv head, and from
    # PREFILL_LONG_CONTEXT on 128-position ones (two and four heads a kv head)
    ((700, 64), (0, 900), 32, 8, 128, 16, bf16),
    ((512, 300), (3000, 3500), 16, 8, 128, 16, bf16),
    ((128, 1, 700), (3200, 4000, 0), 32, 8, 128, 16, bf16),
]


@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
@pytest.mark.parametrize("case", PREFILL_CASES, ids=str)
def test_prefill_matches_reference(case: tuple, kv_cache_dtype: str) -> None:
    query_lens, prefix_lens, num_heads, num_kv_heads, head_dim, block_size, dtype = case
    skip_bf16_dot_in_interpreter(dtype, kv_cache_dtype)
    if not ON_GPU:
        query_lens = [min(n, 70) for n in query_lens[:4]]
        prefix_lens = [min(n, 130) for n in prefix_lens[:4]]
    seq_lens = [p + n for p, n in zip(prefix_lens, query_lens, strict=True)]
    gen = torch.Generator().manual_seed(zlib.crc32(str(case).encode()))
    k_cache, v_cache, block_tables = paged_cache(seq_lens, block_size, num_kv_heads, head_dim,
                                                  cache_dtype(kv_cache_dtype, dtype), gen)
    total = sum(query_lens)
    q = (2 * torch.randn(total, num_heads, head_dim, generator=gen)).to(dtype).to(DEVICE)
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    args = (q, k_cache, v_cache, block_tables, query_start_loc, seq_lens_t, scale, max(query_lens), max(seq_lens))

    assert_close(attention_triton.prefill_attention(*args), attention_torch.prefill_attention(*args))


def test_chunked_prefill_equals_one_shot() -> None:
    """Prefilling a prompt in chunks over its cached prefix gives the same rows as prefilling it at once."""
    num_heads, num_kv_heads, head_dim, block_size, dtype = 8, 2, 64, 16, f32
    prompt_len, chunks = (300, (120, 1, 179)) if ON_GPU else (90, (40, 1, 49))
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache, block_tables = paged_cache([prompt_len], block_size, num_kv_heads, head_dim, dtype, gen)
    q = torch.randn(prompt_len, num_heads, head_dim, generator=gen).to(DEVICE)

    def prefill(start: int, end: int) -> torch.Tensor:
        qsl = torch.tensor([0, end - start], dtype=torch.int32, device=DEVICE)
        seq_lens = torch.tensor([end], dtype=torch.int32, device=DEVICE)
        return attention_triton.prefill_attention(
            q[start:end], k_cache, v_cache, block_tables, qsl, seq_lens, head_dim**-0.5, end - start, end
        )

    bounds = torch.tensor([0, *chunks]).cumsum(0).tolist()
    chunked = torch.cat([prefill(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)])
    assert_close(chunked, prefill(0, prompt_len))


def _prefill_inputs(query_lens: tuple[int, ...], prefix_lens: tuple[int, ...], num_heads: int, num_kv_heads: int,
                    head_dim: int, block_size: int, dtype: torch.dtype, kv_cache_dtype: str,
                    gen: torch.Generator) -> tuple:
    """prefill_attention's positional arguments: chunks of query_lens tokens after cached prefixes of prefix_lens."""
    seq_lens = [p + n for p, n in zip(prefix_lens, query_lens, strict=True)]
    k_cache, v_cache, block_tables = paged_cache(seq_lens, block_size, num_kv_heads, head_dim,
                                                  cache_dtype(kv_cache_dtype, dtype), gen)
    q = (2 * torch.randn(sum(query_lens), num_heads, head_dim, generator=gen)).to(dtype).to(DEVICE)
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return (q, k_cache, v_cache, block_tables, query_start_loc, seq_lens_t, head_dim**-0.5, max(query_lens),
            max(seq_lens))


# (block_m, block_n): query tiles of fewer positions than a KV tile and of more, both smaller than a cache block
# (16), and a KV tile of several blocks; 6 query heads over 2 kv heads put 3 heads in each tile's rows, so that a
# tile's positions (block_m // 3) are never a power of two
PREFILL_TILES = [(16, 16), (16, 32), (32, 16), (64, 16), (32, 64)]


@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
@pytest.mark.parametrize("dtype", [f32, bf16])
@pytest.mark.parametrize(("block_m", "block_n"), PREFILL_TILES, ids=str)
def test_prefill_tiles_match_reference(block_m: int, block_n: int, dtype: torch.dtype, kv_cache_dtype: str) -> None:
    """Every tile shape of the sweep's kind gives the reference's rows: query tiles start off the KV tiles' grid
    (cached prefixes of 37 and 70), so their diagonal crosses KV tiles part way, and contexts end mid-block."""
    skip_bf16_dot_in_interpreter(dtype, kv_cache_dtype)
    gen = torch.Generator().manual_seed(block_m * 1000 + block_n)
    args = _prefill_inputs((45, 1, 23), (0, 37, 70), 6, 2, 32, 16, dtype, kv_cache_dtype, gen)
    config = attention_triton.PrefillConfig(block_m=block_m, block_n=block_n, num_warps=4, num_stages=2)

    out = attention_triton.prefill_attention(*args, config=config)
    assert_close(out, attention_torch.prefill_attention(*args))


# (window, softcap): a window shorter than a KV tile, one spanning several (so that the tiles between its start and
# the diagonal need no mask), each with and without a soft cap
@pytest.mark.parametrize(("window", "softcap"), [(5, None), (5, 1.5), (50, None), (50, 1.5)], ids=str)
def test_prefill_window_and_softcap_with_small_tiles(window: int, softcap: float | None) -> None:
    gen = torch.Generator().manual_seed(window)
    args = _prefill_inputs((40, 1, 23), (0, 90, 70), 4, 2, 32, 8, f32, "auto", gen)
    config = attention_triton.PrefillConfig(block_m=32, block_n=16, num_warps=4, num_stages=2)

    out = attention_triton.prefill_attention(*args, window, softcap=softcap, config=config)
    assert_close(out, attention_torch.prefill_attention(*args, window, softcap=softcap))


def test_prefill_with_more_query_heads_per_kv_head_than_tile_rows() -> None:
    """32 query heads share one kv head and a tile asks for 16 rows: it widens to hold one position of every head."""
    gen = torch.Generator().manual_seed(5)
    args = _prefill_inputs((9, 20), (0, 13), 32, 1, 32, 16, f32, "auto", gen)
    config = attention_triton.PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=2)

    assert_close(attention_triton.prefill_attention(*args, config=config), attention_torch.prefill_attention(*args))


@pytest.mark.skipif(not ON_GPU, reason="short tiles are chosen for CUDA launches only")
@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
def test_decode_of_short_and_long_contexts_in_a_sparse_launch(monkeypatch: pytest.MonkeyPatch,
                                                              kv_cache_dtype: str) -> None:
    """A launch of 10 (sequence, kv head) pairs at 16 splits on a 132-SM GPU reads contexts of up to 16 short tiles
    in short tiles and longer ones in the kernel's own, row by row; both match the reference."""
    monkeypatch.setattr(attention_triton, "_sm_count", lambda device: 132)
    num_heads, num_kv_heads, head_dim, block_size, dtype = 8, 2, 128, 16, bf16
    seq_lens = torch.tensor([512, 513, 2000, 33, 1], dtype=torch.int32)  # the limit, one past it, long, short
    tile = attention_triton.decode_tile(head_dim, dtype, cache_dtype(kv_cache_dtype, dtype))
    assert attention_triton._default_num_splits(len(seq_lens) * num_kv_heads, torch.device(DEVICE), tile) == 16
    assert attention_triton.short_context_positions(len(seq_lens) * num_kv_heads, 16, tile,
                                                    torch.device(DEVICE)) == 512
    gen = torch.Generator().manual_seed(4)
    k_cache, v_cache, block_tables = paged_cache(seq_lens.tolist(), block_size, num_kv_heads, head_dim,
                                                  cache_dtype(kv_cache_dtype, dtype), gen)
    q = (2 * torch.randn(len(seq_lens), num_heads, head_dim, generator=gen)).to(dtype).to(DEVICE)
    args = (q, k_cache, v_cache, block_tables, seq_lens.to(DEVICE), head_dim**-0.5)

    with pdl.early_start():  # the short compile's only use
        assert_close(attention_triton.decode_attention(*args), attention_torch.decode_attention(*args))


# (window, num_splits): windows shorter than one KV tile, spanning several, and longer than every context
@pytest.mark.parametrize(("window", "num_splits"), [(1, 1), (8, 1), (8, 4), (50, 2), (4096, 1)], ids=str)
def test_decode_with_sliding_window_matches_reference(window: int, num_splits: int) -> None:
    batch, num_heads, num_kv_heads, head_dim, block_size = 4, 8, 2, 32, 16
    gen = torch.Generator().manual_seed(window)
    seq_lens = torch.tensor([150, 7, 64, 0], dtype=torch.int32)  # 0: a padding row of the graph bucket
    k_cache, v_cache, block_tables = paged_cache(seq_lens.tolist(), block_size, num_kv_heads, head_dim, f32, gen)
    q = (2 * torch.randn(batch, num_heads, head_dim, generator=gen)).to(DEVICE)
    args = (q, k_cache, v_cache, block_tables, seq_lens.to(DEVICE), head_dim**-0.5)

    out = attention_triton.decode_attention(*args, window, num_splits=num_splits)
    expected = attention_torch.decode_attention(*args, window)
    assert_close(out, expected)
    assert (out[-1] == 0).all()
    if window < 64:
        assert not torch.allclose(expected[0], attention_torch.decode_attention(*args)[0], atol=1e-3)


@pytest.mark.parametrize("window", [1, 8, 40, 4096])
def test_prefill_with_sliding_window_matches_reference(window: int) -> None:
    """Chunks over a cached prefix (so queries start mid-context), several query and KV tiles, an empty chunk."""
    query_lens, prefix_lens = (70, 1, 0, 33), (0, 90, 10, 45)
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 32, 8
    seq_lens = [p + n for p, n in zip(prefix_lens, query_lens, strict=True)]
    gen = torch.Generator().manual_seed(window)
    k_cache, v_cache, block_tables = paged_cache(seq_lens, block_size, num_kv_heads, head_dim, f32, gen)
    q = (2 * torch.randn(sum(query_lens), num_heads, head_dim, generator=gen)).to(DEVICE)
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    args = (q, k_cache, v_cache, block_tables, query_start_loc, seq_lens_t, head_dim**-0.5, max(query_lens),
            max(seq_lens))

    expected = attention_torch.prefill_attention(*args, sliding_window=window)
    assert_close(attention_triton.prefill_attention(*args, sliding_window=window), expected)
    if window < 64:
        assert not torch.allclose(expected, attention_torch.prefill_attention(*args), atol=1e-3)


# (window, num_splits, dtype): soft-capped scores (Gemma 2) alone, with a window (Gemma 2's sliding layers), split
# and merged by the kernel, and in bf16 (CUDA only)
SOFTCAP_DECODE_CASES = [(None, 1, f32), (8, 1, f32), (None, 4, f32), (50, 2, f32), (None, None, bf16), (8, 4, bf16)]


@pytest.mark.parametrize(("window", "num_splits", "dtype"), SOFTCAP_DECODE_CASES, ids=str)
def test_decode_with_softcap_matches_reference(window: int | None, num_splits: int | None,
                                               dtype: torch.dtype) -> None:
    skip_bf16_dot_in_interpreter(dtype)
    batch, num_heads, num_kv_heads, head_dim, block_size, softcap = 4, 8, 2, 32, 16, 1.5
    gen = torch.Generator().manual_seed(17)
    seq_lens = torch.tensor([150, 7, 64, 0], dtype=torch.int32)  # 0: a padding row of the graph bucket
    k_cache, v_cache, block_tables = paged_cache(seq_lens.tolist(), block_size, num_kv_heads, head_dim, dtype, gen)
    q = (2 * torch.randn(batch, num_heads, head_dim, generator=gen)).to(dtype).to(DEVICE)  # scores past the cap
    args = (q, k_cache, v_cache, block_tables, seq_lens.to(DEVICE), head_dim**-0.5, window)

    out = attention_triton.decode_attention(*args, softcap=softcap, num_splits=num_splits)
    expected = attention_torch.decode_attention(*args, softcap=softcap)
    assert_close(out, expected)
    assert (out[-1] == 0).all()
    assert not torch.allclose(expected.float(), attention_torch.decode_attention(*args).float(), atol=5e-2)


@pytest.mark.parametrize("dtype", [f32, bf16])
@pytest.mark.parametrize("window", [None, 8, 40])
def test_prefill_with_softcap_matches_reference(window: int | None, dtype: torch.dtype) -> None:
    """Chunks over a cached prefix, several query and KV tiles, with and without a sliding window."""
    skip_bf16_dot_in_interpreter(dtype)
    query_lens, prefix_lens = (70, 1, 33), (0, 90, 45)
    num_heads, num_kv_heads, head_dim, block_size, softcap = 4, 2, 32, 8, 1.5
    seq_lens = [p + n for p, n in zip(prefix_lens, query_lens, strict=True)]
    gen = torch.Generator().manual_seed(18)
    k_cache, v_cache, block_tables = paged_cache(seq_lens, block_size, num_kv_heads, head_dim, dtype, gen)
    q = (2 * torch.randn(sum(query_lens), num_heads, head_dim, generator=gen)).to(dtype).to(DEVICE)
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    args = (q, k_cache, v_cache, block_tables, query_start_loc, seq_lens_t, head_dim**-0.5, max(query_lens),
            max(seq_lens), window)

    expected = attention_torch.prefill_attention(*args, softcap=softcap)
    assert_close(attention_triton.prefill_attention(*args, softcap=softcap), expected)
    assert not torch.allclose(expected.float(), attention_torch.prefill_attention(*args).float(), atol=5e-2)


@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
@pytest.mark.parametrize("dtype", [f32, bf16])
@pytest.mark.parametrize(("num_kv_heads", "head_dim", "block_size"), [(8, 128, 16), (2, 80, 32), (1, 64, 1)])
def test_store_kv_matches_reference(num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                                    kv_cache_dtype: str) -> None:
    skip_fp8_store_in_interpreter(kv_cache_dtype)
    gen = torch.Generator().manual_seed(1)
    num_blocks, num_tokens = 2 + 40 // block_size, 25
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(cache_dtype(kv_cache_dtype, dtype)).to(DEVICE)
    v_cache = torch.randn(shape, generator=gen).to(cache_dtype(kv_cache_dtype, dtype)).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.tensor([3, 10, num_tokens - 1])] = -1
    slot_mapping = slots.to(DEVICE)
    # K and V as the strided column slices of a fused qkv projection output; some values past fp8's 448.
    qkv = (200 * torch.randn(num_tokens, 3 * num_kv_heads * head_dim, generator=gen)).to(dtype).to(DEVICE)
    k = qkv[:, num_kv_heads * head_dim : 2 * num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, 2 * num_kv_heads * head_dim :].view(num_tokens, num_kv_heads, head_dim)

    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    attention_torch.store_kv(k, v, k_ref, v_ref, slot_mapping)
    attention_triton.store_kv(k, v, k_cache, v_cache, slot_mapping)
    assert same_bits(k_cache, k_ref)
    assert same_bits(v_cache, v_ref)


@pytest.mark.skipif(not ON_GPU, reason="CUDA-graph capture needs a GPU")
@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
@pytest.mark.parametrize(("batch", "num_splits"), [(8, 1), (8, None), (2, None)], ids=str)
def test_decode_replays_in_cuda_graph(batch: int, num_splits: int | None, kv_cache_dtype: str) -> None:
    """Captured once, the decode kernel follows new seq_lens and block tables written in place before each replay
    (at batch 2, on a GPU of 128 SMs or more, a context takes short tiles or not by its length, inside the graph)."""
    num_heads, num_kv_heads, head_dim, block_size, max_ctx, dtype = 16, 8, 128, 16, 1024, bf16
    gen = torch.Generator().manual_seed(2)
    num_blocks = batch * max_ctx // block_size
    width = max_ctx // block_size
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(cache_dtype(kv_cache_dtype, dtype)).to(DEVICE)
    v_cache = torch.randn(shape, generator=gen).to(cache_dtype(kv_cache_dtype, dtype)).to(DEVICE)
    q = torch.randn(batch, num_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    block_tables = torch.zeros(batch, width, dtype=torch.int32, device=DEVICE)
    seq_lens = torch.zeros(batch, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5

    def step() -> torch.Tensor:
        with pdl.early_start():  # as an early-start graph bucket captures it
            return attention_triton.decode_attention(
                q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits=num_splits
            )

    graph, out = capture_graph(step)

    rng = random.Random(3)
    for _ in range(3):
        lens = [rng.randint(1, max_ctx) for _ in range(batch)]
        lens[rng.randrange(batch)] = 0
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        block_tables.copy_(torch.randperm(num_blocks, generator=gen)[: batch * width].view(batch, width))
        q.copy_(torch.randn(q.shape, generator=gen).to(dtype))
        graph.replay()
        assert_close(out, attention_torch.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale))
