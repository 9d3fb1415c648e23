"""Runs one scheduled step on the device: inputs, eager prefill or graph decode, sampling; or, for embed and classify
engines, an eager prefill whose hidden states are pooled."""

from __future__ import annotations

import bisect
import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from types import ModuleType

import numpy as np
import torch

from batchgen.config import EngineConfig
from batchgen.core.kv_sizing import FUSED_LOGPROBS_BYTES_PER_LOGIT, LOGPROBS_BYTES_PER_LOGIT, logprobs_slice_rows
from batchgen.core.prompt_logprobs import PromptLogprobs
from batchgen.core.request import Request
from batchgen.core.scheduler import SchedulerOutput
from batchgen.layers import attention_torch
from batchgen.layers.attention import Attention, AttentionMetadata
from batchgen.layers.shared_prefix import shared_prefix_len
from batchgen.models.base import CausalLM
from batchgen.sample.batch import LastPacked, SamplingBatch, shared_params
from batchgen.sample.graph import SamplerGraphs
from batchgen.sample.logprobs import (
    LogprobsTensors,
    PromptLogprobRows,
    ScoredRange,
    SliceRows,
    StepLogprobs,
    sampled_logprobs,
    score_slice,
)
from batchgen.sample.params import MAX_LOGPROBS, SamplingParams
from batchgen.sample.route import SamplingRoute, choose_route
from batchgen.sample.sampler import SamplerOutput, run_sampler
from batchgen.sample.state import SamplingState, TokenHistory
from batchgen.worker.block_tables import BlockTables
from batchgen.worker.cascade import shares_long_prefix
from batchgen.worker.cuda_graph import (
    CaptureStats,
    CudaGraphRunner,
    GraphCaptureBuffers,
    GraphOutputs,
    start_sizes,
)
from batchgen.worker.pending_tokens import PendingTokens
from batchgen.worker.pooling import PooledStep, Pooler
from batchgen.worker.prompt_logprobs import plan_prompt_logprobs, prompt_logprobs
from batchgen.worker.step_inputs import StepInputs, build_step_inputs
from batchgen.worker.upload import upload_packed

log = logging.getLogger(__name__)

# (sampling rows' requests) -> (S, W) int32 bitmask, bit j of word w allowing token 32 * w + j; None: no row guided.
BitmaskProvider = Callable[[list[Request]], np.ndarray | None]


def current_stream(device: torch.device) -> torch.cuda.Stream:
    """The device's current stream, asked for by device index. Without an index, torch finds the current device
    through torch.cuda.is_available(), a cudaGetDeviceCount call: at each of a step's 4 event records."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.current_stream(index)


class _Timer:
    """Device time between marks: CUDA events on GPU (read after the step's one sync), a host clock on CPU."""

    def __init__(self, device: torch.device):
        self.stream = current_stream(device) if device.type == "cuda" else None
        self.marks: list = []

    def mark(self) -> None:
        if self.stream is not None:
            event = torch.cuda.Event(enable_timing=True)
            event.record(self.stream)
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def intervals_ms(self) -> list[float]:
        pairs = pairwise(self.marks)
        if self.stream is not None:
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
    cascade_attention: bool  # the step's rows shared a KV prefix, read once for all of them
    # {step row: (logprob, rank, top ids, top logprobs)} and the prompt positions scored; empty or None unless asked
    logprobs: dict[int, tuple] = field(default_factory=dict)
    prompt_logprobs: PromptLogprobRows | None = None
    pooled: dict[int, list[float]] = field(default_factory=dict)  # {step row: embedding or logits}: pooling steps


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
    cascade_attention: bool
    logprobs: StepLogprobs | None = None
    pooled: PooledStep | None = None


# The warm-up step: its kernels should be those of a job's steps, whose launches Triton specializes on integer
# arguments equal to 1 (one row) and divisible by 16, and on the kernels' tiles. Rows: 3, as most steps' counts
# are neither (fewer where max_num_seqs is). Tokens: enough that its prompt logprobs take a long scoring step's
# kernels (four-warp score slices from 256 rows), few enough to cost little.
WARM_UP_ROWS = 3
WARM_UP_TOKENS = 2048
WARM_UP_REQUEST_ID = -1  # its rows' ids count down from it; a job's count up from 0
WARM_UP_PARAMS = SamplingParams(max_tokens=1, temperature=0.0, logprobs=1, prompt_logprobs=1)


class ModelRunner:
    def __init__(self, config: EngineConfig, model: CausalLM, device: torch.device, kv_cache_dtype: torch.dtype,
                 bitmask_provider: BitmaskProvider | None = None):
        """config: as the engine resolved it for the model and device (max_model_len and attention_backend set).
        bitmask_provider: the structured-output mask of a step's sampling rows."""
        self.config = config
        self.model = model
        self.device = device
        self.kv_cache_dtype = kv_cache_dtype
        self.bitmask_provider = bitmask_provider
        self.block_table_width = -(-config.max_model_len // config.block_size)
        self.attention_layers = [m for m in model.modules() if isinstance(m, Attention)]
        if config.attention_backend == "triton":
            from batchgen.layers import attention_triton as attention_ops  # Triton only where it runs
        else:
            attention_ops = attention_torch
        self.attention_ops: ModuleType = attention_ops
        # Only the Triton kernels cascade, and only layers without a sliding window (Mistral windows every layer).
        # A job whose rows never share a long prefix never captures a cascade graph (shares_long_prefix).
        self.cascade_attention = (config.cascade_attention and config.attention_backend == "triton"
                                  and any(a.sliding_window is None for a in self.attention_layers))
        self.kv_cache: torch.Tensor | None = None
        self.graphs: CudaGraphRunner | None = None
        self.block_tables = BlockTables(self.block_table_width)
        # The latest step's sampled ids stay on the device as the next step's inputs; the host learns them later.
        self.pending_tokens = PendingTokens(config.max_step_rows, device)
        self._pinned = device.type == "cuda"
        # How `collect` waits for a step's event; tensor-parallel rank 0 watches its followers while it waits.
        self.wait_for_step: Callable[[torch.cuda.Event], None] = torch.cuda.Event.synchronize
        self.vocab_size = model.config.vocab_size
        # Rows of logits scored at once: by torch, and by the fused kernel (which makes no copy of them)
        self.logprobs_slice_rows = SliceRows(logprobs_slice_rows(self.vocab_size, LOGPROBS_BYTES_PER_LOGIT),
                                             logprobs_slice_rows(self.vocab_size, FUSED_LOGPROBS_BYTES_PER_LOGIT))
        self.sampling_state: SamplingState | None = None  # allocated when a request first uses penalties
        self._last_packed = LastPacked()
        # The latest launched step's inputs and sampling rows' parameters and seeds, from which a step of the same rows
        # moves on.
        self._previous_inputs: StepInputs | None = None
        self._previous_params: list[SamplingParams] = []
        self._previous_seeds: list[int | None] = []
        self.sampler_graphs: SamplerGraphs | None = None
        # The Triton decode attention's per-(sequence, kv head) counters, shared by every layer, step and graph.
        num_kv_heads = max((layer.num_kv_heads for layer in self.attention_layers), default=0)
        self.split_arrivals = torch.zeros(config.max_step_rows * num_kv_heads, dtype=torch.int32, device=device)

    # -- KV cache -------------------------------------------------------------------------------------------

    @property
    def kv_block_bytes(self) -> int:
        layer = self.attention_layers[0]
        per_token = 2 * layer.num_kv_heads * layer.head_dim * self.kv_cache_dtype.itemsize
        return per_token * self.config.block_size * len(self.attention_layers)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        layer = self.attention_layers[0]
        shape = (2, len(self.attention_layers), num_blocks, self.config.block_size, layer.num_kv_heads,
                 layer.head_dim)
        # Not zero-filled: no attention path reads a slot before it is written
        # (tests/worker/test_kv_cache_uninitialized.py).
        self.kv_cache = torch.empty(shape, dtype=self.kv_cache_dtype, device=self.device)  # (2, L, NB, BS, KVH, D)
        for i, attention in enumerate(self.attention_layers):
            attention.k_cache, attention.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
            attention.ops = self.attention_ops

    def profile_peak_bytes(self, scores_logits: bool = True) -> int:
        """Peak memory of a forward over a step's most tokens as one-token sequences (a scratch one-block cache, no KV
        writes), the logits of as many rows as a step samples, and then, as a step with logprobs has them, one slice
        of logprobs rows scored with the most alternatives a request may ask for, and one slice scored with one
        alternative (on CUDA a larger slice: the fused kernel makes no copy of it). Without scores_logits (pooling
        steps): the forward and a float32 copy of its hidden states (mean pooling sums them)."""
        num_tokens = self.config.max_num_batched_tokens
        num_logits = min(self.config.max_num_seqs, num_tokens)
        self.allocate_kv_cache(1)
        torch.cuda.reset_peak_memory_stats(self.device)
        meta = AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=self.device),
            seq_lens=torch.ones(num_tokens, dtype=torch.int64, device=self.device),  # as steps have them
            block_tables=torch.zeros(num_tokens, 1, dtype=torch.int32, device=self.device),
            query_start_loc=torch.arange(num_tokens + 1, dtype=torch.int32, device=self.device),
            max_query_len=1, max_seq_len=1, is_decode=True,
        )
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        with torch.inference_mode():
            hidden = self.model(ids, ids, meta)
            if scores_logits:
                sample_logits = self.model.compute_logits(hidden[:num_logits])  # alive while a step scores logprobs
                for k in (MAX_LOGPROBS, 1):
                    rows = min(num_tokens, self.logprobs_slice_rows.for_alternatives(k, self.device))
                    score_slice(self.model.compute_logits(hidden[:rows]), ids[:rows], k)
                del sample_logits
            else:
                hidden.float()  # mean pooling's float32 copy: it counts at the peak, then is freed
            del hidden
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        self._unbind_kv_cache()
        torch.cuda.empty_cache()
        return peak

    # -- CUDA graphs ----------------------------------------------------------------------------------------

    def capture_graphs(self, max_rows: int | None = None) -> CaptureStats:
        """max_rows: the most requests a decode step can hold, when known: larger buckets would never replay."""
        self.graphs = self._graph_runner(max_rows)
        self.sampler_graphs = SamplerGraphs(self.graphs.sizes[-1], self.vocab_size, self.pending_tokens.ids,
                                            self.device, self._wait_for_device)
        sizes = start_sizes(self.graphs.buckets) if self.config.cuda_graph.lazy_capture else None
        with torch.inference_mode():
            return self.graphs.capture(sizes)

    def _wait_for_device(self) -> None:
        """Waits for everything queued on the current stream through wait_for_step, which a tensor-parallel rank 0
        replaces with a wait that watches its followers (a sampler graph is captured between steps)."""
        queued = torch.cuda.Event()
        queued.record()
        self.wait_for_step(queued)

    def warm_up_graphs(self, max_rows: int | None, start_buckets: bool) -> None:
        """capture_graphs' warm-up forwards alone, capturing nothing (compile_ahead's dry run of it): the start's
        buckets or the others (`CudaGraphRunner.warm_up_forwards`). Before the KV cache is allocated, over a scratch
        one-block cache, as profile_peak_bytes: a capture's padding rows read and write no KV."""
        with self._kv_cache_or_scratch(1), torch.inference_mode():
            self._graph_runner(max_rows).warm_up_forwards(start_buckets)

    @contextlib.contextmanager
    def _kv_cache_or_scratch(self, num_blocks: int) -> Iterator[None]:
        """The KV cache where it is allocated; before that (compile_ahead's dry run), a scratch cache of num_blocks
        for the duration."""
        if self.kv_cache is not None:
            yield
            return
        self.allocate_kv_cache(num_blocks)
        try:
            yield
        finally:
            self._unbind_kv_cache()

    def warm_up_step(self, pooler: Pooler | None = None, long_contexts: Sequence[int] = ()) -> None:
        """One eager prefill step of a few dummy prompts, launched and collected as the engine's loop does it:
        greedy, scoring the prompts' and the sampled tokens' logprobs (with pooler: a pooling step instead). A
        process pays for its first launch of each kernel (loaded from Triton's disk cache, or compiled) and its first
        pass over the step's host path once: here, at the start, rather than in the job's first step. Then, for each
        of long_contexts, a step of one prompt that long: the prefill attention launches otherwise from there on
        (prefill_warm_up_contexts). Before the KV cache is allocated (compile_ahead's dry run), over a scratch cache of
        the step's blocks; with the cache, in its first blocks, which hold nothing yet. An engine too small for a
        step's rows skips it."""
        rows = min(WARM_UP_ROWS, self.config.max_num_seqs)  # a step's device buffers hold max_num_seqs rows
        row_tokens = min(self.config.max_model_len, min(WARM_UP_TOKENS, self.config.max_num_batched_tokens) // rows)
        if row_tokens >= 16:  # the step's token count a multiple of 16, as a full step's: Triton specializes on it
            row_tokens -= row_tokens % 16
        self._warm_up_rows(rows, row_tokens, 2, pooler)  # a prompt logprob needs two tokens
        for context in long_contexts:
            if context <= min(self.config.max_model_len, self.config.max_num_batched_tokens):
                self._warm_up_rows(1, context, context, pooler)

    def _warm_up_rows(self, rows: int, row_tokens: int, min_tokens: int, pooler: Pooler | None) -> None:
        """A warm-up step of `rows` prompts of row_tokens each, fewer where the cache holds less; none when that is
        under min_tokens."""
        block_size = self.config.block_size
        row_blocks = -(-row_tokens // block_size)
        if self.kv_cache is not None:  # a cache sized to a small job
            row_blocks = min(row_blocks, self.kv_cache.shape[2] // rows)
            row_tokens = min(row_tokens, row_blocks * block_size)
        if row_tokens < min_tokens:
            return
        requests = [Request(WARM_UP_REQUEST_ID - i, [0] * row_tokens, WARM_UP_PARAMS,
                            block_ids=list(range(i * row_blocks, (i + 1) * row_blocks))) for i in range(rows)]
        for request in requests:
            request.logprobs = []
            request.prompt_logprobs = PromptLogprobs(request.prompt_array, 1, 1)
        step = SchedulerOutput(requests, [row_tokens] * rows, [], num_prefill_tokens=row_tokens * rows,
                               num_decode_tokens=0)
        try:
            with self._kv_cache_or_scratch(rows * row_blocks):
                self.collect(self.launch(step) if pooler is None else self.launch_pooling(step, pooler))
        finally:
            self.release(requests)
            if pooler is not None:
                pooler.release(requests)
            self.pending_tokens.sampled([], [])
            self._previous_inputs, self._previous_params, self._previous_seeds = None, [], []
            self._last_packed = LastPacked()

    def _graph_runner(self, max_rows: int | None) -> CudaGraphRunner:
        sizes = self.config.cuda_graph_sizes
        if max_rows is not None:
            sizes = sizes[:bisect.bisect_left(sizes, max_rows) + 1]
        buffers = GraphCaptureBuffers(sizes[-1], self.block_table_width, self.config.block_size, self.device,
                                      self.split_arrivals)
        return CudaGraphRunner(self.model, buffers, list(sizes), self.pending_tokens, self.cascade_attention)

    # -- one step -------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def launch(self, step: SchedulerOutput) -> LaunchedStep:
        """Queues the step's forward and sampling on the device without waiting for them."""
        start = time.perf_counter()
        if all(step.samples):  # every decode step
            sample_requests, positions = step.requests, step.computed_ends
        else:
            sample_requests = [r for r, samples in zip(step.requests, step.samples, strict=True) if samples]
            positions = [end for end, samples in zip(step.computed_ends, step.samples, strict=True) if samples]
        sampling = self._step_sampling(sample_requests, positions, step.same_rows_as_previous, step.previous_rows)
        graphed = self.graphs is not None and _is_pure_decode(step) and sampling.fixed_shape
        graph_size = self.graphs.step_size(step.num_seqs) if graphed else None
        width = self.block_table_width if graph_size else None
        block_size = self.config.block_size
        inputs = build_step_inputs(step, block_size, self.block_tables, width, self.pending_tokens,
                                   self._previous_inputs)
        self._previous_inputs = inputs
        cascade = self.cascade_attention and inputs.is_decode and shares_long_prefix(step.requests, block_size)
        timer = _Timer(self.device)
        prompt_logprobs = None
        if graph_size:
            prepare_ms = (time.perf_counter() - start) * 1000
            timer.mark()
            outputs = self.graphs.replay(inputs, graph_size, cascade, sampling.greedy_rows)
            logits = outputs.logits[:inputs.num_tokens]
            cascade = cascade and self.graphs.cascade  # off for good where a cascade capture ran out of memory
            timer.mark()
            sampling = self._add_bitmask(sampling, sample_requests)
            output = self._sample(sampling, logits, graph_size, outputs, None)
        else:
            input_ids, positions, meta, sample_token_index = self._to_device(inputs, cascade)
            prepare_ms = (time.perf_counter() - start) * 1000
            timer.mark()
            hidden, logits = self._eager_forward(inputs, input_ids, positions, meta, sample_token_index)
            prompt_logprobs = self._prompt_logprobs(step, inputs, hidden)
            timer.mark()
            sampling = self._add_bitmask(sampling, sample_requests)
            last_tokens = input_ids[sample_token_index] if sampling.bad_words is not None else None
            output = self._sample(sampling, logits, None, None, last_tokens)
        num_samples = len(inputs.sample_rows)
        sampled = torch.empty(num_samples, dtype=torch.int64, pin_memory=self._pinned)
        logprobs = None
        if num_samples:
            sampled.copy_(output.token_ids, non_blocking=True)
            logprobs = self._sampled_logprobs(sampling, logits, output, inputs.sample_rows, prompt_logprobs)
        elif prompt_logprobs is not None:
            logprobs = StepLogprobs([], None, prompt_logprobs)
        timer.mark()
        done = torch.cuda.Event() if self._pinned else None
        if done is not None:
            done.record(timer.stream)
        self.pending_tokens.sampled(step.requests, inputs.sample_rows)
        return LaunchedStep(step.num_seqs, inputs.sample_rows, sampled, done, timer, prepare_ms, graph_size, cascade,
                            logprobs)

    @torch.inference_mode()
    def launch_pooling(self, step: SchedulerOutput, pooler: Pooler) -> LaunchedStep:
        """Queues a step of pooling requests (job.task=embed, classify): an eager forward whose hidden states the
        pooler folds into each request's output; nothing is sampled."""
        start = time.perf_counter()
        inputs = build_step_inputs(step, self.config.block_size, self.block_tables)
        self._previous_inputs = None
        timer = _Timer(self.device)
        input_ids, positions, meta, _ = self._to_device(inputs)
        prepare_ms = (time.perf_counter() - start) * 1000
        timer.mark()
        hidden = self.model(input_ids, positions, meta)
        timer.mark()
        pooled = pooler.pool(step, inputs.query_start_loc, hidden)
        timer.mark()
        done = torch.cuda.Event() if self._pinned else None
        if done is not None:
            done.record(timer.stream)
        self.pending_tokens.sampled(step.requests, [])
        return LaunchedStep(step.num_seqs, [], torch.empty(0, dtype=torch.int64), done, timer, prepare_ms, None,
                            False, pooled=pooled)

    def _step_sampling(self, requests: list[Request], positions: list[int], same_rows: bool,
                       previous_rows: np.ndarray | None = None) -> SamplingBatch:
        """positions: each request's num_tokens, the index of the token it samples (its step's computed end).
        same_rows: the requests are the previous step's, which all sampled; previous_rows: they are those of the
        previous step's at these rows (`SchedulerOutput.previous_rows`)."""
        kept = None  # the previous rows this step keeps, where some left
        if same_rows:
            params, seeds = self._previous_params, self._previous_seeds
        elif previous_rows is not None and previous_rows[-1] < len(self._previous_params):
            kept = previous_rows.tolist()
            params = list(map(self._previous_params.__getitem__, kept))
            seeds = list(map(self._previous_seeds.__getitem__, kept))
        else:
            params, seeds = [r.sampling_params for r in requests], [r.sampling_seed for r in requests]
        self._previous_params, self._previous_seeds = params, seeds
        if (batch := self._last_packed.repeat(params, positions, seeds, kept)) is not None:  # most decode steps
            return batch
        histories = token_histories(requests, params)
        if histories is not None and self.sampling_state is None:
            self.sampling_state = SamplingState(self.vocab_size, self.device)
        return self._last_packed.prepare(params, positions, self.sampling_state, histories, seeds)

    def _add_bitmask(self, sampling: SamplingBatch, requests: list[Request]) -> SamplingBatch:
        """Filled on the host after the forward is queued, so on a GPU it overlaps the forward."""
        if self.bitmask_provider is None or not requests:
            return sampling
        return sampling.with_bitmask(self.bitmask_provider(requests), self.vocab_size, self._pinned)

    def _sample(self, sampling: SamplingBatch, logits: torch.Tensor, graph_size: int | None,
                outputs: GraphOutputs | None, last_tokens: torch.Tensor | None) -> SamplerOutput:
        """The step's ids by the route `choose_route` picks; each route leaves them in the pending tokens.
        graph_size and outputs: the decode graph's, whose first rows are the step's (`logits`), where one ran the
        forward. last_tokens: each row's latest token on the device, for bad words."""
        bucket = None
        if graph_size is None and self.sampler_graphs is not None:
            bucket = self.graphs.padded_size(len(logits))
        route = choose_route(sampling, graph_size is not None, bucket is not None)
        if route is SamplingRoute.FORWARD_ARGMAX:
            return SamplerOutput(outputs.greedy_ids[:len(logits)], logits, None, None)
        if route is SamplingRoute.GRAPH_LOGITS:
            return self.sampler_graphs.run(sampling, graph_size, outputs.logits, self.sampling_state,
                                           outputs.greedy_ids)
        if route is SamplingRoute.STAGED_LOGITS:
            return self.sampler_graphs.run(sampling, bucket, self.sampler_graphs.stage_logits(logits),
                                           self.sampling_state)
        if not len(logits):
            return SamplerOutput(logits.new_empty(0, dtype=torch.int64), logits, None, None)
        output = run_sampler(logits, sampling.to_device(self.device, self.sampling_state, last_tokens))
        self.pending_tokens.ids[:len(logits)].copy_(output.token_ids)
        return output

    def _sampled_logprobs(self, sampling: SamplingBatch, logits: torch.Tensor, output: SamplerOutput,
                          sample_rows: list[int],
                          prompt: tuple[list[ScoredRange], LogprobsTensors] | None) -> StepLogprobs | None:
        if not sampling.wants_logprobs and prompt is None:
            return None
        scored = output.processed_logits() if self.config.logprobs_mode == "processed_logprobs" else logits
        rows, tensors = sampled_logprobs(scored, output.token_ids, sampling.logprobs, self.logprobs_slice_rows,
                                         self._pinned)
        return StepLogprobs([sample_rows[i] for i in rows], tensors, prompt)

    def _prompt_logprobs(self, step: SchedulerOutput, inputs: StepInputs,
                         hidden: torch.Tensor) -> tuple[list[ScoredRange], LogprobsTensors] | None:
        """Raw log-probabilities of the prompt tokens this (prefill) step computes, for rows that ask for them."""
        plan = plan_prompt_logprobs(step, inputs)
        if plan is None:
            return None
        return plan.ranges, prompt_logprobs(plan, hidden, self.model.compute_logits, self.logprobs_slice_rows,
                                            self._pinned)

    def collect(self, launched: LaunchedStep) -> StepResult:
        """Waits for a launched step; its sampled ids are parallel to the step's requests."""
        start = time.perf_counter()
        if launched.done is not None:
            self.wait_for_step(launched.done)
        wait_ms = (time.perf_counter() - start) * 1000
        forward_ms, sample_ms = launched.timer.intervals_ms()
        sampled = launched.sampled.tolist()
        if len(sampled) == launched.num_seqs:  # every row samples (every decode step): row i's token is token i
            token_ids = sampled
        else:
            token_ids = [-1] * launched.num_seqs
            for row, token in zip(launched.sample_rows, sampled, strict=True):
                token_ids[row] = token
        result = StepResult(token_ids, launched.prepare_ms, forward_ms, sample_ms, wait_ms, launched.padded_size,
                            launched.cascade_attention)
        if launched.logprobs is not None:
            result.logprobs, result.prompt_logprobs = launched.logprobs.entries()
        if launched.pooled is not None:
            result.pooled = launched.pooled.entries()
        return result

    def release(self, requests: list[Request]) -> None:
        """Forget finished requests' block-table and sampling-state rows."""
        self.block_tables.release(requests)
        if self.sampling_state is not None:
            self.sampling_state.release(requests)

    def _to_device(self, inputs: StepInputs,
                   cascade: bool = False) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """The step's arrays in one copy: each separate copy costs the host a staging buffer and a launch."""
        pending = inputs.has_pending_tokens
        arrays = [inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.sample_token_index,
                  inputs.seq_lens, inputs.query_start_loc, inputs.block_tables]
        input_ids, positions, slot_mapping, sample_token_index, seq_lens, query_start_loc, block_tables, \
            *pending_rows = upload_packed(arrays + [inputs.pending_rows] if pending else arrays, self.device,
                                          self._pinned)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            seq_lens=seq_lens,
            block_tables=block_tables,
            query_start_loc=query_start_loc,
            max_query_len=inputs.max_query_len,
            max_seq_len=inputs.max_seq_len,
            is_decode=inputs.is_decode,
            shared_prefix_len=shared_prefix_len(block_tables, seq_lens, self.config.block_size) if cascade else None,
            split_arrivals=self.split_arrivals,
        )
        if pending:
            input_ids = self.pending_tokens.input_ids(input_ids, pending_rows[0]).filled()
        return input_ids, positions, meta, sample_token_index

    def _eager_forward(self, inputs: StepInputs, input_ids: torch.Tensor, positions: torch.Tensor,
                       meta: AttentionMetadata, sample_token_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden states of every token, logits of the sampling rows)."""
        hidden = self.model(input_ids, positions, meta)
        if not inputs.sample_rows:
            return hidden, hidden[:0]
        return hidden, self.model.compute_logits(hidden[sample_token_index])

    def _unbind_kv_cache(self) -> None:
        self.kv_cache = None
        for attention in self.attention_layers:
            attention.k_cache = attention.v_cache = torch.empty(0)

    def close(self) -> None:
        """Drops every device tensor the runner holds: the model, graphs (their pool and static buffers), KV cache,
        and the pending tokens, so the caching allocator can hand the memory back."""
        self.model = None
        self.graphs = None
        self.sampler_graphs = None
        self.sampling_state = None
        self._unbind_kv_cache()
        self.attention_layers = []
        self.pending_tokens = None
        self.split_arrivals = None


def token_histories(requests: list[Request], params: list[SamplingParams]) -> list[TokenHistory | None] | None:
    """What the penalty stages read of each request that uses penalty state; None when none does."""
    shared = shared_params(params)
    if not any(p.uses_penalty_state for p in (params if shared is None else [shared])):
        return None
    return [TokenHistory(r, r.prompt_token_ids, r.output_token_ids, r.eos_token_id, r.bad_words_token_ids)
            if p.uses_penalty_state else None for r, p in zip(requests, params, strict=True)]


def _is_pure_decode(step: SchedulerOutput) -> bool:
    """Every request computes exactly its one missing token, so every row samples: the shape a graph replays."""
    if not step.num_prefill_tokens:  # the scheduler's decodes are exactly that
        return True
    return all(n == 1 and r.num_computed_tokens + 1 == r.num_tokens
               for r, n in zip(step.requests, step.num_scheduled_tokens, strict=True))
