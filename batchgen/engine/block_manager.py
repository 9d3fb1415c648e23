"""Paged KV-cache bookkeeping: which fixed-size blocks of the cache each request owns (no torch).

A request owns `ceil(num_tokens_in_cache / block_size)` blocks, listed in order in `request.block_ids`;
token position `p` of the request lives in block `block_ids[p // block_size]` at offset `p % block_size`.
"""

from __future__ import annotations

from collections import deque

from batchgen.engine.request import Request


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
        self.block_size = block_size
        self._num_blocks = num_blocks
        self._free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_total_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self._num_blocks - len(self._free_block_ids)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_missing_blocks(self, request: Request, num_new_tokens: int) -> int:
        """Blocks the request lacks to hold its computed tokens plus `num_new_tokens` more."""
        needed = self.blocks_needed(request.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(request.block_ids))

    def can_allocate(self, request: Request, num_new_tokens: int) -> bool:
        return self.num_missing_blocks(request, num_new_tokens) <= len(self._free_block_ids)

    def allocate(self, request: Request, num_new_tokens: int) -> None:
        missing = self.num_missing_blocks(request, num_new_tokens)
        if missing > len(self._free_block_ids):
            raise RuntimeError(
                f"request {request.request_id} needs {missing} more KV blocks, only {len(self._free_block_ids)} free"
            )
        request.block_ids.extend(self._free_block_ids.popleft() for _ in range(missing))

    def free(self, request: Request) -> None:
        self._free_block_ids.extend(request.block_ids)
        request.block_ids.clear()
