"""Rotary position embeddings (neox style, as Llama uses) with a cos/sin table precomputed for every position."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


def rope_parameters(config: Any) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from a transformers config: `rope_parameters` (v5) or `rope_theta`/`rope_scaling` (v4).

    scaling is None for plain RoPE, else the dict with its "rope_type".
    """
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        theta, scaling = params["rope_theta"], params
    else:
        theta, scaling = getattr(config, "rope_theta", 10000.0), getattr(config, "rope_scaling", None)
    if scaling is not None:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        scaling = None if rope_type == "default" else {**scaling, "rope_type": rope_type}
    return float(theta), scaling


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths divided by `factor`, short ones kept, a smooth blend in between."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    original_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = original_len / low_freq_factor
    high_freq_wavelen = original_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """The cos/sin tables of every position; `apply_rotary` rotates q and k with them."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        if head_dim % 2 != 0:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        self.head_dim = head_dim
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
        inv_freq = 1.0 / (theta**exponents)  # (D / 2,)
        if scaling is not None and scaling["rope_type"] == "linear":  # positions divided by `factor` (Gemma 3)
            inv_freq = inv_freq / scaling["factor"]
        elif scaling is not None:
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # (P, D / 2)
        # Kept in float32 whatever the model dtype (cast at use, as transformers does).
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)  # (T, N, D / 2) each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_table: torch.Tensor,
                 sin_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos = cos_table[positions][:, None, :].to(q.dtype)  # (T, 1, D / 2)
    sin = sin_table[positions][:, None, :].to(q.dtype)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)
