"""Runs one scheduled step on the device: inputs, eager prefill or graph decode, sampling."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise

import numpy as np
import torch
from torch import nn

from batchgen.engine.block_tables import BlockTables
from batchgen.engine.cuda_graph import CaptureStats, CudaGraphRunner, GraphCaptureBuffers, fill_pending_tokens
from batchgen.engine.request import Request
from batchgen.engine.scheduler import SchedulerOutput
from batchgen.engine.step_inputs import StepInputs, build_step_inputs
from batchgen.layers import attention_torch
from batchgen.layers.attention import Attention, AttentionMetadata
from batchgen.layers.sampler import SamplingTensors, sample

log = logging.getLogger(__name__)


class _Timer:
    """Device time between marks: CUDA events on GPU (read after the step's one sync), a host clock on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def intervals_ms(self) -> list[float]:
        pairs = pairwise(self.marks)
        if self.cuda:
            return [a.elapsed_time(b) for a, b in pairs]
        return [(b - a) * 1000 for a, b in pairs]


@dataclass
class StepResult:
    sampled_token_ids: list[int]  # parallel to the scheduled requests; -1 where no token was sampled
    prepare_ms: float
    forward_ms: float
    sample_ms: float
    wait_ms: float  # host time spent waiting for the sampled ids
    padded_size: int | None  # the CUDA-graph bucket that ran the step, None when eager


@dataclass
class LaunchedStep:
    """A step queued on the device; `ModelRunner.collect` waits for its sampled ids."""

    num_seqs: int
    sample_rows: list[int]
    sampled: torch.Tensor  # (S,) int64 on the host (pinned on CUDA), filled when `done` completes
    done: torch.cuda.Event | None  # None on CPU, where the step ran synchronously
    timer: _Timer
    prepare_ms: float
    padded_size: int | None


class ModelRunner:
    def __init__(self, model: nn.Module, device: torch.device, block_size: int, max_model_len: int,
                 max_num_seqs: int, attention_ops=attention_torch):
        self.model = model
        self.device = device
        self.block_size = block_size
        self.block_table_width = -(-max_model_len // block_size)
        self.attention_layers = [m for m in model.modules() if isinstance(m, Attention)]
        self.attention_ops = attention_ops
        self.kv_cache: torch.Tensor | None = None
        self.graphs: CudaGraphRunner | None = None
        self.block_tables = BlockTables(self.block_table_width)
        # The latest step's sampled ids stay on the device as the next step's inputs; the host learns them later.
        self.last_sampled = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)
        self._last_sample_rows: dict[int, int] = {}  # id(request) -> its row in last_sampled
        self._pinned = device.type == "cuda"
        # Structured output: a packed int32 (S, ceil(V / 32)) mask of allowed tokens for the step's sampling rows,
        # or None when no row is guided (then the step pays nothing).
        self.bitmask_provider: Callable[[list[Request]], np.ndarray | None] | None = None

    # -- KV cache -------------------------------------------------------------------------------------------

    @property
    def kv_block_bytes(self) -> int:
        layer = self.attention_layers[0]
        dtype = next(self.model.parameters()).dtype
        per_token = 2 * layer.num_kv_heads * layer.head_dim * dtype.itemsize
        return per_token * self.block_size * len(self.attention_layers)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        layer = self.attention_layers[0]
        dtype = next(self.model.parameters()).dtype
        shape = (2, len(self.attention_layers), num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=dtype, device=self.device)  # (2, L, NB, BS, KVH, D)
        for i, attention in enumerate(self.attention_layers):
            attention.k_cache, attention.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
            attention.ops = self.attention_ops

    def profile_peak_bytes(self, num_tokens: int, num_logits: int) -> int:
        """Peak memory of a forward over num_tokens one-token sequences (a scratch one-block cache, no KV writes)."""
        self.allocate_kv_cache(1)
        torch.cuda.reset_peak_memory_stats(self.device)
        meta = AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=self.device),
            seq_lens=torch.ones(num_tokens, dtype=torch.int32, device=self.device),
            block_tables=torch.zeros(num_tokens, 1, dtype=torch.int32, device=self.device),
            query_start_loc=torch.arange(num_tokens + 1, dtype=torch.int32, device=self.device),
            max_query_len=1, max_seq_len=1, is_decode=True,
        )
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        with torch.inference_mode():
            hidden = self.model(ids, ids, meta)
            self.model.compute_logits(hidden[:num_logits])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        self._unbind_kv_cache()
        torch.cuda.empty_cache()
        return peak

    # -- CUDA graphs ----------------------------------------------------------------------------------------

    def capture_graphs(self, sizes: list[int]) -> CaptureStats:
        buffers = GraphCaptureBuffers(max(sizes), self.block_table_width, self.device)
        self.graphs = CudaGraphRunner(self.model, buffers, sizes, self.last_sampled)
        with torch.inference_mode():
            return self.graphs.capture()

    # -- one step -------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def launch(self, step: SchedulerOutput) -> LaunchedStep:
        """Queues the step's forward and sampling on the device without waiting for them."""
        start = time.perf_counter()
        graph_size = self.graphs.padded_size(step.num_seqs) if self.graphs and _is_pure_decode(step) else None
        width = self.block_table_width if graph_size else None
        inputs = build_step_inputs(step, self.block_size, self.block_tables, width, self._last_sample_rows)
        sample_requests = [step.requests[i] for i in inputs.sample_rows]
        sampling = SamplingTensors.from_params(
            [r.sampling_params for r in sample_requests],
            seeds=[r.sampling_params.seed for r in sample_requests],
            positions=[r.num_tokens for r in sample_requests],
            device=self.device,
        )
        timer = _Timer(self.device)
        if graph_size:
            prepare_ms = (time.perf_counter() - start) * 1000
            timer.mark()
            logits = self.graphs.replay(inputs, graph_size)
        else:
            tensors = self._to_device(inputs)
            prepare_ms = (time.perf_counter() - start) * 1000
            timer.mark()
            logits = self._eager_logits(inputs, *tensors)
        timer.mark()
        num_samples = len(inputs.sample_rows)
        sampled = torch.empty(num_samples, dtype=torch.int64, pin_memory=self._pinned)
        if num_samples:
            # Filled on the host after the forward is queued, so on a GPU it overlaps the forward.
            bitmask = self.bitmask_provider(sample_requests) if self.bitmask_provider else None
            token_bitmask = None
            if bitmask is not None:
                host = torch.from_numpy(bitmask)
                token_bitmask = (host.pin_memory() if self._pinned else host).to(self.device, non_blocking=True)
            on_device = sample(logits, sampling, token_bitmask)
            self.last_sampled[:num_samples].copy_(on_device)
            sampled.copy_(on_device, non_blocking=True)
        timer.mark()
        done = torch.cuda.Event() if self._pinned else None
        if done is not None:
            done.record()
        self._last_sample_rows = {id(step.requests[row]): i for i, row in enumerate(inputs.sample_rows)}
        return LaunchedStep(step.num_seqs, inputs.sample_rows, sampled, done, timer, prepare_ms, graph_size)

    def collect(self, launched: LaunchedStep) -> StepResult:
        """Waits for a launched step; its sampled ids are parallel to the step's requests."""
        start = time.perf_counter()
        if launched.done is not None:
            launched.done.synchronize()
        wait_ms = (time.perf_counter() - start) * 1000
        forward_ms, sample_ms = launched.timer.intervals_ms()
        token_ids = [-1] * launched.num_seqs
        for row, token in zip(launched.sample_rows, launched.sampled.tolist(), strict=True):
            token_ids[row] = token
        return StepResult(token_ids, launched.prepare_ms, forward_ms, sample_ms, wait_ms, launched.padded_size)

    def release(self, requests: list[Request]) -> None:
        """Forget finished requests' block-table rows."""
        self.block_tables.release(requests)

    def _to_device(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        def put(array) -> torch.Tensor:
            host = torch.from_numpy(array)
            return (host.pin_memory() if self._pinned else host).to(self.device, non_blocking=True)

        meta = AttentionMetadata(
            slot_mapping=put(inputs.slot_mapping),
            seq_lens=put(inputs.seq_lens),
            block_tables=put(inputs.block_tables),
            query_start_loc=put(inputs.query_start_loc),
            max_query_len=inputs.max_query_len,
            max_seq_len=inputs.max_seq_len,
            is_decode=inputs.is_decode,
        )
        input_ids = put(inputs.input_ids)
        if inputs.has_pending_tokens:
            input_ids = fill_pending_tokens(input_ids, put(inputs.pending_source), self.last_sampled)
        return input_ids, put(inputs.positions), meta, put(inputs.sample_token_index)

    def _eager_logits(self, inputs: StepInputs, input_ids: torch.Tensor, positions: torch.Tensor,
                      meta: AttentionMetadata, sample_token_index: torch.Tensor) -> torch.Tensor:
        hidden = self.model(input_ids, positions, meta)
        if not inputs.sample_rows:
            return hidden[:0]
        return self.model.compute_logits(hidden[sample_token_index])

    def _unbind_kv_cache(self) -> None:
        self.kv_cache = None
        for attention in self.attention_layers:
            attention.k_cache = attention.v_cache = torch.empty(0)

    def close(self) -> None:
        """Drops every device tensor the runner holds: graphs (their pool and static buffers), KV cache, and the
        sampled-ids buffer, so the caching allocator can hand the memory back."""
        self.graphs = None
        self._unbind_kv_cache()
        self.attention_layers = []
        self.last_sampled = None
        self._last_sample_rows = {}


def _is_pure_decode(step: SchedulerOutput) -> bool:
    """Every request computes exactly its one missing token, so every row samples: the shape a graph replays."""
    return all(n == 1 and r.num_computed_tokens + 1 == r.num_tokens
               for r, n in zip(step.requests, step.num_scheduled_tokens, strict=True))
