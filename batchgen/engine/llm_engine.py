"""The engine: requests in, one scheduled and executed step at a time, finished outputs out."""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from batchgen.config import EngineConfig, ModelConfig
from batchgen.core.block_manager import BlockManager
from batchgen.core.kv_sizing import KVDemand
from batchgen.core.prompt_logprobs import PromptLogprobs
from batchgen.core.request import Request
from batchgen.core.scheduler import Scheduler, SchedulerOutput
from batchgen.engine.continuation import PREFILL_ONLY, continuation_score
from batchgen.engine.detokenizer import Detokenizer
from batchgen.engine.logprob_entries import PromptLogprobEntries, TokenTexts
from batchgen.engine.model_worker import ModelWorker, resolve_device
from batchgen.engine.outputs import RequestOutput, classification_fields
from batchgen.engine.request_logprobs import attach_logprobs
from batchgen.engine.structured_output import StructuredOutputManager, guided_spec
from batchgen.models.gguf_file import is_gguf_path
from batchgen.models.hf_config import model_implementation
from batchgen.models.loader import load_hf_config
from batchgen.models.tp_shapes import check_tensor_parallel
from batchgen.sample.bad_words import bad_words_token_ids
from batchgen.sample.params import SamplingParams
from batchgen.tp.ranks import Followers
from batchgen.worker.model_runner import LaunchedStep

if TYPE_CHECKING:
    from batchgen.worker.step_profiler import StepProfiler  # torch.profiler: imported only when asked for

log = logging.getLogger(__name__)


@dataclass
class StepRecord:
    """One row of steps.parquet. The *_ms columns:

    schedule_ms, prepare_ms: host time choosing the requests; building and copying the inputs.
    forward_ms, sample_ms: device time of the forward and the sampling (CUDA events; host time on CPU).
    wait_ms: host time waiting for the step's sampled ids.
    step_ms: the wall time given to this step: its launch (scheduling, preparing, queueing its work) and, until its
        results are applied, everything since the previous step's results but the next step's launch (which async
        scheduling runs in between and which counts in the next step's step_ms). The steps' step_ms add up to the
        engine loop's time, less what ran while the engine was idle, and hold every host part of their own step:
        on CPU all five parts add up to no more than step_ms; on a GPU forward_ms and sample_ms are device time,
        which overlaps the host's wait and the next step's launch.
    """

    step: int
    kind: str
    num_seqs: int
    num_tokens: int
    num_prefill_tokens: int
    num_decode_tokens: int
    padded_size: int | None
    cuda_graph: bool
    cascade_attention: bool
    schedule_ms: float
    prepare_ms: float
    forward_ms: float
    sample_ms: float
    wait_ms: float
    step_ms: float
    kv_blocks_used: int
    kv_blocks_total: int
    num_waiting: int
    num_running: int
    num_preempted: int
    num_cached_tokens: int


@dataclass
class _InFlight:
    """A launched step whose sampled ids the host has not read yet."""

    step: SchedulerOutput
    launched: LaunchedStep
    schedule_ms: float
    launch_ms: float  # scheduling to queued: the host time of its launch, counted in its own step_ms


# A row for add_requests: add_request's arguments (request id, prompt, prompt token ids, params, sample indices).
NewRow = tuple[int, str | None, list[int] | None, SamplingParams, Sequence[int] | None]


@dataclass(frozen=True)
class _CheckedParams:
    """A row's sampling parameters as add_request checked them, before the row's seed."""

    source: SamplingParams  # the object add_request was given
    params: SamplingParams  # with the model's other EOS ids among its stop ids
    bad_words_token_ids: list[list[int]]  # shared by the rows: never changed in place
    guided: bool  # some guided_* option is set
    error: str | None  # why a token id or bad word is refused (after the prompt's own checks)


def request_seed(engine_seed: int, request_id: int) -> int:
    """A per-request seed that depends only on the engine seed and the request id, so resumed runs sample alike."""
    return (engine_seed * 1_000_003 + request_id * 7_919 + 1) % (2**31 - 1)


def sample_seed(row_seed: int, sample_index: int) -> int:
    """The seed of a prompt's sample: sample 0 keeps the row's seed (n = 1 samples as before), the others mix in
    their index, so each sample is reproducible on its own (a resumed row reruns only its missing samples)."""
    if sample_index == 0:
        return row_seed
    return (row_seed * 6_364_136_223_846_793_005 + sample_index * 1_442_695_040_888_963_407) % 2**63


class LLMEngine:
    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig, detokenizer: Detokenizer | None = None,
                 kv_demand: KVDemand | None = None, profiler: StepProfiler | None = None, task: str = "generate"):
        """kv_demand: the job's rows (prompt lengths and max_tokens), when known: the KV cache is sized to them.
        profiler: records the kernels of the steps it chooses (job.profile_steps).
        task (job.task): generate and score take `add_request` and `add_score_request`; embed and classify take
        `add_pooling_request`, and their steps prefill only, eagerly, without CUDA graphs."""
        self.task = task
        self.device = resolve_device(engine_config.device)
        # Before the worker: its start's warm-up step asks for a step's bitmask (`_bitmask`).
        self.structured_output: StructuredOutputManager | None = None  # built for the first guided request
        self.followers: Followers | None = None  # tensor-parallel ranks 1..N-1
        if engine_config.tensor_parallel_size > 1:
            hf_config, gguf = load_hf_config(model_config), is_gguf_path(model_config.path)
            implementation = "native" if gguf else model_implementation(hf_config, model_config.impl)
            check_tensor_parallel(hf_config, engine_config.tensor_parallel_size, implementation, gguf)
            if self.device.type == "cuda" and self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            self.followers = Followers(model_config, engine_config, task, kv_demand, self.device, self._bitmask)
        try:
            with self._follower_failures():
                worker = self._worker(model_config, engine_config, task, kv_demand)
        except BaseException:
            self._close_followers(graceful=False)
            raise
        self.worker = worker
        if self.followers is not None:
            worker.runner.wait_for_step = self.followers.wait_for_step
        self.hf_config, self.dtype, self.config, self.info = worker.hf_config, worker.dtype, worker.config, worker.info
        if self.followers is not None:
            self.info["tensor_parallel_all_reduce"] = self.followers.group.collectives.describe()
        self.runner, self.pooler = worker.runner, worker.pooler
        self.detokenizer = detokenizer or Detokenizer.load(model_config)
        self.eos_token_ids = self._eos_token_ids(self.hf_config)
        self.profiler = profiler
        self._token_texts = TokenTexts(self.detokenizer)
        num_blocks, block_size = worker.num_blocks, self.config.block_size
        self.scheduler = Scheduler(self.config, BlockManager(num_blocks, block_size, self.config.enable_prefix_caching))
        self._finished_on_arrival: list[Request] = []
        self._last_checked: _CheckedParams | None = None
        self._prompts: dict[tuple[int, int], str | None] = {}  # (request id, sample index) -> prompt text
        self._scoring: set[tuple[int, int]] = set()  # the keys of continuation-scoring requests
        self._pooled: dict[tuple[int, int], list[float]] = {}  # pooling requests' outputs, until they are returned
        self._in_flight: _InFlight | None = None
        # The open window of wall time that the next applied step's step_ms closes: since the previous step's results
        # (or, after an idle engine, the next launch), less the launches in it, each of which its own step counts.
        self._window_start: float | None = None
        self._launches_in_window_ms = 0.0
        self.num_steps = 0

    # -- setup ----------------------------------------------------------------------------------------------

    def _worker(self, model_config: ModelConfig, engine_config: EngineConfig, task: str,
                kv_demand: KVDemand | None) -> ModelWorker:
        if self.followers is None:
            return ModelWorker(model_config, engine_config, task, self.device, kv_demand, self._bitmask)
        followers = self.followers
        return ModelWorker(model_config, engine_config, task, self.device, kv_demand, followers.sender.step_bitmask,
                           followers.tensor_parallel, followers.group.control.agree_min)

    def _follower_failures(self) -> contextlib.AbstractContextManager:
        """With tensor-parallel followers: a collective that fails because one exited raises FollowerExited."""
        return self.followers.failures() if self.followers is not None else contextlib.nullcontext()

    def _close_followers(self, graceful: bool = True) -> None:
        if self.followers is not None:
            self.followers.close(graceful)

    def _eos_token_ids(self, hf_config) -> list[int]:
        eos = self.detokenizer.eos_token_id if self.detokenizer else None
        if eos is None:
            eos = getattr(hf_config, "eos_token_id", None)
        if eos is None:
            return []
        return list(eos) if isinstance(eos, (list, tuple)) else [eos]

    # -- requests -------------------------------------------------------------------------------------------

    def add_request(self, request_id: int, prompt: str | None, prompt_token_ids: list[int] | None,
                    params: SamplingParams, sample_indices: Sequence[int] | None = None) -> None:
        """Queue a prompt's `params.n` samples (or only `sample_indices`, for a resumed row), each a request with
        the same id; one that can never run finishes at once as an error (returned by the next step)."""
        self.add_requests([(request_id, prompt, prompt_token_ids, params, sample_indices)])

    def add_requests(self, rows: Iterable[NewRow]) -> None:
        """add_request of each row, in order, in one call: what rows share (the EOS id, the checks of a parameters
        object that follows rows sharing it) is looked up once, not once a row."""
        eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None
        engine_seed, scheduler, prompts = self.config.seed, self.scheduler, self._prompts
        checked: _CheckedParams | None = None
        queued: list[Request] = []  # enqueued together at the end (Scheduler.enqueue_all)
        for request_id, prompt, prompt_token_ids, source, sample_indices in rows:
            if checked is None or checked.source is not source:
                checked = self._checked_params(source)
            params = checked.params
            seed = request_seed(engine_seed, request_id) if params.seed is None else params.seed
            if sample_indices is None and params.n == 1:  # most rows: one sample, which keeps the row's seed
                first = Request(request_id, [], params, eos_token_id=eos_token_id, seed=seed)
                samples = [first]
            else:
                indices = range(params.n) if sample_indices is None else sample_indices
                samples = [Request(request_id, [], params, eos_token_id=eos_token_id, sample_index=i,
                                   seed=sample_seed(seed, i)) for i in indices]
                first = samples[0]
                for sample in samples[1:]:
                    sample.first_sample = first
            for sample in samples:
                prompts[sample.key] = prompt
            if self.detokenizer is not None:
                for sample in samples:
                    self.detokenizer.add_request(sample)
            try:
                token_ids = self._prompt_token_ids(prompt, prompt_token_ids, params)
                if checked.error is not None:
                    raise ValueError(checked.error)
                for sample in samples:  # token_ids is the first one's own copy
                    sample.prompt_token_ids = token_ids if sample is first else list(token_ids)
                    sample.bad_words_token_ids = checked.bad_words_token_ids
                error = scheduler.admission_error(first)
                if error is None and checked.guided:
                    for sample in samples:
                        self._structured_output().add(sample)
            except ValueError as exc:
                error = str(exc)
            for sample in samples:
                if error is not None:
                    self._finish_with_error(sample, error)
                    continue
                if params.logprobs is not None:
                    sample.logprobs = []
                if params.prompt_logprobs is not None:
                    # From position 1 on: the first prompt token has no logprob.
                    sample.prompt_logprobs = PromptLogprobs(sample.prompt_array, 1, params.prompt_logprobs)
                    sample.use_prefix_cache = False  # prompt logprobs need every prompt position's logits
                queued.append(sample)
        scheduler.enqueue_all(queued)

    def _checked_params(self, params: SamplingParams) -> _CheckedParams:
        """What add_request works out from a row's parameters alone, worked out once for the rows that share the
        object (a job's rows without overrides share its defaults; LLM.generate's prompts, its params). Kept only
        while requests are unfinished: parameters are never changed in place while their rows run, but a caller may
        change them between runs."""
        checked = self._last_checked
        if checked is not None and checked.source is params and self.has_unfinished_requests:
            return checked
        source = params
        eos = self.eos_token_ids
        if len(eos) > 1:
            params = replace(params, stop_token_ids=[*params.stop_token_ids, *eos[1:]])
        error, bad_words = None, []
        try:
            self._check_token_ids(params)
            bad_words = bad_words_token_ids(params.bad_words, self.detokenizer and self.detokenizer.tokenizer)
        except ValueError as exc:
            error = str(exc)
        self._last_checked = _CheckedParams(source, params, bad_words, guided_spec(params) is not None, error)
        return self._last_checked

    def add_score_request(self, request_id: int, context_token_ids: list[int], continuation_token_ids: list[int],
                          prompt: str | None = None) -> None:
        """Queue a continuation to score given its context (lm-evaluation-harness's loglikelihood): context +
        continuation are prefilled and only the continuation's positions scored, so the context's full blocks may
        come from the prefix cache. An empty context stands for the prefix token (BOS, else EOS), as in lm-eval. One
        that can never run finishes at once as an error."""
        if not context_token_ids and (prefix := self._prefix_token_id()) is not None:
            context_token_ids = [prefix]
        request = Request(request_id, [*context_token_ids, *continuation_token_ids], PREFILL_ONLY)
        self._prompts[request.key] = prompt
        self._scoring.add(request.key)
        error = (self._score_error(context_token_ids, continuation_token_ids)
                 or self.scheduler.admission_error(request))
        if error is not None:
            self._finish_with_error(request, error)
            return
        request.prompt_logprobs = PromptLogprobs(request.prompt_array, len(context_token_ids),  # the continuation's
                                                 PREFILL_ONLY.prompt_logprobs)
        request.max_cached_tokens = len(context_token_ids) - 1  # the last context position scores the first token
        self.scheduler.enqueue(request)

    def _score_error(self, context_token_ids: list[int], continuation_token_ids: list[int]) -> str | None:
        if not continuation_token_ids:
            return "the continuation has no tokens: there is nothing to score"
        if not context_token_ids:
            return "the context is empty and the model has no BOS or EOS token to stand for it"
        num_tokens, vocab = len(context_token_ids) + len(continuation_token_ids), self.hf_config.vocab_size
        if not all(0 <= t < vocab for t in (*context_token_ids, *continuation_token_ids)):
            return f"context and continuation token ids must be in [0, {vocab})"
        if num_tokens > self.config.max_model_len:
            return (f"context + continuation have {num_tokens} tokens ({len(context_token_ids)} + "
                    f"{len(continuation_token_ids)}), more than max_model_len={self.config.max_model_len}")
        return None

    def _prefix_token_id(self) -> int | None:
        """What stands for an empty context: the tokenizer's BOS token, else its EOS (lm-eval's prefix_token_id)."""
        source = self.detokenizer.tokenizer if self.detokenizer is not None else self.hf_config
        bos = getattr(source, "bos_token_id", None)
        if bos is not None:
            return bos
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def add_pooling_request(self, request_id: int, prompt: str | None, prompt_token_ids: list[int] | None) -> None:
        """Queue a prompt to embed or classify (an engine of task embed or classify): prefilled, its hidden states
        pooled; one that can never run finishes at once as an error."""
        if self.pooler is None:
            raise ValueError(f"embedding and classification need an engine of task embed or classify, not {self.task}")
        request = Request(request_id, [], PREFILL_ONLY)
        self._prompts[request.key] = prompt
        try:
            request.prompt_token_ids = self._prompt_token_ids(prompt, prompt_token_ids, PREFILL_ONLY)
            error = self.scheduler.admission_error(request)
        except ValueError as exc:
            error = str(exc)
        if error is not None:
            self._finish_with_error(request, error)
            return
        request.max_cached_tokens = self.pooler.max_cached_tokens(request.prompt_token_ids)
        self.scheduler.enqueue(request)

    def _check_token_ids(self, params: SamplingParams) -> None:
        """Token ids in the sampling options must be in the model's vocabulary."""
        vocab = self.runner.vocab_size
        for key, ids in (("logit_bias", params.logit_bias), ("allowed_token_ids", params.allowed_token_ids or [])):
            if ids and max(ids) >= vocab:
                outside = [t for t in ids if t >= vocab]
                raise ValueError(f"sampling.{key} has token ids outside the vocabulary [0, {vocab}): {outside[:5]}")

    def _prompt_token_ids(self, prompt: str | None, token_ids: list[int] | None, params: SamplingParams) -> list[int]:
        if token_ids is None:
            if self.detokenizer is None:
                raise ValueError("the model has no tokenizer: give prompt_token_ids instead of prompt text")
            token_ids = self.detokenizer.encode(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.hf_config.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if params.truncate_prompt_tokens is not None:
            token_ids = token_ids[-params.truncate_prompt_tokens:]
        return list(token_ids)

    def _structured_output(self) -> StructuredOutputManager:
        if self.structured_output is None:
            if self.detokenizer is None:
                raise ValueError("structured output (guided_*) needs the model's tokenizer")
            self.structured_output = StructuredOutputManager(self.detokenizer.transformers_tokenizer(),
                                                             self.hf_config.vocab_size)
        return self.structured_output

    def _bitmask(self, requests: list[Request]) -> np.ndarray | None:
        """The structured-output mask of a step's sampling rows; None while no request is guided."""
        return None if self.structured_output is None else self.structured_output.bitmask(requests)

    def _finish_with_error(self, request: Request, error: str) -> None:
        request.finish_reason, request.error = "error", error
        request.finish_time = time.perf_counter()
        self._finished_on_arrival.append(request)

    @property
    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished_requests() or bool(self._finished_on_arrival)
                or self._in_flight is not None)

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    # -- stepping -------------------------------------------------------------------------------------------

    def step(self) -> tuple[list[RequestOutput], StepRecord | None]:
        """Launch one step and apply the results of one; returns the requests that finished and the applied step's
        timing row (None when no step completed).

        With async scheduling the applied step is the previous one: step N+1 is scheduled and queued while the
        device still runs step N, so the host's work hides behind the device's.
        """
        if self.followers is None:
            return self._step()
        with self.followers.failures():
            return self._step()

    def _step(self) -> tuple[list[RequestOutput], StepRecord | None]:
        finished = self._finished_on_arrival
        self._finished_on_arrival = []
        in_flight = self._in_flight
        if in_flight is not None and self.structured_output and self.structured_output.samples_guided(in_flight.step):
            # The next step's token mask needs this step's tokens: apply it before launching another.
            self._in_flight = None
            finished_now, record = self._apply(in_flight)
            return [self._output(r) for r in finished + finished_now], record
        launched = self._launch_next()
        if self.config.async_scheduling:
            to_apply, self._in_flight = self._in_flight, launched
        else:
            to_apply = launched
        if to_apply is None:
            if launched is None and self.scheduler.has_unfinished_requests():
                raise RuntimeError("the scheduler produced an empty step while requests are unfinished")
            return [self._output(r) for r in finished], None
        finished_now, record = self._apply(to_apply)
        if launched is None and self.config.async_scheduling:
            # Every running request ended with the step just applied (rows of one length that started together end
            # together): the waiting ones it made room for are launched before the finished rows' outputs are built
            # and written, which then overlap the device's work instead of leaving it idle.
            self._in_flight = self._launch_next()
        return [self._output(r) for r in finished + finished_now], record

    def _launch_next(self) -> _InFlight | None:
        if not self.scheduler.has_unfinished_requests():
            return None
        start = time.perf_counter()
        step = self.scheduler.schedule()
        if step.is_empty:  # every running request ends with its pending token
            return None
        schedule_ms = (time.perf_counter() - start) * 1000
        index = self.num_steps + (self._in_flight is not None)  # the number this step's record will carry
        launch = self.runner.launch if self.pooler is None else self._launch_pooling
        if self.followers is not None:  # they launch it as this process does
            self.followers.send(step, pooling=self.pooler is not None)
        if self.profiler is not None and self.profiler.wants(index, step.kind, self.scheduler.num_waiting):
            launched = self.profiler.launch(launch, step, index)
        else:
            launched = launch(step)
        self.scheduler.advance(step)
        launch_ms = (time.perf_counter() - start) * 1000
        if self._window_start is None:
            self._window_start = start
        self._launches_in_window_ms += launch_ms
        return _InFlight(step, launched, schedule_ms, launch_ms)

    def _launch_pooling(self, step: SchedulerOutput) -> LaunchedStep:
        return self.runner.launch_pooling(step, self.pooler)

    def _apply(self, in_flight: _InFlight) -> tuple[list[Request], StepRecord]:
        step = in_flight.step
        result = self.runner.collect(in_flight.launched)
        finished = self.scheduler.commit(step, result.sampled_token_ids)
        if self.detokenizer is not None:
            finished += self.detokenizer.apply_stop_strings(step, self.scheduler)
        if self.structured_output is not None:
            finished += self.structured_output.commit(step, self.scheduler)
        if result.logprobs or result.prompt_logprobs is not None:
            attach_logprobs(step, result, self._token_texts)
        for row, values in result.pooled.items():
            self._pooled[step.requests[row].key] = values
        self.worker.release(finished)
        if self.followers is not None:
            self.followers.sender.release(finished)
        now = time.perf_counter()
        window_ms = (now - self._window_start) * 1000 - self._launches_in_window_ms
        step_ms = window_ms + in_flight.launch_ms
        idle = self._in_flight is None and not self.scheduler.has_unfinished_requests()
        self._window_start = None if idle else now
        self._launches_in_window_ms = 0.0
        block_manager = self.scheduler.block_manager
        record = StepRecord(
            step=self.num_steps, kind=step.kind, num_seqs=step.num_seqs, num_tokens=step.num_tokens,
            num_prefill_tokens=step.num_prefill_tokens, num_decode_tokens=step.num_decode_tokens,
            padded_size=result.padded_size, cuda_graph=result.padded_size is not None,
            cascade_attention=result.cascade_attention,
            schedule_ms=in_flight.schedule_ms, prepare_ms=result.prepare_ms, forward_ms=result.forward_ms,
            sample_ms=result.sample_ms, wait_ms=result.wait_ms, step_ms=step_ms,
            kv_blocks_used=block_manager.num_used_blocks, kv_blocks_total=block_manager.num_total_blocks,
            num_waiting=self.scheduler.num_waiting, num_running=self.scheduler.num_running,
            num_preempted=len(step.preempted), num_cached_tokens=step.num_cached_tokens,
        )
        self.num_steps += 1
        return finished, record

    def _output(self, request: Request) -> RequestOutput:
        prompt = self._prompts.pop(request.key)
        task_fields = self._task_fields(request)
        text = None
        if self.detokenizer is not None:
            text = self.detokenizer.remove_request(request, request.finish_reason != "error" and not task_fields)
        token_ids = list(request.output_token_ids)
        ttft = tpot = latency = None
        first_token_time, arrival_time = request.first_token_time, request.arrival_time
        if first_token_time is not None:
            ttft = (first_token_time - arrival_time) * 1000
            latency = (request.finish_time - arrival_time) * 1000
            if len(token_ids) > 1:
                tpot = (request.finish_time - first_token_time) * 1000 / (len(token_ids) - 1)
        return RequestOutput(
            request_id=request.request_id, prompt=prompt, prompt_token_ids=request.prompt_token_ids,
            prompt_array=request.prompt_array, text=text, token_ids=token_ids, finish_reason=request.finish_reason,
            error=request.error, ttft_ms=ttft, tpot_ms=tpot, latency_ms=latency,
            num_preemptions=request.num_preemptions, sample_index=request.sample_index,
            num_cached_tokens=request.num_cached_tokens,
            logprobs=None if request.logprobs is None else request.logprobs[:len(token_ids)],
            prompt_logprobs=self._prompt_logprob_entries(request, task_fields),
            **task_fields,
        )

    def _prompt_logprob_entries(self, request: Request, task_fields: dict[str, Any]) -> PromptLogprobEntries | None:
        """None without prompt logprobs, and for a scoring request: its prompt logprobs are its result's."""
        if task_fields or request.prompt_logprobs is None:
            return None
        return PromptLogprobEntries(request.prompt_logprobs, self._token_texts)

    def _task_fields(self, request: Request) -> dict[str, Any]:
        """A scoring request's continuation result, or a pooling request's embedding or classification; empty for a
        generated completion or an error."""
        if not self._scoring and not self._pooled:  # a generate engine without scoring requests (most jobs)
            return {}
        scoring = request.key in self._scoring
        self._scoring.discard(request.key)
        pooled = self._pooled.pop(request.key, None)
        if request.finish_reason == "error":
            return {}
        if scoring:
            score = continuation_score(request.prompt_logprobs)
            return {"continuation_logprob": score.logprob,
                    "continuation_num_tokens": score.num_tokens, "continuation_is_greedy": score.is_greedy}
        if pooled is None:
            return {}
        if self.task == "classify":
            return classification_fields(pooled, getattr(self.hf_config, "id2label", None))
        return {"embedding": pooled}

    def close(self, free_memory: bool = True) -> None:
        """Release the model, KV cache and graphs so that the next run of a multirun sweep starts clean. After a
        tensor-parallel follower died, nothing waits for the device: an NCCL collective aborted for it may never end
        there (a synchronize here then waited forever). free_memory=False, for a process that ends next: the graphs,
        the compile processes and the followers stop, and the memory is left to the process's end (a full garbage
        collection walks every row the job still holds)."""
        self.runner.close()
        self._in_flight = None  # a stopped job may leave a launched step holding device tensors
        follower_died = self.followers is not None and self.followers.died()
        self._close_followers()
        if free_memory:
            gc.collect()
        if follower_died and self.device.type == "cuda":
            log.warning("A tensor-parallel follower died: %s may still run the collective aborted for it; start the "
                        "next engine in a new process", self.device)
        elif self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            if free_memory:
                # cuBLAS keeps a workspace per handle and stream in the caching allocator, which empty_cache() skips.
                torch._C._cuda_clearCublasWorkspaces()
                torch.cuda.empty_cache()
