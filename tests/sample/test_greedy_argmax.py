"""The decode graphs' greedy argmax (Triton, `draw_triton.greedy_argmax`) against torch.argmax: the first
largest value, and the first NaN where a row has one.

Runs on CUDA; without a GPU, `TRITON_INTERPRET=1 pytest tests/sample/test_greedy_argmax.py` runs it through Triton's CPU
interpreter (it needs numpy<2.4).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="Triton kernels need triton (torch's CPU build has none)")

from batchgen.sample.draw_triton import greedy_argmax
from tests.helpers.triton_support import DEVICE, TRITON_MARKS  # noqa: E402

pytestmark = TRITON_MARKS


# programs: None launches the default (one a block for these small batches); a few share a launch's blocks
# (a decode graph's large batches), each taking several, some of them of different rows.
@pytest.mark.parametrize("programs", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "vocab"), [(1, 151_936), (3, 50_257), (5, 100), (2, 64)], ids=str)
def test_greedy_argmax_matches_torch(rows: int, vocab: int, dtype: torch.dtype, programs: int | None) -> None:
    gen = torch.Generator().manual_seed(rows * vocab)
    # Few distinct values, so every row has ties for its maximum (some across the blocks of a row).
    logits = torch.randint(-50, 50, (rows + 4, vocab), generator=gen).to(dtype)
    logits[rows] = float("-inf")  # a row of masked logits: index 0
    logits[rows + 1, vocab // 3] = float("inf")
    logits[rows + 1, vocab // 2] = float("inf")  # two infinities: the first
    logits[rows + 2, [vocab - 1, vocab // 2]] = float("nan")  # NaN beats every number: the first NaN
    logits[rows + 3, -1] = 1000.0  # the last column
    logits = logits.to(DEVICE)
    pending_ids = torch.full((rows + 2,), -1, dtype=torch.int64, device=DEVICE)

    ids = greedy_argmax(logits, pending_ids, programs=programs)

    expected = logits.float().cpu().argmax(dim=-1)
    assert expected[rows + 2] == vocab // 2 and expected[rows + 1] == vocab // 3  # torch's rules, as documented
    assert torch.equal(ids.cpu(), expected)
    assert torch.equal(pending_ids.cpu(), expected[: rows + 2])  # only the rows pending_ids has


@pytest.mark.parametrize("programs", [None, 5])
@pytest.mark.parametrize(("rows", "vocab"), [(6, 151_936), (5, 100)], ids=str)
def test_greedy_argmax_of_wanted_rows_only(rows: int, vocab: int, programs: int | None) -> None:
    """A decode graph's rows that draw are not read: only the wanted rows get their argmax and pending id; the others
    get id 0, which the sampler's padding rows (greedy) may take."""
    gen = torch.Generator().manual_seed(rows + vocab)
    logits = torch.randn(rows, vocab, generator=gen).to(DEVICE)
    wanted = torch.tensor([1, 0] * (rows // 2) + [1] * (rows % 2), dtype=torch.int64, device=DEVICE)
    pending_ids = torch.full((rows,), -1, dtype=torch.int64, device=DEVICE)

    ids = greedy_argmax(logits, pending_ids, wanted, programs=programs)

    expected = logits.cpu().argmax(dim=-1)
    chosen = wanted.cpu().bool()
    assert torch.equal(ids.cpu(), torch.where(chosen, expected, 0))
    assert torch.equal(pending_ids.cpu(), torch.where(chosen, expected, -1))
