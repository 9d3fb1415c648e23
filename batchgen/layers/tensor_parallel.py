"""Tensor parallelism as the layers see it: this process's rank among `size`, the collectives that join the ranks'
partial results, and which slice of each checkpoint tensor a rank holds (Megatron's split).

A model is built under `building(tp)`: its layers read `current()` once, at construction, and keep it, so a forward
never looks at module state. With size 1 (the default) every helper leaves a layer as it is without tensor
parallelism: no shard specs, no collectives.

The split (each rank r of N):
- qkv and gate/up projections (column-parallel): rank r holds heads [r * H / N, (r + 1) * H / N) of q and the
  rows of its KV heads, and its 1/N of each of gate and up; its outputs are its own heads' and columns'.
- o_proj and down_proj (row-parallel): rank r holds the input columns that match; the ranks' partial outputs are
  summed by one all-reduce (layers/parallel_linear.py).
- KV heads: split like the q heads when N divides their number; with fewer KV heads than ranks, ranks
  r * KVH / N share KV head (r * KVH) // N (replicated), which their q heads are grouped with.
- the vocabulary of the embedding and lm_head: ceil(V / N) rows a rank, the last rank's padded with zeros.
- fp8 weights' per-row scales: split as their weight's rows (column-parallel), whole on every rank (row-parallel);
  layers/fp8_loading.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch


class Collectives(Protocol):
    """The device collectives of the tensor-parallel ranks (gloo on CPU, NCCL on CUDA: batchgen/tp/group.py)."""

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sums `tensor` over the ranks, in place, on the current stream (so CUDA graphs capture it)."""

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """(rows, ...) on each rank -> (size * rows, ...), rank r's rows at [r * rows, (r + 1) * rows)."""


@dataclass(frozen=True)
class ShardPart:
    """One part of a (possibly fused) parameter: the part's full extent in the checkpoint and the range
    [start, stop) of it that this rank holds."""

    full: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Shard:
    """How a parameter slices its checkpoint tensors: along `dim` (of the parameter as the model holds it, an expert
    of a stacked one), parts laid out one after the other (q, k, v; gate, up), each rank holding a range of each."""

    dim: int
    parts: tuple[ShardPart, ...]

    def local_slices(self) -> list[slice]:
        """Where each part's range lies in the parameter, along dim."""
        slices, start = [], 0
        for part in self.parts:
            slices.append(slice(start, start + part.size))
            start += part.size
        return slices


@dataclass(frozen=True)
class AttentionHeads:
    """The attention heads a rank holds: (first, count) of the q heads and of the KV heads, and how many ranks hold
    each KV head (1 unless there are fewer KV heads than ranks)."""

    q_start: int
    num_heads: int
    kv_start: int
    num_kv_heads: int
    kv_replicas: int


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    collectives: Collectives | None = None  # None: size 1, or a shard built only to load it (tests)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The ranks' partial results summed (in place); the tensor itself with one rank."""
        if self.size > 1:
            self.collectives.all_reduce(tensor)
        return tensor

    def gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """(rows, n) on each rank -> (rows, size * n), rank r's columns at [r * n, (r + 1) * n)."""
        if self.size == 1:
            return tensor
        rows, columns = tensor.shape
        gathered = self.collectives.all_gather(tensor.contiguous())  # (size * rows, n)
        return gathered.view(self.size, rows, columns).transpose(0, 1).reshape(rows, self.size * columns)

    def max_over_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        """The elementwise maximum of `tensor` over the ranks, on every rank (one all-gather); the tensor itself with
        one rank."""
        if self.size == 1:
            return tensor
        gathered = self.collectives.all_gather(tensor.contiguous())  # (size * rows, ...)
        return gathered.view(self.size, *tensor.shape).amax(dim=0)

    def even_part(self, full: int) -> ShardPart:
        """This rank's 1/size of `full` (size divides it: tp_shapes.check_tensor_parallel checked)."""
        local = full // self.size
        return ShardPart(full, self.rank * local, (self.rank + 1) * local)

    def vocab_part(self, vocab_size: int) -> ShardPart:
        """This rank's rows of the vocabulary: ceil(V / size) a rank, the last rank's range short of it."""
        per_rank = -(-vocab_size // self.size)
        start = min(self.rank * per_rank, vocab_size)
        return ShardPart(vocab_size, start, min(start + per_rank, vocab_size))

    def padded_vocab_rows(self, vocab_size: int) -> int:
        """The rows each rank's embedding and lm_head hold (the vocabulary padded to a multiple of size)."""
        return -(-vocab_size // self.size)

    def attention_heads(self, num_heads: int, num_kv_heads: int) -> AttentionHeads:
        per_rank = num_heads // self.size
        if num_kv_heads >= self.size:
            kv_per_rank = num_kv_heads // self.size
            return AttentionHeads(self.rank * per_rank, per_rank, self.rank * kv_per_rank, kv_per_rank, 1)
        return AttentionHeads(self.rank * per_rank, per_rank, self.rank * num_kv_heads // self.size, 1,
                              self.size // num_kv_heads)

    def head_parts(self, heads: AttentionHeads, num_heads: int, num_kv_heads: int, head_dim: int
                   ) -> tuple[ShardPart, ShardPart]:
        """The q rows and the K (or V) rows of a qkv projection that this rank holds."""
        q = ShardPart(num_heads * head_dim, heads.q_start * head_dim, (heads.q_start + heads.num_heads) * head_dim)
        kv = ShardPart(num_kv_heads * head_dim, heads.kv_start * head_dim,
                       (heads.kv_start + heads.num_kv_heads) * head_dim)
        return q, kv

    def mark(self, param: torch.Tensor, dim: int, *parts: ShardPart) -> None:
        """Records how `param` slices its checkpoint tensors (models/weights.py reads it when loading); nothing with
        one rank."""
        if self.size > 1:
            set_shard(param, Shard(dim, parts))


SINGLE = TensorParallel()
_current = SINGLE


def current() -> TensorParallel:
    """The tensor parallelism of the model being built (SINGLE outside `building`)."""
    return _current


@contextlib.contextmanager
def building(tp: TensorParallel) -> Iterator[None]:
    """Layers constructed inside hold `tp`'s shard."""
    global _current
    previous, _current = _current, tp
    try:
        yield
    finally:
        _current = previous


def shard_of(param: torch.Tensor) -> Shard | None:
    return getattr(param, "shard", None)


def set_shard(param: torch.Tensor, layout: Shard) -> None:
    """Records that `param` slices its checkpoint tensors as `layout` says (TensorParallel.mark builds the layout;
    a layer swapped for its fp8 form, or back, takes its predecessor's)."""
    param.shard = layout
