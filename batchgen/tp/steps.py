"""Each step as rank 0 sends it to the followers, which rebuild it and run the same ModelRunner.launch on it.

The followers keep a copy of every running request, made from its first step's message, so a step's message carries
only what changed: the scheduler's per-row lists (which say how far each request has computed and how many output
slots it has), the requests new to the followers, the output tokens committed since the last message, the block
ids added, preemptions, the requests released, and the structured-output bitmask. A decode step's message is a few
small lists, one pickle and one broadcast; the followers unpack it while the device still runs the step before.

On a follower the rebuilt step's requests hold what rank 0's held when it launched the step: the committed output
tokens followed by pending slots (whose tokens every rank sampled on its device), the block table, the number of
computed tokens. So the step inputs, graph choices, sampling rows and pending tokens come out the same.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field

import numpy as np

from batchgen.core.prompt_logprobs import PromptLogprobs
from batchgen.core.request import PENDING_TOKEN, Request
from batchgen.core.scheduler import SchedulerOutput
from batchgen.sample.params import SamplingParams
from batchgen.tp.group import ControlChannel
from batchgen.worker.model_runner import BitmaskProvider


@dataclass(slots=True)
class NewRequest:
    """What the followers keep of a request for as long as it runs."""

    ref: int  # its number in the messages
    request_id: int
    sample_index: int
    prompt: np.ndarray  # int64
    sampling_params: SamplingParams
    seed: int | None
    eos_token_id: int | None
    bad_words_token_ids: list[list[int]]


@dataclass(slots=True)
class StepMessage:
    pooling: bool  # a step of an embed or classify engine (ModelRunner.launch_pooling)
    refs: list[int]  # the step's requests, in order
    num_scheduled_tokens: list[int]
    computed_ends: list[int]
    output_slots: list[int]
    samples: list[bool]
    num_prefill_tokens: int
    num_decode_tokens: int
    preempted: list[int]
    released: list[int]  # finished since the last message: their rows are freed first
    new_requests: list[NewRequest] = field(default_factory=list)
    outputs: list[tuple[int, int, list[int]]] = field(default_factory=list)  # (step row, from index, committed ids)
    blocks: list[tuple[int, int, list[int]]] = field(default_factory=list)  # (step row, from index, block ids)
    preemptions: list[tuple[int, int]] = field(default_factory=list)  # (step row, num_preemptions)
    # (step row, the first prompt position without a logprob): where the follower's next prompt logprobs start
    prompt_logprobs: list[tuple[int, int]] = field(default_factory=list)
    bitmask: np.ndarray | None = None


@dataclass(slots=True)
class _Sent:
    """What the followers know of one of rank 0's requests."""

    request: Request  # kept alive, so that its id() stays its own
    ref: int
    outputs: int = 0  # committed output tokens
    blocks: int = 0
    preemptions: int = 0
    prompt_logprobs: int = 0  # the next prompt position without a logprob


def committed_outputs(request: Request) -> int:
    """The output tokens the host knows: all but the trailing pending slots."""
    outputs = request.output_token_ids
    count = len(outputs)
    while count and outputs[count - 1] == PENDING_TOKEN:
        count -= 1
    return count


class StepSender:
    """Rank 0: sends each step before launching it, and the requests finished since."""

    def __init__(self, channel: ControlChannel, bitmask_provider: BitmaskProvider | None = None) -> None:
        self.channel = channel
        self.bitmask_provider = bitmask_provider
        self.bitmask: np.ndarray | None = None  # the latest step's, which rank 0's runner reads too (step_bitmask)
        self._sent: dict[int, _Sent] = {}  # id(request) ->
        self._next_ref = 0
        self._released: list[int] = []

    def step_bitmask(self, requests: list[Request]) -> np.ndarray | None:
        """Rank 0's runner's bitmask provider: the mask already computed for the step, and sent."""
        return self.bitmask

    def send(self, step: SchedulerOutput, pooling: bool = False) -> None:
        message = StepMessage(pooling, [], step.num_scheduled_tokens, step.computed_ends, step.output_slots,
                              step.samples, step.num_prefill_tokens, step.num_decode_tokens,
                              [self._sent[id(r)].ref for r in step.preempted if id(r) in self._sent], self._released)
        self._released = []
        for row, request in enumerate(step.requests):
            message.refs.append(self._changes(message, row, request))
        self.bitmask = None
        if self.bitmask_provider is not None:
            self.bitmask = self.bitmask_provider([r for r, s in zip(step.requests, step.samples, strict=True) if s])
        message.bitmask = self.bitmask
        self.channel.send(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def _changes(self, message: StepMessage, row: int, request: Request) -> int:
        """Adds to the message what the followers lack of the request at this step row; returns its ref."""
        sent = self._sent.get(id(request))
        if sent is None:
            sent = self._sent[id(request)] = _Sent(request, self._next_ref)
            self._next_ref += 1
            message.new_requests.append(NewRequest(sent.ref, request.request_id, request.sample_index,
                                                   request.prompt_array, request.sampling_params, request.seed,
                                                   request.eos_token_id, request.bad_words_token_ids))
        outputs = committed_outputs(request)
        if outputs != sent.outputs:
            start = min(outputs, sent.outputs)
            message.outputs.append((row, start, request.output_token_ids[start:outputs]))
            sent.outputs = outputs
        blocks = request.block_ids
        if request.num_preemptions != sent.preemptions or len(blocks) < sent.blocks:  # recomputed in new blocks
            sent.preemptions = request.num_preemptions
            message.preemptions.append((row, sent.preemptions))
            message.blocks.append((row, 0, list(blocks)))
        elif len(blocks) > sent.blocks:
            message.blocks.append((row, sent.blocks, blocks[sent.blocks:]))
        sent.blocks = len(blocks)
        recorded = request.prompt_logprobs
        if recorded is not None and recorded.next_position != sent.prompt_logprobs:
            sent.prompt_logprobs = recorded.next_position
            message.prompt_logprobs.append((row, sent.prompt_logprobs))
        return sent.ref

    def release(self, requests: list[Request]) -> None:
        """The requests finished: the next message tells the followers to free their rows."""
        for request in requests:
            sent = self._sent.pop(id(request), None)
            if sent is not None:
                self._released.append(sent.ref)

    def stop(self) -> None:
        self.channel.send(pickle.dumps(None))


@dataclass(slots=True)
class _Mirrored:
    request: Request
    committed: int = 0  # leading output tokens known; the rest of output_token_ids are pending slots


class StepMirror:
    """A follower: the copies of rank 0's running requests, and each message made into the step rank 0 launched."""

    def __init__(self) -> None:
        self._requests: dict[int, _Mirrored] = {}  # ref ->
        self.bitmask: np.ndarray | None = None

    def step_bitmask(self, requests: list[Request]) -> np.ndarray | None:
        """The follower's runner's bitmask provider: the mask rank 0 sent with the step."""
        return self.bitmask

    def released(self, message: StepMessage) -> list[Request]:
        """The requests that finished before this step, forgotten here; the caller frees their rows."""
        return [self._requests.pop(ref).request for ref in message.released]

    def step(self, message: StepMessage) -> SchedulerOutput:
        for new in message.new_requests:
            request = Request(new.request_id, new.prompt.tolist(), new.sampling_params, new.eos_token_id,
                              sample_index=new.sample_index, seed=new.seed,
                              bad_words_token_ids=new.bad_words_token_ids)
            request._prompt_array = new.prompt
            self._requests[new.ref] = _Mirrored(request)
        mirrored = [self._requests[ref] for ref in message.refs]
        for row, start, tokens in message.outputs:
            entry = mirrored[row]
            del entry.request.output_token_ids[start:]
            entry.request.output_token_ids.extend(tokens)
            entry.committed = start + len(tokens)
        for row, start, block_ids in message.blocks:
            del mirrored[row].request.block_ids[start:]
            mirrored[row].request.block_ids.extend(block_ids)
        for row, count in message.preemptions:
            mirrored[row].request.num_preemptions = count
        for row, next_position in message.prompt_logprobs:
            # A follower records no values (rank 0 does): it only plans the positions that the step scores.
            request = mirrored[row].request
            request.prompt_logprobs = PromptLogprobs(request.prompt_array, next_position,
                                                     request.sampling_params.prompt_logprobs)
        for entry, end, count, slots in zip(mirrored, message.computed_ends, message.num_scheduled_tokens,
                                            message.output_slots, strict=True):
            entry.request.num_computed_tokens = end - count
            outputs = entry.request.output_token_ids
            del outputs[entry.committed:]
            outputs.extend([PENDING_TOKEN] * (slots - entry.committed))
        self.bitmask = message.bitmask
        return SchedulerOutput([entry.request for entry in mirrored], message.num_scheduled_tokens,
                               [self._requests[ref].request for ref in message.preempted],
                               message.num_prefill_tokens, message.num_decode_tokens,
                               rows=(message.computed_ends, message.output_slots, message.samples))
