"""The fused logprobs kernel (`logprobs_triton.score_top1`) against the torch path of `score_slice`: the chosen
token's logprob and rank, the most likely token (the first of equal ones) and its logprob, for bf16 and float32
logits, ties and -inf logits.

Runs on CUDA; without a GPU, `TRITON_INTERPRET=1 pytest tests/sample/test_logprobs_triton.py` runs it through Triton's
CPU interpreter.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="Triton kernels need triton (torch's CPU build has none)")

from batchgen.sample.logprobs import score_slice  # noqa: E402
from batchgen.sample.logprobs_triton import MANY_ROWS, score_top1  # noqa: E402
from tests.helpers.triton_support import DEVICE, TRITON_MARKS  # noqa: E402

pytestmark = TRITON_MARKS


def reference(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """score_slice's torch path, on the CPU."""
    scored = score_slice(logits.cpu(), token_ids.cpu(), k)
    return scored.logprobs, scored.ranks, scored.top_ids, scored.top_logprobs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("rows", "vocab"), [(3, 151_936), (7, 5_000), (4, 100), (MANY_ROWS, 5_000)], ids=str)
def test_the_fused_kernel_equals_the_torch_path(rows: int, vocab: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(rows * vocab)
    # Few distinct values: every row has ties, for its maximum and for the chosen token's logit.
    logits = torch.randint(-30, 30, (rows + 3, vocab), generator=gen).to(dtype) / 4
    logits[rows, : vocab // 2] = float("-inf")  # masked logits (a filtered distribution), the chosen one among them
    logits[rows + 1, 1:] = float("-inf")  # one finite logit: the top token is the first
    logits[rows + 2, -1] = 100.0  # the last column, alone above the rest
    token_ids = torch.randint(0, vocab, (rows + 3,), generator=gen)
    token_ids[rows] = 0
    token_ids[rows + 1] = 0
    logits, token_ids = logits.to(DEVICE), token_ids.to(DEVICE)

    scored = score_top1(logits, token_ids)

    logprobs, ranks, top_ids, top_logprobs = reference(logits, token_ids, 1)
    assert torch.equal(scored.ranks.cpu(), ranks)
    assert torch.equal(scored.top_ids.cpu(), top_ids)
    assert torch.allclose(scored.logprobs.cpu(), logprobs, atol=1e-5, rtol=1e-5)
    assert torch.allclose(scored.top_logprobs.cpu(), top_logprobs, atol=1e-5, rtol=1e-5)
    assert scored.logprobs[rows].item() == float("-inf") and scored.ranks[rows].item() == vocab - vocab // 2 + 1
    assert scored.top_ids[rows + 1].item() == 0 and scored.top_logprobs[rows + 1].item() == 0.0
    assert scored.top_ids[rows + 2].item() == vocab - 1


def test_score_slice_runs_the_fused_kernel_for_at_most_one_alternative_on_cuda() -> None:
    if DEVICE != "cuda":
        pytest.skip("the torch path runs on CPU")
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 1_000, generator=gen).to(torch.bfloat16)
    token_ids = torch.randint(0, 1_000, (5,), generator=gen)
    for k in (0, 1):
        scored = score_slice(logits.to(DEVICE), token_ids.to(DEVICE), k)
        logprobs, ranks, top_ids, _ = reference(logits, token_ids, k)
        assert scored.top_ids.shape == top_ids.shape == (5, k) and torch.equal(scored.ranks.cpu(), ranks)
        assert torch.allclose(scored.logprobs.cpu(), logprobs, atol=1e-5, rtol=1e-5)


def test_no_rows() -> None:
    scored = score_top1(torch.empty(0, 100, device=DEVICE), torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert scored.logprobs.shape == (0,) and scored.top_ids.shape == (0, 1)
