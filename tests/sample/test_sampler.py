"""Sampler: greedy argmax, seeded reproducibility independent of the batch, filters, and the sampled distribution."""

from dataclasses import replace

import pytest
import torch

from batchgen.sample.batch import SamplingBatch, SamplingTensors
from batchgen.sample.params import SamplingParams
from batchgen.sample.sampler import run_sampler


def tensors_for(params: list[SamplingParams], seeds: list[int] | None = None, positions: list[int] | None = None,
                device: str = "cpu") -> SamplingTensors:
    seeds = list(range(len(params))) if seeds is None else seeds
    positions = [0] * len(params) if positions is None else positions
    seeded = [replace(p, seed=seed) for p, seed in zip(params, seeds, strict=True)]
    return SamplingBatch.prepare(seeded, positions).to_device(device)


def sample(logits: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
    """logits (B, V), any float dtype -> (B,) int64 token ids on the same device."""
    return run_sampler(logits, tensors).token_ids


def random_logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_greedy_is_argmax(dtype):
    logits = random_logits(16, 1000).to(dtype)
    tensors = tensors_for([SamplingParams(temperature=0)] * 16)
    assert tensors.all_greedy
    tokens = sample(logits, tensors)
    assert tokens.dtype == torch.int64 and torch.equal(tokens, logits.argmax(dim=-1))


def test_greedy_rows_take_argmax_in_mixed_batch():
    logits = random_logits(8, 500)
    params = [SamplingParams(temperature=0 if i % 2 else 1.0, top_k=5, top_p=0.5, min_p=0.1) for i in range(8)]
    tensors = tensors_for(params)
    assert not tensors.all_greedy
    tokens = sample(logits, tensors)
    assert torch.equal(tokens[1::2], logits[1::2].argmax(dim=-1))


def test_only_used_filters_are_built():
    tensors = tensors_for([SamplingParams(), SamplingParams(temperature=0, top_k=3)])
    assert tensors.top_k is None and tensors.top_p is None and tensors.min_p is None
    tensors = tensors_for([SamplingParams(top_k=3), SamplingParams(top_p=0.9), SamplingParams(min_p=0.1)])
    assert tensors.top_k.tolist() == [3, 0, 0] and tensors.top_p is not None and tensors.min_p is not None


def test_same_seed_and_position_same_token_different_seeds_differ():
    rows = 256
    logits = torch.zeros(rows, 1000)  # uniform: the token is decided by the random draws alone
    params = [SamplingParams()] * rows
    first = sample(logits, tensors_for(params, seeds=[5] * rows, positions=list(range(rows))))
    again = sample(logits, tensors_for(params, seeds=[5] * rows, positions=list(range(rows))))
    other = sample(logits, tensors_for(params, seeds=[6] * rows, positions=list(range(rows))))
    assert torch.equal(first, again)
    assert (first != other).float().mean() > 0.9
    per_seed = sample(logits, tensors_for(params, seeds=list(range(rows)), positions=[3] * rows))
    assert per_seed.unique().numel() > 200


def test_large_and_negative_seeds():
    logits = torch.zeros(3, 100)
    tokens = sample(logits, tensors_for([SamplingParams()] * 3, seeds=[2**64 + 1, -1, 2**40]))
    assert tokens.shape == (3,)


def test_row_result_independent_of_batch():
    vocab = 300
    row_logits = random_logits(1, vocab, seed=1)
    row_params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9)
    alone = sample(row_logits, tensors_for([row_params], seeds=[11], positions=[42]))
    for trial in range(5):
        batch_logits = random_logits(6, vocab, seed=10 + trial)
        batch_logits[trial] = row_logits[0]
        params = [SamplingParams(temperature=0.5 + i / 10, min_p=0.05 * (i % 2)) for i in range(6)]
        params[trial] = row_params
        seeds, positions = list(range(100, 106)), list(range(trial, trial + 6))
        seeds[trial], positions[trial] = 11, 42
        assert sample(batch_logits, tensors_for(params, seeds, positions))[trial] == alone[0]


def many_draws(logits_row: torch.Tensor, params: SamplingParams, draws: int = 4000) -> torch.Tensor:
    logits = logits_row.expand(draws, -1).contiguous()
    return sample(logits, tensors_for([params] * draws, seeds=[1] * draws, positions=list(range(draws))))


def test_top_k_stays_in_top_k():
    logits = random_logits(1, 200, seed=2)[0]
    tokens = many_draws(logits, SamplingParams(top_k=7))
    top = set(logits.topk(7).indices.tolist())
    assert set(tokens.tolist()) <= top and len(set(tokens.tolist())) > 3


def test_top_p_stays_in_nucleus():
    logits = random_logits(1, 200, seed=3)[0] / 2
    probs = logits.softmax(-1)
    sorted_probs, order = probs.sort(descending=True)
    size = int((sorted_probs.cumsum(0) < 0.6).sum()) + 1  # smallest prefix whose mass reaches 0.6
    nucleus = set(order[:size].tolist())
    tokens = set(many_draws(logits, SamplingParams(top_p=0.6)).tolist())
    assert tokens <= nucleus and len(tokens) > 1


def test_tiny_top_p_keeps_the_top_token():
    logits = random_logits(1, 50, seed=4)[0]
    assert set(many_draws(logits, SamplingParams(top_p=1e-6), draws=200).tolist()) == {int(logits.argmax())}


def test_min_p_stays_above_threshold():
    logits = random_logits(1, 200, seed=5)[0] / 2
    probs = logits.softmax(-1)
    allowed = set((probs >= 0.2 * probs.max()).nonzero().flatten().tolist())
    tokens = set(many_draws(logits, SamplingParams(min_p=0.2)).tolist())
    assert tokens <= allowed and len(tokens) > 1


def test_distribution_matches_softmax():
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0, 0.5])
    draws = 40_000
    tokens = many_draws(logits, SamplingParams(temperature=1.0), draws=draws)
    empirical = torch.bincount(tokens, minlength=5).float() / draws
    # Binomial standard error is at most 0.0025 here; 0.015 is six of them.
    assert (empirical - logits.softmax(-1)).abs().max() < 0.015


def test_distribution_with_temperature_and_top_k():
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0, 0.5])
    draws = 40_000
    tokens = many_draws(logits, SamplingParams(temperature=2.0, top_k=3), draws=draws)
    empirical = torch.bincount(tokens, minlength=5).float() / draws
    expected = torch.full((5,), float("-inf"))
    expected[[0, 3, 4]] = logits[[0, 3, 4]] / 2
    assert (empirical - expected.softmax(-1)).abs().max() < 0.015


def test_low_temperature_concentrates():
    logits = random_logits(1, 100, seed=6)[0]
    top = int(logits.argmax())
    hot = (many_draws(logits, SamplingParams(temperature=2.0)) == top).float().mean()
    cold = (many_draws(logits, SamplingParams(temperature=0.1)) == top).float().mean()
    assert cold > 0.95 and cold > hot + 0.3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sampling_accepts_half_logits(dtype):
    logits = random_logits(4, 64).to(dtype)
    tokens = sample(logits, tensors_for([SamplingParams(top_p=0.9)] * 4))
    assert tokens.dtype == torch.int64 and tokens.shape == (4,)


def test_masked_tokens_are_never_sampled_even_at_extreme_draws():
    # Seeds 1000..1255 over 65536 tokens include draws that once rounded to exactly 1.0, which turned the
    # masked logits into NaN that argmax then picked.
    rows, vocab = 256, 65536
    logits = random_logits(rows, vocab, seed=3)
    params = [SamplingParams(temperature=1.0, top_k=1)] * rows
    tokens = sample(logits, tensors_for(params, seeds=list(range(1000, 1000 + rows)), positions=list(range(rows))))
    assert torch.equal(tokens, logits.argmax(dim=-1))
