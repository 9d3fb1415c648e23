"""The paged reference attention ops against a dense causal attention computed from unpaged K/V."""

from __future__ import annotations

import pytest
import torch

from batchgen.layers import attention_torch as ops

HEAD_DIM = 8
HEAD_LAYOUTS = [(4, 4), (4, 2), (6, 1)]  # (query heads, kv heads): MHA, GQA, MQA
FP8 = ops.FP8_DTYPE


def dense_causal_attention(
    q: torch.Tensor,  # (L, H, D): the last L positions of the sequence
    k: torch.Tensor,  # (S, KVH, D): the whole sequence
    v: torch.Tensor,  # (S, KVH, D)
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:  # (L, H, D) float64
    query_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    k = k.double().repeat_interleave(num_heads // num_kv_heads, dim=1)  # (S, H, D)
    v = v.double().repeat_interleave(num_heads // num_kv_heads, dim=1)
    scores = torch.einsum("lhd,shd->hls", q.double(), k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    query_positions = torch.arange(seq_len - query_len, seq_len)
    causal = torch.arange(seq_len)[None, :] <= query_positions[:, None]  # (L, S)
    probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    return torch.einsum("hls,shd->lhd", probs, v)


class PagedLayout:
    """Random K/V for sequences of the given lengths, placed in shuffled cache blocks (NaN everywhere else)."""

    def __init__(self, seq_lens: list[int], block_size: int, num_kv_heads: int, seed: int = 0,
                 cache_dtype: torch.dtype = torch.float32) -> None:
        generator = torch.Generator().manual_seed(seed)
        blocks_per_seq = [-(-n // block_size) for n in seq_lens]
        num_blocks = sum(blocks_per_seq) + 3  # spare blocks stay NaN
        free = torch.randperm(num_blocks, generator=generator).tolist()
        self.tables = [[free.pop() for _ in range(n)] for n in blocks_per_seq]
        max_blocks = max(blocks_per_seq) + 1  # an unused extra column, as a runner's fixed-width table has
        self.block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in self.tables], dtype=torch.int32)
        shape = (num_blocks, block_size, num_kv_heads, HEAD_DIM)
        self.k_cache = torch.full(shape, float("nan"), dtype=cache_dtype)
        self.v_cache = torch.full(shape, float("nan"), dtype=cache_dtype)
        self.block_size = block_size
        self.k = [torch.randn(n, num_kv_heads, HEAD_DIM, generator=generator) for n in seq_lens]
        self.v = [torch.randn(n, num_kv_heads, HEAD_DIM, generator=generator) for n in seq_lens]

    def slots(self, seq: int, start: int, end: int) -> torch.Tensor:  # (end - start,) int64
        positions = torch.arange(start, end)
        blocks = torch.tensor(self.tables[seq], dtype=torch.int64)[positions // self.block_size]
        return blocks * self.block_size + positions % self.block_size

    def store(self, seq: int, start: int, end: int) -> None:
        ops.store_kv(self.k[seq][start:end], self.v[seq][start:end], self.k_cache, self.v_cache,
                     self.slots(seq, start, end))


def test_store_kv_writes_each_slot_and_skips_padding() -> None:
    k_cache = torch.zeros(4, 2, 1, HEAD_DIM)
    v_cache = torch.zeros(4, 2, 1, HEAD_DIM)
    k, v = torch.randn(5, 1, HEAD_DIM), torch.randn(5, 1, HEAD_DIM)
    slots = torch.tensor([-1, 5, 0, -1, 3])  # padding first, so the first real row is not row 0
    ops.store_kv(k, v, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(8, 1, HEAD_DIM), v_cache.view(8, 1, HEAD_DIM)
    for row, slot in ((1, 5), (2, 0), (4, 3)):
        torch.testing.assert_close(flat_k[slot], k[row], rtol=0, atol=0)
        torch.testing.assert_close(flat_v[slot], v[row], rtol=0, atol=0)
    assert flat_k[[1, 2, 4, 6, 7]].eq(0).all() and flat_v[[1, 2, 4, 6, 7]].eq(0).all()


def test_store_kv_with_only_padding_writes_nothing() -> None:
    k_cache = torch.randn(3, 4, 2, HEAD_DIM)
    before = k_cache.clone()
    ops.store_kv(torch.randn(2, 2, HEAD_DIM), torch.randn(2, 2, HEAD_DIM), k_cache, k_cache.clone(),
                 torch.tensor([-1, -1]))
    torch.testing.assert_close(k_cache, before, rtol=0, atol=0)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEAD_LAYOUTS)
def test_prefill_matches_dense_attention(block_size: int, num_heads: int, num_kv_heads: int) -> None:
    # (context length after the step, new tokens): full prompts and chunks over a cached prefix.
    sequences = [(13, 13), (40, 9), (1, 1), (33, 1), (20, 20)]
    layout = PagedLayout([n for n, _ in sequences], block_size, num_kv_heads, seed=block_size)
    for seq, (seq_len, query_len) in enumerate(sequences):
        layout.store(seq, 0, seq_len - query_len)  # the prefix cached by earlier steps
        layout.store(seq, seq_len - query_len, seq_len)  # this step's tokens, as Attention.forward writes them
    query_lens = [q for _, q in sequences]
    q = torch.randn(sum(query_lens), num_heads, HEAD_DIM)
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([n for n, _ in sequences], dtype=torch.int32)
    scale = HEAD_DIM**-0.5
    out = ops.prefill_attention(q, layout.k_cache, layout.v_cache, layout.block_tables, query_start_loc, seq_lens,
                                scale, max(query_lens), int(seq_lens.max()))
    assert out.shape == q.shape and out.dtype == q.dtype
    for seq, (start, end) in enumerate(zip(query_start_loc[:-1].tolist(), query_start_loc[1:].tolist(), strict=True)):
        expected = dense_causal_attention(q[start:end], layout.k[seq], layout.v[seq], scale)
        torch.testing.assert_close(out[start:end].double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEAD_LAYOUTS)
def test_decode_matches_dense_attention_and_zeroes_padding_rows(
    block_size: int, num_heads: int, num_kv_heads: int
) -> None:
    seq_lens_real = [1, 17, 32, 5]
    num_padding = 2
    layout = PagedLayout(seq_lens_real, block_size, num_kv_heads, seed=block_size + 100)
    for seq, seq_len in enumerate(seq_lens_real):
        layout.store(seq, 0, seq_len - 1)
    last_k = torch.stack([k[-1] for k in layout.k] + [torch.randn(num_kv_heads, HEAD_DIM)] * num_padding)
    last_v = torch.stack([v[-1] for v in layout.v] + [torch.randn(num_kv_heads, HEAD_DIM)] * num_padding)
    padding_slots = torch.full((num_padding,), -1)
    slots = torch.cat([layout.slots(seq, n - 1, n) for seq, n in enumerate(seq_lens_real)] + [padding_slots])
    unwritten_before = int(layout.k_cache.isnan().sum())
    ops.store_kv(last_k, last_v, layout.k_cache, layout.v_cache, slots)
    written = len(seq_lens_real) * num_kv_heads * HEAD_DIM  # padding rows must not write
    assert int(layout.k_cache.isnan().sum()) == unwritten_before - written

    # Padding rows' tables point at a spare block: never written, NaN, read by no one.
    spare = min(set(range(layout.k_cache.shape[0])) - {block for table in layout.tables for block in table})
    block_tables = torch.cat([layout.block_tables, torch.full((num_padding, layout.block_tables.shape[1]), spare,
                                                              dtype=torch.int32)])
    seq_lens = torch.tensor(seq_lens_real + [0] * num_padding, dtype=torch.int32)
    q = torch.randn(len(seq_lens), num_heads, HEAD_DIM)
    scale = HEAD_DIM**-0.5
    out = ops.decode_attention(q, layout.k_cache, layout.v_cache, block_tables, seq_lens, scale)
    assert out.shape == q.shape and not out.isnan().any()
    for seq in range(len(seq_lens_real)):
        expected = dense_causal_attention(q[seq : seq + 1], layout.k[seq], layout.v[seq], scale)
        torch.testing.assert_close(out[seq : seq + 1].double(), expected, rtol=1e-5, atol=1e-5)
    assert out[len(seq_lens_real) :].eq(0).all()


@pytest.mark.parametrize("seq_lens", [[33, 2, 40, 7, 1, 38, 3], [12, 13, 11, 14]], ids=["mixed", "alike"])
@pytest.mark.parametrize("sliding_window", [None, 6])
def test_decode_over_a_batch_equals_decode_of_each_row_alone(seq_lens: list[int], sliding_window: int | None) -> None:
    """On CPU a batch of mixed lengths runs in two halves by context (each gathering only up to its own longest
    row); every row's output must be what it gets alone, in the batch's own order."""
    layout = PagedLayout(seq_lens, block_size=4, num_kv_heads=2, seed=7)
    for seq, seq_len in enumerate(seq_lens):
        layout.store(seq, 0, seq_len)
    q = torch.randn(len(seq_lens), 4, HEAD_DIM)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = HEAD_DIM**-0.5
    out = ops.decode_attention(q, layout.k_cache, layout.v_cache, layout.block_tables, lens, scale, sliding_window)
    for row in range(len(seq_lens)):
        alone = ops.decode_attention(q[row : row + 1], layout.k_cache, layout.v_cache,
                                     layout.block_tables[row : row + 1], lens[row : row + 1], scale, sliding_window)
        torch.testing.assert_close(out[row : row + 1], alone, rtol=1e-6, atol=1e-6)


def test_prefill_of_one_token_agrees_with_decode() -> None:
    layout = PagedLayout([9, 4], block_size=4, num_kv_heads=2)
    for seq, seq_len in enumerate([9, 4]):
        layout.store(seq, 0, seq_len)
    q = torch.randn(2, 4, HEAD_DIM)
    seq_lens = torch.tensor([9, 4], dtype=torch.int32)
    decode = ops.decode_attention(q, layout.k_cache, layout.v_cache, layout.block_tables, seq_lens, 0.3)
    prefill = ops.prefill_attention(q, layout.k_cache, layout.v_cache, layout.block_tables,
                                    torch.tensor([0, 1, 2], dtype=torch.int32), seq_lens, 0.3, 1, 9)
    torch.testing.assert_close(decode, prefill, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEAD_LAYOUTS)
def test_softcapped_attention_matches_dense_attention(num_heads: int, num_kv_heads: int) -> None:
    """Soft-capped scores (Gemma 2), in prefill chunks over a cached prefix and in decode: dense attention over
    softcap * tanh(scores / softcap), and clearly not the uncapped attention."""
    sequences = [(13, 13), (40, 9), (33, 1)]  # (context length after the step, new tokens)
    layout = PagedLayout([n for n, _ in sequences], 4, num_kv_heads, seed=num_heads + 7)
    for seq, (seq_len, _) in enumerate(sequences):
        layout.store(seq, 0, seq_len)
    query_lens = [q for _, q in sequences]
    q = 3 * torch.randn(sum(query_lens), num_heads, HEAD_DIM)  # scores of a few units: the cap of 2 bends them
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([n for n, _ in sequences], dtype=torch.int32)
    scale, softcap = HEAD_DIM**-0.5, 2.0
    prefill = ops.prefill_attention(q, layout.k_cache, layout.v_cache, layout.block_tables, query_start_loc,
                                    seq_lens, scale, max(query_lens), int(seq_lens.max()), softcap=softcap)
    last_rows = query_start_loc[1:].long() - 1
    decode = ops.decode_attention(q[last_rows], layout.k_cache, layout.v_cache, layout.block_tables, seq_lens, scale,
                                  softcap=softcap)
    torch.testing.assert_close(decode, prefill[last_rows], rtol=1e-6, atol=1e-6)
    for seq, (start, end) in enumerate(zip(query_start_loc[:-1].tolist(), query_start_loc[1:].tolist(), strict=True)):
        k, v = layout.k[seq], layout.v[seq]
        expected = dense_causal_attention(q[start:end], k, v, scale, softcap)
        torch.testing.assert_close(prefill[start:end].double(), expected, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(expected, dense_causal_attention(q[start:end], k, v, scale), atol=1e-2)


def fp8_rounded(x: torch.Tensor) -> torch.Tensor:
    return x.to(FP8).to(x.dtype)


def test_fp8_store_kv_rounds_and_clamps_to_the_fp8_range() -> None:
    k_cache = torch.zeros(2, 4, 1, HEAD_DIM, dtype=FP8)
    v_cache = torch.zeros(2, 4, 1, HEAD_DIM, dtype=FP8)
    k = torch.randn(3, 1, HEAD_DIM) * 200  # some past fp8's largest value, 448
    v = torch.randn(3, 1, HEAD_DIM, dtype=torch.bfloat16)
    k[0, 0, 0], k[1, 0, 1] = 1e4, -1e6
    ops.store_kv(k, v, k_cache, v_cache, torch.tensor([6, -1, 1]))
    flat_k, flat_v = k_cache.view(8, 1, HEAD_DIM).float(), v_cache.view(8, 1, HEAD_DIM).float()
    assert not flat_k.isnan().any() and flat_k[6, 0, 0] == 448
    assert torch.equal(flat_k[[6, 1]], k[[0, 2]].clamp(-448, 448).to(FP8).float())
    assert torch.equal(flat_v[[6, 1]], v[[0, 2]].to(FP8).float())
    assert flat_k[[0, 2, 3, 4, 5, 7]].eq(0).all()


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEAD_LAYOUTS)
def test_fp8_cache_attention_is_attention_over_fp8_rounded_kv(num_heads: int, num_kv_heads: int) -> None:
    """Prefill (chunks over a cached prefix) and decode over an fp8 cache equal dense attention over K/V rounded
    through float8_e4m3fn, and stay close to attention over the unrounded K/V."""
    sequences = [(13, 13), (40, 9), (33, 1)]  # (context length after the step, new tokens)
    layout = PagedLayout([n for n, _ in sequences], 4, num_kv_heads, seed=num_heads, cache_dtype=FP8)
    for seq, (seq_len, _) in enumerate(sequences):
        layout.store(seq, 0, seq_len)
    query_lens = [q for _, q in sequences]
    q = torch.randn(sum(query_lens), num_heads, HEAD_DIM)
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([n for n, _ in sequences], dtype=torch.int32)
    scale = HEAD_DIM**-0.5
    prefill = ops.prefill_attention(q, layout.k_cache, layout.v_cache, layout.block_tables, query_start_loc,
                                    seq_lens, scale, max(query_lens), int(seq_lens.max()))
    last_rows = query_start_loc[1:].long() - 1
    decode = ops.decode_attention(q[last_rows], layout.k_cache, layout.v_cache, layout.block_tables, seq_lens, scale)
    assert prefill.dtype == decode.dtype == q.dtype
    torch.testing.assert_close(decode, prefill[last_rows], rtol=1e-6, atol=1e-6)
    for seq, (start, end) in enumerate(zip(query_start_loc[:-1].tolist(), query_start_loc[1:].tolist(), strict=True)):
        k, v = layout.k[seq], layout.v[seq]
        expected = dense_causal_attention(q[start:end], fp8_rounded(k), fp8_rounded(v), scale)
        torch.testing.assert_close(prefill[start:end].double(), expected, rtol=1e-5, atol=1e-5)
        unrounded = dense_causal_attention(q[start:end], k, v, scale)
        torch.testing.assert_close(prefill[start:end].double(), unrounded, rtol=0.1, atol=0.1)
        assert not torch.allclose(prefill[start:end].double(), unrounded, rtol=1e-4, atol=1e-4)
