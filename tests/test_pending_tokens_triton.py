"""The one-kernel fill of pending tokens (`pending_tokens_triton`) against the torch path it replaces on CUDA.

Runs on CUDA; without a GPU, `TRITON_INTERPRET=1 pytest tests/test_pending_tokens_triton.py` runs it through Triton's
CPU interpreter (it needs numpy<2.4).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from triton_support import DEVICE, TRITON_MARKS  # noqa: E402

from batchgen.engine.cuda_graph import fill_pending_tokens  # noqa: E402
from batchgen.layers import pending_tokens_triton  # noqa: E402

pytestmark = TRITON_MARKS


@pytest.mark.parametrize("num_tokens", [2, 7, 1024, 2500])
def test_fill_matches_torch(num_tokens: int) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    input_ids = torch.randint(0, 50_000, (num_tokens,), generator=gen)
    last_sampled = torch.randint(0, 50_000, (64,), generator=gen)
    pending_source = torch.randint(-1, 64, (num_tokens,), generator=gen)  # about 1 in 65 not pending
    pending_source[0] = -1
    pending_source[-1] = 63  # the last row of last_sampled

    filled = pending_tokens_triton.fill_pending_tokens(input_ids.to(DEVICE), pending_source.to(DEVICE),
                                                       last_sampled.to(DEVICE))

    expected = fill_pending_tokens(input_ids, pending_source, last_sampled)  # torch's, on CPU tensors
    assert expected[0] == input_ids[0] and expected[-1] == last_sampled[63]
    assert torch.equal(filled.cpu(), expected)


def test_no_tokens() -> None:
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    assert pending_tokens_triton.fill_pending_tokens(empty, empty, torch.zeros(4, dtype=torch.int64,
                                                                                device=DEVICE)).numel() == 0
