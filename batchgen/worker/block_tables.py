"""The host copy of each running request's block table, kept across steps so a step writes only its new blocks.

Rebuilding every table every step costs O(batch x blocks) Python work per step: at batch 256 with long contexts
that was the largest host cost of a decode step. A request's row is rewritten from scratch after a preemption.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter

import numpy as np

from batchgen.core.request import Request
from batchgen.core.request_rows import RequestRows


class BlockTables:
    def __init__(self, width: int, rows: int = 64):
        self.table = np.zeros((rows, width), dtype=np.int32)  # (rows, max_blocks_per_seq)
        self._rows = RequestRows(_Entry, range(rows))
        self._last: _LastStep | None = None

    def rows(self, requests: list[Request], grown_rows: list[int] | None = None,
             previous_rows: np.ndarray | None = None) -> np.ndarray:
        """The table row of each request, its new blocks written first. grown_rows: where the requests are the
        previous call's at `previous_rows`, in that order (the scheduler says so: `SchedulerOutput.previous_rows`),
        the rows whose requests have gained blocks since; None: found here."""
        last = self._last
        if grown_rows is not None and last is not None and previous_rows is not None:
            if len(previous_rows) != len(last.requests):  # some of the previous rows left: found when asked
                last = self._last = _LastStep(requests, list(map(last.entries.__getitem__, previous_rows.tolist())),
                                              last.rows[previous_rows], None)
            if grown_rows:
                entries = last.entries
                self._write_grown(last, [requests[row] for row in grown_rows], [entries[row] for row in grown_rows])
            return last.rows
        if last is not None and len(requests) == len(last.requests) and all(map(operator.is_, requests,
                                                                                last.requests)):
            # The previous call's requests (most decode steps): its entries say what each row holds, so one pass
            # finds the requests whose blocks changed since.
            changed = [(request, entry) for request, entry in zip(requests, last.entries, strict=True)
                       if len(request.block_ids) != entry.written or request.num_preemptions != entry.preemptions]
            if not changed:
                return last.rows
            if all(request.num_preemptions == entry.preemptions for request, entry in changed):
                # Blocks only appended, none preempted since: only the new blocks are written.
                self._write_grown(last, *zip(*changed, strict=True))
                return last.rows
        entries = self._rows.entries(requests, self._grow)
        widest = self._write(requests, entries)
        self._last = _LastStep(requests, entries, np.array([entry.row for entry in entries], dtype=np.int64), widest)
        return self._last.rows

    @property
    def widest(self) -> int:
        """The most blocks any request of the latest `rows` call holds."""
        last = self._last
        if last.widest is None:  # only an eager step's table width asks: a graph's is fixed
            last.widest = max(map(attrgetter("written"), last.entries))
        return last.widest

    def _write_grown(self, last: _LastStep, requests: Sequence[Request], entries: Sequence[_Entry]) -> None:
        """_write for some of the latest call's requests, which have gained blocks since."""
        widest = self._write(requests, entries)
        if last.widest is not None:
            last.widest = max(last.widest, widest)

    def _write(self, requests: Sequence[Request], entries: Sequence[_Entry]) -> int:
        """Writes the requests' blocks not yet in their rows (all of them after a preemption), in one scatter for all
        of them (a prefill step brings hundreds of new rows): per request, Python gathers only its row, the column of
        its first new block and how many there are; numpy spreads them over each block. Returns the most blocks one
        of the requests holds (0 for none), found in the same pass."""
        rows: list[int] = []  # per request with new blocks: its row,
        first_columns: list[int] = []  # the column of its first new block,
        counts: list[int] = []  # and how many it has
        blocks: list[int] = []  # the new blocks, request after request
        widest = 0
        for request, entry in zip(requests, entries, strict=True):
            if entry.preemptions != request.num_preemptions:  # recomputed into new blocks: rewrite the row
                entry.written, entry.preemptions = 0, request.num_preemptions
            block_ids, written = request.block_ids, entry.written
            num_blocks = len(block_ids)
            if num_blocks > widest:
                widest = num_blocks
            if num_blocks > written:
                rows.append(entry.row)
                first_columns.append(written)
                counts.append(num_blocks - written)
                blocks += block_ids[written:]
                entry.written = num_blocks
        if not blocks:
            return widest
        if len(blocks) == len(rows):  # one new block each (decodes whose token starts a block): nothing to spread
            self.table[rows, first_columns] = blocks
        else:
            num_new = np.array(counts)
            # A block's column: its index among the step's new blocks, less its request's first one's, plus the
            # request's first column.
            firsts = np.cumsum(num_new) - num_new
            columns = np.arange(len(blocks)) + np.repeat(np.array(first_columns) - firsts, num_new)
            self.table[np.repeat(np.array(rows), num_new), columns] = blocks
        return widest

    def release(self, requests: list[Request]) -> None:
        """Frees the finished requests' rows. The latest call's rows stay known: a step that repeats them leaves the
        finished requests out (`previous_rows`), and a released row goes to another request only in a call that finds
        its rows itself."""
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
    """The requests of the latest `rows` call, their entries and rows, and the most blocks one of them holds."""

    requests: list[Request]
    entries: list[_Entry]
    rows: np.ndarray
    widest: int | None  # None: not yet found (`BlockTables.widest`)
