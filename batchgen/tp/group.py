"""The process groups of the tensor-parallel ranks, kept apart from torch.distributed's default group (a job under
torchrun has one of its own, and so may the program that builds an `LLM`):

- the device group: the layers' all-reduces and all-gathers (gloo on CPU, NCCL on CUDA, on the current stream, so
  CUDA graphs capture them; the decode graphs' small all-reduces through the ranks' mapped buffers instead,
  batchgen/tp/peer_memory.py);
- the control group (gloo, host memory): rank 0's step messages, and the few numbers the ranks agree on.

Rank 0 serves the rendezvous store (a TCPStore on a free port of this host); a follower connects to it, says it has
joined, and both build the groups.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions, AllreduceOptions, BroadcastOptions

from batchgen.tp.peer_memory import PeerAllReduce

HOST = "127.0.0.1"  # the ranks of a tensor-parallel engine share a host
STORE_TIMEOUT = timedelta(minutes=10)  # a follower starting: Python, torch, the connection
# Followers wait for rank 0's next step for as long as it takes (an idle LLM object); a rank that dies closes its
# connections, which fails the collectives of the others at once.
CONTROL_TIMEOUT = timedelta(hours=48)
NCCL_TIMEOUT = timedelta(minutes=30)
MESSAGE_HEADER_BYTES = 32 * 1024  # one broadcast carries a message up to this size; a larger one takes a second
_LENGTH = struct.Struct("<q")


def joined_key(rank: int) -> str:
    return f"joined/{rank}"


def serve_store(size: int) -> dist.TCPStore:
    """Rank 0's rendezvous store, on a free port (its .port)."""
    return dist.TCPStore(HOST, 0, size, is_master=True, wait_for_workers=False, timeout=STORE_TIMEOUT)


def connect_store(port: int, size: int) -> dist.TCPStore:
    return dist.TCPStore(HOST, port, size, is_master=False, timeout=STORE_TIMEOUT)


def nccl_environment(environ: dict[str, str] | os._Environ) -> None:
    """NVLink multicast (NVLS) off unless the user set it: it needs a fabric manager setup not every host has."""
    environ.setdefault("NCCL_NVLS_ENABLE", "0")


class DeviceCollectives:
    """The layers' collectives (layers.tensor_parallel.Collectives) over one backend."""

    def __init__(self, backend: dist.Backend, size: int, peer: PeerAllReduce | None = None) -> None:
        self.backend = backend
        self.size = size
        self.peer = peer

    def all_reduce(self, tensor: torch.Tensor) -> None:
        if self.peer is not None and self.peer.accepts(tensor):
            self.peer.all_reduce(tensor)
            return
        options = AllreduceOptions()
        options.asyncOp = False  # NCCL runs a synchronous collective on the current stream
        _wait(self.backend.allreduce([tensor], options))

    def describe(self) -> str:
        """How the ranks sum: the backend's name, and whether the decode graphs sum through the mapped buffers."""
        name = self.backend.name()
        return f"{name}; decode graphs: mapped buffers" if self.peer is not None else name

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        gathered = tensor.new_empty((self.size * tensor.shape[0], *tensor.shape[1:]))
        options = AllgatherOptions()
        options.asyncOp = False
        _wait(self.backend._allgather_base(gathered, tensor, options))
        return gathered


def _wait(work: dist.Work | None) -> None:
    """NCCL returns no work for a synchronous collective (it is already ordered on the current stream); gloo
    returns one to wait on."""
    if work is not None:
        work.wait()


class ControlChannel:
    """Rank 0's messages to every follower, each one broadcast of a preallocated buffer (two when it is longer), and
    agreements over small integers; host memory, gloo."""

    def __init__(self, backend: dist.Backend, rank: int) -> None:
        self.backend = backend
        self.rank = rank
        self.header = torch.zeros(MESSAGE_HEADER_BYTES, dtype=torch.uint8)

    def _broadcast(self, buffer: torch.Tensor) -> None:
        options = BroadcastOptions()
        options.rootRank = 0
        self.backend.broadcast([buffer], options).wait()

    def send(self, payload: bytes) -> None:
        """Rank 0: broadcasts `payload` to the followers."""
        inline = MESSAGE_HEADER_BYTES - _LENGTH.size
        header = self.header.numpy()
        _LENGTH.pack_into(header, 0, len(payload))
        header[_LENGTH.size:_LENGTH.size + min(len(payload), inline)] = memoryview(payload[:inline])
        self._broadcast(self.header)
        if len(payload) > inline:
            self._broadcast(torch.frombuffer(bytearray(payload[inline:]), dtype=torch.uint8))

    def receive(self) -> bytes:
        """A follower: the next payload rank 0 sends."""
        inline = MESSAGE_HEADER_BYTES - _LENGTH.size
        self._broadcast(self.header)
        header = self.header.numpy()
        (length,) = _LENGTH.unpack_from(header, 0)
        payload = header[_LENGTH.size:_LENGTH.size + min(length, inline)].tobytes()
        if length > inline:
            rest = torch.empty(length - inline, dtype=torch.uint8)
            self._broadcast(rest)
            payload += rest.numpy().tobytes()
        return payload

    def agree_min(self, value: int) -> int:
        """The smallest of the ranks' values, on every rank."""
        tensor = torch.tensor([value], dtype=torch.int64)
        options = AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        self.backend.allreduce([tensor], options).wait()
        return int(tensor.item())


@dataclass
class RankGroup:
    """This process's place among the tensor-parallel ranks and its two groups."""

    rank: int
    size: int
    collectives: DeviceCollectives
    control: ControlChannel

    @classmethod
    def create(cls, store: dist.Store, rank: int, size: int, device: torch.device, peer_rows: int = 0) -> RankGroup:
        """Builds both groups; every rank calls it at the same time (rank 0 once every follower has joined), with the
        same peer_rows: the most rows of the decode graphs' all-reduces through mapped buffers (0: none, NCCL)."""
        control = ControlChannel(dist.ProcessGroupGloo(dist.PrefixStore("control", store), rank, size,
                                                       CONTROL_TIMEOUT), rank)
        peer = None
        if device.type == "cuda":
            nccl_environment(os.environ)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = NCCL_TIMEOUT
            backend = dist.ProcessGroupNCCL(dist.PrefixStore("device", store), rank, size, options)
            backend.eager_connect_single_device(device)
            if peer_rows:
                peer = PeerAllReduce.create(dist.PrefixStore("peer", store), control.agree_min, rank, size, device,
                                            peer_rows)
        else:
            backend = dist.ProcessGroupGloo(dist.PrefixStore("device", store), rank, size, CONTROL_TIMEOUT)
        return cls(rank, size, DeviceCollectives(backend, size, peer), control)

    def abort(self) -> None:
        """Fails every collective in flight or to come, so a rank waiting on a dead one returns (NCCL would wait
        forever), and lets the mapped buffers' waits pass."""
        if self.collectives.peer is not None:
            self.collectives.peer.abort()
        for backend in (self.collectives.backend, self.control.backend):
            backend.abort()

    def shutdown(self) -> None:
        """Rank 0, once its followers have exited: releases its side of the communicators (NCCL warns of a group
        left undestroyed). An NCCL group is aborted rather than shut down: nothing runs on it any more, and shutting
        down one that CUDA graphs captured did not return on two H100s."""
        if self.collectives.peer is not None:
            self.collectives.peer.close()
        device_backend = self.collectives.backend
        if device_backend.name() == "nccl":
            device_backend.abort()
        else:
            device_backend.shutdown()
        self.control.backend.shutdown()
