"""The decode kernel's default KV split count: what each CUDA-graph bucket launches (no GPU needed to choose it)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="Triton kernels need triton (torch's CPU build has none)")

from batchgen.layers import attention_triton  # noqa: E402

SMS, KV_HEADS = 132, 8


@pytest.mark.parametrize("block_n", [None, 32, 64, 128], ids=str)  # None: the cascade kernels
def test_split_counts_fit_the_kernel_and_never_grow_with_the_batch(monkeypatch: pytest.MonkeyPatch,
                                                                   block_n: int | None) -> None:
    monkeypatch.setattr(attention_triton, "_sm_count", lambda device: SMS)
    target = attention_triton._PROGRAMS_PER_SM.get(block_n, 1) * SMS
    counts = [attention_triton._default_num_splits(batch * KV_HEADS, torch.device("cuda"), block_n)
              for batch in range(1, 513)]
    for batch, splits in enumerate(counts, start=1):
        programs = batch * KV_HEADS
        assert 1 <= splits <= attention_triton._MAX_SPLITS and splits & (splits - 1) == 0
        assert (splits == 1) == (programs >= target), batch  # a launch at its target reads each context whole
        assert programs * splits >= target or splits == attention_triton._MAX_SPLITS, batch
        assert splits == 1 or programs * splits // 2 < target, batch  # the fewest splits that reach it
    assert counts == sorted(counts, reverse=True)


def test_fp8_tiles_never_split_more_than_16_bit_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp8's 128-position tiles reach the point where merges cost more than balance gains at fewer programs."""
    monkeypatch.setattr(attention_triton, "_sm_count", lambda device: SMS)
    cuda = torch.device("cuda")
    for batch in range(1, 513):
        sixteen_bit, fp8 = (attention_triton._default_num_splits(batch * KV_HEADS, cuda, n) for n in (64, 128))
        assert fp8 <= sixteen_bit, batch
    assert attention_triton._default_num_splits(48 * KV_HEADS, cuda, 128) < \
        attention_triton._default_num_splits(48 * KV_HEADS, cuda, 64)


def test_off_cuda_reads_each_context_whole() -> None:
    assert attention_triton._default_num_splits(8, torch.device("cpu"), 64) == 1


def test_short_tiles_only_where_the_most_splits_leave_the_sms_sparse(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention_triton, "_sm_count", lambda device: SMS)
    cuda, short = torch.device("cuda"), attention_triton.SHORT_TILE
    for block_n in (64, 128):
        limits = []
        for batch in range(1, 65):
            programs = batch * KV_HEADS
            splits = attention_triton._default_num_splits(programs, cuda, block_n)
            limit = attention_triton.short_context_positions(programs, splits, block_n, cuda)
            assert limit in (0, splits * short), batch  # one short tile a split, at most
            assert (limit > 0) == (splits > 1 and programs * splits <= 2 * SMS), batch
            limits.append(limit)
        assert limits[:2] == [16 * short] * 2 and not any(limits[2:])  # batches 1 and 2 of 8 kv heads
    assert attention_triton.short_context_positions(KV_HEADS, 16, short, cuda) == 0  # tiles already short
    assert attention_triton.short_context_positions(KV_HEADS, 16, 64, torch.device("cpu")) == 0


def test_reads_kv_early_exactly_where_the_launch_takes_short_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention_triton, "_sm_count", lambda device: SMS)
    cuda, bf16, fp8 = torch.device("cuda"), torch.bfloat16, torch.float8_e4m3fn

    def limit(batch: int, kv_heads: int = KV_HEADS, q_dtype=bf16, cache_dtype=bf16, device=cuda) -> int:
        return attention_triton.decode_early_read_limit(batch, kv_heads, 128, q_dtype, cache_dtype, device)

    short = 16 * attention_triton.SHORT_TILE
    assert [limit(batch) for batch in range(1, 9)] == [short, short] + [0] * 6  # as the short-tile rule above
    assert limit(1, cache_dtype=fp8) == short
    assert limit(4, kv_heads=4) > 0  # fewer kv heads: sparse up to a larger batch
    assert limit(1, q_dtype=torch.float32, cache_dtype=torch.float32) == 0  # fp32 tiles are short already
    assert limit(1, device=torch.device("cpu")) == 0


def test_an_attention_layer_asks_its_ops_for_the_early_read_limit() -> None:
    from batchgen.layers import attention_torch
    from batchgen.layers.attention import Attention

    layer = Attention(num_heads=16, num_kv_heads=KV_HEADS, head_dim=128, scale=0.1)
    layer.k_cache = torch.empty(0, dtype=torch.float8_e4m3fn)
    assert layer.decode_early_read_limit(1, torch.bfloat16) == 0  # the torch ops read nothing early
    calls = []
    layer.ops = type("Ops", (), {"decode_early_read_limit": staticmethod(lambda *args: calls.append(args) or 512)})
    assert layer.decode_early_read_limit(2, torch.bfloat16) == 512
    assert calls == [(2, KV_HEADS, 128, torch.bfloat16, torch.float8_e4m3fn, torch.device("cpu"))]
    assert attention_torch.decode_early_read_limit(*calls[0]) == 0
