"""When a decode step cascades its attention: the host's cheap guess, before the device computes the exact length.

Cascade attention (`attention_triton`) pays an extra kernel and a merge per layer to read a shared KV prefix once
instead of once per row; vLLM uses it from the same thresholds on.
"""

from __future__ import annotations

from batchgen.core.request import Request

CASCADE_MIN_SEQS = 8
CASCADE_MIN_SHARED_TOKENS = 256


def shares_long_prefix(requests: list[Request], block_size: int) -> bool:
    """Whether at least CASCADE_MIN_SEQS requests all hold the same physical block at the column that ends the
    first CASCADE_MIN_SHARED_TOKENS positions. O(rows): prefix-cache block hashes chain, and n > 1 samples share
    their prompt's blocks by reference, so one shared block implies the blocks before it are shared too (the
    device computes the exact shared length either way)."""
    if len(requests) < CASCADE_MIN_SEQS:
        return False
    column = max(CASCADE_MIN_SHARED_TOKENS // block_size, 1) - 1
    first = requests[0].block_ids
    if len(first) <= column:
        return False
    block = first[column]
    return all(len(r.block_ids) > column and r.block_ids[column] == block for r in requests)
