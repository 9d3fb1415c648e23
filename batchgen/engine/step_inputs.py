"""Flattens one scheduled step into the host-side arrays the model runner copies to the device."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchgen.engine.block_tables import BlockTables
from batchgen.engine.request import PENDING_TOKEN, Request
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
    # (T,) int64: where input_ids holds PENDING_TOKEN, the row of the previous step's sampled ids that holds the
    # token (still on the device); -1 elsewhere.
    pending_source: np.ndarray
    max_query_len: int
    max_seq_len: int

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def is_decode(self) -> bool:
        return self.max_query_len == 1

    @property
    def has_pending_tokens(self) -> bool:
        return bool((self.pending_source >= 0).any())


def build_step_inputs(step: SchedulerOutput, block_size: int, tables: BlockTables,
                      block_table_width: int | None = None,
                      previous_sample_rows: dict[int, int] | None = None) -> StepInputs:
    """step: as scheduled, before `Scheduler.advance` moves its requests on (its `samples` name the sampling rows).
    block_table_width: a fixed width (the CUDA-graph buffers' width) or None for the widest request's.
    previous_sample_rows: id(request) -> its row among the previous step's samples, for tokens still pending."""
    requests, counts = step.requests, step.num_scheduled_tokens
    width = block_table_width or max(len(r.block_ids) for r in requests)
    rows = tables.rows(requests)  # before reading tables.table: it may grow
    block_tables = tables.table[rows, :width]
    sample_rows = [row for row, samples in enumerate(step.samples) if samples]
    if max(counts) == 1:
        return _one_token_each(requests, block_size, block_tables, sample_rows, previous_sample_rows)
    return _chunks(step, block_size, block_tables, sample_rows, previous_sample_rows)


def _chunks(step: SchedulerOutput, block_size: int, block_tables: np.ndarray, sample_rows: list[int],
            previous_sample_rows: dict[int, int] | None) -> StepInputs:
    """A step with multi-token chunks: per-request quantities from the step's lists in Python, per-token arrays in a
    few numpy calls (each numpy call costs microseconds on a host whose caches the forward has just flushed)."""
    requests, counts, ends = step.requests, step.num_scheduled_tokens, step.computed_ends
    num_scheduled = np.array(counts, dtype=np.int64)
    query_start_loc = np.zeros(len(counts) + 1, dtype=np.int32)
    np.cumsum(num_scheduled, out=query_start_loc[1:])
    seq_lens = np.array(ends, dtype=np.int32)
    token_rows = np.repeat(np.arange(len(counts)), num_scheduled)
    # Each token's position is its index in the step plus its request's (begin - query start) = (end - query end).
    positions = np.repeat(seq_lens - query_start_loc[1:], num_scheduled) + np.arange(len(token_rows), dtype=np.int64)
    token_ids: list[int] = []
    for request, num_tokens, end in zip(requests, counts, ends, strict=True):
        token_ids += request.token_ids(end - num_tokens, end)
    return _finish(requests, np.array(token_ids, dtype=np.int64), positions, seq_lens, query_start_loc, block_tables,
                   sample_rows, block_size, token_rows, max(counts), previous_sample_rows)


def _one_token_each(requests: list[Request], block_size: int, block_tables: np.ndarray, sample_rows: list[int],
                    previous_sample_rows: dict[int, int] | None) -> StepInputs:
    """The decode-shaped step, vectorized: no per-request numpy calls."""
    n = len(requests)
    positions = np.fromiter((r.num_computed_tokens for r in requests), dtype=np.int64, count=n)
    input_ids = np.fromiter((r.token_id(r.num_computed_tokens) for r in requests), dtype=np.int64, count=n)
    return _finish(requests, input_ids, positions, (positions + 1).astype(np.int32),
                   np.arange(n + 1, dtype=np.int32), block_tables, sample_rows, block_size, np.arange(n), 1,
                   previous_sample_rows)


def _finish(requests: list[Request], input_ids: np.ndarray, positions: np.ndarray, seq_lens: np.ndarray,
            query_start_loc: np.ndarray, block_tables: np.ndarray, sample_rows: list[int], block_size: int,
            token_rows: np.ndarray, max_query_len: int, previous_sample_rows: dict[int, int] | None) -> StepInputs:
    blocks = block_tables[token_rows, positions // block_size]
    pending_source = np.full(len(input_ids), -1, dtype=np.int64)
    pending = np.flatnonzero(input_ids == PENDING_TOKEN)
    if len(pending):  # only the previous step's tokens can still be pending: every earlier step is committed
        pending_source[pending] = [previous_sample_rows[id(requests[row])] for row in token_rows[pending]]
    return StepInputs(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=blocks.astype(np.int64) * block_size + positions % block_size,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
        block_tables=block_tables,
        sample_rows=sample_rows,
        sample_token_index=query_start_loc[1:][sample_rows].astype(np.int64) - 1,
        max_query_len=max_query_len,
        max_seq_len=int(seq_lens.max()),
        pending_source=pending_source,
    )
