"""The host copy of each running request's block table, kept across steps so a step writes only its new blocks.

Rebuilding every table every step costs O(batch x blocks) Python work per step: at batch 256 with long contexts
that was the largest host cost of a decode step. A request's row is rewritten from scratch after a preemption.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from itertools import chain

import numpy as np

from batchgen.core.request import Request
from batchgen.core.request_rows import RequestRows


class BlockTables:
    def __init__(self, width: int, rows: int = 64):
        self.table = np.zeros((rows, width), dtype=np.int32)  # (rows, max_blocks_per_seq)
        self._rows = RequestRows(_Entry, range(rows))
        self._last: _LastStep | None = None

    def rows(self, requests: list[Request]) -> np.ndarray:
        """The table row of each request, its new blocks written first."""
        num_blocks = np.array([len(request.block_ids) for request in requests], dtype=np.int64)
        preemptions = [request.num_preemptions for request in requests]
        last = self._last
        if (last is not None and len(requests) == len(last.requests)
                and all(map(operator.is_, requests, last.requests)) and preemptions == last.preemptions):
            # The previous call's requests, none preempted since (most decode steps): blocks are only appended, so
            # only the rows whose block count grew are written.
            self._write([requests[index] for index in np.flatnonzero(num_blocks != last.num_blocks).tolist()])
            rows = last.rows
        else:
            rows = self._write(requests)
        self._last = _LastStep(requests, preemptions, num_blocks, rows)
        return rows

    @property
    def widest(self) -> int:
        """The most blocks any request of the latest `rows` call holds."""
        return int(self._last.num_blocks.max())

    def _write(self, requests: list[Request]) -> np.ndarray:
        """Writes the requests' blocks not yet in their rows (all of them after a preemption), in one scatter for all
        of them (a prefill step brings hundreds of new rows); returns their rows."""
        entry_of, grow = self._rows.entry, self._grow
        rows: list[int] = []
        # Per request with blocks to write: its row, its first new column, its new blocks.
        new_rows: list[int] = []
        new_starts: list[int] = []
        new_blocks: list[list[int]] = []
        for request in requests:
            entry = entry_of(request, grow)[0]
            if entry.preemptions != request.num_preemptions:  # recomputed into new blocks: rewrite the row
                entry.written, entry.preemptions = 0, request.num_preemptions
            blocks = request.block_ids
            if len(blocks) > entry.written:
                new_rows.append(entry.row)
                new_starts.append(entry.written)
                new_blocks.append(blocks[entry.written:])
                entry.written = len(blocks)
            rows.append(entry.row)
        if new_rows:
            counts = np.array([len(blocks) for blocks in new_blocks], dtype=np.int64)
            firsts = np.cumsum(counts) - counts  # each request's first entry in the flattened blocks
            columns = np.arange(int(counts.sum()), dtype=np.int64) + np.repeat(np.array(new_starts) - firsts, counts)
            self.table[np.repeat(np.array(new_rows), counts), columns] = list(chain.from_iterable(new_blocks))
        return np.array(rows, dtype=np.int64)

    def release(self, requests: list[Request]) -> None:
        if requests:
            self._last = None  # a released row may go to another request
        self._rows.release(requests)

    def _grow(self) -> range:
        grown = len(self.table)
        self.table = np.concatenate([self.table, np.zeros_like(self.table)])
        return range(grown, 2 * grown)


@dataclass(slots=True)
class _Entry:
    row: int
    written: int = 0  # blocks of the request already in the row
    preemptions: int = 0


@dataclass(slots=True)
class _LastStep:
    """The requests of the latest `rows` call, their preemption and block counts then, and their rows."""

    requests: list[Request]
    preemptions: list[int]
    num_blocks: np.ndarray
    rows: np.ndarray
