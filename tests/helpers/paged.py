"""A minimal stand-in for the model runner in tests: binds a paged KV cache to a model, hands out block ids and builds
the flattened inputs and AttentionMetadata of one step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from batchgen.layers import attention_torch
from batchgen.layers.attention import Attention, AttentionMetadata
from tests.helpers.triton_support import DEVICE, ON_GPU  # noqa: E402


class PagedTestCache:
    """KV caches for every Attention layer of `model` (on its device, in its dtype), filled with NaN so that reading
    a slot never written shows up.

    Block ids are handed out in a shuffled order, so a sequence's blocks are not contiguous in the cache.
    """

    def __init__(self, model: nn.Module, num_blocks: int = 64, block_size: int = 4, seed: int = 0) -> None:
        self.block_size = block_size
        weight = next(model.parameters())
        self.device = weight.device
        for layer in model.modules():
            if isinstance(layer, Attention):
                shape = (num_blocks, block_size, layer.num_kv_heads, layer.head_dim)
                layer.k_cache = torch.full(shape, float("nan"), dtype=weight.dtype, device=self.device)
                layer.v_cache = torch.full(shape, float("nan"), dtype=weight.dtype, device=self.device)
        generator = torch.Generator().manual_seed(seed)
        self.free_blocks: list[int] = torch.randperm(num_blocks, generator=generator).tolist()
        self.blocks: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    def _slot(self, seq_id: int, position: int) -> int:
        blocks = self.blocks[seq_id]
        while len(blocks) * self.block_size <= position:
            blocks.append(self.free_blocks.pop())
        return blocks[position // self.block_size] * self.block_size + position % self.block_size

    def step(
        self, chunks: list[tuple[int, list[int]]], num_padding_rows: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Inputs for one step: each chunk is (seq_id, new token ids) continuing that sequence. Padding rows (one token
        each, as a padded CUDA-graph decode batch has) write nothing and have seq_len 0."""
        input_ids, positions, slots, seq_lens, query_lens = [], [], [], [], []
        for seq_id, tokens in chunks:
            self.blocks.setdefault(seq_id, [])
            start = self.lengths.get(seq_id, 0)
            self.lengths[seq_id] = start + len(tokens)
            input_ids += tokens
            positions += range(start, start + len(tokens))
            slots += [self._slot(seq_id, p) for p in range(start, start + len(tokens))]
            seq_lens.append(start + len(tokens))
            query_lens.append(len(tokens))
        input_ids += [0] * num_padding_rows
        positions += [0] * num_padding_rows
        slots += [-1] * num_padding_rows
        seq_lens += [0] * num_padding_rows
        query_lens += [1] * num_padding_rows
        tables = [self.blocks[seq_id] for seq_id, _ in chunks] + [[]] * num_padding_rows
        max_blocks = max(len(table) for table in tables)
        padded_tables = [table + [0] * (max_blocks - len(table)) for table in tables]
        query_start_loc = [0, *torch.tensor(query_lens).cumsum(0).tolist()]
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots, torch.int64),
            seq_lens=self._tensor(seq_lens, torch.int32),
            block_tables=self._tensor(padded_tables, torch.int32),
            query_start_loc=self._tensor(query_start_loc, torch.int32),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            is_decode=all(length == 1 for length in query_lens),
        )
        return self._tensor(input_ids, torch.int64), self._tensor(positions, torch.int64), meta

    def _tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    @torch.no_grad()
    def run(
        self, model: nn.Module, chunks: list[tuple[int, list[int]]], num_padding_rows: int = 0
    ) -> list[torch.Tensor]:
        """Runs one step and returns each chunk's logits, (len(tokens), vocab) per chunk."""
        input_ids, positions, meta = self.step(chunks, num_padding_rows)
        logits = model.compute_logits(model(input_ids, positions, meta))  # (T, vocab)
        lengths = [len(tokens) for _, tokens in chunks]
        return list(logits[: sum(lengths)].split(lengths))


TOLERANCE = {  # (atol, rtol); bf16/fp16 kernels round P to the input dtype before the PV dot, like flash-attention
    torch.float32: (1e-3, 1e-3),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (5e-3, 5e-3),
}


FP8 = attention_torch.FP8_DTYPE


def prefill_then_decode_logits(model: nn.Module, tokens: list[int]) -> torch.Tensor:
    """(len(tokens), vocab): a fresh cache, the first five tokens in one prefill step, then one decode step per token
    with two padding rows (every step at most 8 rows: the small-M GEMV's)."""
    cache = PagedTestCache(model)
    steps = [cache.run(model, [(0, tokens[:5])])[0]]
    steps += [cache.run(model, [(0, [t])], num_padding_rows=2)[0] for t in tokens[5:]]
    return torch.cat(steps)


KV_CACHE_DTYPES = ["auto", "fp8"]  # engine.kv_cache_dtype: the query's dtype, or float8_e4m3fn


def cache_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    return FP8 if kv_cache_dtype == "fp8" else dtype


def skip_bf16_dot_in_interpreter(dtype: torch.dtype, kv_cache_dtype: str = "auto") -> None:
    """(bf16 queries against an fp8 cache run their dots in fp16, which the interpreter computes right.)"""
    if not ON_GPU and dtype == torch.bfloat16 and kv_cache_dtype != "fp8":
        pytest.skip("Triton 3.6's interpreter feeds bf16 tl.dot its raw uint16 storage; bf16 runs on CUDA only")


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype
    assert not actual.isnan().any()
    atol, rtol = TOLERANCE[expected.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def paged_cache(
    seq_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random K/V caches and block tables that hand each sequence shuffled, non-contiguous blocks."""
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks nobody owns
    width = max(blocks_per_seq, default=0) + 2  # columns past a sequence's blocks stay 0, as the engine leaves them
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    owners = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    for b, n in enumerate(blocks_per_seq):
        block_tables[b, :n] = torch.tensor(owners[:n], dtype=torch.int32)
        owners = owners[n:]
    return k_cache.to(DEVICE), v_cache.to(DEVICE), block_tables.to(DEVICE)

