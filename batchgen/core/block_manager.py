"""Paged KV-cache bookkeeping: which fixed-size blocks of the cache each request owns (no torch).

A request owns `ceil(num_tokens_in_cache / block_size)` blocks, listed in order in `request.block_ids`;
token position `p` of the request lives in block `block_ids[p // block_size]` at offset `p % block_size`.

Automatic prefix caching (vLLM v1's design): a full, computed block is identified by a hash of its tokens and of
the hash of the block before it, so equal hashes mean equal token prefixes and equal KV. A new request takes every
cached block of its leading tokens instead of computing them. Blocks are reference-counted (several running
requests may share one); a freed block keeps its hash and KV in the free queue until its space is needed, and the
least recently freed is evicted first. A request's blocks are freed tail first, so its later blocks, the least
likely to be shared, go before its prefix; freed blocks without a hash are reused before any cached one.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

from batchgen.core.request import Request


class PrefixLookup(NamedTuple):
    block_ids: list[int]  # the cached blocks of the request's leading tokens
    next_hash: bytes | None  # the hash of the first full block after them, which the request would compute itself


def hash_block(parent_hash: bytes | None, token_ids: list[int]) -> bytes:
    """SHA-256 of the parent block's hash and this block's tokens: collisions are not a practical concern."""
    return hashlib.sha256((parent_hash or b"") + array("q", token_ids).tobytes()).digest()


def hash_blocks(parent_hash: bytes | None, token_ids: list[int], block_size: int) -> list[bytes]:
    """The chained hash_block of each full block of token_ids, the first chained to parent_hash; the tokens are
    converted to bytes once for all the blocks."""
    return hash_token_bytes(parent_hash, array("q", token_ids).tobytes(), block_size)


def hash_token_bytes(parent_hash: bytes | None, data: bytes, block_size: int) -> list[bytes]:
    """hash_blocks of tokens given as their int64 bytes (array("q") or an int64 array's)."""
    block_bytes = 8 * block_size
    hashes = []
    for offset in range(0, len(data) - block_bytes + 1, block_bytes):
        parent_hash = hashlib.sha256((parent_hash or b"") + data[offset:offset + block_bytes]).digest()
        hashes.append(parent_hash)
    return hashes


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Per block, as flat lists rather than an object per block: an admission touches a few entries of each, and
        # on a host whose caches the forward has just flushed every object it reads costs a cache miss.
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks  # set while the block holds full computed tokens
        # Blocks with no reference, in eviction order (front first); an OrderedDict used as an ordered set.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}  # block hash -> block id, for referenced and free blocks alike

    @property
    def num_total_blocks(self) -> int:
        return len(self.ref_counts)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request references, cached ones included (their space can be taken)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return len(self.ref_counts) - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix caching -------------------------------------------------------------------------------------

    def computed_blocks(self, request: Request) -> list[int]:
        """The cached blocks that hold the request's leading tokens, for a request that holds no blocks yet.

        At least the last token is left out, so the step that computes the rest yields logits to sample from, and
        no more than the request's max_cached_tokens are taken."""
        return self.lookup_prefix(request).block_ids

    def lookup_prefix(self, request: Request) -> PrefixLookup:
        """computed_blocks, and the hash of the first full block the request would compute itself, in one pass over
        its block hashes (the scheduler asks both of every request it tries to admit)."""
        if not self.enable_prefix_caching or not request.use_prefix_cache:
            return PrefixLookup([], None)
        return PrefixLookup(*self._cached_prefix(request))

    def lookup_admission(self, request: Request) -> tuple[list[int], bytes | None, set[bytes]]:
        """lookup_prefix's two answers and uncached_prompt_blocks past its hits: what the scheduler asks of every
        request it tries to admit, before allocating (an allocation may evict cached blocks, which would then count
        as uncached)."""
        if not self.enable_prefix_caching or not request.use_prefix_cache:
            return [], None, set()
        hits, next_hash = self._cached_prefix(request)
        return hits, next_hash, self._uncached_prompt_blocks(request, len(hits))

    def _cached_prefix(self, request: Request) -> tuple[list[int], bytes | None]:
        """lookup_prefix's answers, for a request that uses the cache."""
        num_full = self._hash_full_blocks(request, request.num_tokens - 1)
        if request.max_cached_tokens is not None:
            num_full = min(num_full, request.max_cached_tokens // self.block_size)
        hashes, cached = request.block_hashes, self._cached
        hits: list[int] = []
        for index in range(num_full):
            block_id = cached.get(hashes[index])
            if block_id is None:
                return hits, hashes[index]
            hits.append(block_id)
        return hits, None

    def hash_prompt(self, request: Request, prompt_bytes: bytes | None = None) -> None:
        """Hashes the request's full prompt blocks ahead of its admission, as vLLM does when a request arrives: a job
        adds rows between steps, while the device runs the step in flight, instead of inside the step that admits
        them. prompt_bytes: the prompt's int64 bytes, when the caller has them."""
        if not self.enable_prefix_caching or not request.use_prefix_cache:
            return
        num_full = len(request.prompt_token_ids) // self.block_size
        if request.block_hashes or not num_full:
            self._hash_full_blocks(request, len(request.prompt_token_ids))
            return
        # A new request (most): its prompt's int64 bytes are hashed as they are.
        if prompt_bytes is None:
            prompt_bytes = request.prompt_array.tobytes()
        request.block_hashes.extend(hash_token_bytes(None, prompt_bytes, self.block_size))

    def uncached_prompt_blocks(self, request: Request, num_hits: int = 0) -> set[bytes]:
        """The hashes of the request's full prompt blocks that are not in the cache (yet); num_hits: its leading
        blocks just found in the cache, which need no second look."""
        if not self.enable_prefix_caching or not request.use_prefix_cache:
            return set()
        return self._uncached_prompt_blocks(request, num_hits)

    def _uncached_prompt_blocks(self, request: Request, num_hits: int) -> set[bytes]:
        num_full = self._hash_full_blocks(request, request.num_prompt_tokens)
        if num_full <= num_hits:  # most short prompts: no full block left to compute
            return set()
        cached = self._cached
        return {h for h in request.block_hashes[num_hits:num_full] if h not in cached}

    def cache_full_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Registers the request's blocks filled by its first `num_computed_tokens` tokens, whose KV is written."""
        if not self.enable_prefix_caching:
            return
        block_ids, num_registered = request.block_ids, request.num_hashed_blocks
        num_full = min(num_computed_tokens // self.block_size, len(block_ids))
        if num_full <= num_registered:
            return
        num_hashed = self._hash_full_blocks(request, num_full * self.block_size)
        hashes, cached, block_hashes = request.block_hashes, self._cached, self.block_hashes
        for index in range(num_registered, num_hashed):
            block_id, block_hash = block_ids[index], hashes[index]
            # A block recomputed next to a cached copy (a prompt whose last block was a hit) stays unhashed.
            if block_hashes[block_id] is None and block_hash not in cached:
                block_hashes[block_id] = block_hash
                cached[block_hash] = block_id
        if num_hashed > num_registered:
            request.num_hashed_blocks = num_hashed

    def _hash_full_blocks(self, request: Request, num_tokens: int) -> int:
        """Extends `request.block_hashes` over the full blocks within its first num_tokens tokens (up to a pending
        token); returns how many of them are hashed. Each block is hashed once per request, at its first need."""
        hashes, size = request.block_hashes, self.block_size
        num_full = num_tokens // size
        num_hashed = len(hashes)
        if num_hashed >= num_full:
            return num_full
        if num_hashed + 1 == num_full:
            # One block (a decode's, at most one per request per step): hashed here, without known_token_ids' and
            # hash_blocks' generality, as it runs for a sixteenth of a decode step's rows.
            token_ids = request.known_block(num_hashed * size, num_full * size)
            if token_ids is not None:
                hashes.append(hash_block(hashes[-1] if hashes else None, token_ids))
            return len(hashes)
        token_ids = request.known_token_ids(num_hashed * size, num_full * size)
        hashes.extend(hash_blocks(hashes[-1] if hashes else None, token_ids, size))
        return len(hashes)

    # -- allocation -----------------------------------------------------------------------------------------

    def num_missing_blocks(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()) -> int:
        """Free blocks the request needs to hold its computed tokens (or `computed_blocks`, taken from the cache)
        plus `num_new_tokens` more."""
        return self._num_new_blocks(request, num_new_tokens, computed_blocks) + self._num_unreferenced(computed_blocks)

    def holds(self, request: Request, num_new_tokens: int) -> bool:
        """Whether the request's blocks already have room for `num_new_tokens` more tokens."""
        return request.num_computed_tokens + num_new_tokens <= len(request.block_ids) * self.block_size

    def can_allocate(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()) -> bool:
        return self.num_missing_blocks(request, num_new_tokens, computed_blocks) <= len(self._free)

    def allocate(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()) -> None:
        """Takes `computed_blocks` (cache hits) into the request's block list, then free blocks for its next
        `num_new_tokens` tokens; the caller moves `num_computed_tokens` past the hits."""
        if not self.try_allocate(request, num_new_tokens, computed_blocks):
            missing = self.num_missing_blocks(request, num_new_tokens, computed_blocks)
            raise RuntimeError(
                f"request {request.request_id} needs {missing} more KV blocks, only {len(self._free)} free"
            )

    def try_allocate(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()) -> bool:
        """`allocate` if the free blocks suffice (`can_allocate`), counting them once; whether it allocated."""
        # _num_new_blocks inlined: every admission and every decode that starts a block asks this.
        size, block_ids = self.block_size, request.block_ids
        num_tokens = request.num_computed_tokens + len(computed_blocks) * size + num_new_tokens
        num_new_blocks = max(0, -(-num_tokens // size) - len(block_ids) - len(computed_blocks))
        if computed_blocks:  # most allocations have no cache hits to take
            if num_new_blocks + self._num_unreferenced(computed_blocks) > len(self._free):
                return False
            self._take_cached_blocks(request, computed_blocks)
        elif num_new_blocks > len(self._free):
            return False
        block_ids.extend(self._take_free_blocks(num_new_blocks))
        return True

    def append_blocks(self, requests: list[Request]) -> None:
        """One free block more for each request, in order (decodes whose token starts a block): try_allocate(request, 1)
        for each, for a caller that has checked that enough blocks are free."""
        for request, block_id in zip(requests, self._take_free_blocks(len(requests)), strict=True):
            request.block_ids.append(block_id)

    def _take_cached_blocks(self, request: Request, block_ids: Sequence[int]) -> None:
        """References cache hits and appends them to the request's blocks, as already hashed."""
        free, ref_counts = self._free, self.ref_counts
        for block_id in block_ids:
            if ref_counts[block_id] == 0:
                del free[block_id]
            ref_counts[block_id] += 1
        request.block_ids.extend(block_ids)
        request.num_hashed_blocks += len(block_ids)

    def _num_new_blocks(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int]) -> int:
        """Blocks the request needs beyond its own and `computed_blocks`."""
        num_held = len(request.block_ids) + len(computed_blocks)
        num_tokens = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        return max(0, -(-num_tokens // self.block_size) - num_held)

    def _num_unreferenced(self, block_ids: Sequence[int]) -> int:
        """Those of the blocks in the free queue: referencing them takes free space."""
        if not block_ids:
            return 0
        ref_counts = self.ref_counts
        return sum(1 for block_id in block_ids if ref_counts[block_id] == 0)

    def free(self, request: Request) -> None:
        """Drops the request's references, its blocks of computed tokens offered to the cache first. Decodes fill
        their blocks one token a step: they are hashed here, once a request finishes or is preempted (for its
        recompute), not at every step that fills one; only a prompt's blocks are offered as they are computed."""
        self.cache_full_blocks(request, request.num_computed_tokens)
        free, ref_counts, block_hashes = self._free, self.ref_counts, self.block_hashes
        for block_id in reversed(request.block_ids):
            ref_counts[block_id] -= 1
            if ref_counts[block_id] == 0:
                free[block_id] = None
                if block_hashes[block_id] is None:
                    free.move_to_end(block_id, last=False)
        request.block_ids.clear()
        request.num_hashed_blocks = 0

    def _take_free_blocks(self, count: int) -> list[int]:
        """The first `count` blocks of the free queue, referenced once; cached ones are evicted."""
        free, ref_counts, block_hashes, cached = self._free, self.ref_counts, self.block_hashes, self._cached
        taken = []
        for _ in range(count):
            block_id, _ = free.popitem(last=False)
            block_hash = block_hashes[block_id]
            if block_hash is not None:  # evict: the space is needed, the cached KV goes
                del cached[block_hash]
                block_hashes[block_id] = None
            ref_counts[block_id] = 1
            taken.append(block_id)
        return taken
