"""The pipeline stages after the structured-output bitmask: logit bias, min_tokens and the penalties.

Every stage is a fixed-shape tensor program (no host sync, no data-dependent shape), so it runs as it is inside a
captured decode graph. Per-request data lives in device rows that persist across steps (`SamplingStateRows`);
a step gathers the rows of its batch by index, and rows that use nothing point at the neutral row 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NEG_INF = float("-inf")


@dataclass
class SamplingStateRows:
    """Device rows that persist per request (row 0: neutral, for batch rows that use nothing); each (R, V)."""

    output_counts: torch.Tensor  # float32: how often each token was generated so far
    prompt_mask: torch.Tensor  # bool: the token occurs in the prompt
    bias: torch.Tensor  # float32: logit_bias, -inf outside allowed_token_ids and for one-token bad words
    stop_mask: torch.Tensor  # bool: EOS and stop_token_ids, masked while min_tokens is not reached


@dataclass
class PenaltyTensors:
    rows: SamplingStateRows
    state_rows: torch.Tensor  # (B,) int64: each batch row's state row
    repetition: torch.Tensor  # (B,) float32, 1 = off
    presence: torch.Tensor  # (B,) float32, 0 = off
    frequency: torch.Tensor  # (B,) float32, 0 = off
    block_stops: torch.Tensor  # (B,) float32, 1 while fewer than min_tokens tokens are generated


def apply_penalties(logits: torch.Tensor, p: PenaltyTensors) -> torch.Tensor:
    """vLLM's order: bias and the min_tokens stop mask, then repetition, frequency and presence penalties."""
    rows = p.rows
    logits = logits.float() + rows.bias.index_select(0, p.state_rows)
    blocked = rows.stop_mask.index_select(0, p.state_rows) & (p.block_stops > 0).unsqueeze(1)
    logits = logits.masked_fill(blocked, NEG_INF)
    counts = rows.output_counts.index_select(0, p.state_rows)
    generated = counts > 0
    seen = generated | rows.prompt_mask.index_select(0, p.state_rows)
    repetition = p.repetition.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalized, logits)
    return logits - p.frequency.unsqueeze(1) * counts - p.presence.unsqueeze(1) * generated


def count_sampled(p: PenaltyTensors, token_ids: torch.Tensor) -> None:
    """Adds the step's sampled tokens to their requests' output counts, on the device (inside a graph too)."""
    counts = p.rows.output_counts
    flat_index = p.state_rows * counts.shape[1] + token_ids
    # index_add_ (atomic adds on CUDA): rows sharing the neutral row 0 add to the same entries, with no sync.
    counts.view(-1).index_add_(0, flat_index, torch.ones_like(token_ids, dtype=counts.dtype))
