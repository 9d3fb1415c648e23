"""Decode steps as CUDA graphs: one graph per padded batch-size bucket, all in one memory pool.

A pure-decode step of n requests replays the graph of the smallest bucket >= n. Its inputs are copied into
static buffers first (`GraphCaptureBuffers`); padded rows get slot -1 (write no KV) and context length 0 (read
nothing).

Steps whose rows share a KV prefix replay a bucket's cascade variant (`attention_triton`), which computes the shared
length inside the graph. Each is captured on first use, so jobs without shared prefixes never pay for them.

A bucket whose attention reads short contexts' KV before its PDL wait also has an early-start variant, captured
under `pdl.early_start`, which steps whose contexts all fit replay (`early_read_limit`): the next kernel starts
while the attention still reads, which shortens small-batch steps.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from batchgen.layers.attention import Attention, AttentionMetadata
from batchgen.layers.shared_prefix import shared_prefix_len
from batchgen.layers.staging import aligned_length, staging_buffer
from batchgen.models.base import CausalLM
from batchgen.worker.pending_tokens import PendingTokens
from batchgen.worker.step_inputs import StepInputs

log = logging.getLogger(__name__)

# A deferred bucket is captured at this many of its steps (the earlier ones replay a larger bucket, padded): a
# capture costs two forwards of host time, which a bucket that only a job's ramp-up or drain passes through (a few
# dozen steps) does not pay back, as padded rows cost a graph little, while one its steady state uses for hundreds of
# steps is captured early in them.
CAPTURE_AFTER_USES = 64


def padded_size(sizes: list[int], n: int) -> int | None:
    """The smallest bucket >= n, or None when n is above the largest (the step then runs eagerly)."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def start_sizes(sizes: list[int]) -> list[int]:
    """The buckets an engine that defers captures (engine.cuda_graph.lazy_capture) captures at its start: the powers
    of two and the largest, so that every step has a bucket at most twice its rows."""
    return [size for size in sizes if size & (size - 1) == 0 or size == sizes[-1]]


class BucketInputs(NamedTuple):
    """A bucket's views of the static input buffer: (size,) int64 each, and (size, width) int32 block tables."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    pending_rows: torch.Tensor
    argmax_rows: torch.Tensor  # 1 where the row takes the graph's argmax (a greedy row), else 0
    block_tables: torch.Tensor


class GraphCaptureBuffers:
    """Static device inputs in one byte buffer, which each step fills with one host-to-device copy (a second copy
    for the block tables made small steps measurably slower).

    A bucket of `size` rows lays its inputs out from the buffer's start: six int64 rows (ids, positions, slots,
    context lengths, pending rows, argmax rows), each starting 64-byte aligned (Triton specializes on alignment),
    then the (size, width) int32 block tables. Its graphs read those views; buckets' layouts overlap, and only the
    one being replayed is staged.
    """

    def __init__(self, max_size: int, block_table_width: int, block_size: int, device: torch.device,
                 split_arrivals: torch.Tensor | None = None):
        self.pinned = device.type == "cuda"
        self.block_table_width = block_table_width
        self.block_size = block_size
        self.split_arrivals = split_arrivals
        self.bytes = torch.zeros(self._nbytes(max_size), dtype=torch.uint8, device=device)
        self.query_start_loc = torch.arange(max_size + 1, dtype=torch.int32, device=device)

    def _nbytes(self, size: int) -> int:
        return _rows_nbytes(size) + size * self.block_table_width * 4

    def views(self, size: int) -> BucketInputs:
        """`size`'s layout over the device buffer."""
        rows = self.bytes[:_rows_nbytes(size)].view(torch.int64).view(_ROWS, _row_stride(size))[:, :size]
        tables = self.bytes[_rows_nbytes(size):self._nbytes(size)].view(torch.int32)
        return BucketInputs(*rows, tables.view(size, self.block_table_width))

    def clear(self, size: int) -> None:
        """Inputs of `size` padding rows (no KV read or written), for a capture: another bucket's staged step would
        read as garbage through this bucket's layout."""
        self.bytes[:self._nbytes(size)].zero_()
        views = self.views(size)
        views.slot_mapping.fill_(-1)
        views.pending_rows.fill_(-1)

    def metadata(self, size: int, cascade: bool = False) -> AttentionMetadata:
        views = self.views(size)
        return AttentionMetadata(
            slot_mapping=views.slot_mapping,
            seq_lens=views.seq_lens,
            block_tables=views.block_tables,
            query_start_loc=self.query_start_loc[:size + 1],
            max_query_len=1,
            max_seq_len=self.block_table_width,
            is_decode=True,
            shared_prefix_len=shared_prefix_len(views.block_tables, views.seq_lens, self.block_size) if cascade
            else None,
            split_arrivals=self.split_arrivals,
        )

    def load(self, inputs: StepInputs, size: int, argmax_rows: np.ndarray | None = None) -> None:
        """Stage the step in host memory in `size`'s layout (`staging.staging_buffer`), padded to `size` rows, then
        copy it to the device in one copy, without a sync. argmax_rows: per row, whether it takes the graph's argmax
        (None: every row).

        Padding rows get token 0 at position 0, slot -1 (no KV write), context length 0 (no KV read), no pending
        token, no argmax and a block table of zeros.
        """
        n = inputs.num_tokens
        nbytes = self._nbytes(size)
        host = staging_buffer(nbytes, self.pinned)
        staged = host.numpy()  # numpy views: a torch view costs the host microseconds each
        rows = staged[:_rows_nbytes(size)].view(np.int64).reshape(_ROWS, _row_stride(size))
        rows[:, n:size] = ((0,), (0,), (-1,), (0,), (-1,), (0,))
        rows[0, :n] = inputs.input_ids
        rows[1, :n] = inputs.positions
        rows[2, :n] = inputs.slot_mapping
        rows[3, :n] = inputs.seq_lens
        rows[4, :n] = -1 if inputs.pending_rows is None else inputs.pending_rows
        rows[5, :n] = 1 if argmax_rows is None else argmax_rows
        tables = staged[_rows_nbytes(size):nbytes].view(np.int32).reshape(size, self.block_table_width)
        tables[:n] = inputs.block_tables
        tables[n:] = 0
        self.bytes[:nbytes].copy_(host, non_blocking=True)


_ROWS = len(BucketInputs._fields) - 1  # the int64 rows, before the block tables


def _row_stride(size: int) -> int:
    return aligned_length(size, 8)


def _rows_nbytes(size: int) -> int:
    """The bytes of a bucket's int64 rows, after which its block tables start."""
    return _ROWS * _row_stride(size) * 8


class GraphOutputs(NamedTuple):
    logits: torch.Tensor  # (size, vocab)
    # (size,) int64: the argmax of each row that takes it (BucketInputs.argmax_rows), also written into the pending
    # tokens: the whole sampling of a greedy step, in the graph (eagerly after it, torch's argmax and its copies are
    # launches of their own). Rows that draw hold 0: the sampler writes their ids and pending tokens.
    greedy_ids: torch.Tensor


class GraphKey(NamedTuple):
    size: int  # the bucket
    cascade: bool  # the shared-prefix variant
    early: bool  # captured under pdl.early_start


@dataclass
class CaptureStats:
    sizes: list[int]
    seconds: float
    pool_bytes: int
    seconds_per_size: dict[int, float]  # warm-up (Triton compiles, autotuning) + capture, by bucket
    deferred: list[int]  # buckets left to capture at their CAPTURE_AFTER_USES-th step


class CudaGraphRunner:
    """Captures model forward + logits for each bucket, largest first, into one shared memory pool; buckets left out
    of the start's capture (deferred) are captured once steps use them (`step_size`)."""

    def __init__(self, model: CausalLM, buffers: GraphCaptureBuffers, sizes: list[int], pending: PendingTokens,
                 cascade: bool = False):
        self.model = model
        self.buffers = buffers
        self.pending = pending  # the previous step's sampled ids, which the graphs read and write
        self.buckets = sorted(sizes)  # every bucket a step may replay, captured or deferred
        self.sizes = list(self.buckets)  # the captured buckets (after `capture`)
        self._uses: dict[int, int] = {}  # steps of each deferred bucket so far
        self.deferred_seconds: dict[int, float] = {}  # each deferred bucket's capture, once steps used it
        self.cascade = cascade  # whether steps may replay cascade variants
        # Keyed by (bucket, cascade, early start); each graph's outputs are its own static tensors.
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[GraphKey, GraphOutputs] = {}
        self._pool = None
        self._attention = [module for module in model.modules() if isinstance(module, Attention)]
        self._dtype = next(model.parameters(), torch.empty(0)).dtype  # the queries'
        self._early_read_limits: dict[int, int] = {}  # by bucket, see early_read_limit

    def _forward(self, size: int, cascade: bool, sampled_into: torch.Tensor) -> GraphOutputs:
        """sampled_into: where the argmax goes besides the outputs (the pending tokens' ids in the graph)."""
        from batchgen.sample.draw_triton import greedy_argmax  # Triton only where graphs are captured (CUDA)

        inputs = self.buffers.views(size)
        input_ids = self.pending.input_ids(inputs.input_ids, inputs.pending_rows)
        hidden = self.model(input_ids, inputs.positions, self.buffers.metadata(size, cascade))
        logits = self.model.compute_logits(hidden)
        return GraphOutputs(logits, greedy_argmax(logits, sampled_into, inputs.argmax_rows))

    def early_read_limit(self, size: int) -> int:
        """The longest context that every layer's decode attention at this bucket reads before its PDL wait; 0 for
        none. A step whose contexts all fit replays the bucket's early-start variant (`pdl.early_start`): its
        kernels let the next start before they wait. Elsewhere more resident kernels hold up the attention's reads
        after its wait, which makes larger batches and longer contexts slower."""
        if size not in self._early_read_limits:
            limits = [layer.decode_early_read_limit(size, self._dtype) for layer in self._attention]
            self._early_read_limits[size] = min(limits, default=0)
        return self._early_read_limits[size]

    def _warm_up(self, key: GraphKey) -> None:
        """The forward before a capture, so that lazy initialisation and autotuning stay out of the graph; called
        inside the key's pdl.early_start."""
        self.buffers.clear(key.size)
        self._forward(key.size, key.cascade, torch.empty_like(self.pending.ids))

    def _capture_one(self, key: GraphKey) -> None:
        # Warm-up and capture must not write into real KV blocks, nor the warm-up into the pending tokens. Both are
        # queued after any step still in flight (a cascade variant is captured mid-run), whose sampled ids the next
        # step reads; the next replay stages its own inputs.
        from batchgen.layers import pdl  # Triton only where graphs are captured (CUDA)

        with pdl.early_start(key.early):
            self._warm_up(key)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self.outputs[key] = self._forward(key.size, key.cascade, self.pending.ids)
        self.graphs[key] = graph
        torch.cuda.synchronize()

    def capture_keys(self, sizes: list[int]) -> list[GraphKey]:
        """What capturing `sizes` captures, in its order: largest first, each with its early-start variant where it
        has one."""
        return [GraphKey(size, cascade=False, early=early) for size in sorted(sizes, reverse=True)
                for early in ((False, True) if self.early_read_limit(size) else (False,))]

    def warm_up_keys(self, start_buckets: bool) -> list[GraphKey]:
        """What compile_ahead's dry run warms up, smallest first: the `start_sizes` buckets (start_buckets) or the
        others. The start sizes hold one bucket of each launch configuration that changes with the rows (the decode
        GEMV's row tiles, the decode attention's splits), so they launch nearly every distinct kernel, which the dry
        run hands to the compile processes as it meets them; the small buckets launch most of them."""
        first = start_sizes(self.buckets)
        return list(reversed(self.capture_keys(first if start_buckets else
                                               [size for size in self.buckets if size not in first])))

    def warm_up_forwards(self, start_buckets: bool) -> None:
        """The warm-up forwards of `warm_up_keys`, capturing nothing (compile_ahead's dry run of them: a deferred
        capture then finds its kernels compiled)."""
        from batchgen.layers import pdl

        for key in self.warm_up_keys(start_buckets):
            with pdl.early_start(key.early):
                self._warm_up(key)

    def capture(self, sizes: list[int] | None = None) -> CaptureStats:
        """Capture `sizes` (None: every bucket; the others are deferred), each with its early-start variant where it
        has one (up front: its kernels compile apart from the plain ones, which a job would otherwise wait for in
        mid-run); a graph that runs out of memory is dropped with a warning, not fatal (a step without a captured
        bucket runs eagerly)."""
        start = time.perf_counter()
        before = torch.cuda.memory_reserved()
        self._pool = torch.cuda.graph_pool_handle()
        seconds_per_size: dict[int, float] = {}
        for size in sorted(self.buckets if sizes is None else sizes, reverse=True):
            seconds_per_size[size] = self._capture_size(size)
        self.sizes = sorted({key.size for key in self.graphs})
        deferred = [size for size in self.buckets if size not in seconds_per_size]
        self.buckets = sorted([*self.sizes, *deferred])  # a bucket without memory for its graphs is not tried again
        torch.cuda.synchronize()
        return CaptureStats(self.sizes, time.perf_counter() - start, torch.cuda.memory_reserved() - before,
                            {size: seconds for size, seconds in sorted(seconds_per_size.items()) if size in self.sizes},
                            deferred)

    def _capture_size(self, size: int) -> float:
        """Captures the bucket's graphs; returns the seconds it took. Those that run out of memory are left out."""
        start = time.perf_counter()
        for key in self.capture_keys([size]):
            try:
                self._capture_one(key)
            except torch.OutOfMemoryError:
                log.warning("CUDA-graph capture ran out of memory at batch size %d%s", key.size,
                            " (early start)" if key.early else "")
                self.outputs.pop(key, None)
                torch.cuda.empty_cache()
        return time.perf_counter() - start

    def step_size(self, n: int) -> int | None:
        """The bucket a decode step of n rows replays: its own (the smallest bucket that holds n) once captured; a
        deferred one is captured at its CAPTURE_AFTER_USES-th step, and the steps before replay the smallest captured
        bucket that holds n, padded. None: no bucket holds n (the step runs eagerly)."""
        bucket = padded_size(self.buckets, n)
        if bucket is None or bucket in self.sizes:
            return bucket
        uses = self._uses[bucket] = self._uses.get(bucket, 0) + 1
        if uses < CAPTURE_AFTER_USES:
            return self.padded_size(n)
        self.deferred_seconds[bucket] = self._capture_size(bucket)
        if any(key.size == bucket for key in self.graphs):
            bisect.insort(self.sizes, bucket)
            return bucket
        self.buckets.remove(bucket)  # out of memory: its steps stay padded
        return self.padded_size(n)

    def _capture_cascade(self, size: int) -> bool:
        """Whether the bucket's cascade variant is (now) captured; running out of memory only turns it off."""
        key = GraphKey(size, cascade=True, early=False)
        if key not in self.graphs:
            try:
                self._capture_one(key)
            except torch.OutOfMemoryError:
                log.warning("CUDA-graph capture of cascade attention ran out of memory at batch size %d; such "
                            "steps replay the plain graph", size)
                self.outputs.pop(key, None)
                self.cascade = False
                torch.cuda.empty_cache()
                return False
        return True

    def _key(self, inputs: StepInputs, size: int, cascade: bool) -> GraphKey:
        """The variant of the bucket that the step replays."""
        if cascade and self.cascade and self._capture_cascade(size):
            return GraphKey(size, cascade=True, early=False)
        early, plain = GraphKey(size, cascade=False, early=True), GraphKey(size, cascade=False, early=False)
        if early in self.graphs and int(inputs.seq_lens.max(initial=0)) <= self.early_read_limit(size):
            return early
        return plain if plain in self.graphs else early

    def padded_size(self, n: int) -> int | None:
        return padded_size(self.sizes, n)

    def replay(self, inputs: StepInputs, size: int, cascade: bool = False,
               argmax_rows: np.ndarray | None = None) -> GraphOutputs:
        """The graph's whole static outputs, of which the first n rows are those of the pure-decode step's n <= size
        requests (the sampler graphs read the whole logits buffer). cascade: the rows share a KV prefix, so the
        bucket's cascade variant runs (captured now if this is its first use). argmax_rows: the rows whose argmax the
        graph computes (the greedy ones); None: every row's."""
        key = self._key(inputs, size, cascade)
        self.buffers.load(inputs, size, argmax_rows)
        self.graphs[key].replay()
        return self.outputs[key]
