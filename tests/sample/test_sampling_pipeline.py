"""The sampling pipeline: same tokens as the sampler it replaced, the static-buffer (graph) path equal to the eager
one, the bitmask hook, and the penalties' arithmetic."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from batchgen.core.request import Request
from batchgen.sample.batch import LastPacked, SamplingBatch
from batchgen.sample.bitmask import apply_token_bitmask
from batchgen.sample.graph import SamplerGraphs
from batchgen.sample.params import VALUE_RANGES, SamplingParams, row_params
from batchgen.sample.penalties import PenaltyTensors, SamplingStateRows, apply_penalties
from batchgen.sample.route import SamplingRoute, choose_route
from batchgen.sample.sampler import run_sampler
from batchgen.sample.state import SamplingState
from batchgen.worker.model_runner import token_histories
from tests.helpers import reference_sampler
from tests.sample.test_sampler import sample, tensors_for

VOCAB = 300


def mixed_params(rows: int) -> list[SamplingParams]:
    choices = [dict(temperature=0), dict(temperature=0.8), dict(temperature=0.7, top_k=20),
               dict(temperature=1.2, top_p=0.8), dict(temperature=0.9, min_p=0.1),
               dict(temperature=0.6, top_k=5, top_p=0.9, min_p=0.02)]
    return [SamplingParams(**choices[i % len(choices)]) for i in range(rows)]


def logits_for(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("rows", [1, 6, 37])
def test_pipeline_equals_the_replaced_sampler(rows):
    params = mixed_params(rows)
    seeds, positions = [1000 + i for i in range(rows)], [7 * i for i in range(rows)]
    logits = logits_for(rows)
    old = reference_sampler.sample(logits, reference_sampler.SamplingTensors.from_params(params, seeds, positions,
                                                                                           "cpu"))
    new = sample(logits, tensors_for(params, seeds, positions))
    assert torch.equal(old, new)


def make_requests(params: list[SamplingParams], outputs: list[list[int]] | None = None) -> list[Request]:
    requests = []
    for i, p in enumerate(params):
        p.seed = 50 + i
        request = Request(i, [i % VOCAB, (3 * i) % VOCAB], p, eos_token_id=0)
        request.output_token_ids = list(outputs[i]) if outputs else [5, 6]
        requests.append(request)
    return requests


def step_batch(requests: list[Request], state: SamplingState | None) -> SamplingBatch:
    """The batch the model runner prepares for these sampling rows."""
    params = [r.sampling_params for r in requests]
    return SamplingBatch.prepare(params, [r.num_tokens for r in requests], state, token_histories(requests, params))


def penalized_params(rows: int) -> list[SamplingParams]:
    params = mixed_params(rows)
    for i, p in enumerate(params):
        if i % 3 == 0:
            p.repetition_penalty, p.frequency_penalty, p.presence_penalty = 1.3, 0.2, 0.5
        if i % 4 == 1:
            p.logit_bias, p.min_tokens = {7: 5.0}, 4
    return params


@pytest.mark.parametrize("staged", [False, True], ids=["decode_logits", "staged_eager_logits"])
@pytest.mark.parametrize("penalties", [False, True], ids=["plain", "penalized"])
def test_static_buffer_path_equals_eager(penalties, staged):
    """The path a graphed decode step takes (static buffers padded to the bucket) gives the eager step's tokens, as
    does that of an eager forward's logits staged into the sampler's own buffer; on CPU it runs without capture,
    which the GPU tests add."""
    rows, size = 11, 16
    params = penalized_params(rows) if penalties else mixed_params(rows)
    results = []
    for graphed in (False, True):
        requests = make_requests([SamplingParams(**vars(p)) for p in params])
        state = SamplingState(VOCAB, torch.device("cpu")) if penalties else None
        pending_ids = torch.zeros(size, dtype=torch.int64)
        graphs = SamplerGraphs(size, VOCAB, pending_ids, torch.device("cpu"))
        tokens = []
        for step in range(4):
            sampling = step_batch(requests, state)
            logits = torch.zeros(size, VOCAB)
            logits[:rows] = logits_for(rows, seed=step)
            if graphed:
                static = graphs.stage_logits(logits[:rows]) if staged else logits
                ids = graphs.run(sampling, size, static, state).token_ids.clone()
                assert torch.equal(pending_ids[:rows], ids)
            else:
                ids = run_sampler(logits[:rows], sampling.to_device("cpu", state)).token_ids
            tokens.append(ids.tolist())
            for request, token in zip(requests, ids.tolist(), strict=True):
                request.output_token_ids.append(token)
        results.append(tokens)
    assert results[0] == results[1]


def test_bitmask_restricts_sampling():
    rows = 8
    allowed_sets = [{3, 40, 41}, {0}, {299}, set(range(32, 64))] * 2
    bitmask = np.zeros((rows, -(-VOCAB // 32)), dtype=np.int32)
    for row, allowed in enumerate(allowed_sets):
        for token in allowed:
            bitmask[row, token // 32] |= np.int32(np.uint32(1 << (token % 32)).view(np.int32))
    bitmask[7] = -1  # all allowed
    requests = make_requests(mixed_params(rows))
    sampling = step_batch(requests, None).with_bitmask(bitmask, VOCAB, pinned=False)
    assert sampling.features.bitmask
    for seed in range(5):
        tokens = run_sampler(logits_for(rows, seed), sampling.to_device("cpu")).token_ids
        for row in range(7):
            assert tokens[row].item() in allowed_sets[row]
    masked = apply_token_bitmask(logits_for(1), torch.from_numpy(bitmask[:1]))
    assert torch.isfinite(masked[0]).nonzero().flatten().tolist() == [3, 40, 41]


def test_penalties_follow_vllm():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, 3.0]])
    masks = torch.zeros(2, 5, dtype=torch.bool)
    rows = SamplingStateRows(torch.tensor([[0.0] * 5, [0.0, 2.0, 0.0, 1.0, 0.0]]), masks.clone(), torch.zeros(2, 5),
                             masks.clone())
    rows.prompt_mask[1, 0] = True  # token 0 in the prompt
    rows.bias[1, 4] = -1.0
    rows.stop_mask[1, 2] = True
    p = PenaltyTensors(rows, torch.tensor([1]), torch.tensor([2.0]), torch.tensor([0.5]), torch.tensor([0.25]),
                       torch.tensor([1.0]))
    out = apply_penalties(logits, p)[0]
    # token 0: prompt only -> 2 / 2; token 1: twice in the output -> -2 * 2 - 0.25 * 2 - 0.5;
    # token 2: a stop token before min_tokens -> -inf; token 3: once -> 0.5 / 2 - 0.25 - 0.5; token 4: biased, unseen
    assert out.tolist() == [1.0, -5.0, float("-inf"), -0.5, 2.0]


def test_greedy_rows_see_penalties():
    logits = torch.tensor([[5.0, 4.0, 0.0]])
    rows = SamplingStateRows(torch.tensor([[0.0, 0.0, 0.0], [3.0, 0.0, 0.0]]), torch.zeros(2, 3, dtype=torch.bool),
                             torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.bool))
    tensors = tensors_for([SamplingParams(temperature=0)])
    tensors.penalties = PenaltyTensors(rows, torch.tensor([1]), torch.tensor([1.0]), torch.tensor([0.0]),
                                       torch.tensor([1.0]), torch.tensor([0.0]))
    assert run_sampler(logits, tensors).token_ids.tolist() == [1]
    assert rows.output_counts[1].tolist() == [3.0, 1.0, 0.0]  # the sampled token is counted on the device


@pytest.mark.parametrize("key, value", [("repetition_penalty", 0), ("presence_penalty", 3),
                                        ("frequency_penalty", -2.5), ("min_tokens", -1), ("logit_bias", {"a": 1}),
                                        ("bad_words", [""]), ("allowed_token_ids", []), ("logprobs", 21),
                                        ("prompt_logprobs", -1), ("max_tokens", 0)])
def test_invalid_values_name_the_key(key, value):
    with pytest.raises(ValueError, match=f"row 4: sampling.{key}="):
        row_params(SamplingParams(), {key: value}, 4)


def test_rows_without_overrides_share_the_defaults():
    defaults = SamplingParams(temperature=0.5, stop=["\n"])
    assert row_params(defaults, {}, 3) is defaults
    overridden = row_params(defaults, {"top_k": 5}, 3)
    assert overridden is not defaults and overridden.top_k == 5 and overridden.stop == ["\n"]


def test_scoring_request_allows_max_tokens_zero():
    params = row_params(SamplingParams(), {"max_tokens": 0, "prompt_logprobs": 3, "logit_bias": {"5": 1.5},
                                           "bad_words": "thee"}, 0)
    assert params.scoring and params.logit_bias == {5: 1.5} and params.bad_words == ["thee"]


def test_logprobs_mode_is_validated():
    from batchgen.config import ConfigError, EngineConfig, validate_engine

    with pytest.raises(ConfigError, match="engine.logprobs_mode='softmax'"):
        validate_engine(EngineConfig(logprobs_mode="softmax"))


def test_rows_override_the_new_fields():
    from batchgen.io.errors import RowError
    from batchgen.io.overrides import parse_overrides

    record = {"prompt": "x", "logit_bias": {"5": 1, 7: -2.5}, "bad_words": "thee", "prompt_logprobs": 2,
              "repetition_penalty": 1.2, "allowed_token_ids": [1, 2]}
    overrides = parse_overrides(record)
    params = row_params(SamplingParams(), overrides, 0)
    assert params.logit_bias == {5: 1, 7: -2.5} and params.bad_words == ["thee"] and params.prompt_logprobs == 2
    assert params.allowed_token_ids == [1, 2] and params.repetition_penalty == 1.2
    with pytest.raises(RowError, match="logit_bias="):
        parse_overrides({"logit_bias": {"a": 1}})


@pytest.mark.parametrize("key, value", [("n", 0), ("temperature", -0.1), ("top_p", 0), ("top_p", 1.01), ("top_k", -2),
                                        ("min_p", 1.5), ("repetition_penalty", 0), ("presence_penalty", 2.5),
                                        ("frequency_penalty", -3), ("min_tokens", -1)])
def test_rows_and_the_job_check_values_by_the_same_rule(key, value):
    from batchgen.io.errors import RowError
    from batchgen.io.overrides import parse_overrides

    requirement = re.escape(f"is invalid: must be {VALUE_RANGES[key].requirement}")
    with pytest.raises(RowError, match=f"^{key}={value} {requirement}"):
        parse_overrides({key: value})
    with pytest.raises(ValueError, match=f"^sampling.{key}={value} {requirement}"):
        SamplingParams(**{key: value})


def test_a_repeated_step_reuses_its_packed_rows_with_the_new_positions():
    params = mixed_params(9)
    for i, p in enumerate(params):
        p.seed = 50 + i
    last = LastPacked()
    reused_floats = last.prepare(params, np.arange(9)).floats
    positions = np.arange(9) + 1  # the next decode step: every position moves on
    for rows in (slice(None), slice(None, None, -1), slice(5)):  # the same rows, then other orders and subsets
        batch = last.prepare(params[rows], positions[rows])
        fresh = SamplingBatch.prepare(params[rows], positions[rows])
        assert batch.features == fresh.features
        assert np.array_equal(batch.floats, fresh.floats) and np.array_equal(batch.ints, fresh.ints)
    previous = last.batch
    again = last.prepare(params[:5], positions[:5] + 1)
    assert again.floats is previous.floats and again.ints is not previous.ints  # shared parameters, new positions
    assert previous.floats is not reused_floats  # other rows, or another order: packed afresh


def test_rows_sharing_one_parameters_object_pack_as_rows_with_copies_of_it():
    """A job's rows share one parameters object, whose values prepare reads once: the batch is the one of rows
    holding equal copies, with each row's seed, position and penalty state."""
    rng = np.random.default_rng(0)
    for trial in range(40):
        rows = int(rng.integers(1, 40))
        options = penalized_params(12)[int(rng.integers(12))]
        options.logprobs = [None, 0, 3][trial % 3]
        shared = [options] * rows
        copies = [SamplingParams(**{f: getattr(options, f) for f in options.__dataclass_fields__})
                  for _ in range(rows)]
        seeds = rng.integers(0, 2**64, rows, dtype=np.uint64).tolist()
        positions = rng.integers(2, 100, rows).tolist()
        batches = []
        for params in (shared, copies):
            requests = [Request(i, [i % VOCAB, (3 * i) % VOCAB], p, eos_token_id=0, seed=seed)
                        for i, (p, seed) in enumerate(zip(params, seeds, strict=True))]
            histories = token_histories(requests, params)
            state = SamplingState(VOCAB, torch.device("cpu")) if histories is not None else None
            batches.append(SamplingBatch.prepare(params, positions, state, histories, seeds))
        one, other = batches
        assert one.features == other.features and one.logprobs == other.logprobs
        assert np.array_equal(one.floats, other.floats) and np.array_equal(one.ints, other.ints)
        assert one.bad_words == other.bad_words


def test_repeat_moves_the_previous_batch_only_for_the_same_seeds():
    params = [SamplingParams(temperature=0.8)] * 4  # rows sharing one parameters object
    last = LastPacked()
    packed = last.prepare(params, np.arange(4), seeds=[1, 2, 3, 4])
    assert last.repeat(params, np.arange(4) + 1, [1, 2, 3, 4]).floats is packed.floats
    assert last.repeat(params, np.arange(4), [5, 6, 7, 8]) is None  # other rows with the same parameters


def test_repeat_moves_the_previous_batch_only_for_the_very_same_parameters():
    params, others = mixed_params(4), mixed_params(4)
    for i, (p, other) in enumerate(zip(params, others, strict=True)):
        p.seed = other.seed = 7 + i
    last = LastPacked()
    assert last.repeat(params, np.arange(4)) is None  # nothing packed yet
    packed = last.prepare(params, np.arange(4))
    moved = last.repeat(list(params), np.arange(4) + 1)
    assert moved.floats is packed.floats
    assert np.array_equal(moved.ints, SamplingBatch.prepare(params, np.arange(4) + 1).ints)
    assert last.repeat(others, np.arange(4)) is None  # equal values, other objects
    assert last.repeat(params[:3], np.arange(3)) is None


def test_each_field_reaches_the_device_under_its_name():
    params = [SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.2,
                             presence_penalty=0.5, frequency_penalty=-0.25, min_tokens=4),
              SamplingParams(temperature=0, top_k=-1)]
    requests = make_requests(params)
    params[0].seed, params[1].seed = 2**64 + 2**63 + 3, 9
    state = SamplingState(VOCAB, torch.device("cpu"))
    tensors = step_batch(requests, state).to_device("cpu", state)
    assert tensors.temperature.tolist() == [np.float32(0.7), 0.0]
    assert tensors.inv_temperature.tolist() == [np.float32(1) / np.float32(0.7), 1.0]  # greedy rows: 1
    assert tensors.top_k.tolist() == [5, 0] and tensors.top_p.tolist() == [np.float32(0.9), 1.0]
    assert tensors.min_p.tolist() == [np.float32(0.05), 0.0]
    assert tensors.seed.tolist() == [3, 9] and tensors.position.tolist() == [4, 4]
    penalties = tensors.penalties
    assert penalties.repetition.tolist() == [np.float32(1.2), 1.0]
    assert penalties.presence.tolist() == [0.5, 0.0] and penalties.frequency.tolist() == [-0.25, 0.0]
    assert penalties.block_stops.tolist() == [1.0, 0.0]  # 2 of 4 tokens generated
    assert penalties.state_rows.tolist() == [1, 0]  # the second row uses no state: the neutral row


def test_a_given_argmax_serves_the_greedy_rows_unless_a_stage_changes_the_logits():
    """A decode graph hands the sampler its argmax: the greedy rows take it (the same ids as the sampler's own), and
    where penalties change the logits first the sampler takes its own argmax."""
    rows = 12
    params = mixed_params(rows)
    seeds, positions = [3000 + i for i in range(rows)], [5 * i for i in range(rows)]
    logits = logits_for(rows, seed=4)
    tensors = tensors_for(params, seeds, positions)
    own = run_sampler(logits, tensors).token_ids
    greedy = tensors.temperature == 0
    assert greedy.any() and not greedy.all()
    assert torch.equal(run_sampler(logits, tensors, logits.argmax(dim=-1)).token_ids, own)
    marked = torch.full((rows,), VOCAB - 1)  # not the argmax of any row: shows where the given ids are taken
    assert torch.equal(run_sampler(logits, tensors, marked).token_ids, torch.where(greedy, marked, own))

    state = SamplingStateRows(torch.zeros(2, VOCAB), torch.zeros(2, VOCAB, dtype=torch.bool), torch.zeros(2, VOCAB),
                              torch.zeros(2, VOCAB, dtype=torch.bool))
    tensors.penalties = PenaltyTensors(state, torch.ones(rows, dtype=torch.int64), torch.ones(rows),
                                       torch.zeros(rows), torch.zeros(rows), torch.zeros(rows))
    assert torch.equal(run_sampler(logits, tensors, marked).token_ids, own)


def test_the_route_follows_the_forward_and_the_stages_the_rows_use():
    greedy = step_batch(make_requests([SamplingParams(temperature=0)] * 2), None)
    sampled = step_batch(make_requests(mixed_params(2)), None)
    guided = greedy.with_bitmask(np.full((2, 10), -1, dtype=np.int32), VOCAB, pinned=False)
    banned = make_requests([SamplingParams(bad_words=["thee"])] * 2)
    for request in banned:
        request.bad_words_token_ids = [[5, 7]]  # the output ends in 5: the device checks the latest token
    bad_words = step_batch(banned, SamplingState(VOCAB, torch.device("cpu")))
    assert not bad_words.fixed_shape

    assert choose_route(greedy, forward_graphed=True, bucket_fits=True) is SamplingRoute.FORWARD_ARGMAX
    assert choose_route(guided, forward_graphed=True, bucket_fits=True) is SamplingRoute.GRAPH_LOGITS
    assert choose_route(sampled, forward_graphed=True, bucket_fits=False) is SamplingRoute.GRAPH_LOGITS
    assert choose_route(sampled, forward_graphed=False, bucket_fits=True) is SamplingRoute.STAGED_LOGITS
    assert choose_route(sampled, forward_graphed=False, bucket_fits=False) is SamplingRoute.EAGER
    assert choose_route(greedy, forward_graphed=False, bucket_fits=True) is SamplingRoute.EAGER
    assert choose_route(bad_words, forward_graphed=False, bucket_fits=True) is SamplingRoute.EAGER
    empty = step_batch([], None)
    assert choose_route(empty, forward_graphed=False, bucket_fits=True) is SamplingRoute.EAGER

