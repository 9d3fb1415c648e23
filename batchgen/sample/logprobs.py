"""Log-probabilities of chosen tokens and their top alternatives (logit - logsumexp of the row, in float32): the
sampled tokens' (with `sampling.logprobs`) and the prompt tokens' (with `sampling.prompt_logprobs`).

Rows are scored in slices of logits (a prompt-logprobs step may score every token of a 16,384-token step: 10 GB of
float32 logits at Qwen3's vocabulary; core/kv_sizing.py chooses the slices' rows); each slice leaves only the chosen
token's logprob and rank and the top-k on the device, and those alone are copied to the host, once for all slices.
With at most one alternative on CUDA, a Triton kernel reads each logits row once for all of them
(logprobs_triton.py); otherwise torch does, with a float32 copy of the slice."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class LogprobsTensors:
    """On the host (pinned on CUDA) once `to_host` has queued the copies, filled when the step's event completes."""

    logprobs: torch.Tensor  # (N,) float32: the chosen token's log-probability
    ranks: torch.Tensor  # (N,) int64: 1 + how many tokens are more likely than the chosen one
    top_ids: torch.Tensor  # (N, k) int64, most likely first
    top_logprobs: torch.Tensor  # (N, k) float32

    def to_host(self, pinned: bool) -> LogprobsTensors:
        """Host copies, queued without a sync."""

        def copy(tensor: torch.Tensor) -> torch.Tensor:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pinned)
            return host.copy_(tensor, non_blocking=True)

        return LogprobsTensors(copy(self.logprobs), copy(self.ranks), copy(self.top_ids), copy(self.top_logprobs))


def uses_fused_kernel(k: int, device: torch.device) -> bool:
    """Whether score_slice runs the Triton kernel: on CUDA, for at most one alternative."""
    return k <= 1 and device.type == "cuda"


def score_slice(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """logits (N, V) any float dtype, token_ids (N,) on the same device -> device tensors of N rows. A token's rank
    counts the logits above its own, so equal logits share a rank."""
    if uses_fused_kernel(k, logits.device):
        from batchgen.sample.logprobs_triton import score_top1  # Triton only where CUDA runs

        scored = score_top1(logits, token_ids)
        return LogprobsTensors(scored.logprobs, scored.ranks, scored.top_ids[:, :k], scored.top_logprobs[:, :k])
    values = logits.float()  # (N, V) float32: the same tensor where the logits are float32
    log_total = torch.logsumexp(values, dim=-1, keepdim=True)
    chosen = values.gather(1, token_ids.unsqueeze(1))
    ranks = (values > chosen).sum(dim=-1).add_(1)
    if k == 1:  # a reduction: cheaper than topk's selection
        top_values, top_ids = values.max(dim=-1, keepdim=True)
    elif k:
        top_values, top_ids = values.topk(k, dim=-1)
    else:
        top_values, top_ids = values[:, :0], token_ids.unsqueeze(1)[:, :0]
    return LogprobsTensors((chosen - log_total).squeeze(1), ranks, top_ids, top_values - log_total)


@dataclass(frozen=True)
class SliceRows:
    """How many rows of logits exist at a time while a step scores logprobs (core/kv_sizing.py)."""

    general: int  # scored by torch, with a float32 copy
    fused: int  # scored by the fused kernel (uses_fused_kernel), which only reads the logits

    def for_alternatives(self, k: int, device: torch.device) -> int:
        return self.fused if uses_fused_kernel(k, device) else self.general


def compute_logprobs(logits_of_rows: Callable[[int, int], torch.Tensor], token_ids: torch.Tensor, k: int,
                     slice_rows: SliceRows, pinned: bool) -> LogprobsTensors:
    """logits_of_rows(start, end) -> (end - start, V) logits of rows [start, end); token_ids (N,) on the device.
    At most slice_rows' rows for k of logits exist at a time; returns host copies of the N rows, queued without a
    sync."""
    num_rows, device = len(token_ids), token_ids.device
    max_rows = slice_rows.for_alternatives(k, device)
    if num_rows <= max_rows:
        return score_slice(logits_of_rows(0, num_rows), token_ids, k).to_host(pinned)
    scored = LogprobsTensors(torch.empty(num_rows, dtype=torch.float32, device=device),
                             torch.empty(num_rows, dtype=torch.int64, device=device),
                             torch.empty(num_rows, k, dtype=torch.int64, device=device),
                             torch.empty(num_rows, k, dtype=torch.float32, device=device))
    for start in range(0, num_rows, max_rows):
        end = min(start + max_rows, num_rows)
        part = score_slice(logits_of_rows(start, end), token_ids[start:end], k)
        scored.logprobs[start:end] = part.logprobs
        scored.ranks[start:end] = part.ranks
        scored.top_ids[start:end] = part.top_ids
        scored.top_logprobs[start:end] = part.top_logprobs
    return scored.to_host(pinned)


@dataclass(frozen=True)
class ScoredRange:
    """Consecutive prompt positions of one step row whose logprobs a step computes."""

    row: int  # the step row
    start: int  # the first prompt position scored
    count: int


@dataclass
class PromptLogprobRows:
    """A step's prompt logprobs on the host as arrays: a scoring step has thousands of positions, each row's a slice
    of them (`ranges`, in order), so they reach their requests as slices, never one Python object per position."""

    ranges: list[ScoredRange]
    logprobs: np.ndarray  # (P,) float32
    ranks: np.ndarray  # (P,) int64
    top_ids: np.ndarray  # (P, k) int64, k: the most alternatives any row asked for
    top_logprobs: np.ndarray  # (P, k) float32


@dataclass
class StepLogprobs:
    """Device work queued for a step's logprobs; read on the host after the step's event."""

    sample_rows: list[int]  # step rows whose sampled token has logprobs, parallel to `sampled`
    sampled: LogprobsTensors | None
    prompt: tuple[list[ScoredRange], LogprobsTensors] | None  # the prompt positions scored and their logprobs

    def entries(self) -> tuple[dict[int, tuple], PromptLogprobRows | None]:
        """({step row: (logprob, rank, top ids, top logprobs)}, the prompt positions' logprobs)."""
        sampled = {}
        if self.sampled is not None:
            sampled = dict(zip(self.sample_rows, _rows(self.sampled), strict=True))
        prompt = None
        if self.prompt is not None:
            ranges, t = self.prompt
            prompt = PromptLogprobRows(ranges, t.logprobs.numpy(), t.ranks.numpy(), t.top_ids.numpy(),
                                       t.top_logprobs.numpy())
        return sampled, prompt


def _rows(t: LogprobsTensors) -> list[tuple]:
    return list(zip(t.logprobs.tolist(), t.ranks.tolist(), t.top_ids.tolist(), t.top_logprobs.tolist(), strict=True))


def sampled_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, wanted: list[int | None],
                     slice_rows: SliceRows, pinned: bool) -> tuple[list[int], LogprobsTensors | None]:
    """Logprobs of the rows that ask for them, a slice of rows at a time; logits (S, V) and token_ids (S,) of the
    step's sampling rows."""
    rows = [i for i, k in enumerate(wanted) if k is not None]
    if not rows:
        return [], None
    index = torch.tensor(rows, dtype=torch.int64).to(logits.device, non_blocking=True)
    k = max(wanted[i] for i in rows)
    return rows, compute_logprobs(lambda start, end: logits.index_select(0, index[start:end]),
                                  token_ids.index_select(0, index), k, slice_rows, pinned)
