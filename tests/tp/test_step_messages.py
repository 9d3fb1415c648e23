"""Step messages in one process: rank 0's scheduler runs a job with chunked prefill, preemption, prefix caching and
async scheduling (one step in flight); at every launch the step a follower rebuilds from the messages holds, request
by request, what rank 0's holds: output tokens and pending slots, blocks, computed tokens, preemptions."""

from __future__ import annotations

import pickle

import numpy as np

from batchgen.core.prompt_logprobs import PromptLogprobs
from batchgen.core.request import Request
from batchgen.core.scheduler import SchedulerOutput
from batchgen.sample.params import SamplingParams
from batchgen.tp.steps import StepMirror, StepSender
from tests.core.test_scheduler import EOS, add_requests, fake_token, make_scheduler


class RecordingChannel:
    def __init__(self) -> None:
        self.payloads: list[bytes] = []

    def send(self, payload: bytes) -> None:
        self.payloads.append(payload)


def state(request: Request) -> tuple:
    scored_from = None if request.prompt_logprobs is None else request.prompt_logprobs.next_position
    return (request.request_id, request.sample_index, request.prompt_token_ids, request.output_token_ids,
            request.block_ids, request.num_computed_tokens, request.num_preemptions, request.eos_token_id, scored_from)


def record_prompt_logprobs(request: Request, num_scheduled_tokens: int) -> None:
    """As the engine records a step's prompt logprobs: the positions the step scored, values made up."""
    recorded = request.prompt_logprobs
    count = min(num_scheduled_tokens, request.num_prompt_tokens - recorded.next_position)
    if count > 0:
        recorded.record(recorded.next_position, np.zeros(count, np.float32), np.ones(count, np.int32),
                        np.zeros((count, 1), np.int32), np.zeros((count, 1), np.float32))


def rebuilt_like(rebuilt: SchedulerOutput, step: SchedulerOutput) -> None:
    assert [state(r) for r in rebuilt.requests] == [state(r) for r in step.requests]
    # A preempted request is brought up to date when it runs again; the step names it for the pooler's rows.
    assert [r.key for r in rebuilt.preempted] == [r.key for r in step.preempted]
    for name in ("num_scheduled_tokens", "computed_ends", "output_slots", "samples", "num_prefill_tokens",
                 "num_decode_tokens"):
        assert getattr(rebuilt, name) == getattr(step, name), name


def test_the_rebuilt_steps_hold_rank_0s_requests_through_preemption_and_prefix_caching():
    scheduler = make_scheduler(max_num_seqs=6, max_num_batched_tokens=24, num_blocks=24, block_size=4)
    requests = add_requests(scheduler, [9, 17, 5, 12, 9, 30, 3, 14], max_tokens=14, prompt_logprobs=1)
    shared = [Request(100 + i, [7] * 16, SamplingParams(max_tokens=10), eos_token_id=EOS) for i in range(4)]
    for request in shared:  # one prompt: its blocks come from the prefix cache
        scheduler.add_request(request)
    requests += shared
    for request in requests[:8]:
        request.prompt_logprobs = PromptLogprobs(request.prompt_array, 1, 1)  # the first prompt token has none
    channel, mirror = RecordingChannel(), StepMirror()
    sender = StepSender(channel)
    released: list[Request] = []  # on the follower's side, in the order it frees them
    in_flight: SchedulerOutput | None = None
    while scheduler.has_unfinished_requests() or in_flight is not None:
        step = scheduler.schedule() if scheduler.has_unfinished_requests() else None
        if step is not None and not step.is_empty:
            sender.send(step)
            message = pickle.loads(channel.payloads[-1])
            released += mirror.released(message)
            rebuilt_like(mirror.step(message), step)
            scheduler.advance(step)
        else:
            step = None
        if in_flight is not None:  # async scheduling: the step before is committed after this one is launched
            for request, count in zip(in_flight.requests, in_flight.num_scheduled_tokens, strict=True):
                if request.prompt_logprobs is not None:
                    record_prompt_logprobs(request, count)
            tokens = [fake_token(r) if sampled else -1 for r, sampled in zip(in_flight.requests, in_flight.samples,
                                                                             strict=True)]
            sender.release(scheduler.commit(in_flight, tokens))
        in_flight = step
    assert sum(r.num_preemptions for r in requests) > 0 and sum(r.num_cached_tokens for r in requests) > 0
    assert all(r.is_finished for r in requests)
    # Freed on the follower in the message after they finish; the last to finish have no message after them.
    assert 0 < len(released) < len(requests) and len({id(r) for r in released}) == len(released)
