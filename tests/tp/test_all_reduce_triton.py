"""The mapped-buffer all-reduce kernel (batchgen/tp/all_reduce_triton.py) with two ranks emulated in one process, one
launch after the other: both ranks' buffers live in one tensor, each rank's receive buffer found from the other's by
its offset, as the mapped buffers are. A rank's launch waits for the other's words, so the first rank of each call
first runs with its stop word set (as an abort does): it sends its words and stops waiting; its count goes back and
its input is restored, then the second rank runs (finding the first's words), then the first again (resending the
same words, finding the second's). Each sum must be the two rows added in float32 and rounded once, the same on both
ranks, through calls of several row counts that reuse the slots' halves and counts that wrap past 2**31.

Runs on CUDA (one GPU), or `TRITON_INTERPRET=1` on CPU; the two-GPU test is test_gpu_peer_all_reduce.py.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="Triton kernels need triton (torch's CPU build has none)")

from batchgen.tp.all_reduce_triton import one_shot_all_reduce  # noqa: E402
from tests.helpers.triton_support import DEVICE, ON_GPU, TRITON_MARKS  # noqa: E402

pytestmark = TRITON_MARKS
MAX_ROWS, SLOT_WORDS = 4, 128  # a float32 row of 128 fills its slot
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
# (rows, width) of successive calls: rows 0 and 1 reuse each half of their slots several times
CALLS = [(1, 128), (3, 40), (1, 128), (4, 8), (2, 100), (1, 2), (3, 128)]


class Rank:
    def __init__(self, rank: int, buffers: torch.Tensor, first_count: int) -> None:
        self.rank = rank
        self.receive = buffers[rank]
        self.offsets = torch.tensor([(buffers[r].data_ptr() - self.receive.data_ptr()) // 8 for r in range(2)],
                                    dtype=torch.int64, device=DEVICE)
        self.counts = torch.full((MAX_ROWS,), first_count, dtype=torch.int32, device=DEVICE)
        self.stop = torch.zeros(1, dtype=torch.int32, device=DEVICE)

    def all_reduce(self, x: torch.Tensor) -> None:
        one_shot_all_reduce(x, self.receive, self.offsets, self.counts, self.stop, SLOT_WORDS, self.rank, 2)


def all_reduce_both(ranks: list[Rank], inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    first, second = ranks
    first_input = inputs[0].clone()
    first.stop.fill_(1)
    first.all_reduce(inputs[0])  # sends its words, waits for nothing
    first.stop.fill_(0)
    first.counts[: inputs[0].shape[0]] -= 1
    inputs[0].copy_(first_input)
    second.all_reduce(inputs[1])
    first.all_reduce(inputs[0])
    return inputs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("first_count", [0, 2**31 - 3])  # the counts wrap at the fourth call of row 0
def test_each_rank_gets_the_rows_summed_once_in_float32(dtype: torch.dtype, first_count: int):
    per_rank = 2 * 2 * MAX_ROWS * SLOT_WORDS  # senders, halves, rows, words
    buffers = torch.zeros(2, per_rank, dtype=torch.int64, device=DEVICE)
    ranks = [Rank(0, buffers, first_count), Rank(1, buffers, first_count)]
    generator = torch.Generator().manual_seed(7)
    for call, (rows, width) in enumerate(CALLS):
        inputs = [(torch.randn(rows, width, generator=generator) * 4).to(dtype).to(DEVICE) for _ in range(2)]
        expected = (inputs[0].float() + inputs[1].float()).to(dtype)
        summed = all_reduce_both(ranks, [x.clone() for x in inputs])
        assert torch.equal(summed[0], expected), f"call {call}: rank 0"
        assert torch.equal(summed[1], expected), f"call {call}: rank 1"
    uses = torch.zeros(MAX_ROWS, dtype=torch.int64)
    for rows, _ in CALLS:
        uses[:rows] += 1
    wrapped = ((first_count + uses + 2**31) % 2**32 - 2**31).to(torch.int32)
    assert torch.equal(ranks[0].counts.cpu(), wrapped) and torch.equal(ranks[1].counts.cpu(), wrapped)
