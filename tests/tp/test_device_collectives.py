"""DeviceCollectives over a backend's two ways of finishing a synchronous collective, and beside the mapped
buffers' all-reduce (its GPU tests: test_gpu_peer_all_reduce.py)."""

from __future__ import annotations

import pytest
import torch

from batchgen.config import EngineConfig
from batchgen.tp.group import ControlChannel, DeviceCollectives, RankGroup
from batchgen.tp.peer_memory import peer_rows


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


class RecordingPeer:
    """A stand-in for the mapped buffers' all-reduce (batchgen/tp/peer_memory.py): adds 100 to what it sums."""

    def __init__(self, accepts: bool) -> None:
        self.accepting = accepts
        self.aborted = False

    def accepts(self, tensor: torch.Tensor) -> bool:
        return self.accepting

    def all_reduce(self, tensor: torch.Tensor) -> None:
        tensor.add_(100)

    def abort(self) -> None:
        self.aborted = True


def test_the_mapped_buffers_sum_what_they_accept_and_the_backend_the_rest():
    peer = RecordingPeer(accepts=True)
    collectives = DeviceCollectives(DoublingBackend(None), size=2, peer=peer)
    tensor = torch.tensor([1.0])
    collectives.all_reduce(tensor)
    assert tensor.tolist() == [101.0]
    peer.accepting = False
    collectives.all_reduce(tensor)
    assert tensor.tolist() == [202.0]


class AbortableBackend(DoublingBackend):
    def __init__(self) -> None:
        super().__init__(None)
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True


def test_abort_releases_the_mapped_buffers_waits_and_both_groups():
    peer, device, control = RecordingPeer(accepts=True), AbortableBackend(), AbortableBackend()
    group = RankGroup(0, 2, DeviceCollectives(device, 2, peer), ControlChannel(control, 0))
    group.abort()
    assert peer.aborted and device.aborted and control.aborted


@pytest.mark.parametrize(("options", "rows"), [({}, 256), ({"max_num_seqs": 8}, 8), ({"enforce_eager": True}, 0),
                                               ({"custom_all_reduce": False}, 0)])
def test_the_mapped_buffers_hold_the_largest_decode_graph(options: dict, rows: int):
    assert peer_rows(EngineConfig(**options)) == rows
