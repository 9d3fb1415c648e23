"""The Triton draw (row keys hashed in the kernel) picks what the torch draw picks, for any vocabulary size."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from triton_support import DEVICE, TRITON_MARKS  # noqa: E402

pytestmark = TRITON_MARKS


@pytest.mark.parametrize("vocab", [65, 1000, 5000])
def test_triton_draw_equals_torch_draw(vocab):
    from batchgen.layers.sampler import _row_keys, _uniform
    from batchgen.layers.sampler_triton import gumbel_argmax

    rows = 16
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab)) * 3
    logits[::3, ::2] = float("-inf")  # masked tokens, as the filters leave them
    inv_temperatures = torch.linspace(0.5, 2.0, rows)
    seeds = torch.tensor([2**62 + 7 * i for i in range(rows // 2)] + list(range(rows // 2)), dtype=torch.int64)
    positions = torch.arange(rows, dtype=torch.int64) * 1000
    gumbel = _uniform(_row_keys(seeds, positions), vocab).log_().neg_().log_()
    expected = (logits * inv_temperatures.unsqueeze(1) - gumbel).argmax(dim=-1)
    tensors = [t.to(DEVICE) for t in (logits, inv_temperatures, seeds, positions)]
    assert torch.equal(gumbel_argmax(*tensors).cpu(), expected)
