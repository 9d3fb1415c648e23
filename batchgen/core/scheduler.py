"""Continuous-batching scheduler over a paged KV cache, with chunked prefill and preemption by recompute (no torch).

Each step has a token budget (`max_num_batched_tokens`) and at most `max_num_seqs` running requests; finished
requests leave and waiting ones join at every step. Step composition, chosen by `mixed_prefill_decode`:

- False (default, nano-vllm style; uniform decode steps replay CUDA graphs): a step is all prefill or all decode.
  It is a prefill step when a running request is mid-prefill or the head of the waiting queue can be admitted:
  mid-prefill requests continue first, then waiting requests are admitted FIFO, each getting min(tokens left,
  budget left), so a long prompt is split across steps (chunked prefill). While requests are decoding, admission
  waits until it is worth a step: `admit_rows` free slots (or as many as wait) or waiting prompts that fill the
  token budget; an eager prefill step costs its launches however few rows it admits, and the decodes wait for it.
  For the same reason such a step does not cut a row to fill the last 1/UNCUT_TAIL_SHARE of its budget: the row's
  remainder would need a prefill step of its own next, with the few rows that fit beside it; it waits whole instead.
  Otherwise, or when the prefill step ends up empty, it is a decode step: every running request gets 1 token.
- True (vLLM v1 style): running requests first, in admission order (a decode takes 1 token, a mid-prefill request
  a chunk of the remaining budget), then waiting requests with whatever budget remains; a step with both is "mixed".

Tokens count as decode tokens iff the request `is_decoding` and is not admitted in this step (a recompute after
preemption is prefill).
`SchedulerOutput.requests` lists decodes first, then prefill chunks.

A step is applied in two halves, so that the engine can schedule step N+1 while the device still runs step N
(async scheduling): `advance` when the step is launched (tokens count as computed; each sampled token gets a
PENDING_TOKEN slot) and `commit` when its sampled ids arrive (slots filled, stop conditions checked). A request
whose pending token may end it is still scheduled; if it does end, the later step's token is discarded. One that
will end on length whatever the token is not scheduled again.

Preemption by recompute: when a running request cannot get the blocks its next tokens need, the most recently
admitted running request is preempted (blocks freed, `num_computed_tokens = 0`, back to the FRONT of the waiting
queue) and the allocation retried; when the request itself is the most recent one, it preempts itself and is not
scheduled this step. Admission never preempts: a waiting request is admitted only when blocks for its chunk are
free, and not at all in a step that preempted, so freed memory goes to the running requests first.

Prefix caching (see block_manager.py): a prompt's full blocks are hashed when it arrives, between steps; an admitted
request (new or preempted) starts past its leading tokens found in the cache. A block enters the cache at `commit`,
not at `advance`: only then has its step run and are all its tokens known. A waiting request whose next uncached
block is a prompt block another request is computing (admitted in this step, or running but not yet committed)
waits, and later requests go ahead of it: once that block is cached it shares it instead of computing a copy (many
rows sharing a system prompt compute it once, not once per row admitted with the first). The other samples of a
prompt (n > 1) wait aside until the first sample has committed its first token, so its prompt blocks are cached and
they share them; then they join the front of the waiting queue.
"""

from __future__ import annotations

import operator
import time
from collections import deque
from dataclasses import InitVar, dataclass, field
from itertools import islice
from operator import attrgetter

import numpy as np

from batchgen.config import EngineConfig
from batchgen.core.block_manager import BlockManager
from batchgen.core.request import PENDING_TOKEN, Request, RequestStatus, prompt_arrays

# A prefill step that interrupts decodes leaves a budget below 1/UNCUT_TAIL_SHARE of max_num_batched_tokens unused
# rather than cut a row to fill it (see the module docstring).
UNCUT_TAIL_SHARE = 8


@dataclass(slots=True)
class DecodeRows:
    """A step's decode rows (its first rows) as arrays: what the next step of the same rows derives its own from. Row
    i is requests[i]."""

    requests: list[Request]
    computed_ends: np.ndarray  # (D,) int64: each request's num_computed_tokens once the step has run
    output_slots: np.ndarray  # (D,) int64: the output slot each decode's token fills
    max_num_outputs: np.ndarray  # (D,) int64: Request.max_num_outputs, fixed while a request runs
    # The Request.stop_token_set of every row when they all have the same (most steps: the rows share their
    # parameters), else None. Fixed while a request runs, like max_num_outputs.
    stop_token_set: frozenset[int] | None

    @classmethod
    def from_lists(cls, requests: list[Request], computed_ends: list[int], output_slots: list[int]) -> DecodeRows:
        count = len(requests)
        stop_token_sets = set(map(attrgetter("stop_token_set"), requests))
        return cls(requests, np.array(computed_ends, dtype=np.int64), np.array(output_slots, dtype=np.int64),
                   np.fromiter(map(attrgetter("max_num_outputs"), requests), dtype=np.int64, count=count),
                   stop_token_sets.pop() if len(stop_token_sets) == 1 else None)

    def next_step(self) -> DecodeRows:
        """The same rows one decode further."""
        return DecodeRows(self.requests, self.computed_ends + 1, self.output_slots + 1, self.max_num_outputs,
                          self.stop_token_set)

    def take(self, rows: np.ndarray) -> DecodeRows:
        """These rows alone, in this order."""
        requests = self.requests
        return DecodeRows([requests[row] for row in rows.tolist()], self.computed_ends[rows], self.output_slots[rows],
                          self.max_num_outputs[rows], self.stop_token_set)


@dataclass
class SchedulerOutput:
    requests: list[Request]  # decodes first, then prefill chunks
    num_scheduled_tokens: list[int]  # parallel to requests
    preempted: list[Request]  # preempted while building this step
    num_prefill_tokens: int
    num_decode_tokens: int
    num_cached_tokens: int = 0  # tokens of the requests admitted in this step found in the prefix cache
    # (computed_ends, output_slots, samples) as the scheduler found them while building the step; None: computed here
    rows: InitVar[tuple[list[int], list[int], list[bool]] | None] = None
    # Parallel to requests: this step completes the request's sequence, so a token is sampled for it, into
    # output_token_ids[output_slots[i]]. Fixed when the step is built, because `Scheduler.advance` moves requests on.
    samples: list[bool] = field(init=False)
    output_slots: list[int] = field(init=False)
    computed_ends: list[int] = field(init=False)  # each request's num_computed_tokens once the step has run
    # The decode rows' arrays (None when the step has none, or was not built by the scheduler).
    decode_rows: DecodeRows | None = None
    # The step's requests are the previous step's, in the same order, each decoding again (most decode steps): the
    # step inputs carry their block-table rows over. grown_rows: the rows given a new block in this step, the only
    # block-table rows to write.
    same_rows_as_previous: bool = False
    grown_rows: list[int] = field(default_factory=list)
    # Where the step's requests are the previous step's decodes, each decoding again, less those that left (finished,
    # or ending with their pending token), in the same order: row i's row in the previous step (all of them where
    # same_rows_as_previous). The step's inputs and sampling rows are then the previous step's, taken at these rows.
    # None: the step was scheduled row by row.
    previous_rows: np.ndarray | None = None
    # Scheduler.num_finished when the step was built: while it is unchanged at the step's commit, none of the step's
    # requests has finished since (None: unknown, the step was not built by the scheduler).
    num_finished_at_schedule: int | None = None

    def __post_init__(self, rows: tuple[list[int], list[int], list[bool]] | None) -> None:
        if rows is not None:
            self.computed_ends, self.output_slots, self.samples = rows
            return
        self.computed_ends = [request.num_computed_tokens + num_tokens
                              for request, num_tokens in zip(self.requests, self.num_scheduled_tokens, strict=True)]
        self.output_slots = [len(request.output_token_ids) for request in self.requests]
        self.samples = [end == len(request.prompt_token_ids) + num_outputs  # the step reaches request.num_tokens
                        for request, end, num_outputs in zip(self.requests, self.computed_ends, self.output_slots,
                                                             strict=True)]

    @property
    def num_seqs(self) -> int:
        return len(self.requests)

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def is_empty(self) -> bool:
        return not self.requests

    @property
    def kind(self) -> str:
        """prefill | decode | mixed | idle"""
        if self.num_prefill_tokens and self.num_decode_tokens:
            return "mixed"
        if self.num_prefill_tokens:
            return "prefill"
        return "decode" if self.num_decode_tokens else "idle"


@dataclass
class _StepBuilder:
    """A step as it is scheduled: each row's entries are kept as the step's rows need them, appended where the row is
    scheduled. A decode (a request that is_decoding and was not admitted in this step; an admission is prefill even
    when the cache holds all but its last token) takes one token and samples; a prefill chunk samples when it
    reaches the end of the request's known tokens."""

    budget: int
    decodes: list[Request] = field(default_factory=list)
    decode_ends: list[int] = field(default_factory=list)  # num_computed_tokens + 1
    decode_slots: list[int] = field(default_factory=list)  # len(output_token_ids): the slot its token fills
    prefills: list[Request] = field(default_factory=list)
    prefill_tokens: list[int] = field(default_factory=list)  # scheduled tokens
    prefill_ends: list[int] = field(default_factory=list)  # num_computed_tokens once the chunk has run
    prefill_slots: list[int] = field(default_factory=list)  # len(output_token_ids)
    prefill_samples: list[bool] = field(default_factory=list)  # the chunk reaches the request's num_tokens
    preempted: list[Request] = field(default_factory=list)
    num_cached_tokens: int = 0
    # Set where the decodes repeat the previous step's rows, or some of them (Scheduler._repeat_decodes): their
    # arrays, made from the previous step's, the rows given a new block, and each row's row in the previous step.
    repeated: DecodeRows | None = None
    grown_rows: list[int] = field(default_factory=list)
    previous_rows: np.ndarray | None = None
    same_rows: bool = False  # previous_rows holds every row of the previous step

    def add_prefill(self, request: Request, num_computed: int, num_tokens: int) -> None:
        """A chunk of num_tokens after the request's first num_computed tokens (the caller takes them from the
        budget)."""
        num_prompt, num_outputs = len(request.prompt_token_ids), len(request.output_token_ids)
        self.prefills.append(request)
        self.prefill_tokens.append(num_tokens)
        self.prefill_ends.append(num_computed + num_tokens)
        self.prefill_slots.append(num_outputs)
        self.prefill_samples.append(num_computed + num_tokens == num_prompt + num_outputs)

    def build(self, num_finished: int) -> SchedulerOutput:
        num_decodes = len(self.decodes)
        decode_rows = self.repeated
        if decode_rows is None and num_decodes:
            decode_rows = DecodeRows.from_lists(self.decodes, self.decode_ends, self.decode_slots)
        return SchedulerOutput(
            requests=self.decodes + self.prefills,
            num_scheduled_tokens=[1] * num_decodes + self.prefill_tokens,
            preempted=self.preempted,
            num_prefill_tokens=sum(self.prefill_tokens),
            num_decode_tokens=num_decodes,
            num_cached_tokens=self.num_cached_tokens,
            rows=(self.decode_ends + self.prefill_ends, self.decode_slots + self.prefill_slots,
                  [True] * num_decodes + self.prefill_samples),
            decode_rows=decode_rows,
            same_rows_as_previous=self.same_rows and not self.prefills,
            grown_rows=self.grown_rows,
            previous_rows=self.previous_rows if not self.prefills else None,
            num_finished_at_schedule=num_finished,
        )


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        """config: reads max_num_seqs, max_num_batched_tokens, max_model_len (set), admit_rows and
        mixed_prefill_decode."""
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last one is preempted first
        # The running requests that miss more than their last token's KV (admitted, mid-prefill): exactly those whose
        # `is_decoding` is false, kept here (by id, in admission order) so that a step need not ask every running
        # request. A request joins at admission and leaves once a launched chunk leaves only its last token to compute.
        self._prefilling: dict[int, Request] = {}
        self._siblings: dict[int, list[Request]] = {}  # id(first sample) -> later samples waiting for its prompt
        self._previous_decodes: DecodeRows | None = None  # the latest launched step's rows, when all are decodes
        self.num_finished = 0  # requests finished so far

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + sum(len(siblings) for siblings in self._siblings.values())

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self._siblings)

    def admission_error(self, request: Request) -> str | None:
        """Why this request can never run, or None."""
        prompt_len, max_model_len = len(request.prompt_token_ids), self.config.max_model_len
        if prompt_len == 0:
            return "the prompt is empty"
        if prompt_len > max_model_len:
            return f"the prompt has {prompt_len} tokens, more than max_model_len={max_model_len}"
        max_tokens, cache = request.sampling_params.max_tokens, self.block_manager
        max_len = min(prompt_len + max_tokens, max_model_len)
        if max_len > cache.num_total_blocks * cache.block_size:  # more blocks than the whole cache has
            return (f"the prompt ({prompt_len} tokens) with max_tokens={max_tokens} needs up to {max_len} tokens of KV "
                    f"cache = {cache.blocks_needed(max_len)} blocks of {cache.block_size} tokens, but the whole cache "
                    f"has {cache.num_total_blocks} blocks")
        return None

    def add_request(self, request: Request) -> None:
        error = self.admission_error(request)
        if error is not None:
            raise ValueError(f"request {request.request_id} can never run: {error}")
        self.enqueue(request)

    def enqueue(self, request: Request) -> None:
        """add_request for a request whose admission_error the caller has found to be None (the engine asks it once
        for all the samples of a prompt)."""
        self.enqueue_all([request])

    def enqueue_all(self, requests: list[Request]) -> None:
        """enqueue of each request, in order. Their prompts' int64 arrays are made now, between steps (the prefill
        step slices them, hash_prompt reads them), in one conversion: a job adds hundreds of rows at a time, and
        each prompt_array is a view of one array holding them all."""
        prompt_bytes = prompt_arrays(requests)
        max_model_len, hash_prompt = self.config.max_model_len, self.block_manager.hash_prompt
        for request, own_bytes in zip(requests, prompt_bytes, strict=True):
            request.status = RequestStatus.WAITING
            params = request.sampling_params
            request.max_num_outputs = min(params.max_tokens, max_model_len - len(request.prompt_token_ids))
            eos = () if request.eos_token_id is None or params.ignore_eos else (request.eos_token_id,)
            request.stop_token_set = frozenset((*eos, *params.stop_token_ids))
            hash_prompt(request, own_bytes)
            if request.first_sample is not None and self._waits_for_first_sample(request):
                self._siblings.setdefault(id(request.first_sample), []).append(request)
            else:
                self.waiting.append(request)

    def _waits_for_first_sample(self, request: Request) -> bool:
        """A later sample of a prompt with a full block to share waits until the first sample has cached it."""
        first = request.first_sample
        return (first is not None and first.first_token_time is None and not first.is_finished
                and self.block_manager.enable_prefix_caching and request.use_prefix_cache
                and request.num_prompt_tokens > self.block_manager.block_size)

    def schedule(self) -> SchedulerOutput:
        """The next step. Each step the engine schedules is launched (`advance`) before the next is scheduled."""
        step = _StepBuilder(budget=self.config.max_num_batched_tokens)
        if self.config.mixed_prefill_decode:
            self._schedule_every_running(step, prefills=True)
            self._admit_waiting(step)
        else:
            if self._wants_prefill_step():
                uncut_tail = self.config.max_num_batched_tokens // UNCUT_TAIL_SHARE if self._decoding() else 0
                self._schedule_running(step, decodes=False, prefills=True)
                self._admit_waiting(step, uncut_tail)
            if not step.decodes and not step.prefills:
                self._schedule_every_running(step, prefills=False)
        self._previous_decodes = None  # set again when this step is launched
        return step.build(self.num_finished)

    def advance(self, output: SchedulerOutput) -> None:
        """The step is launched: its tokens count as computed, and each sampled token gets a pending slot."""
        # The decodes come first, each one token that samples; then the prefill chunks.
        requests, first_chunk = output.requests, output.num_decode_tokens
        # A step of decodes alone is one the next step may repeat.
        self._previous_decodes = output.decode_rows if not output.num_prefill_tokens else None
        for request in islice(requests, first_chunk):
            request.num_computed_tokens += 1
            request.output_token_ids.append(PENDING_TOKEN)
        if first_chunk == len(requests):
            return
        chunks = requests[first_chunk:]
        for request, num_tokens, samples in zip(chunks, output.num_scheduled_tokens[first_chunk:],
                                                output.samples[first_chunk:], strict=True):
            request.num_computed_tokens += num_tokens
            if samples:
                request.output_token_ids.append(PENDING_TOKEN)
        # A request whose KV now lacks only its last token decodes from here on: one that samples, or a recompute
        # whose chunk stopped one token short of its sequence.
        prefilling = self._prefilling
        if prefilling:
            for request, samples in zip(chunks, output.samples[first_chunk:], strict=True):
                if samples or request.is_decoding:
                    prefilling.pop(id(request), None)

    def commit(self, output: SchedulerOutput, sampled_token_ids: list[int]) -> list[Request]:
        """The step's sampled ids arrived: fills the pending slots; returns the requests that finished.

        Runs for every request of every step: the decode rows are committed by array operations over their rows
        (`_commit_decodes`), less those that finished since the step was built (their tokens are discarded); the
        other rows by a loop whose checks are inlined, which offers a request's prompt blocks to the prefix cache as a
        chunk fills them."""
        now = time.perf_counter()
        finished: list[Request] = []
        first_row = 0
        decode_rows = output.decode_rows
        if decode_rows is not None and output.num_finished_at_schedule is not None:
            first_row = len(decode_rows.requests)
            if output.num_finished_at_schedule == self.num_finished:
                self._commit_decodes(decode_rows, output.output_slots, sampled_token_ids, finished, now)
            else:
                finished_status = RequestStatus.FINISHED
                live = [row for row, request in enumerate(decode_rows.requests)
                        if request.status is not finished_status]
                if live:
                    self._commit_decodes(decode_rows.take(np.array(live)),
                                         list(map(output.output_slots.__getitem__, live)),
                                         list(map(sampled_token_ids.__getitem__, live)), finished, now)
        if first_row < len(output.requests):
            self._commit_rows(output, sampled_token_ids, first_row, finished, now)
        if finished:
            finished_status = RequestStatus.FINISHED
            self.running = [request for request in self.running if request.status is not finished_status]
        return finished

    def _commit_decodes(self, rows: DecodeRows, output_slots: list[int], sampled_token_ids: list[int],
                        finished: list[Request], now: float) -> None:
        """_commit_rows for a step's decode rows (its first rows; output_slots and sampled_token_ids go on past
        them), none of which has finished since the step was built. Each decode samples, and its request has
        committed a token before (so its first_token_time is set); the blocks decodes fill go to the prefix cache
        when the request's blocks are freed (BlockManager.free), not here."""
        requests = rows.requests
        num_rows = len(requests)
        token_ids = sampled_token_ids if len(sampled_token_ids) == num_rows else sampled_token_ids[:num_rows]
        for request, slot, token_id in zip(requests, output_slots, token_ids, strict=False):
            request.output_token_ids[slot] = token_id
        stop_token_set = rows.stop_token_set
        if stop_token_set is None:
            stopped = [row for row, (request, token_id) in enumerate(zip(requests, token_ids, strict=True))
                       if token_id in request.stop_token_set]
        elif stop_token_set.isdisjoint(token_ids):  # most steps
            stopped = []
        else:
            stopped = [row for row, token_id in enumerate(token_ids) if token_id in stop_token_set]
        ended = np.flatnonzero(rows.output_slots >= rows.max_num_outputs - 1).tolist()  # slot + 1 outputs
        if not stopped and not ended:
            return
        stopped_rows = set(stopped)
        for row in sorted(stopped_rows.union(ended)):
            request = requests[row]
            self._mark_finished(request, "stop" if row in stopped_rows else "length", now)
            finished.append(request)

    def _commit_rows(self, output: SchedulerOutput, sampled_token_ids: list[int], first_row: int,
                     finished: list[Request], now: float) -> None:
        """commit of the step's rows from first_row on."""
        block_manager = self.block_manager
        caching, block_size = block_manager.enable_prefix_caching, block_manager.block_size
        finished_status = RequestStatus.FINISHED
        rows = zip(output.requests, output.samples, output.output_slots, output.computed_ends, sampled_token_ids,
                   strict=True)
        for request, samples, slot, computed_end, token_id in islice(rows, first_row, None):
            if request.status is finished_status:  # it ended at an earlier step: this token is discarded
                continue
            if caching and (prompt_end := min(computed_end, request.num_prompt_tokens)) // block_size \
                    > request.num_hashed_blocks:
                # A request preempted since this step was launched has no blocks and num_computed_tokens 0.
                block_manager.cache_full_blocks(request, min(prompt_end, request.num_computed_tokens))
            if not samples:
                continue
            max_num_outputs = request.max_num_outputs
            if max_num_outputs == 0 and request.sampling_params.max_tokens == 0:
                # scoring: its prompt is computed, the prompt logprobs are the result
                self._mark_finished(request, "length", now)
                finished.append(request)
                if self._siblings:
                    self._release_siblings(request)
                continue
            request.output_token_ids[slot] = token_id
            if request.first_token_time is None:
                request.first_token_time = now
                if self._siblings:
                    self._release_siblings(request)
            if token_id in request.stop_token_set:
                reason = "stop"
            elif slot >= max_num_outputs - 1:  # slot + 1 outputs
                reason = "length"
            else:
                continue
            self._mark_finished(request, reason, now)
            finished.append(request)

    def finish_request(self, request: Request, reason: str) -> None:
        """Ends a request the engine decided to stop (a stop string in its detokenized text)."""
        if request.status == RequestStatus.RUNNING:
            _remove_identical(self.running, request)
        self._mark_finished(request, reason, time.perf_counter())

    def _mark_finished(self, request: Request, reason: str, now: float) -> None:
        if request.status is RequestStatus.WAITING:  # preempted while its last token was still pending
            _remove_identical(self.waiting, request)
        self._prefilling.pop(id(request), None)
        request.status = RequestStatus.FINISHED
        self.num_finished += 1
        request.finish_reason = reason
        request.finish_time = now
        request.drop_pending_tokens()
        self.block_manager.free(request)

    def _release_siblings(self, first_sample: Request) -> None:
        """The later samples waiting for this first sample's prompt blocks go to the front of the queue."""
        self.waiting.extendleft(reversed(self._siblings.pop(id(first_sample), [])))

    def _wants_prefill_step(self) -> bool:
        if self._prefilling:
            return True
        if not self.waiting or len(self.running) >= self.config.max_num_seqs:
            return False
        if self.running and not self._admission_worth_a_step():
            return False
        head = self.waiting[0]
        cached_blocks = self.block_manager.lookup_prefix(head).block_ids
        num_new = self._admission_tokens(head, cached_blocks, self.config.max_num_batched_tokens)
        return self.block_manager.can_allocate(head, num_new, cached_blocks)

    def _decoding(self) -> bool:
        """Whether a running request will decode: one not mid-prefill whose pending token does not end it (a job of
        max_tokens 1 never decodes)."""
        prefilling = self._prefilling
        return any(id(request) not in prefilling and len(request.output_token_ids) < request.max_num_outputs
                   for request in self.running)

    def _admission_worth_a_step(self) -> bool:
        """Whether a prefill step that interrupts the running decodes would admit enough: admit_rows rows (or every
        waiting one, when fewer wait), or waiting prompts whose tokens fill the step's budget."""
        free_slots = self.config.max_num_seqs - len(self.running)
        if free_slots >= min(self.config.admit_rows, len(self.waiting)):
            return True
        tokens, budget = 0, self.config.max_num_batched_tokens
        for request in islice(self.waiting, free_slots):
            tokens += request.num_tokens
            if tokens >= budget:
                return True
        return False

    def _admission_tokens(self, request: Request, cached_blocks: list[int], budget: int) -> int:
        """How many of a waiting request's tokens after its cached blocks fit the budget."""
        return min(request.num_tokens - len(cached_blocks) * self.block_manager.block_size, budget)

    def _schedule_every_running(self, step: _StepBuilder, prefills: bool) -> None:
        """_schedule_running(step, decodes=True, prefills), by its decode-only loop where that is the same: no
        request is mid-prefill and the budget holds a token for each."""
        if not self._prefilling and step.budget >= len(self.running):
            if not self._repeat_decodes(step):
                self._schedule_decodes(step)
        else:
            self._schedule_running(step, decodes=True, prefills=prefills)

    def _schedule_running(self, step: _StepBuilder, decodes: bool, prefills: bool) -> None:
        """Schedules running requests in admission order: decodes (1 token each), prefills (a chunk each), or both.

        A decode step asks this of every running request, so the checks are inlined; a prefill step without decodes
        goes through the prefilling requests alone."""
        prefilling, running_status = self._prefilling, RequestStatus.RUNNING
        # Preemption pops the latest admitted requests off `running`: iterating it directly they are never reached;
        # in the copy of the prefilling ones their status says they left.
        candidates = self.running if decodes else list(prefilling.values())
        block_size = self.block_manager.block_size
        # The step's decode rows and budget, kept in locals: this loop runs for every row of a decode step.
        add_decode, add_end, add_slot = step.decodes.append, step.decode_ends.append, step.decode_slots.append
        budget = step.budget
        for request in candidates:
            if budget <= 0:
                break
            if request.status is not running_status:
                continue
            decoding = not prefilling or id(request) not in prefilling
            if not (decodes if decoding else prefills):
                continue
            num_outputs = len(request.output_token_ids)
            if num_outputs and num_outputs >= request.max_num_outputs:
                continue  # its pending token ends it, whatever the token is
            num_computed = request.num_computed_tokens
            num_new = 1 if decoding else min(len(request.prompt_token_ids) + num_outputs - num_computed, budget)
            # Most decodes: the token fits the request's last block.
            if (num_computed + num_new > len(request.block_ids) * block_size
                    and not self._allocate_or_preempt(request, num_new, step)):
                break  # it preempted itself: it was the last running request
            if decoding:
                add_decode(request)
                add_end(num_computed + 1)
                add_slot(num_outputs)
                budget -= 1
            else:
                step.add_prefill(request, num_computed, num_new)
                budget -= num_new
        step.budget = budget

    def _schedule_decodes(self, step: _StepBuilder) -> None:
        """Every running request's decode (most decode steps; see _schedule_every_running): _schedule_running's loop
        without its budget and prefill checks, which could not stop or skip a request here."""
        running_status, block_size = RequestStatus.RUNNING, self.block_manager.block_size
        decodes, ends, slots = step.decodes, step.decode_ends, step.decode_slots
        num_scheduled = len(decodes)
        # Preemption pops the latest admitted requests off `running`: iterating it directly they are never reached.
        for request in self.running:
            if request.status is not running_status:
                continue
            num_outputs = len(request.output_token_ids)
            if num_outputs and num_outputs >= request.max_num_outputs:
                continue  # its pending token ends it, whatever the token is
            num_computed = request.num_computed_tokens
            # Most decodes: the token fits the request's last block.
            if (num_computed >= len(request.block_ids) * block_size
                    and not self._allocate_or_preempt(request, 1, step)):
                break  # it preempted itself: it was the last running request
            decodes.append(request)
            ends.append(num_computed + 1)
            slots.append(num_outputs)
        step.budget -= len(decodes) - num_scheduled

    def _repeat_decodes(self, step: _StepBuilder) -> bool:
        """_schedule_decodes with array operations, where the running requests are the previous step's decodes, or
        those of them still running, in the same order (most decode steps): each decodes again, its computed end and
        output slot one further, save those whose pending token ends them (they leave the step). False, scheduling
        nothing, where that does not hold or the step would differ from _schedule_decodes': more requests starting a
        block than there are free blocks (the general loop preempts)."""
        previous, running = self._previous_decodes, self.running
        if previous is None or len(running) > len(previous.requests):
            return False
        rows = previous.next_step()
        # Requests that finished since the previous step have left `running`, the others keeping their order; after
        # a preemption or an admission `running` is something else, which the general loop schedules.
        ending = rows.output_slots >= rows.max_num_outputs  # its pending token ends it, whatever the token is
        if len(running) == len(previous.requests):
            if not all(map(operator.is_, previous.requests, running)):
                return False
            previous_rows = np.flatnonzero(~ending) if ending.any() else np.arange(len(running))
        else:
            running_status = RequestStatus.RUNNING
            kept = [row for row, request in enumerate(previous.requests) if request.status is running_status]
            if len(kept) != len(running) or not all(map(operator.is_, map(previous.requests.__getitem__, kept),
                                                         running)):
                return False
            still_running = np.array(kept, dtype=np.int64)
            previous_rows = still_running[~ending[still_running]]
        if not len(previous_rows):
            return False
        if len(previous_rows) < len(previous.requests):
            rows = rows.take(previous_rows)
        # The new token's position is the previous computed end. The previous step's token, one position before, fit
        # the request's blocks, so the new one needs a block only at a block's start, and then only if the
        # request's blocks end there.
        positions, requests, block_manager = rows.computed_ends - 1, rows.requests, self.block_manager
        block_size = block_manager.block_size
        starting = np.flatnonzero(positions % block_size == 0).tolist()
        grown_rows = [row for row in starting if positions[row] >= len(requests[row].block_ids) * block_size]
        if len(grown_rows) > block_manager.num_free_blocks:
            return False
        block_manager.append_blocks([requests[row] for row in grown_rows])
        step.decodes, step.decode_ends, step.decode_slots = requests, rows.computed_ends.tolist(), \
            rows.output_slots.tolist()
        step.repeated, step.grown_rows, step.previous_rows = rows, grown_rows, previous_rows
        step.same_rows = len(previous_rows) == len(previous.requests)
        step.budget -= len(requests)
        return True

    def _allocate_or_preempt(self, request: Request, num_new: int, step: _StepBuilder) -> bool:
        """Allocates blocks for the request's next tokens, preempting the latest admitted requests until they fit."""
        while not self.block_manager.try_allocate(request, num_new):
            victim = self.running.pop()
            self._preempt(victim)
            step.preempted.append(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self._prefilling.pop(id(request), None)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def _admit_waiting(self, step: _StepBuilder, uncut_tail: int = 0) -> None:
        """Admits waiting requests FIFO while the budget, the free slots and the free blocks allow. A prefill step may
        admit hundreds of short rows: the loop keeps its state in locals and inlines the per-row checks.
        uncut_tail: a row that would be cut to fit a budget left below this waits, whole, for a later step."""
        waiting = self.waiting
        if step.preempted or not waiting:
            return  # mixed scheduling calls this at every step
        block_manager, block_size = self.block_manager, self.block_manager.block_size
        lookup_admission, try_allocate, add_prefill = (block_manager.lookup_admission, block_manager.try_allocate,
                                                       step.add_prefill)
        running, prefilling = self.running, self._prefilling
        free_slots = self.config.max_num_seqs - len(running)
        in_flight = self._prompt_blocks_in_flight()
        deferred: list[Request] = []
        budget, num_cached_tokens, running_status = step.budget, step.num_cached_tokens, RequestStatus.RUNNING
        while waiting and budget > 0 and free_slots > 0:
            request = waiting[0]
            cached_blocks, next_hash, uncached = lookup_admission(request)
            if next_hash is not None and next_hash in in_flight:
                deferred.append(waiting.popleft())  # it will find that block in the cache instead
                if len(deferred) >= self.config.max_num_seqs:
                    break  # a long queue is not scanned whole at every step
                continue
            num_cached = len(cached_blocks) * block_size
            num_new = len(request.prompt_token_ids) + len(request.output_token_ids) - num_cached
            if num_new > budget:
                if budget < uncut_tail:
                    break
                num_new = budget
            if not try_allocate(request, num_new, cached_blocks):
                break
            waiting.popleft()
            if uncached:
                in_flight |= uncached
            request.num_computed_tokens = num_cached
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_cached
            num_cached_tokens += num_cached
            request.status = running_status
            running.append(request)
            free_slots -= 1
            prefilling[id(request)] = request
            budget -= num_new
            add_prefill(request, num_cached, num_new)
        step.budget, step.num_cached_tokens = budget, num_cached_tokens
        waiting.extendleft(reversed(deferred))

    def _prompt_blocks_in_flight(self) -> set[bytes]:
        """Prompt blocks that running requests compute but have not cached yet (their prompt is not committed)."""
        in_flight: set[bytes] = set()
        for request in self.running:
            if request.first_token_time is None:
                in_flight |= self.block_manager.uncached_prompt_blocks(request)
        return in_flight


def _remove_identical(requests: list[Request] | deque[Request], request: Request) -> None:
    """Removes this very request: list.remove would compare the dataclass field by field with every one before it."""
    for index, other in enumerate(requests):
        if other is request:
            del requests[index]
            return
