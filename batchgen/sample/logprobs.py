"""Log-probabilities of chosen tokens and their top alternatives: a log_softmax over the vocabulary in float32."""

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
