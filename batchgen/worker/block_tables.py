"""The host copy of each running request's block table, kept across steps so a step writes only its new blocks.

Rebuilding every table every step costs O(batch x blocks) Python work per step: at batch 256 with long contexts
that was the largest host cost of a decode step. A request's row is rewritten from scratch after a preemption.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchgen.core.request import Request
from batchgen.core.request_rows import RequestRows


class BlockTables:
    def __init__(self, width: int, rows: int = 64):
        self.table = np.zeros((rows, width), dtype=np.int32)  # (rows, max_blocks_per_seq)
        self._rows = RequestRows(_Entry, range(rows))

    def rows(self, requests: list[Request]) -> np.ndarray:
        """The table row of each request, its new blocks written first."""
        rows = []
        held = self._rows.held  # bound once: this runs for every row of every step
        for request in requests:
            entry = held(request) or self._rows.entry(request, self._grow)[0]
            if entry.preemptions != request.num_preemptions:  # recomputed into new blocks: rewrite the row
                entry.written, entry.preemptions = 0, request.num_preemptions
            blocks = request.block_ids
            if len(blocks) > entry.written:
                self.table[entry.row, entry.written:len(blocks)] = blocks[entry.written:]
                entry.written = len(blocks)
            rows.append(entry.row)
        return np.array(rows, dtype=np.int64)

    def release(self, requests: list[Request]) -> None:
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
