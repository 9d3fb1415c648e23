"""A minimal stand-in for the model runner in tests: binds a paged KV cache to a model, hands out block ids and builds
the flattened inputs and AttentionMetadata of one step."""

from __future__ import annotations

import torch
from torch import nn

from batchgen.layers.attention import Attention, AttentionMetadata


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
