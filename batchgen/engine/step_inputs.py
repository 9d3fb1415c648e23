"""Flattens one scheduled step into the host-side arrays the model runner copies to the device."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchgen.engine.scheduler import SchedulerOutput


@dataclass
class StepInputs:
    input_ids: np.ndarray  # (T,) int64
    positions: np.ndarray  # (T,) int64
    slot_mapping: np.ndarray  # (T,) int64
    seq_lens: np.ndarray  # (B,) int32
    query_start_loc: np.ndarray  # (B + 1,) int32
    block_tables: np.ndarray  # (B, max_blocks) int32
    sample_rows: list[int]  # indices into the scheduled requests that sample a token this step
    sample_token_index: np.ndarray  # (S,) int64: flattened token index whose hidden state gives each sample's logits
    max_query_len: int
    max_seq_len: int

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def is_decode(self) -> bool:
        return self.max_query_len == 1


def build_step_inputs(step: SchedulerOutput, block_size: int, block_table_width: int | None = None) -> StepInputs:
    """block_table_width: a fixed width (the CUDA-graph buffers' width) or None for the widest request's."""
    requests, counts = step.requests, step.num_scheduled_tokens
    num_tokens = sum(counts)
    input_ids = np.empty(num_tokens, dtype=np.int64)
    positions = np.empty(num_tokens, dtype=np.int64)
    seq_lens = np.empty(len(requests), dtype=np.int32)
    query_start_loc = np.zeros(len(requests) + 1, dtype=np.int32)
    width = block_table_width or max(len(r.block_ids) for r in requests)
    block_tables = np.zeros((len(requests), width), dtype=np.int32)
    sample_rows: list[int] = []
    start = 0
    for row, (request, count) in enumerate(zip(requests, counts, strict=True)):
        begin = request.num_computed_tokens
        end = begin + count
        input_ids[start:start + count] = request.token_ids(begin, end)
        positions[start:start + count] = np.arange(begin, end)
        seq_lens[row] = end
        block_tables[row, :len(request.block_ids)] = request.block_ids
        start += count
        query_start_loc[row + 1] = start
        if end == request.num_tokens:
            sample_rows.append(row)
    blocks = block_tables[np.repeat(np.arange(len(requests)), counts), positions // block_size]
    slot_mapping = blocks.astype(np.int64) * block_size + positions % block_size
    sample_token_index = query_start_loc[1:][sample_rows].astype(np.int64) - 1
    return StepInputs(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
        block_tables=block_tables,
        sample_rows=sample_rows,
        sample_token_index=sample_token_index,
        max_query_len=max(counts),
        max_seq_len=int(seq_lens.max()),
    )
