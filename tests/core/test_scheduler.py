"""Scheduler: continuous batching, chunked prefill, separate vs mixed steps, preemption by recompute, stops."""

import random
from collections import Counter

import pytest

from batchgen.config import EngineConfig
from batchgen.core.block_manager import BlockManager, hash_blocks
from batchgen.core.request import PENDING_TOKEN, Request, RequestStatus
from batchgen.core.scheduler import Scheduler, SchedulerOutput
from batchgen.sample.params import SamplingParams

EOS = 2


def make_scheduler(max_num_seqs: int = 16, max_num_batched_tokens: int = 64, max_model_len: int = 1024,
                   num_blocks: int = 1000, block_size: int = 4, mixed: bool = False,
                   prefix_caching: bool = True) -> Scheduler:
    config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                          max_model_len=max_model_len, mixed_prefill_decode=mixed)
    return Scheduler(config, BlockManager(num_blocks, block_size, prefix_caching))


def make_request(request_id: int, prompt_len: int, max_tokens: int = 16, **params) -> Request:
    prompt = [100 + request_id] * prompt_len
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, **params), eos_token_id=EOS)


def add_requests(scheduler: Scheduler, prompt_lens: list[int], max_tokens: int = 16, first_id: int = 0,
                 **params) -> list[Request]:
    requests = [make_request(first_id + i, n, max_tokens, **params) for i, n in enumerate(prompt_lens)]
    for request in requests:
        scheduler.add_request(request)
    return requests


def fake_token(request: Request) -> int:
    """What a greedy model would sample: a function of the request and the position only (never EOS)."""
    return 1000 + (request.request_id * 31 + request.num_tokens * 7) % 500


def apply(scheduler: Scheduler, output: SchedulerOutput, sampled: list[int]) -> list[Request]:
    """Launch and commit at once, as the engine does without async scheduling."""
    scheduler.advance(output)
    return scheduler.commit(output, sampled)


def run_step(scheduler: Scheduler, token: int | None = None) -> tuple[SchedulerOutput, list[Request]]:
    output = scheduler.schedule()
    sampled = [(fake_token(r) if token is None else token) if s else -1
               for r, s in zip(output.requests, output.samples, strict=True)]
    return output, apply(scheduler, output, sampled)


def scheduled(output: SchedulerOutput) -> dict[int, int]:
    return {r.request_id: n for r, n in zip(output.requests, output.num_scheduled_tokens, strict=True)}


def run_to_completion(scheduler: Scheduler, max_steps: int = 10_000) -> list[SchedulerOutput]:
    outputs = []
    while scheduler.has_unfinished_requests():
        outputs.append(run_step(scheduler)[0])
        assert len(outputs) < max_steps
    return outputs


def test_enqueue_all_makes_each_prompt_array_and_hashes_each_prompt():
    scheduler = make_scheduler(block_size=4)
    requests = [make_request(i, n) for i, n in enumerate([3, 4, 9, 1, 8])]
    made_before = requests[2].prompt_array  # an array made before keeps its own
    scheduler.enqueue_all(requests)
    assert list(scheduler.waiting) == requests
    assert requests[2].prompt_array is made_before
    for request in requests:
        assert request.prompt_array.tolist() == request.prompt_token_ids
        assert request.block_hashes == hash_blocks(None, request.prompt_token_ids, 4)
        assert request.stop_token_set == {EOS} and request.max_num_outputs == 16


def test_prefill_then_decode_then_leave():
    scheduler = make_scheduler()
    requests = add_requests(scheduler, [5, 6, 7], max_tokens=2)
    output, finished = run_step(scheduler)
    assert scheduled(output) == {0: 5, 1: 6, 2: 7}
    assert output.kind == "prefill" and output.samples == [True] * 3
    assert (output.num_prefill_tokens, output.num_decode_tokens, output.num_seqs) == (18, 0, 3)
    assert finished == [] and all(r.is_decoding for r in requests)
    output, finished = run_step(scheduler)
    assert scheduled(output) == {0: 1, 1: 1, 2: 1}
    assert output.kind == "decode" and output.num_decode_tokens == 3
    assert finished == requests
    assert all(r.finish_reason == "length" and r.num_output_tokens == 2 and r.block_ids == [] for r in requests)
    assert scheduler.block_manager.num_used_blocks == 0 and not scheduler.has_unfinished_requests()
    assert scheduler.schedule().kind == "idle"


def test_continuous_batching_joins_when_one_leaves():
    scheduler = make_scheduler(max_num_seqs=2)
    short, long, late = make_request(0, 4, max_tokens=1), make_request(1, 4, max_tokens=5), make_request(2, 4)
    for request in (short, long, late):
        scheduler.add_request(request)
    output, finished = run_step(scheduler)
    assert scheduled(output) == {0: 4, 1: 4} and finished == [short]
    assert (scheduler.num_running, scheduler.num_waiting) == (1, 1)
    output, _ = run_step(scheduler)
    assert scheduled(output) == {2: 4}  # separate mode: the newcomer's prefill step, the decode waits
    output, _ = run_step(scheduler)
    assert scheduled(output) == {1: 1, 2: 1}


def test_max_num_seqs_and_token_budget():
    scheduler = make_scheduler(max_num_seqs=3, max_num_batched_tokens=10)
    add_requests(scheduler, [4] * 6)
    assert scheduled(scheduler.schedule()) == {0: 4, 1: 4, 2: 2}
    scheduler = make_scheduler(max_num_seqs=2, max_num_batched_tokens=10)
    add_requests(scheduler, [4] * 6)
    assert scheduled(scheduler.schedule()) == {0: 4, 1: 4}


def test_decode_step_respects_budget():
    scheduler = make_scheduler(max_num_seqs=8, max_num_batched_tokens=3)
    add_requests(scheduler, [1] * 5)
    run_step(scheduler)
    run_step(scheduler)
    output, _ = run_step(scheduler)
    assert output.kind == "decode" and output.num_tokens <= 3


def test_chunked_prefill_exact_chunks():
    scheduler = make_scheduler(max_num_batched_tokens=10)
    (request,) = add_requests(scheduler, [25])
    chunks = []
    for _ in range(3):
        output, _ = run_step(scheduler)
        chunks.append((scheduled(output)[0], output.samples[0], output.kind))
    assert chunks == [(10, False, "prefill"), (10, False, "prefill"), (5, True, "prefill")]
    assert request.num_output_tokens == 1 and request.num_computed_tokens == 25
    output, _ = run_step(scheduler)
    assert scheduled(output) == {0: 1} and output.kind == "decode"


def test_chunked_prefill_shares_budget_with_newcomers():
    scheduler = make_scheduler(max_num_batched_tokens=10)
    add_requests(scheduler, [14, 3, 20])
    assert scheduled(run_step(scheduler)[0]) == {0: 10}
    assert scheduled(run_step(scheduler)[0]) == {0: 4, 1: 3, 2: 3}
    assert scheduled(run_step(scheduler)[0]) == {2: 10}
    assert scheduled(run_step(scheduler)[0]) == {2: 7}
    output, _ = run_step(scheduler)
    assert scheduled(output) == {0: 1, 1: 1, 2: 1} and output.kind == "decode"


def test_separate_mode_never_mixes():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    add_requests(scheduler, [3], max_tokens=10)
    run_step(scheduler)
    run_step(scheduler)
    add_requests(scheduler, [12], first_id=1)
    kinds = [run_step(scheduler)[0] for _ in range(3)]
    assert [(o.kind, scheduled(o)) for o in kinds] == [
        ("prefill", {1: 8}), ("prefill", {1: 4}), ("decode", {0: 1, 1: 1})]
    assert all(o.kind in ("prefill", "decode") for o in run_to_completion(scheduler))


def test_mixed_mode_mixes_decodes_first():
    scheduler = make_scheduler(max_num_batched_tokens=8, mixed=True)
    add_requests(scheduler, [3], max_tokens=10)
    run_step(scheduler)
    add_requests(scheduler, [20], first_id=1)
    outputs = [run_step(scheduler)[0] for _ in range(4)]
    assert [scheduled(o) for o in outputs] == [{0: 1, 1: 7}, {0: 1, 1: 7}, {0: 1, 1: 6}, {0: 1, 1: 1}]
    assert [o.kind for o in outputs] == ["mixed", "mixed", "mixed", "decode"]
    assert outputs[0].requests[0].request_id == 0 and outputs[0].samples == [True, False]
    assert (outputs[0].num_decode_tokens, outputs[0].num_prefill_tokens) == (1, 7)
    assert outputs[2].samples == [True, True]


def test_mixed_mode_decode_before_newcomer_in_request_order():
    scheduler = make_scheduler(mixed=True)
    add_requests(scheduler, [4, 4])
    run_step(scheduler)
    add_requests(scheduler, [5], first_id=2)
    output, _ = run_step(scheduler)
    assert [r.request_id for r in output.requests] == [0, 1, 2]
    assert output.num_scheduled_tokens == [1, 1, 5] and output.kind == "mixed"


@pytest.mark.parametrize("mixed", [False, True])
def test_preemption_order_and_recompute(mixed):
    scheduler = make_scheduler(num_blocks=3, block_size=4, mixed=mixed)
    requests = add_requests(scheduler, [4, 4, 4], max_tokens=4)
    run_step(scheduler)  # each prompt fills exactly one block; each decode needs a second one
    assert scheduler.block_manager.num_free_blocks == 0
    output, _ = run_step(scheduler)
    # request 0 needs a block: request 2 (the latest) goes; request 1 then needs one and is the latest itself.
    assert scheduled(output) == {0: 1}
    assert output.preempted == [requests[2], requests[1]]
    assert list(scheduler.waiting) == [requests[1], requests[2]]
    assert all(r.num_computed_tokens == 0 and r.block_ids == [] and r.num_preemptions == 1 and
               r.status == RequestStatus.WAITING for r in requests[1:])
    run_to_completion(scheduler)
    reference = make_scheduler(mixed=mixed)
    reference_requests = add_requests(reference, [4, 4, 4], max_tokens=4)
    run_to_completion(reference)
    assert [r.output_token_ids for r in requests] == [r.output_token_ids for r in reference_requests]
    assert all(r.num_output_tokens == 4 for r in requests)


def test_recompute_after_preemption_is_prefill_of_prompt_and_outputs():
    scheduler = make_scheduler(num_blocks=2, block_size=4)
    first, second = add_requests(scheduler, [4, 4], max_tokens=4)
    run_step(scheduler)
    output, _ = run_step(scheduler)
    assert output.preempted == [second] and second.num_output_tokens == 1
    while not first.is_finished:
        run_step(scheduler)
    output, _ = run_step(scheduler)
    assert scheduled(output) == {1: 5} and output.kind == "prefill" and output.samples == [True]
    assert second.num_output_tokens == 2


def test_a_recompute_whose_chunk_leaves_only_its_last_token_decodes_next():
    """Its last token is an output the cache lacks, as a decoding request's is: the next step is a decode."""
    scheduler = make_scheduler(max_num_batched_tokens=4, num_blocks=2, block_size=4)
    first, second = add_requests(scheduler, [4, 4], max_tokens=4)
    while not second.num_preemptions:
        run_step(scheduler)
    while not first.is_finished:
        run_step(scheduler)
    assert second.num_output_tokens == 1
    output, _ = run_step(scheduler)
    assert scheduled(output) == {1: 4} and output.kind == "prefill" and output.samples == [False]
    output, _ = run_step(scheduler)
    assert scheduled(output) == {1: 1} and output.kind == "decode" and output.samples == [True]


def test_separate_mode_falls_back_to_decode_when_prefill_preempts_itself():
    scheduler = make_scheduler(max_num_batched_tokens=4, num_blocks=3, block_size=4)
    (decoder,) = add_requests(scheduler, [4], max_tokens=4)
    run_step(scheduler)
    run_step(scheduler)  # the decoder now holds 2 blocks
    (prefill,) = add_requests(scheduler, [8], max_tokens=1, first_id=1)
    assert scheduled(run_step(scheduler)[0]) == {1: 4}  # takes the last block
    output, _ = run_step(scheduler)
    assert output.preempted == [prefill] and scheduled(output) == {0: 1} and output.kind == "decode"
    run_to_completion(scheduler)
    assert decoder.num_output_tokens == 4 and prefill.num_output_tokens == 1


def test_stop_on_eos_unless_ignored():
    scheduler = make_scheduler()
    stops, ignores = make_request(0, 3), make_request(1, 3, max_tokens=3, ignore_eos=True)
    scheduler.add_request(stops)
    scheduler.add_request(ignores)
    _, finished = run_step(scheduler, token=EOS)
    assert finished == [stops] and stops.finish_reason == "stop" and stops.output_token_ids == [EOS]
    run_step(scheduler, token=EOS)
    _, finished = run_step(scheduler, token=EOS)
    assert finished == [ignores] and ignores.finish_reason == "length" and ignores.num_output_tokens == 3


def test_stop_token_ids():
    scheduler = make_scheduler()
    (request,) = add_requests(scheduler, [3], stop_token_ids=[42, 43])
    run_step(scheduler, token=5)
    _, finished = run_step(scheduler, token=43)
    assert finished == [request] and request.finish_reason == "stop" and request.output_token_ids == [5, 43]


def test_max_model_len_stops_with_length():
    scheduler = make_scheduler(max_model_len=12)
    short, full = add_requests(scheduler, [10, 12], max_tokens=100)
    run_to_completion(scheduler)
    assert (short.finish_reason, short.num_output_tokens, short.num_tokens) == ("length", 2, 12)
    assert (full.finish_reason, full.num_output_tokens) == ("length", 1)
    assert short.first_token_time is not None and short.finish_time >= short.first_token_time


def test_a_pending_token_that_reaches_max_model_len_is_not_scheduled_past():
    # Launched steps not yet committed (async scheduling): the second output fills max_model_len whatever it is.
    scheduler = make_scheduler(max_model_len=12)
    (request,) = add_requests(scheduler, [10], max_tokens=100)
    for kind in ("prefill", "decode"):
        step = scheduler.schedule()
        assert step.kind == kind
        scheduler.advance(step)
    assert scheduler.schedule().is_empty and request.output_token_ids == [PENDING_TOKEN, PENDING_TOKEN]


def test_admission_error():
    scheduler = make_scheduler(max_model_len=100, num_blocks=10, block_size=4)
    assert scheduler.admission_error(make_request(0, 100, max_tokens=1)) is not None  # 101 tokens > 40 slots
    assert scheduler.admission_error(make_request(0, 30, max_tokens=10)) is None
    too_long = scheduler.admission_error(make_request(0, 101))
    assert "101 tokens" in too_long and "max_model_len=100" in too_long
    never_fits = scheduler.admission_error(make_request(0, 30, max_tokens=11))
    assert "41 tokens" in never_fits and "11 blocks" in never_fits and "10 blocks" in never_fits
    assert scheduler.admission_error(make_request(0, 0)) == "the prompt is empty"
    with pytest.raises(ValueError, match="can never run"):
        scheduler.add_request(make_request(0, 101))


def test_admission_error_caps_at_max_model_len():
    scheduler = make_scheduler(max_model_len=40, num_blocks=10, block_size=4)
    assert scheduler.admission_error(make_request(0, 40, max_tokens=1000)) is None
    (request,) = add_requests(scheduler, [40], max_tokens=1000)
    run_to_completion(scheduler)
    assert request.num_output_tokens == 1


def test_finish_request_frees_blocks():
    scheduler = make_scheduler()
    running, waiting = make_request(0, 4), make_request(1, 4)
    scheduler.add_request(running)
    run_step(scheduler)
    scheduler.add_request(waiting)
    scheduler.finish_request(running, "stop")
    scheduler.finish_request(waiting, "stop")
    assert running.is_finished and running.finish_reason == "stop" and running.block_ids == []
    assert scheduler.block_manager.num_used_blocks == 0 and not scheduler.has_unfinished_requests()


def check_invariants(scheduler: Scheduler, output: SchedulerOutput, mixed: bool) -> None:
    config, manager = scheduler.config, scheduler.block_manager
    ids = [r.key for r in output.requests]
    assert len(ids) == len(set(ids)), "a request scheduled twice"
    assert output.num_seqs <= config.max_num_seqs and scheduler.num_running <= config.max_num_seqs
    assert 0 < output.num_tokens <= config.max_num_batched_tokens or not scheduler.has_unfinished_requests()
    assert mixed or output.kind != "mixed"
    for request, num_tokens in zip(output.requests, output.num_scheduled_tokens, strict=True):
        assert request.status == RequestStatus.RUNNING and num_tokens > 0
        assert request.num_computed_tokens + num_tokens <= request.num_tokens
        assert len(request.block_ids) >= manager.blocks_needed(request.num_computed_tokens + num_tokens)
        # The model runner replays a decode graph for a step without prefill tokens, without re-checking its rows.
        assert output.num_prefill_tokens or (num_tokens == 1 and request.num_computed_tokens + 1 == request.num_tokens)
    owned = Counter(block for r in scheduler.running for block in r.block_ids)
    assert all(manager.ref_counts[block] == count for block, count in owned.items()), "a wrong ref count"
    assert len(owned) == manager.num_used_blocks
    assert manager.num_free_blocks + manager.num_used_blocks == manager.num_total_blocks
    assert all(r.block_ids == [] and r.num_computed_tokens == 0 for r in scheduler.waiting)
    assert all(r in scheduler.waiting for r in output.preempted)


@pytest.mark.parametrize("shared_prefixes", [False, True])
@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_randomized_simulation(mixed, seed, shared_prefixes):
    rng = random.Random(seed)
    block_size, max_model_len = rng.choice([1, 2, 4, 8]), 48
    scheduler = make_scheduler(max_num_seqs=rng.randint(1, 8), max_num_batched_tokens=rng.randint(1, 40),
                               max_model_len=max_model_len, block_size=block_size,
                               num_blocks=-(-max_model_len // block_size) + rng.randint(0, 6), mixed=mixed)
    pending = [make_request(i, rng.randint(1, 40), max_tokens=rng.randint(1, 20)) for i in range(40)]
    if shared_prefixes:  # prompts drawn from three token streams, so that they share prefixes of every length
        for request in pending:
            stream = rng.randrange(3)
            request.prompt_token_ids = [stream * 100 + k for k in range(request.num_prompt_tokens)]
        for first, later in zip(pending[::4], pending[1::4], strict=True):  # and some are later samples of a prompt
            later.prompt_token_ids, later.first_sample, later.sample_index = list(first.prompt_token_ids), first, 1
    every_request = list(pending)
    steps = 0
    while pending or scheduler.has_unfinished_requests():
        for _ in range(min(len(pending), rng.randint(0, 3))):
            scheduler.add_request(pending.pop(0))
        output = scheduler.schedule()
        check_invariants(scheduler, output, mixed)
        apply(scheduler, output, [rng.randint(1000, 2000) if s else -1 for s in output.samples])
        steps += 1
        assert steps < 20_000
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_total_blocks
    for request in every_request:
        assert request.is_finished and request.finish_reason == "length"
        expected = min(request.sampling_params.max_tokens, max(1, max_model_len - request.num_prompt_tokens))
        assert request.num_output_tokens == expected


@pytest.mark.parametrize("mixed", [False, True])
def test_preempted_greedy_requests_match_unpreempted_run(mixed):
    rng = random.Random(7)
    shapes = [(rng.randint(1, 30), rng.randint(1, 30)) for _ in range(30)]

    def run(num_blocks: int) -> tuple[list[list[int]], int]:
        scheduler = make_scheduler(max_num_seqs=6, max_num_batched_tokens=16, num_blocks=num_blocks, mixed=mixed)
        requests = [make_request(i, prompt_len, max_tokens) for i, (prompt_len, max_tokens) in enumerate(shapes)]
        for request in requests:
            scheduler.add_request(request)
        run_to_completion(scheduler)
        return [r.output_token_ids for r in requests], sum(r.num_preemptions for r in requests)

    tight, preemptions = run(num_blocks=16)
    roomy, no_preemptions = run(num_blocks=1000)
    assert preemptions > 0 and no_preemptions == 0
    assert tight == roomy


# -- async scheduling: step N+1 is scheduled and advanced before step N's sampled ids are committed ------------


def test_async_token_of_a_step_launched_after_eos_is_discarded():
    scheduler = make_scheduler()
    request = add_requests(scheduler, [4])[0]
    prefill = scheduler.schedule()
    scheduler.advance(prefill)
    assert request.output_token_ids == [PENDING_TOKEN] and request.is_decoding
    decode = scheduler.schedule()  # scheduled although its pending token may be EOS
    assert scheduled(decode) == {0: 1} and decode.output_slots == [1]
    scheduler.advance(decode)
    assert scheduler.commit(prefill, [EOS]) == [request]
    assert request.finish_reason == "stop" and request.output_token_ids == [EOS] and request.block_ids == []
    assert scheduler.commit(decode, [1234]) == []
    assert request.output_token_ids == [EOS] and not scheduler.has_unfinished_requests()


def test_async_request_that_ends_on_length_is_not_scheduled_again():
    scheduler = make_scheduler()
    ending, going_on = add_requests(scheduler, [4], max_tokens=1) + add_requests(scheduler, [4], first_id=1)
    prefill = scheduler.schedule()
    scheduler.advance(prefill)
    decode = scheduler.schedule()
    assert scheduled(decode) == {1: 1}
    scheduler.advance(decode)
    assert scheduler.commit(prefill, [1500, 1501]) == [ending]
    assert ending.finish_reason == "length" and ending.output_token_ids == [1500]
    assert scheduler.commit(decode, [1502]) == []
    assert going_on.output_token_ids == [1501, 1502]


def test_async_preempted_request_that_ends_on_its_pending_token_leaves_the_waiting_queue():
    scheduler = make_scheduler(num_blocks=2, block_size=4)
    first, second = add_requests(scheduler, [4, 4], max_tokens=4)
    prefill = scheduler.schedule()
    scheduler.advance(prefill)
    decode = scheduler.schedule()  # the first request's new block preempts the second
    assert scheduled(decode) == {0: 1} and decode.preempted == [second]
    assert second.status == RequestStatus.WAITING and second.num_computed_tokens == 0
    scheduler.advance(decode)
    assert scheduler.commit(prefill, [1500, EOS]) == [second]
    assert second.finish_reason == "stop" and second.output_token_ids == [EOS]
    assert scheduler.num_waiting == 0 and scheduler.running == [first]
    scheduler.commit(decode, [1501])
    assert first.output_token_ids == [1500, 1501]


# -- prefix caching and n > 1 ---------------------------------------------------------------------------------


def make_shared_request(request_id: int, prefix_len: int, suffix_len: int, max_tokens: int = 4) -> Request:
    prompt = list(range(1, prefix_len + 1)) + [500 + request_id] * suffix_len
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens), eos_token_id=EOS)


def test_a_later_request_computes_only_what_the_cache_lacks():
    scheduler = make_scheduler(block_size=4)
    first = make_shared_request(0, prefix_len=10, suffix_len=3)
    scheduler.add_request(first)
    output, _ = run_step(scheduler)
    assert scheduled(output) == {0: 13} and output.num_cached_tokens == 0
    second = make_shared_request(1, prefix_len=10, suffix_len=5)  # the shared prefix ends mid-block
    scheduler.add_request(second)
    output, _ = run_step(scheduler)
    assert scheduled(output) == {1: 7} and output.num_cached_tokens == 8  # two full blocks hit
    assert second.num_cached_tokens == 8 and second.block_ids[:2] == first.block_ids[:2]
    assert [scheduler.block_manager.ref_counts[b] for b in first.block_ids] == [2, 2, 1, 1]
    run_to_completion(scheduler)
    assert scheduler.block_manager.num_used_blocks == 0 and scheduler.block_manager.num_cached_blocks > 0


def test_a_request_waits_for_the_prompt_blocks_another_is_computing_and_then_shares_them():
    scheduler = make_scheduler(block_size=4)
    sharing = [make_shared_request(i, prefix_len=8, suffix_len=2) for i in range(3)]
    unrelated = make_request(9, prompt_len=6)
    for request in [*sharing, unrelated]:
        scheduler.add_request(request)
    output, _ = run_step(scheduler)
    # The requests behind the first wait for its two prefix blocks; the unrelated one goes ahead of them.
    assert scheduled(output) == {0: 10, 9: 6} and list(scheduler.waiting) == sharing[1:]
    output, _ = run_step(scheduler)  # committed: the prefix is cached, so the others compute only their suffixes
    assert scheduled(output) == {1: 2, 2: 2} and output.num_cached_tokens == 16
    assert sharing[1].block_ids[:2] == sharing[2].block_ids[:2] == sharing[0].block_ids[:2]


def test_admission_looks_past_at_most_max_num_seqs_waiting_requests():
    scheduler = make_scheduler(max_num_seqs=2, block_size=4)
    sharing = [make_shared_request(i, prefix_len=8, suffix_len=2) for i in range(4)]
    unrelated = make_request(9, prompt_len=6)
    for request in [*sharing, unrelated]:
        scheduler.add_request(request)
    output, _ = run_step(scheduler)
    assert scheduled(output) == {0: 10} and list(scheduler.waiting) == [*sharing[1:], unrelated]


def test_without_prefix_caching_requests_sharing_a_prefix_are_admitted_together():
    scheduler = make_scheduler(num_blocks=100, prefix_caching=False)
    for i in range(2):
        scheduler.add_request(make_shared_request(i, prefix_len=8, suffix_len=2))
    output, _ = run_step(scheduler)
    assert scheduled(output) == {0: 10, 1: 10} and output.num_cached_tokens == 0


def test_async_a_block_is_cached_only_when_its_step_is_committed():
    scheduler = make_scheduler(block_size=4)
    first = make_shared_request(0, prefix_len=8, suffix_len=1)
    scheduler.add_request(first)
    prefill = scheduler.schedule()
    scheduler.advance(prefill)  # launched, not yet run
    scheduler.add_request(make_shared_request(1, prefix_len=8, suffix_len=1))
    next_step = scheduler.schedule()  # the second waits: the blocks it would share are computed, not yet cached
    assert scheduled(next_step) == {0: 1} and scheduler.block_manager.num_cached_blocks == 0
    scheduler.advance(next_step)
    scheduler.commit(prefill, [1500])
    assert scheduler.block_manager.num_cached_blocks == 2
    scheduler.add_request(make_shared_request(2, prefix_len=8, suffix_len=1))
    assert scheduler.schedule().num_cached_tokens == 2 * 8


def test_preempted_request_resumes_from_its_cached_blocks():
    scheduler = make_scheduler(num_blocks=5, block_size=4)
    first, second = add_requests(scheduler, [8, 7], max_tokens=8)
    output, _ = run_step(scheduler)  # 2 + 2 blocks
    while not output.preempted:
        output, _ = run_step(scheduler)
    assert output.preempted == [second] and second.num_output_tokens > 0
    while second.status == RequestStatus.WAITING:
        output, _ = run_step(scheduler)
    # Its prompt and first outputs whose blocks were not reused are not recomputed.
    assert output.num_cached_tokens > 0 and second.num_cached_tokens == 0
    run_to_completion(scheduler)
    reference = make_scheduler(block_size=4)
    reference_requests = add_requests(reference, [8, 7], max_tokens=8)
    run_to_completion(reference)
    assert [r.output_token_ids for r in (first, second)] == [r.output_token_ids for r in reference_requests]


def add_samples(scheduler: Scheduler, request_id: int, prompt_len: int, n: int, max_tokens: int = 4) -> list[Request]:
    first = make_request(request_id, prompt_len, max_tokens)
    samples = [first] + [make_request(request_id, prompt_len, max_tokens) for _ in range(n - 1)]
    for index, sample in enumerate(samples):
        sample.sample_index, sample.first_sample = index, (first if index else None)
        scheduler.add_request(sample)
    return samples


def test_later_samples_wait_for_the_first_sample_prompt_then_share_its_blocks():
    scheduler = make_scheduler(block_size=4)
    samples = add_samples(scheduler, 0, prompt_len=10, n=3)
    assert scheduler.num_waiting == 3 and list(scheduler.waiting) == samples[:1]
    output, _ = run_step(scheduler)
    assert scheduled(output) == {0: 10}
    assert list(scheduler.waiting) == samples[1:]
    output, _ = run_step(scheduler)  # a prefill step: the siblings compute only the tail of the prompt
    assert [n for r, n in zip(output.requests, output.num_scheduled_tokens, strict=True) if r is not samples[0]] \
        == [2, 2]
    assert output.num_cached_tokens == 16
    shared = samples[0].block_ids[:2]
    assert all(s.block_ids[:2] == shared for s in samples)
    assert [scheduler.block_manager.ref_counts[b] for b in shared] == [3, 3]
    assert scheduler.block_manager.num_used_blocks == 2 + 3  # the shared prompt blocks and one tail block each
    run_to_completion(scheduler)
    assert all(s.num_output_tokens == 4 for s in samples)


def test_later_samples_of_a_prompt_without_a_full_block_join_at_once():
    scheduler = make_scheduler(block_size=4)
    samples = add_samples(scheduler, 0, prompt_len=4, n=3)
    assert list(scheduler.waiting) == samples


def test_later_samples_join_at_once_without_prefix_caching():
    scheduler = make_scheduler(num_blocks=100, prefix_caching=False)
    samples = add_samples(scheduler, 0, prompt_len=10, n=3)
    assert list(scheduler.waiting) == samples
    output, _ = run_step(scheduler)
    assert output.num_seqs == 3 and output.num_cached_tokens == 0


def test_a_prompt_is_hashed_when_it_arrives_not_in_the_step_that_admits_it():
    scheduler = make_scheduler(block_size=4)
    (request,) = add_requests(scheduler, [10])
    assert len(request.block_hashes) == 2  # its full blocks, before any step
    hashes = list(request.block_hashes)
    run_step(scheduler)
    assert request.block_hashes == hashes


def make_admitting_scheduler(min_admit_rows: int | None, max_num_seqs: int = 8,
                             max_num_batched_tokens: int = 64) -> Scheduler:
    config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                          max_model_len=1024, min_admit_rows=min_admit_rows)
    return Scheduler(config, BlockManager(1000, 4, True))


def finish_running(scheduler: Scheduler, count: int) -> None:
    """Ends the `count` earliest running requests, as a stop token would."""
    for request in scheduler.running[:count]:
        scheduler.finish_request(request, "stop")


def test_prefill_interrupts_decodes_only_to_admit_min_admit_rows():
    scheduler = make_admitting_scheduler(min_admit_rows=3)
    add_requests(scheduler, [4] * 8, max_tokens=100)
    add_requests(scheduler, [4] * 6, max_tokens=100, first_id=8)
    assert run_step(scheduler)[0].kind == "prefill"  # nothing decodes yet: the first batch is admitted at once
    assert run_step(scheduler)[0].kind == "decode"
    for freed in (1, 1):  # one slot, then two: still fewer than 3
        finish_running(scheduler, freed)
        output, _ = run_step(scheduler)
        assert output.kind == "decode" and scheduler.num_waiting == 6
    finish_running(scheduler, 1)  # three free slots: worth a prefill step
    output, _ = run_step(scheduler)
    assert output.kind == "prefill" and sorted(scheduled(output)) == [8, 9, 10]


def test_fewer_waiting_rows_than_min_admit_rows_are_admitted_when_they_all_fit():
    scheduler = make_admitting_scheduler(min_admit_rows=4)
    add_requests(scheduler, [4] * 8, max_tokens=100)
    add_requests(scheduler, [4] * 2, max_tokens=100, first_id=8)
    run_step(scheduler)  # the first batch's prefill
    run_step(scheduler)  # its first decode
    finish_running(scheduler, 1)
    assert run_step(scheduler)[0].kind == "decode"  # one slot for two waiting rows
    finish_running(scheduler, 1)
    output, _ = run_step(scheduler)
    assert output.kind == "prefill" and sorted(scheduled(output)) == [8, 9]


def test_waiting_prompts_that_fill_the_token_budget_are_worth_a_step():
    scheduler = make_admitting_scheduler(min_admit_rows=4, max_num_batched_tokens=32)
    add_requests(scheduler, [4] * 8, max_tokens=100)
    add_requests(scheduler, [40, 4, 4], max_tokens=100, first_id=8)
    run_step(scheduler)  # the first batch's prefill
    run_step(scheduler)  # its first decode
    finish_running(scheduler, 1)  # one free slot, but the head's prompt alone fills the budget
    output, _ = run_step(scheduler)
    assert output.kind == "prefill" and scheduled(output) == {8: 32}


def test_a_prefill_step_between_decodes_leaves_the_last_eighth_of_its_budget_rather_than_cut_a_row():
    """Cut, the third row's remainder would take a prefill step of its own next, interrupting the decodes again."""
    scheduler = make_admitting_scheduler(min_admit_rows=3)  # budget 64: its last eighth is 8 tokens
    add_requests(scheduler, [4] * 4, max_tokens=100)
    run_step(scheduler)  # the first batch's prefill
    assert run_step(scheduler)[0].kind == "decode"
    add_requests(scheduler, [30, 30, 10, 10, 10], max_tokens=100, first_id=4)  # 4 free slots: worth a step
    output, _ = run_step(scheduler)
    assert output.kind == "prefill" and scheduled(output) == {4: 30, 5: 30}  # 4 tokens left: row 6 waits whole
    assert run_step(scheduler)[0].kind == "decode"
    assert [r.request_id for r in scheduler.waiting] == [6, 7, 8]
    assert scheduler.waiting[0].num_computed_tokens == 0


@pytest.mark.parametrize("decoding", [False, True])
def test_a_row_is_cut_to_fill_the_budget_where_no_decodes_wait_or_more_than_an_eighth_is_left(decoding):
    scheduler = make_admitting_scheduler(min_admit_rows=3)
    first_id = 0
    if decoding:
        add_requests(scheduler, [4] * 4, max_tokens=100)
        run_step(scheduler)
        run_step(scheduler)
        first_id = 4
    add_requests(scheduler, [30, 20, 20], max_tokens=100, first_id=first_id)  # 14 tokens left for the third
    output, _ = run_step(scheduler)
    assert scheduled(output) == {first_id: 30, first_id + 1: 20, first_id + 2: 14}
    output, _ = run_step(scheduler)  # the cut row's remainder
    assert output.kind == "prefill" and scheduled(output) == {first_id + 2: 6}


def test_rows_whose_pending_token_ends_them_do_not_count_as_decoding():
    """max_tokens 1 (a classify job): the rows admitted at the previous step, not yet committed (async scheduling),
    will never decode, so the next step fills its budget."""
    scheduler = make_admitting_scheduler(min_admit_rows=3)
    add_requests(scheduler, [30, 30, 10, 30, 26, 30], max_tokens=1)
    first = scheduler.schedule()
    assert scheduled(first) == {0: 30, 1: 30, 2: 4}
    scheduler.advance(first)
    second = scheduler.schedule()  # rows 0 and 1 are running, their pending token their last
    assert second.kind == "prefill" and scheduled(second) == {2: 6, 3: 30, 4: 26, 5: 2}


def test_nothing_decoding_a_row_is_cut_to_fill_even_the_last_eighth():
    scheduler = make_admitting_scheduler(min_admit_rows=3)
    add_requests(scheduler, [30, 30, 10], max_tokens=100)
    output, _ = run_step(scheduler)
    assert scheduled(output) == {0: 30, 1: 30, 2: 4}


def test_min_admit_rows_defaults_to_an_eighth_of_max_num_seqs():
    assert EngineConfig(max_num_seqs=512).admit_rows == 64
    assert EngineConfig(max_num_seqs=4).admit_rows == 1
    assert EngineConfig(max_num_seqs=512, min_admit_rows=1).admit_rows == 1


@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("num_blocks", [1000, 40, 14])
def test_rows_recorded_while_scheduling_equal_the_rows_of_the_requests(mixed, num_blocks):
    """Each row's computed end, output slot and sampling flag are recorded where it is scheduled (hundreds of rows
    admitted at once included); they equal what the requests say when the step is built, through shared prefixes
    (deferred admissions), preemption and commits a step late (async scheduling)."""
    rng = random.Random(num_blocks)
    scheduler = make_scheduler(max_num_seqs=64, max_num_batched_tokens=96, num_blocks=num_blocks, mixed=mixed)
    shared = [[rng.randrange(50) for _ in range(8)] for _ in range(3)]
    next_id, previous, num_steps = 0, None, 0
    while next_id < 300 or scheduler.has_unfinished_requests():
        if next_id < 300 and rng.random() < 0.4:
            for _ in range(rng.randint(1, 40)):
                prompt = rng.choice(shared) + [rng.randrange(50) for _ in range(rng.randint(1, 10))]
                request = Request(next_id, prompt, SamplingParams(max_tokens=rng.randint(1, 8)), eos_token_id=EOS)
                next_id += 1
                scheduler.add_request(request)
        output = scheduler.schedule()
        derived = SchedulerOutput(output.requests, output.num_scheduled_tokens, output.preempted,
                                  output.num_prefill_tokens, output.num_decode_tokens)
        assert (output.computed_ends, output.output_slots, output.samples) == \
            (derived.computed_ends, derived.output_slots, derived.samples)
        scheduler.advance(output)
        if previous is not None:
            scheduler.commit(*previous)
        previous = (output, [fake_token(r) if s else -1 for r, s in zip(output.requests, output.samples, strict=True)])
        num_steps += 1
        assert num_steps < 5_000
    scheduler.commit(*previous)
    assert scheduler.block_manager.num_used_blocks == 0


def test_a_prefill_step_admits_many_rows_in_queue_order_within_slots_and_budget():
    scheduler = make_scheduler(max_num_seqs=50, max_num_batched_tokens=200, block_size=4)
    requests = add_requests(scheduler, [3] * 80)
    output, _ = run_step(scheduler)
    assert output.requests == requests[:50]  # the free slots
    assert output.num_scheduled_tokens == [3] * 50 and output.samples == [True] * 50
    assert [r.block_ids for r in output.requests] == [[i] for i in range(50)]
    scheduler = make_scheduler(max_num_seqs=50, max_num_batched_tokens=100, block_size=4)
    requests = add_requests(scheduler, [3] * 80)
    output, _ = run_step(scheduler)
    assert output.requests == requests[:34]  # the budget: 33 whole prompts, then a chunk of the 34th
    assert output.num_scheduled_tokens == [3] * 33 + [1] and output.samples == [True] * 33 + [False]


def test_blocks_filled_by_decodes_reach_the_cache_when_the_request_ends():
    scheduler = make_scheduler(block_size=4)
    (request,) = add_requests(scheduler, [4], max_tokens=14)
    run_step(scheduler)  # the prefill: the prompt's block is offered as it is computed
    cache = scheduler.block_manager
    assert cache.num_cached_blocks == 1
    while request.num_computed_tokens < 12:
        run_step(scheduler)
    assert not request.is_finished
    assert cache.num_cached_blocks == 1  # two blocks of decodes are full: not hashed while the request runs
    run_to_completion(scheduler)
    # 4 prompt tokens and 14 outputs, the last of which never had its KV computed: four full blocks.
    assert request.num_output_tokens == 14 and cache.num_cached_blocks == 4
    follow_up = Request(1, [*request.prompt_token_ids, *request.output_token_ids], SamplingParams(max_tokens=1))
    scheduler.add_request(follow_up)
    assert scheduler.schedule().num_cached_tokens == 16


def test_a_preempted_request_recomputes_none_of_its_cached_decode_blocks():
    scheduler = make_scheduler(num_blocks=6, block_size=4)
    first, second = add_requests(scheduler, [4, 4], max_tokens=12)
    output, _ = run_step(scheduler)
    while not output.preempted:  # at the 13th token each needs a fourth block: the second gives its three up
        output, _ = run_step(scheduler)
    assert output.preempted == [second] and second.num_output_tokens == 9
    while second.status == RequestStatus.WAITING:
        output, _ = run_step(scheduler)
    # The first took the block freed first (the second's third: a request's blocks are freed tail first) for its
    # fourth; the second's first two, the prompt's and one filled by decodes, come from the cache.
    assert output.num_cached_tokens == 8
