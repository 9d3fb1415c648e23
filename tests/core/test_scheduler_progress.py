"""The scheduler always makes progress: every step schedules a token while requests are unfinished, and every
request finishes, whatever the chunk budget, prompt lengths, n, prefix caching, prompt logprobs (scoring requests
with max_tokens=0 included), preemption by a small KV cache, mixed or separate steps, and async scheduling."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from batchgen.core.request import Request, RequestStatus
from batchgen.core.scheduler import Scheduler, SchedulerOutput
from batchgen.sample.params import SamplingParams
from tests.core.test_scheduler import EOS, add_requests, check_invariants, make_scheduler, run_step, scheduled


@dataclass(frozen=True)
class Case:
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    num_blocks: int
    prefix_caching: bool
    mixed: bool
    async_scheduling: bool


def draw_case(rng: random.Random) -> Case:
    block_size, max_model_len = rng.choice([1, 2, 4, 8, 16]), rng.randint(16, 120)
    return Case(block_size=block_size, max_model_len=max_model_len, max_num_seqs=rng.randint(1, 8),
                max_num_batched_tokens=rng.choice([1, 2, 3, rng.randint(4, 40), rng.randint(40, 300)]),
                # Room for one full-length request and at most a few blocks more: preemption is frequent.
                num_blocks=-(-max_model_len // block_size) + rng.randint(0, 4),
                prefix_caching=rng.random() < 0.5, mixed=rng.random() < 0.5, async_scheduling=rng.random() < 0.5)


def draw_prompt_samples(rng: random.Random, request_id: int, max_model_len: int) -> list[Request]:
    """A prompt's n samples as the engine makes them; a prompt_logprobs request takes no prefix-cache hits, and a
    third of them score only (max_tokens=0)."""
    prompt_len = rng.choice([1, max_model_len, rng.randint(1, max_model_len)])
    stream = rng.randrange(3)  # prompts drawn from three token streams share prefixes of every length
    prompt = [stream * 1000 + 10 + k for k in range(prompt_len)]
    prompt_logprobs = rng.choice([None, 0, 2])
    max_tokens = 0 if prompt_logprobs is not None and rng.random() < 0.33 else rng.randint(1, 20)
    params = SamplingParams(max_tokens=max_tokens, prompt_logprobs=prompt_logprobs, ignore_eos=rng.random() < 0.5)
    samples = [Request(request_id, list(prompt), params, eos_token_id=EOS, sample_index=index,
                       use_prefix_cache=prompt_logprobs is None) for index in range(rng.choice([1, 1, 2, 3]))]
    for sample in samples[1:]:
        sample.first_sample = samples[0]
    return samples


def step_bound(requests: list[Request]) -> int:
    """Steps the requests may take: each one's prompt and outputs, a token per step, 8 times over. A one-token
    budget with a cache that preempts at every other step takes up to 6 times (measured over 300 seeds): the
    recomputes after preemption; a stall or a request that never advances exceeds any such bound."""
    return 8 * sum(r.num_prompt_tokens + r.sampling_params.max_tokens for r in requests)


@pytest.mark.parametrize("seed", range(60))
def test_every_step_schedules_a_token_and_every_request_finishes(seed):
    rng = random.Random(seed)
    case = draw_case(rng)
    scheduler = make_scheduler(case.max_num_seqs, case.max_num_batched_tokens, case.max_model_len, case.num_blocks,
                               case.block_size, case.mixed, case.prefix_caching)
    prompts = [draw_prompt_samples(rng, request_id, case.max_model_len) for request_id in range(30)]
    every_request = [sample for samples in prompts for sample in samples]
    added_at: dict[tuple[int, int], int] = {}
    finished_at: dict[tuple[int, int], int] = {}
    in_flight: SchedulerOutput | None = None
    steps = 0
    while prompts or scheduler.has_unfinished_requests() or in_flight is not None:
        num_arriving = rng.randint(0, 3)
        for sample in (sample for samples in prompts[:num_arriving] for sample in samples):
            scheduler.add_request(sample)
            added_at[sample.key] = steps
        del prompts[:num_arriving]
        launched = None
        if scheduler.has_unfinished_requests():
            output = scheduler.schedule()
            # Async scheduling may find every running request ending with its pending token: the step in flight
            # is then committed instead. Otherwise an empty step while requests are unfinished is a stall.
            assert output.num_tokens > 0 or in_flight is not None, f"an empty step at step {steps}"
            if output.num_tokens:
                check_invariants(scheduler, output, case.mixed)
                scheduler.advance(output)
                launched = output
        to_commit, in_flight = (in_flight, launched) if case.async_scheduling else (launched, None)
        if to_commit is not None:
            sampled = [rng.choice([EOS, rng.randint(1000, 2000)]) if samples else -1 for samples in to_commit.samples]
            for request in scheduler.commit(to_commit, sampled):
                finished_at[request.key] = steps
        steps += 1
        assert steps <= step_bound(every_request), "the scheduler does not progress"
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_total_blocks
    for request in every_request:
        assert request.status == RequestStatus.FINISHED and request.finish_reason in ("length", "stop")
        params = request.sampling_params
        if params.max_tokens == 0:
            assert request.output_token_ids == []
        else:
            assert 1 <= request.num_output_tokens <= params.max_tokens
        # Each request finishes within the steps that the requests added up to its finish could take.
        alive = [r for r in every_request if added_at[r.key] <= finished_at[request.key]]
        assert finished_at[request.key] - added_at[request.key] <= step_bound(alive)


# -- the stalls this test found ---------------------------------------------------------------------------------


def scheduled_steps(scheduler: Scheduler, max_steps: int = 10) -> list[dict[int, int]]:
    """Each step's scheduled tokens per request id, until every request finishes (at most max_steps)."""
    steps = []
    while scheduler.has_unfinished_requests() and len(steps) < max_steps:
        output, _ = run_step(scheduler)
        steps.append(scheduled(output))
    return steps


@pytest.mark.parametrize("mixed", [False, True])
def test_a_scoring_request_longer_than_the_budget_is_prefilled_in_chunks(mixed):
    """max_tokens=0: the request has no output yet, so no pending token can end it before its prompt is done."""
    scheduler = make_scheduler(max_num_batched_tokens=16, mixed=mixed)
    (request,) = add_requests(scheduler, [40], max_tokens=0, prompt_logprobs=1)
    assert scheduled_steps(scheduler) == [{0: 16}, {0: 16}, {0: 8}]
    assert request.finish_reason == "length" and request.output_token_ids == []


def test_a_prompt_of_max_model_len_tokens_is_prefilled_in_chunks():
    scheduler = make_scheduler(max_num_batched_tokens=16, max_model_len=40)
    (request,) = add_requests(scheduler, [40], max_tokens=4)
    assert scheduled_steps(scheduler) == [{0: 16}, {0: 16}, {0: 8}]
    assert request.finish_reason == "length" and request.num_output_tokens == 1


def test_the_later_samples_of_a_scoring_prompt_join_when_the_first_finishes():
    """Scoring samples that share prompt blocks wait for the first sample's; it finishes without a token."""
    scheduler = make_scheduler(block_size=4)
    params = SamplingParams(max_tokens=0, prompt_logprobs=0)
    first, second = (Request(0, list(range(10, 20)), params, sample_index=i) for i in range(2))
    second.first_sample = first
    scheduler.add_request(first)
    scheduler.add_request(second)
    assert list(scheduler.waiting) == [first]
    run_step(scheduler)
    assert first.is_finished and list(scheduler.waiting) == [second]
    output, _ = run_step(scheduler)
    assert output.num_cached_tokens == 8 and second.is_finished


def run_workload(seed: int) -> list[tuple]:
    """The steps of the seed's workload (drawn as in the progress test), each as its rows and preemptions."""
    rng = random.Random(seed)
    case = draw_case(rng)
    scheduler = make_scheduler(case.max_num_seqs, case.max_num_batched_tokens, case.max_model_len, case.num_blocks,
                               case.block_size, case.mixed, case.prefix_caching)
    prompts = [draw_prompt_samples(rng, request_id, case.max_model_len) for request_id in range(30)]
    steps: list[tuple] = []
    in_flight: SchedulerOutput | None = None
    while prompts or scheduler.has_unfinished_requests() or in_flight is not None:
        num_arriving = rng.randint(0, 3)
        for sample in (sample for samples in prompts[:num_arriving] for sample in samples):
            scheduler.add_request(sample)
        del prompts[:num_arriving]
        launched = None
        if scheduler.has_unfinished_requests():
            output = scheduler.schedule()
            steps.append(([r.key for r in output.requests], output.num_scheduled_tokens, output.computed_ends,
                          output.output_slots, output.samples, [r.key for r in output.preempted]))
            if output.num_tokens:
                scheduler.advance(output)
                launched = output
        to_commit, in_flight = (in_flight, launched) if case.async_scheduling else (launched, None)
        if to_commit is not None:
            sampled = [rng.choice([EOS, rng.randint(1000, 2000)]) if samples else -1 for samples in to_commit.samples]
            scheduler.commit(to_commit, sampled)
    return steps


@pytest.mark.parametrize("seed", range(60))
def test_the_decode_loop_schedules_as_the_general_one(seed, monkeypatch):
    """Scheduler._schedule_decodes, the loop of most decode steps, against _schedule_running's general loop."""
    fast = run_workload(seed)
    monkeypatch.setattr(Scheduler, "_schedule_decodes",
                        lambda self, step: Scheduler._schedule_running(self, step, decodes=True, prefills=False))
    assert fast == run_workload(seed)
