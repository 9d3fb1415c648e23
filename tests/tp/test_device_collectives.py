"""DeviceCollectives over a backend's two ways of finishing a synchronous collective."""

from __future__ import annotations

import torch

from batchgen.tp.group import DeviceCollectives


class FinishedWork:
    def __init__(self) -> None:
        self.waited = False

    def wait(self) -> bool:
        self.waited = True
        return True


class DoublingBackend:
    """A two-rank backend whose peer holds the same tensor; `work` is what its collectives return: NCCL returns None
    for a synchronous collective, gloo a work to wait on."""

    def __init__(self, work: FinishedWork | None) -> None:
        self.work = work

    def allreduce(self, tensors: list[torch.Tensor], options: object) -> FinishedWork | None:
        tensors[0].mul_(2)
        return self.work

    def _allgather_base(self, out: torch.Tensor, tensor: torch.Tensor, options: object) -> FinishedWork | None:
        out.copy_(torch.cat([tensor, tensor]))
        return self.work


def test_collectives_finish_when_the_backend_returns_no_work():
    collectives = DeviceCollectives(DoublingBackend(None), size=2)
    tensor = torch.tensor([1.0, 2.0])
    collectives.all_reduce(tensor)
    assert tensor.tolist() == [2.0, 4.0]
    assert collectives.all_gather(torch.tensor([[3.0]])).tolist() == [[3.0], [3.0]]


def test_collectives_wait_for_the_work_a_backend_returns():
    work = FinishedWork()
    collectives = DeviceCollectives(DoublingBackend(work), size=2)
    collectives.all_reduce(torch.ones(1))
    assert work.waited
