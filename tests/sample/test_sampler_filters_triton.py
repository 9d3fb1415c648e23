"""The one-kernel filters and draw of small vocabularies pick what the torch filters and draw pick, with the same
filtered logits: top-k, top-p and min-p alone and together, tokens tied at a cut, greedy rows and masked tokens."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="Triton kernels need triton (torch's CPU build has none)")

from tests.helpers.triton_support import DEVICE, TRITON_MARKS  # noqa: E402

pytestmark = TRITON_MARKS

ROWS = 12
FILTERS = {"top_k": ("top_k",), "top_p": ("top_p",), "min_p": ("min_p",), "all": ("top_k", "top_p", "min_p")}


def row_values(values: list, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor([values[i % len(values)] for i in range(ROWS)], dtype=dtype)


def torch_draw(logits, temperatures, inv_temperatures, top_ks, top_ps, min_ps, seeds, positions, greedy_ids):
    from batchgen.sample.sampler import _apply_min_p, _apply_top_k_top_p, _row_keys, _uniform

    filtered = logits.float() * inv_temperatures.unsqueeze(1)
    if top_ks is not None or top_ps is not None:
        filtered = _apply_top_k_top_p(filtered, top_ks, top_ps)
    if min_ps is not None:
        filtered = _apply_min_p(filtered, min_ps)
    gumbel = _uniform(_row_keys(seeds, positions), logits.shape[1]).log_().neg_().log_()
    ids = torch.where(temperatures == 0, greedy_ids, (filtered - gumbel).argmax(dim=-1))
    return ids, filtered


def inverse(temperatures: torch.Tensor) -> torch.Tensor:
    """1 / temperature, 1 for greedy rows (as SamplingBatch computes it)."""
    return 1.0 / torch.where(temperatures == 0, 1.0, temperatures)


@pytest.mark.parametrize("filters", list(FILTERS))
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "tied"])
@pytest.mark.parametrize(("vocab", "dtype"), [(65, torch.float32), (1000, torch.bfloat16), (4096, torch.float32)],
                         ids=str)
def test_filtered_draw_equals_torch(vocab, dtype, ties, filters):
    from batchgen.sample.filters_triton import filtered_draw

    gen = torch.Generator().manual_seed(vocab + 7 * ties)
    if ties:  # few distinct values: many tokens tie at each cut
        logits = torch.randint(-6, 6, (ROWS, vocab), generator=gen).float()
    else:
        logits = torch.randn(ROWS, vocab, generator=gen) * 3
    logits[::4, ::3] = float("-inf")  # masked tokens (a bitmask's)
    logits = logits.to(dtype)
    temperatures = row_values([0.8, 0.0, 1.0, 1.7, 0.5], torch.float32)  # 0: a greedy row
    tensors = {
        "top_k": row_values([40, 0, 1, 5, vocab + 10, 3], torch.int64),  # 0: off; more than the vocabulary
        # 1: off. Not a multiple of the probability of tokens tied after top-k (1/40, 1/5, 1/3), where the mass
        # before a token would equal p up to rounding, and sums in another order may round to the other side.
        "top_p": row_values([0.87, 1.0, 0.52, 0.06, 0.99], torch.float32),
        "min_p": row_values([0.05, 0.0, 0.2, 0.5], torch.float32),  # 0: off
    }
    top_ks, top_ps, min_ps = (tensors[name] if name in FILTERS[filters] else None for name in tensors)
    seeds = torch.arange(ROWS, dtype=torch.int64) * 2**40 + 3
    positions = torch.arange(ROWS, dtype=torch.int64) * 17
    greedy_ids = torch.randint(0, vocab, (ROWS,), generator=gen)
    args = (logits, temperatures, inverse(temperatures), top_ks, top_ps, min_ps, seeds, positions, greedy_ids)

    expected_ids, expected_filtered = torch_draw(*args)
    on_device = [None if t is None else t.to(DEVICE) for t in args]
    ids, filtered = (t.cpu() for t in filtered_draw(*on_device))

    assert torch.equal(filtered, expected_filtered)
    assert torch.equal(ids, expected_ids)
    assert (filtered == float("-inf")).any()  # a filter cut something


def test_the_two_zeros_tie_at_a_cut():
    from batchgen.sample.filters_triton import filtered_draw

    logits = torch.full((2, 65), -1.0)
    logits[:, :10] = 1.0
    logits[:, 10:30:2], logits[:, 11:30:2] = -0.0, 0.0  # top-k 20 cuts the zeros: the first ten by index stay
    temperatures = torch.ones(2)
    top_ks = torch.full((2,), 20, dtype=torch.int64)
    seeds, positions, greedy_ids = torch.arange(2), torch.arange(2), torch.zeros(2, dtype=torch.int64)
    args = (logits, temperatures, inverse(temperatures), top_ks, None, None, seeds, positions, greedy_ids)

    _, expected_filtered = torch_draw(*args)
    _, filtered = filtered_draw(*[None if t is None else t.to(DEVICE) for t in args])

    assert torch.equal(torch.isfinite(filtered.cpu()), torch.isfinite(expected_filtered))
    assert torch.isfinite(expected_filtered[:, :20]).all() and not torch.isfinite(expected_filtered[:, 20:]).any()
