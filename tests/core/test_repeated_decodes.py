"""A decode step of the previous step's rows, or of those still running, scheduled from that step's arrays
(`Scheduler._repeat_decodes`), is the step the general decode loop schedules; a step's decode rows committed from its
arrays (`Scheduler._commit_decodes`), less those finished since the step was built, end as the general commit loop ends
them: random workloads run through both, compared step by step and token for token."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from batchgen.config import EngineConfig
from batchgen.core.block_manager import BlockManager
from batchgen.core.request import Request
from batchgen.core.scheduler import Scheduler, SchedulerOutput
from batchgen.sample.params import SamplingParams

EOS = 2


class GeneralScheduler(Scheduler):
    """Every decode step through the general loops."""

    def _repeat_decodes(self, step) -> bool:
        return False


class RowByRowCommits(Scheduler):
    """Every row of every step committed through the general loop."""

    def commit(self, output: SchedulerOutput, sampled_token_ids: list[int]) -> list[Request]:
        output.num_finished_at_schedule = None  # as for a step the scheduler did not build
        return super().commit(output, sampled_token_ids)


class CountedCommits(Scheduler):
    """Counts the steps whose decode rows were committed from their arrays, and those of them committed after some of
    their requests had finished."""

    array_commits = 0
    commits_after_finishes = 0

    def commit(self, output: SchedulerOutput, sampled_token_ids: list[int]) -> list[Request]:
        if output.decode_rows is not None and output.num_finished_at_schedule not in (None, self.num_finished):
            self.commits_after_finishes += 1
        return super().commit(output, sampled_token_ids)

    def _commit_decodes(self, *args) -> None:
        self.array_commits += 1
        super()._commit_decodes(*args)


@dataclass(frozen=True)
class Workload:
    seed: int
    num_prompts: int
    num_blocks: int  # few: preemptions
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    mixed: bool
    prefix_caching: bool
    async_order: bool  # schedule and launch step N+1 before committing step N, as the engine's async scheduling


def make_requests(workload: Workload) -> list[Request]:
    rng = random.Random(workload.seed)
    shared = [rng.randrange(3, 50) for _ in range(3 * workload.block_size)]  # a prefix some prompts start with
    requests = []
    for request_id in range(workload.num_prompts):
        own = [rng.randrange(3, 50) for _ in range(rng.randrange(1, 3 * workload.block_size))]
        prompt = shared[:rng.randrange(len(shared))] + own if rng.random() < 0.4 else own
        params = SamplingParams(max_tokens=rng.choice([1, 2, 5, 9, 17, 30]), n=rng.choice([1, 1, 1, 2, 3]),
                                ignore_eos=rng.random() < 0.2,
                                stop_token_ids=[7] if rng.random() < 0.3 else [])
        first = None
        for sample_index in range(params.n):
            request = Request(request_id, list(prompt), params, eos_token_id=EOS, sample_index=sample_index,
                              first_sample=first)
            first = first or request
            requests.append(request)
    return requests


def sampled_token(request: Request, slot: int) -> int:
    """A token depending on the request and the output slot alone, so both schedulers see the same tokens: an end
    (EOS, or the stop id 7) now and then, and otherwise ids that form repeated blocks for the prefix cache."""
    value = (request.request_id * 131 + request.sample_index * 17 + slot * 29) % 97
    if value < 3:
        return EOS
    if value < 6:
        return 7
    return 10 + value % 5


def step_summary(output: SchedulerOutput) -> tuple:
    return ([r.key for r in output.requests], output.num_scheduled_tokens, output.computed_ends, output.output_slots,
            output.samples, [r.key for r in output.preempted], output.num_cached_tokens)


@dataclass
class Run:
    steps: list[tuple]  # step_summary of each step
    cached_blocks: list[int]  # the prefix cache's blocks after each commit
    finished: list[list[tuple[int, int]]]  # the requests each commit finished, in its order
    outcomes: dict[tuple[int, int], tuple]  # each request's tokens, finish reason, preemptions and cached tokens
    repeated: int  # steps that repeated the previous step's rows
    carried: int  # steps that repeated some of them, the others having left
    scheduler: Scheduler


def run(scheduler_type: type[Scheduler], workload: Workload) -> Run:
    config = EngineConfig(max_num_seqs=workload.max_num_seqs, max_num_batched_tokens=workload.max_num_batched_tokens,
                          max_model_len=256, mixed_prefill_decode=workload.mixed)
    scheduler = scheduler_type(config, BlockManager(workload.num_blocks, workload.block_size,
                                                    workload.prefix_caching))
    requests = make_requests(workload)
    rng = random.Random(workload.seed + 1)
    pending_arrivals = list(requests)
    steps, repeated, carried, in_flight = [], 0, 0, None
    cached_blocks: list[int] = []
    finished: list[list[tuple[int, int]]] = []

    def commit(output: SchedulerOutput) -> None:
        sampled = [sampled_token(r, slot) if samples else -1
                   for r, slot, samples in zip(output.requests, output.output_slots, output.samples, strict=True)]
        finished.append([request.key for request in scheduler.commit(output, sampled)])
        cached_blocks.append(scheduler.block_manager.num_cached_blocks)  # the blocks each commit offered the cache
        for request, samples in zip(output.requests, output.samples, strict=True):
            # A stop string found in the text: the engine ends the request after the commit.
            if samples and not request.is_finished and request.output_token_ids[-1] == 13 and rng.random() < 0.5:
                scheduler.finish_request(request, "stop")

    while pending_arrivals or scheduler.has_unfinished_requests() or in_flight is not None:
        for _ in range(rng.randrange(0, 4) if len(steps) % 5 == 0 else 0):  # rows arrive between steps
            if pending_arrivals:
                scheduler.add_request(pending_arrivals.pop(0))
        if not scheduler.has_unfinished_requests() and pending_arrivals:
            scheduler.add_request(pending_arrivals.pop(0))
        output = scheduler.schedule() if scheduler.has_unfinished_requests() else None
        if output is not None and output.is_empty:
            output = None
        if output is not None:
            steps.append(step_summary(output))
            repeated += output.same_rows_as_previous
            carried += output.previous_rows is not None and not output.same_rows_as_previous
            scheduler.advance(output)
        if workload.async_order:
            if in_flight is not None:
                commit(in_flight)
            in_flight = output
        elif output is not None:
            commit(output)
        assert len(steps) < 5000
    outcomes = {r.key: (r.output_token_ids, r.finish_reason, r.num_preemptions, r.num_cached_tokens)
                for r in requests}
    return Run(steps, cached_blocks, finished, outcomes, repeated, carried, scheduler)


WORKLOADS = [
    Workload(seed, num_prompts=40, num_blocks=num_blocks, block_size=4, max_num_seqs=max_num_seqs,
             max_num_batched_tokens=budget, mixed=mixed, prefix_caching=caching, async_order=async_order)
    for seed, (num_blocks, max_num_seqs, budget, mixed, caching, async_order) in enumerate([
        (400, 16, 256, False, True, True),
        (400, 16, 256, False, True, False),
        (24, 12, 64, False, True, True),  # a tiny cache: preemptions
        (20, 12, 64, True, True, True),
        (24, 8, 32, True, False, False),
        (400, 32, 24, True, True, True),  # a small budget: chunked prefills beside the decodes
        (40, 16, 128, False, False, True),
    ])
]


@pytest.mark.parametrize("workload", WORKLOADS, ids=lambda w: f"seed{w.seed}")
def test_repeated_decode_steps_equal_the_general_loop(workload):
    arrays, general = run(Scheduler, workload), run(GeneralScheduler, workload)
    assert arrays.repeated > 0 and general.repeated == 0  # the workload exercises the array path
    assert general.carried == 0
    assert arrays.steps == general.steps
    assert arrays.cached_blocks == general.cached_blocks
    assert arrays.outcomes == general.outcomes
    assert {reason for _, reason, _, _ in arrays.outcomes.values()} >= {"length", "stop"}


@pytest.mark.parametrize("workload", WORKLOADS, ids=lambda w: f"seed{w.seed}")
def test_decode_rows_committed_from_arrays_equal_the_general_loop(workload):
    arrays, general = run(CountedCommits, workload), run(RowByRowCommits, workload)
    assert arrays.scheduler.array_commits > 0  # the workload exercises the array path
    assert arrays.steps == general.steps
    assert arrays.cached_blocks == general.cached_blocks
    assert arrays.finished == general.finished
    assert arrays.outcomes == general.outcomes
    arrays_cache, general_cache = arrays.scheduler.block_manager, general.scheduler.block_manager
    assert arrays_cache.block_hashes == general_cache.block_hashes
    assert arrays_cache.ref_counts == general_cache.ref_counts
    assert list(arrays_cache._free) == list(general_cache._free)


def test_steps_whose_rows_left_are_scheduled_from_arrays():
    """Rows end at different steps in every workload above: their equality covers the steps that carry the rows still
    running over from the previous step's arrays."""
    assert all(run(Scheduler, workload).carried > 0 for workload in WORKLOADS)


def test_decode_rows_are_committed_after_some_of_their_requests_finished():
    """The equality above covers commits that leave out requests finished since their step was built."""
    assert sum(run(CountedCommits, workload).scheduler.commits_after_finishes for workload in WORKLOADS) > 0


def test_preemptions_happen_in_the_tiny_cache_workloads():
    """The workloads above that should preempt do, so their equality covers preemption."""
    preempted = [any(step[5] for step in run(Scheduler, workload).steps) for workload in WORKLOADS]
    assert preempted[2] and preempted[3]


def test_a_repeated_step_grows_the_rows_whose_token_starts_a_block():
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    scheduler = Scheduler(config, BlockManager(100, 4, False))
    short, long = (Request(i, [5] * length, SamplingParams(max_tokens=10, ignore_eos=True), eos_token_id=EOS)
                   for i, length in ((0, 2), (1, 3)))
    scheduler.add_request(short)
    scheduler.add_request(long)
    outputs = []
    for _ in range(4):
        output = scheduler.schedule()
        scheduler.advance(output)
        scheduler.commit(output, [9] * output.num_seqs)
        outputs.append(output)
    prefill, first_decode, second, third = outputs
    assert not first_decode.same_rows_as_previous  # the previous step was a prefill
    # Positions 3 and 4 (short), 4 and 5 (long): block 1 starts at position 4.
    assert second.same_rows_as_previous and second.grown_rows == [1]
    assert third.same_rows_as_previous and third.grown_rows == [0]
    assert [len(r.block_ids) for r in (short, long)] == [2, 2]


def test_a_step_leaves_out_the_rows_that_finished_and_those_ending_with_their_pending_token():
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    scheduler = Scheduler(config, BlockManager(100, 4, False))
    requests = [Request(i, [5] * 3, SamplingParams(max_tokens=max_tokens, ignore_eos=True), eos_token_id=EOS)
                for i, max_tokens in enumerate((2, 9, 3, 9))]
    for request in requests:
        scheduler.add_request(request)
    prefill = scheduler.schedule()
    scheduler.advance(prefill)
    decode = scheduler.schedule()  # async order: scheduled while the prefill's tokens are pending
    scheduler.advance(decode)
    scheduler.commit(prefill, [9] * 4)
    # Request 0's pending token (its second) ends it: it leaves; the others keep their rows, in order.
    second = scheduler.schedule()
    assert [r.request_id for r in second.requests] == [1, 2, 3]
    assert second.previous_rows.tolist() == [1, 2, 3] and not second.same_rows_as_previous
    scheduler.advance(second)
    scheduler.commit(decode, [9] * 4)  # request 0 ends on length
    assert requests[0].is_finished
    third = scheduler.schedule()  # request 2's pending token (its third) ends it
    assert [r.request_id for r in third.requests] == [1, 3]
    assert third.previous_rows.tolist() == [0, 2]
    assert third.computed_ends == [6, 6] and third.output_slots == [3, 3]
