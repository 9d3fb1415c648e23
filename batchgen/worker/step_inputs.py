"""Flattens one scheduled step into the host-side arrays the model runner copies to the device."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate, islice
from typing import NamedTuple

import numpy as np

from batchgen.core.request import PENDING_TOKEN, Request
from batchgen.core.scheduler import SchedulerOutput
from batchgen.worker.block_tables import BlockTables
from batchgen.worker.pending_tokens import PendingTokens


@dataclass
class StepInputs:
    input_ids: np.ndarray  # (T,) int64
    positions: np.ndarray  # (T,) int64
    slot_mapping: np.ndarray  # (T,) int64
    # (B,) int64, the CUDA-graph buffers' dtype: eager and replayed decode launches (and the KV sizing's) then share
    # one Triton compile of the attention kernel
    seq_lens: np.ndarray
    query_start_loc: np.ndarray  # (B + 1,) int32
    block_tables: np.ndarray  # (B, max_blocks) int32
    sample_rows: list[int]  # indices into the scheduled requests that sample a token this step
    sample_token_index: np.ndarray  # (S,) int64: flattened token index whose hidden state gives each sample's logits
    # (T,) int64: where input_ids holds PENDING_TOKEN, the row of PendingTokens.ids that holds the token (still on
    # the device); -1 elsewhere. None when no token is pending.
    pending_rows: np.ndarray | None
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
        return self.pending_rows is not None


def build_step_inputs(step: SchedulerOutput, block_size: int, tables: BlockTables,
                      block_table_width: int | None = None, pending: PendingTokens | None = None,
                      previous: StepInputs | None = None) -> StepInputs:
    """step: as scheduled, before `Scheduler.advance` moves its requests on (its `samples` name the sampling rows).
    block_table_width: a fixed width (the CUDA-graph buffers' width) or None for the widest request's.
    pending: the previous step's sampled ids, for the step's tokens still pending.
    previous: the previous step's inputs, from which a step of its rows, or some of them (`step.previous_rows`),
    moves on.

    Per-request quantities are computed in Python from the step's lists, per-token ones in as few numpy calls as
    possible: on a host whose caches the forward has just flushed, each numpy call costs microseconds."""
    requests, counts, ends = step.requests, step.num_scheduled_tokens, step.computed_ends
    num_rows = len(requests)
    # before reading tables.table: it may grow
    previous_rows = step.previous_rows
    rows = tables.rows(requests, step.grown_rows if previous_rows is not None else None, previous_rows)
    block_tables = tables.table[rows, :block_table_width or tables.widest]
    if (previous_rows is not None and previous is not None and pending is not None
            and previous.block_tables.shape[1] == block_tables.shape[1]):
        if step.same_rows_as_previous and len(previous.positions) == num_rows:
            return _next_decode(previous, block_tables, block_size, None)
        if not step.same_rows_as_previous and previous.is_decode and previous_rows[-1] < len(previous.positions):
            return _next_decode(previous, block_tables, block_size, previous_rows)
    seq_lens = np.array(ends, dtype=np.int64)
    # The decodes come first, each sampling; then the prefill chunks.
    num_decodes, samples = step.num_decode_tokens, step.samples
    sample_rows = list(range(num_decodes))
    if num_decodes < num_rows:
        sample_rows += [row for row in range(num_decodes, num_rows) if samples[row]]
    if num_decodes == num_rows or sum(counts) == num_rows:  # one token each: the decode shape, token i is query i
        tokens = _one_token_each(requests, num_decodes, ends, seq_lens, pending)
        query_start_loc = np.arange(num_rows + 1, dtype=np.int32)
        sample_token_index = (np.arange(num_rows, dtype=np.int64) if len(sample_rows) == num_rows
                              else np.array(sample_rows, dtype=np.int64))
        max_query_len = 1
    else:
        query_ends = list(accumulate(counts))
        tokens = _chunks(requests, counts, ends, query_ends, pending)
        query_start_loc = np.array([0, *query_ends], dtype=np.int32)
        sample_token_index = np.array([query_ends[row] - 1 for row in sample_rows], dtype=np.int64)
        max_query_len = max(counts)
    blocks = block_tables[tokens.rows, tokens.positions // block_size]
    return StepInputs(
        input_ids=tokens.input_ids,
        positions=tokens.positions,
        slot_mapping=blocks.astype(np.int64) * block_size + tokens.positions % block_size,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
        block_tables=block_tables,
        sample_rows=sample_rows,
        sample_token_index=sample_token_index,
        max_query_len=max_query_len,
        max_seq_len=max(ends),
        pending_rows=tokens.pending_rows,
    )


def _next_decode(previous: StepInputs, block_tables: np.ndarray, block_size: int,
                 previous_rows: np.ndarray | None) -> StepInputs:
    """The inputs of a decode step of the previous (decode) step's rows, or of those at previous_rows (None: all of
    them), each one position further. Each row's token is the one the previous step sampled for it, on the device in
    its row of the pending tokens (the previous step's row: every row of a decode step samples), whether or not the
    host has it yet: the inputs read no request."""
    if previous_rows is None:
        positions, seq_lens = previous.positions + 1, previous.seq_lens + 1
        num_rows = len(positions)
        query_start_loc, sample_rows = previous.query_start_loc, previous.sample_rows
        sample_token_index, max_seq_len = previous.sample_token_index, previous.max_seq_len + 1
        pending_rows = np.arange(num_rows, dtype=np.int64)
    else:
        positions, seq_lens = previous.positions[previous_rows] + 1, previous.seq_lens[previous_rows] + 1
        num_rows = len(positions)
        query_start_loc, sample_rows = np.arange(num_rows + 1, dtype=np.int32), list(range(num_rows))
        sample_token_index, max_seq_len = np.arange(num_rows, dtype=np.int64), int(seq_lens.max())
        pending_rows = previous_rows.astype(np.int64, copy=False)
    blocks = block_tables[np.arange(num_rows), positions // block_size]
    return StepInputs(
        input_ids=np.full(num_rows, PENDING_TOKEN, dtype=np.int64),
        positions=positions,
        slot_mapping=blocks.astype(np.int64) * block_size + positions % block_size,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
        block_tables=block_tables,
        sample_rows=sample_rows,
        sample_token_index=sample_token_index,
        max_query_len=1,
        max_seq_len=max_seq_len,
        pending_rows=pending_rows,
    )


class _Tokens(NamedTuple):
    """The step's tokens, flattened in request order."""

    input_ids: np.ndarray
    positions: np.ndarray
    rows: np.ndarray  # each token's index among the step's requests
    pending_rows: np.ndarray | None  # as StepInputs.pending_rows


def _one_token_each(requests: list[Request], num_decodes: int, ends: list[int], seq_lens: np.ndarray,
                    pending: PendingTokens | None) -> _Tokens:
    """The decode-shaped step: each request's token at position end - 1 (Request.token_id, inlined: this runs for
    every row of every decode step). A decode's token is its last output slot: only that token's KV is missing."""
    token_ids = [request.output_token_ids[-1] for request in islice(requests, num_decodes)]
    token_ids += [request.output_token_ids[end - 1 - len(request.prompt_token_ids)]
                  if end > len(request.prompt_token_ids) else request.prompt_token_ids[end - 1]
                  for request, end in zip(requests[num_decodes:], ends[num_decodes:], strict=True)]
    # Only the previous step's tokens can still be pending: earlier ones are committed.
    pending_rows = pending.rows(requests, token_ids) if PENDING_TOKEN in token_ids else None
    return _Tokens(np.array(token_ids, dtype=np.int64), seq_lens - 1, np.arange(len(ends)), pending_rows)


def _chunks(requests: list[Request], counts: list[int], ends: list[int], query_ends: list[int],
            pending: PendingTokens | None) -> _Tokens:
    """A step with multi-token chunks: request i's tokens are positions [ends[i] - counts[i], ends[i])."""
    pieces: list[np.ndarray] = []
    pending_chunks: list[tuple[int, int, int]] = []  # (first, end) token indices in the step, and the pending row
    for request, num_tokens, end, query_end in zip(requests, counts, ends, query_ends, strict=True):
        if end <= len(request.prompt_token_ids):  # most chunks: a slice of the prompt
            pieces.append(request.prompt_array[end - num_tokens:end])
            continue
        chunk = request.token_ids(end - num_tokens, end)
        pieces.append(np.array(chunk, dtype=np.int64))
        if chunk[-1] == PENDING_TOKEN:  # pending slots are the last ones: a chunk with one ends with one
            pending_chunks.append((query_end - num_tokens + chunk.index(PENDING_TOKEN), query_end,
                                   pending.row(request)))
    input_ids = np.concatenate(pieces)
    pending_rows = None
    if pending_chunks:
        pending_rows = np.full(len(input_ids), -1, dtype=np.int64)
        for first, last, row in pending_chunks:
            pending_rows[first:last] = row
    num_scheduled = np.array(counts, dtype=np.int64)
    # A token's position is its index in the step plus its request's (end - query end).
    offsets = np.array([end - query_end for end, query_end in zip(ends, query_ends, strict=True)], dtype=np.int64)
    positions = np.repeat(offsets, num_scheduled) + np.arange(len(input_ids), dtype=np.int64)
    return _Tokens(input_ids, positions, np.repeat(np.arange(len(counts)), num_scheduled), pending_rows)
