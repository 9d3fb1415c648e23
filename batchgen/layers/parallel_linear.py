"""The layers of a tensor-parallel model (layers/tensor_parallel.py has the split): column- and row-parallel
projections, the vocabulary-parallel embedding and lm_head. Each factory returns the plain layer with one rank, so a
model without tensor parallelism is built exactly as before.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import skip_init

from batchgen.layers.embedding import Embedding, InputIdsWithPending, token_ids
from batchgen.layers.fp8 import Fp8Linear
from batchgen.layers.linear import Linear
from batchgen.layers.tensor_parallel import ShardPart, TensorParallel, current


def column_parallel_linear(in_features: int, parts: Sequence[ShardPart], bias: bool = True) -> Linear:
    """A projection whose outputs (fused parts, such as q, k, v) are split across the ranks: this rank computes its
    range of each part, laid out one after the other. No collective: the next layer takes the split outputs."""
    tp = current()
    linear = Linear(in_features, sum(part.size for part in parts), bias=bias)
    tp.mark(linear.weight, 0, *parts)
    if bias:
        tp.mark(linear.bias, 0, *parts)
    return linear


def even_parts(tp: TensorParallel, *sizes: int) -> list[ShardPart]:
    """This rank's 1/size of each fused part (gate and up, say)."""
    return [tp.even_part(size) for size in sizes]


class RowParallel:
    """The forward of a projection whose inputs are split across the ranks (those a column-parallel layer produced),
    whatever its weights' format (`Linear`'s or `Fp8Linear`'s `project`): each rank multiplies its columns of the
    weight, and one all-reduce sums the partial outputs. Rank 0 adds the bias, before the sum (as vLLM does), so it is
    added once."""

    tp: TensorParallel
    reduce: bool  # False leaves the partial sum to a caller that adds it to others before one all-reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, in / size) -> (T, out)
        partial = self.project(x, self.bias if self.tp.rank == 0 else None)
        return self.tp.all_reduce(partial) if self.reduce else partial


class RowParallelLinear(RowParallel, Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel, reduce: bool,
                 device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        """in_features: the full input width; reduce=False leaves the partial sum to a caller that adds it to
        others before one all-reduce (a MoE layer's experts and shared expert)."""
        part = tp.even_part(in_features)
        super().__init__(part.size, out_features, bias=bias, device=device, dtype=dtype)
        self.tp = tp
        self.reduce = reduce
        tp.mark(self.weight, 1, part)


class Fp8RowParallelLinear(RowParallel, Fp8Linear):
    """A RowParallelLinear with fp8 weights (layers/fp8_loading.py swaps one for the other, with the split of its
    parameters). Its per-output-channel scales are whole on every rank: each rank holds part of every row."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, tp: TensorParallel,
                 reduce: bool, device: torch.device | None = None) -> None:
        """in_features: this rank's columns."""
        super().__init__(in_features, out_features, bias, dtype, device)
        self.tp = tp
        self.reduce = reduce

    @classmethod
    def empty_like(cls, linear: RowParallelLinear) -> Fp8RowParallelLinear:
        weight = linear.weight
        return cls(linear.in_features, linear.out_features, linear.bias is not None, weight.dtype, linear.tp,
                   linear.reduce, weight.device)

    def empty_unquantized(self) -> RowParallelLinear:
        return skip_init(RowParallelLinear, self.in_features * self.tp.size, self.out_features,
                         self.bias is not None, self.tp, self.reduce, device=self.weight.device, dtype=self.dtype)


def row_parallel_linear(in_features: int, out_features: int, bias: bool = True, reduce: bool = True) -> Linear:
    tp = current()
    if tp.size == 1:
        return Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, tp, reduce)


def gated_projections(hidden_size: int, intermediate_size: int, bias: bool = False,
                      reduce: bool = True) -> tuple[Linear, Linear]:
    """A gated MLP's fused gate/up projection (column-parallel: this rank's gate rows, then its up rows) and its down
    projection (row-parallel; reduce: as RowParallelLinear's)."""
    gate_up = column_parallel_linear(hidden_size, even_parts(current(), intermediate_size, intermediate_size), bias)
    return gate_up, row_parallel_linear(intermediate_size, hidden_size, bias, reduce)


class VocabParallelEmbedding(nn.Embedding):
    """The embedding table split by vocabulary rows: each rank looks up the ids in its range (zeros elsewhere) and
    one all-reduce assembles every token's row. Ids may come with pending tokens, filled in first."""

    def __init__(self, vocab_size: int, embedding_dim: int, tp: TensorParallel) -> None:
        super().__init__(tp.padded_vocab_rows(vocab_size), embedding_dim)
        self.tp = tp
        self.part = tp.vocab_part(vocab_size)
        tp.mark(self.weight, 0, self.part)

    def forward(self, ids: torch.Tensor | InputIdsWithPending) -> torch.Tensor:  # (T,) -> (T, embedding_dim)
        ids = token_ids(ids)
        outside = (ids < self.part.start) | (ids >= self.part.stop)
        rows = F.embedding((ids - self.part.start).masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(rows.masked_fill(outside.unsqueeze(-1), 0))


def vocab_embedding(vocab_size: int, embedding_dim: int, single: type[nn.Embedding] = Embedding) -> nn.Embedding:
    """single: the class of the embedding with one rank (GPT-2 keeps nn.Embedding, whose lookup stays in torch)."""
    tp = current()
    if tp.size == 1:
        return single(vocab_size, embedding_dim)
    return VocabParallelEmbedding(vocab_size, embedding_dim, tp)


class ParallelLMHead(Linear):
    """The lm_head split by vocabulary rows: each rank computes its rows' logits and an all-gather gives every rank
    the whole (N, vocab), identical on all of them, so each samples the same tokens."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: TensorParallel) -> None:
        super().__init__(hidden_size, tp.padded_vocab_rows(vocab_size), bias=False)
        self.tp = tp
        self.vocab_size = vocab_size
        tp.mark(self.weight, 0, tp.vocab_part(vocab_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, hidden) -> (N, vocab)
        logits = self.tp.gather_last_dim(super().forward(x))
        if logits.shape[-1] == self.vocab_size:
            return logits
        return logits[:, :self.vocab_size].contiguous()  # the last rank's padding rows


def lm_head(hidden_size: int, vocab_size: int) -> Linear:
    tp = current()
    if tp.size == 1:
        return Linear(hidden_size, vocab_size, bias=False)
    return ParallelLMHead(hidden_size, vocab_size, tp)
