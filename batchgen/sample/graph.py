"""The sampling pipeline of a graphed decode step, captured as its own CUDA graph per (bucket, features).

The forward graph of a bucket ends in static logits; the sampler graph reads them and the step's per-row parameters
from a static byte buffer (one copy per step, plus the bitmask when a row is guided), and writes the sampled ids into
`pending_ids`, where the next step's graph finds them, and into the requests' output counts. A separate graph per
feature set keeps each step to the stages its rows use: an unpenalized step never reads the penalty state. Graphs
are captured on first use (once per bucket and feature set), not at start-up.

An eager forward's logits (prefill and mixed steps) are staged into one more static buffer and sampled by the same
graphs, which replaces the eager pipeline's dozens of small launches, each of them host time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from batchgen.layers.staging import staging_buffer
from batchgen.sample.batch import ParamLayout, SamplingBatch, SamplingFeatures, SamplingTensors
from batchgen.sample.sampler import SamplerOutput, run_sampler
from batchgen.sample.state import SamplingState


class SamplerGraphs:
    def __init__(self, max_size: int, vocab_size: int, pending_ids: torch.Tensor, device: torch.device,
                 wait_for_device: Callable[[], None] | None = None):
        """wait_for_device: waits until the device has run everything queued so far, before a capture (whose
        synchronize would never return while an earlier step waits in a collective for a dead tensor-parallel
        follower); None: torch.cuda.synchronize."""
        self.device = device
        self.wait_for_device = wait_for_device or (lambda: torch.cuda.synchronize(device))
        self.max_size = max_size
        self.capture_graphs = device.type == "cuda"  # on CPU the same static-buffer path runs eagerly (tests)
        # A bucket of `size` rows lays its parameters out from the start (ParamLayout.of(size)); buckets overlap.
        self.params = torch.zeros(ParamLayout.of(max_size).nbytes, dtype=torch.uint8, device=device)
        self.bitmask = torch.full((max_size, -(-vocab_size // 32)), -1, dtype=torch.int32, device=device)
        self.pending_ids = pending_ids
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, SamplerOutput]] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.capture_graphs else None
        self._staged_logits: torch.Tensor | None = None

    def stage_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """An eager forward's logits (n <= max_size rows) in the static buffer that graphs of eager steps read. Rows
        past n keep earlier (finite) values: padding rows sample them greedily and nothing reads their ids."""
        staged = self._staged_logits
        if staged is None or staged.dtype != logits.dtype or staged.shape[1] != logits.shape[1]:
            staged = self._staged_logits = torch.zeros(self.max_size, logits.shape[1], dtype=logits.dtype,
                                                       device=self.device)
        staged[:len(logits)].copy_(logits)
        return staged

    def run(self, batch: SamplingBatch, size: int, logits: torch.Tensor, state: SamplingState | None,
            greedy_ids: torch.Tensor | None = None) -> SamplerOutput:
        """Samples the batch's n <= size rows from the bucket's static logits (size, V); the ids land in
        pending_ids[:n]. greedy_ids: the forward graph's static argmax of the logits (size,), or None (see
        run_sampler)."""
        features = batch.features
        # A bucket's plain and cascade forward graphs each end in their own static outputs, which a graph reads (the
        # logits name them; the staged logits of eager steps come without greedy_ids).
        key = (size, features, state.version if features.penalties else 0, logits.data_ptr())
        if self.capture_graphs and key not in self.graphs:
            if features.penalties:  # graphs of state tensors that have since grown (and moved) are never replayed
                self.graphs = {k: v for k, v in self.graphs.items() if not k[1].penalties or k[2] == key[2]}
            self.graphs[key] = self._capture(size, features, logits, state, greedy_ids)
        self._load(batch, size)
        if self.capture_graphs:
            graph, output = self.graphs[key]
            graph.replay()
        else:
            output = self._pipeline(size, features, logits, state, greedy_ids)
            self._keep_ids(output, size)
        n = batch.num_rows
        return SamplerOutput(output.token_ids[:n], output.logits[:n],
                             None if output.filtered is None else output.filtered[:n],
                             None if output.inv_temperature is None else output.inv_temperature[:n])

    def _pipeline(self, size: int, features: SamplingFeatures, logits: torch.Tensor, state: SamplingState | None,
                  greedy_ids: torch.Tensor | None) -> SamplerOutput:
        tensors = SamplingTensors.view(features, ParamLayout.of(size).fields(self.params), state, self.bitmask[:size])
        return run_sampler(logits[:size], tensors, None if greedy_ids is None else greedy_ids[:size])

    def _load(self, batch: SamplingBatch, size: int) -> None:
        """Stages the rows padded to `size` with neutral rows (greedy, state row 0, everything allowed) and copies
        them in one copy."""
        layout = ParamLayout.of(size)
        host = staging_buffer(layout.nbytes, self.capture_graphs)
        layout.stage(batch, host.numpy())
        self.params[:layout.nbytes].copy_(host, non_blocking=True)
        if batch.features.bitmask:
            n = batch.num_rows
            self.bitmask[:n].copy_(batch.bitmask, non_blocking=True)
            self.bitmask[n:size].fill_(-1)

    def _capture(self, size: int, features: SamplingFeatures, logits: torch.Tensor, state: SamplingState | None,
                 greedy_ids: torch.Tensor | None) -> tuple[torch.cuda.CUDAGraph, SamplerOutput]:
        # Warm-up (Triton compiles, lazy init) on neutral rows: it counts only into the neutral state row 0 and
        # leaves pending_ids alone, so it can run while earlier steps are still queued.
        self._load(SamplingBatch.prepare([], []), size)
        self.bitmask[:size].fill_(-1)
        self._pipeline(size, features, logits, state, greedy_ids)
        self.wait_for_device()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            output = self._pipeline(size, features, logits, state, greedy_ids)
            self._keep_ids(output, size)
        return graph, output

    def _keep_ids(self, output: SamplerOutput, size: int) -> None:
        self.pending_ids[:size].copy_(output.token_ids[:size])  # the pending ids hold the largest bucket
