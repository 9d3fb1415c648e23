"""Packed token bitmasks (structured output): bit j of int32 word w allows token 32 * w + j; -1 allows all 32."""

from __future__ import annotations

import torch


def unpack_token_bitmask(packed: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(B, ceil(V / 32)) int32 -> (B, V) bool, True where the token is allowed; ids past the words are disallowed."""
    bits = torch.arange(32, dtype=torch.int32, device=packed.device)
    # An arithmetic shift keeps the sign bit, so `& 1` reads bit 31 correctly too.
    allowed = ((packed.unsqueeze(-1) >> bits) & 1).bool().flatten(1)  # (B, 32 * words)
    if allowed.shape[1] < vocab_size:
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]), value=False)
    return allowed[:, :vocab_size]


def apply_token_bitmask(logits: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """logits (B, V) with every token the mask disallows set to -inf (a new tensor)."""
    allowed = unpack_token_bitmask(packed.to(logits.device), logits.shape[1])
    return logits.masked_fill(~allowed, float("-inf"))
