"""The Triton draw (row keys hashed in the kernel, each row split over programs) picks what the torch draw picks,
for any vocabulary size, and greedy rows take their greedy ids; its bound on the Gumbel terms holds for every draw."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="Triton kernels need triton (torch's CPU build has none)")

from tests.helpers.triton_support import DEVICE, TRITON_MARKS  # noqa: E402

pytestmark = TRITON_MARKS


def _torch_draw(logits, temperatures, seeds, positions, greedy_ids, scale=True):
    """The torch path's draw, and the tensors seeded_draw takes for it (on DEVICE)."""
    from batchgen.sample.sampler import _row_keys, _uniform

    inv_temperatures = 1.0 / torch.where(temperatures == 0, 1.0, temperatures)
    scaled = logits * inv_temperatures.unsqueeze(1) if scale else logits
    gumbel = _uniform(_row_keys(seeds, positions), logits.shape[1]).log_().neg_().log_()
    expected = torch.where(temperatures == 0, greedy_ids, (scaled - gumbel).argmax(dim=-1))
    tensors = [t.to(DEVICE) for t in (logits, temperatures, inv_temperatures, seeds, positions, greedy_ids)]
    return expected, tensors, gumbel


@pytest.mark.parametrize("scale", [True, False], ids=["divides by T", "divided already"])
@pytest.mark.parametrize("vocab", [65, 1000, 2049, 5000, 151_936])
def test_triton_draw_equals_torch_draw(vocab, scale):
    from batchgen.sample.draw_triton import seeded_draw

    rows = 16
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    logits[::3, ::2] = float("-inf")  # masked tokens, as the filters leave them
    logits[5, vocab // 2] = float("nan")  # a NaN wins, as in torch.argmax
    temperatures = torch.linspace(0.5, 2.0, rows)
    temperatures[[2, 9]] = 0.0  # greedy rows take their greedy ids
    seeds = torch.tensor([2**62 + 7 * i for i in range(rows // 2)] + list(range(rows // 2)), dtype=torch.int64)
    positions = torch.arange(rows, dtype=torch.int64) * 1000
    greedy_ids = torch.randint(0, vocab, (rows,), generator=gen)

    expected, tensors, _ = _torch_draw(logits, temperatures, seeds, positions, greedy_ids, scale)
    token_ids = seeded_draw(*tensors, scale=scale)

    assert expected[5] == vocab // 2
    assert torch.equal(token_ids.cpu(), expected)


@pytest.mark.parametrize("shape", ["flat", "peaked", "tied"])
def test_triton_draw_equals_torch_draw_on_every_path(shape):
    """Flat logits (the Gumbel terms decide), peaked ones (a few tokens lead) and logits that cancel the Gumbel terms
    up to a spread of 1, so that dozens of a block's columns stay within the bounds' slack of its lead and the block
    computes every exact score (a spread much narrower would make the winner turn on the logarithms' last bit, where
    the interpreter's and torch's may differ)."""
    from batchgen.sample.draw_triton import seeded_draw

    rows, vocab = 24, 6000
    gen = torch.Generator().manual_seed(len(shape))
    temperatures = torch.ones(rows)
    seeds = torch.arange(rows, dtype=torch.int64) * 977
    positions = torch.arange(rows, dtype=torch.int64) + 5
    greedy_ids = torch.zeros(rows, dtype=torch.int64)
    logits = torch.zeros(rows, vocab)
    if shape == "peaked":
        logits = torch.randn(rows, vocab, generator=gen) * 8
    expected, tensors, gumbel = _torch_draw(logits, temperatures, seeds, positions, greedy_ids)
    if shape == "tied":
        logits = gumbel + torch.rand(rows, vocab, generator=gen)
        expected, tensors, _ = _torch_draw(logits, temperatures, seeds, positions, greedy_ids)

    assert torch.equal(seeded_draw(*tensors).cpu(), expected)


def test_gumbel_lower_bound_holds_for_every_draw():
    """_gumbel_lower_bound is at most _gumbel_of, and within 0.08 of it, for each of the 2**23 values a draw's bits
    take."""
    from tests.sample.gumbel_bound_kernel import bounds_and_gumbels

    bits = torch.arange(2**23, dtype=torch.int32, device=DEVICE)
    lower, gumbel = bounds_and_gumbels(bits)
    assert bool((lower <= gumbel).all())
    assert float((gumbel - lower).max()) < 0.08
