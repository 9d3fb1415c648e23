"""Log-probabilities of chosen tokens and their top alternatives (a log_softmax over the vocabulary in float32): the
sampled tokens' (with `sampling.logprobs`) and the prompt tokens' (with `sampling.prompt_logprobs`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LogprobsTensors:
    """Host tensors (pinned on CUDA), filled once the step's event completes."""

    logprobs: torch.Tensor  # (N,) float32: the chosen token's log-probability
    ranks: torch.Tensor  # (N,) int64: 1 + how many tokens are more likely than the chosen one
    top_ids: torch.Tensor  # (N, k) int64, most likely first
    top_logprobs: torch.Tensor  # (N, k) float32


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int, pinned: bool) -> LogprobsTensors:
    """logits (N, V) any float dtype, token_ids (N,) on the same device -> host copies, queued without a sync."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=-1).add_(1)
    top_logprobs, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], token_ids.unsqueeze(1)[:, :0])

    def to_host(tensor: torch.Tensor) -> torch.Tensor:
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pinned)
        return host.copy_(tensor, non_blocking=True)

    return LogprobsTensors(to_host(chosen.squeeze(1)), to_host(ranks), to_host(top_ids), to_host(top_logprobs))


@dataclass
class StepLogprobs:
    """Device work queued for a step's logprobs; read on the host after the step's event."""

    sample_rows: list[int]  # step rows whose sampled token has logprobs, parallel to `sampled`
    sampled: LogprobsTensors | None
    prompt: tuple[list[tuple[int, int]], LogprobsTensors] | None  # ([(step row, prompt position)], their logprobs)

    def entries(self) -> tuple[dict[int, tuple], list[tuple[int, int, tuple]]]:
        """({step row: (logprob, rank, top ids, top logprobs)}, [(step row, prompt position, same tuple)])."""
        sampled = {}
        if self.sampled is not None:
            sampled = dict(zip(self.sample_rows, _rows(self.sampled), strict=True))
        prompt = []
        if self.prompt is not None:
            owners, tensors = self.prompt
            prompt = [(row, position, values) for (row, position), values in zip(owners, _rows(tensors), strict=True)]
        return sampled, prompt


def _rows(t: LogprobsTensors) -> list[tuple]:
    return list(zip(t.logprobs.tolist(), t.ranks.tolist(), t.top_ids.tolist(), t.top_logprobs.tolist(), strict=True))


def sampled_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, wanted: list[int | None],
                     pinned: bool) -> tuple[list[int], LogprobsTensors | None]:
    """Logprobs of the rows that ask for them; logits (S, V) and token_ids (S,) of the step's sampling rows."""
    rows = [i for i, k in enumerate(wanted) if k is not None]
    if not rows:
        return [], None
    index = torch.tensor(rows, dtype=torch.int64).to(logits.device, non_blocking=True)
    k = max(wanted[i] for i in rows)
    return rows, compute_logprobs(logits.index_select(0, index), token_ids.index_select(0, index), k, pinned)
