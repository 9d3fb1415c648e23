"""Rotary position embeddings (neox style, as Llama uses) with a cos/sin table precomputed for every position.

The scaled variants transformers implements (`llama3`, `yarn`, `longrope`, `dynamic`) and partial rotary embeddings
(`partial_rotary_factor`: only the first rotary_dim of each head rotates) are all a table: row p holds the angles of
position p, already multiplied by the variant's attention factor. transformers picks `longrope`'s and `dynamic`'s
frequencies by the length of the whole forward pass; a table fixes them per position instead (docs/models.md,
"RoPE scaling", says where the two agree and what happens past the original length).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from batchgen.models.hf_config import max_positions

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")
# The types whose frequencies depend on a pretraining length, which transformers defaults to max_position_embeddings.
_WITH_ORIGINAL_LENGTH = ("llama3", "yarn", "longrope")


def rope_parameters(config: Any) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from a transformers config: `rope_parameters` (v5) or `rope_theta`/`rope_scaling` (v4).

    scaling is None for plain RoPE, else the dict with its "rope_type", "max_position_embeddings" and, for the types
    that use one, "original_max_position_embeddings" (a top-level config field of that name wins, as in
    transformers: Phi-3 keeps it there).
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
        if rope_type == "default":
            return float(theta), None
        max_position_embeddings = config.max_position_embeddings
        scaling = {**scaling, "rope_type": rope_type, "max_position_embeddings": max_position_embeddings}
        if rope_type in _WITH_ORIGINAL_LENGTH:
            original = (getattr(config, "original_max_position_embeddings", None)
                        or scaling.get("original_max_position_embeddings") or max_position_embeddings)
            scaling["original_max_position_embeddings"] = original
    return float(theta), scaling


def rotary_dim_of(config: Any, head_dim: int) -> int:
    """How many leading dimensions of each head rotate: head_dim times `partial_rotary_factor` (1 when unset)."""
    params = getattr(config, "rope_parameters", None)
    factor = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    if factor is None:
        factor = getattr(config, "partial_rotary_factor", None) or 1.0
    return int(head_dim * factor)


def rotary_embedding(config: Any, head_dim: int) -> RotaryEmbedding:
    """The rotary embedding a config describes, with a row for each position the model supports."""
    theta, scaling = rope_parameters(config)
    return RotaryEmbedding(rotary_dim_of(config, head_dim), max_positions(config), theta, scaling)


def _default_inv_freq(dim: int, theta: float | torch.Tensor) -> torch.Tensor:  # (dim / 2,), or (P, dim / 2)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    return 1.0 / (theta**exponents)


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


def _context_factor(scaling: dict[str, Any]) -> float:
    """yarn's and longrope's `factor`; without one, how far max_position_embeddings stretches the original length."""
    factor = scaling.get("factor")
    if factor is None:
        factor = scaling["max_position_embeddings"] / scaling["original_max_position_embeddings"]
    return factor


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(dim: int, theta: float, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN: each frequency blends its extrapolated (unscaled) and interpolated (divided by `factor`) values, by
    how many turns it makes over the original length (more than beta_fast: kept, fewer than beta_slow: scaled);
    cos and sin are multiplied by an attention factor that grows with log(factor)."""
    factor = _context_factor(scaling)
    original_len = scaling["original_max_position_embeddings"]
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def dim_making_turns(turns: float) -> float:
        """The (fractional) dimension index whose frequency turns `turns` times over the original length."""
        return dim * math.log(original_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_making_turns(beta_fast), dim_making_turns(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    wavelengths = theta ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolated, interpolated = 1.0 / wavelengths, 1.0 / (factor * wavelengths)
    kept = 1 - ramp  # 1: the frequency is kept as it is, 0: it is divided by factor
    return interpolated * (1 - kept) + extrapolated * kept, float(attention_factor)


def _longrope(dim: int, theta: float, scaling: dict[str, Any], num_positions: int) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3): each frequency divided by its own factor, `short_factor` for the positions below the original
    length and `long_factor` from there on; cos and sin are multiplied by sqrt(1 + log(factor) / log(original))."""
    factor = _context_factor(scaling)
    original_len = scaling["original_max_position_embeddings"]
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original_len))
    base = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    short = 1.0 / (torch.tensor(scaling["short_factor"], dtype=torch.float32) * base)
    long = 1.0 / (torch.tensor(scaling["long_factor"], dtype=torch.float32) * base)
    is_long = torch.arange(num_positions)[:, None] >= original_len  # (P, 1)
    return torch.where(is_long, long, short), float(attention_factor)


def _dynamic_ntk(dim: int, theta: float, scaling: dict[str, Any], num_positions: int) -> torch.Tensor:
    """Dynamic NTK: up to max_position_embeddings plain RoPE; position p past it uses the base that transformers
    computes for a sequence of p + 1 tokens, theta * (factor * (p + 1) / max - (factor - 1)) ** (dim / (dim - 2))."""
    factor = scaling["factor"]
    max_len = scaling["max_position_embeddings"]
    inv_freq = _default_inv_freq(dim, theta).expand(num_positions, -1)
    if num_positions <= max_len:
        return inv_freq
    lengths = torch.arange(max_len + 1, num_positions + 1)[:, None]  # (P - max, 1): p + 1 of each later position
    bases = theta * ((factor * lengths / max_len) - (factor - 1)) ** (dim / (dim - 2))
    return torch.cat([inv_freq[:max_len], _default_inv_freq(dim, bases)])


class RotaryEmbedding(nn.Module):
    """The cos/sin tables of every position; `apply_rotary` rotates q and k with them."""

    def __init__(self, rotary_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None = None) -> None:
        """rotary_dim: the leading dimensions of each head that rotate (the head_dim, or less for partial rotary).
        scaling: rope_parameters' dict; None for plain RoPE."""
        super().__init__()
        if rotary_dim % 2 != 0:
            raise ValueError(f"rotary dimension must be even, got {rotary_dim}")
        self.rotary_dim = rotary_dim
        rope_type = "default" if scaling is None else scaling["rope_type"]
        attention_factor = 1.0
        if rope_type == "yarn":
            inv_freq, attention_factor = _yarn(rotary_dim, theta, scaling)
        elif rope_type == "longrope":
            inv_freq, attention_factor = _longrope(rotary_dim, theta, scaling, max_positions)
        elif rope_type == "dynamic":
            inv_freq = _dynamic_ntk(rotary_dim, theta, scaling, max_positions)
        elif rope_type == "linear":  # positions divided by `factor` (Gemma 3's global layers)
            inv_freq = _default_inv_freq(rotary_dim, theta) / scaling["factor"]
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(_default_inv_freq(rotary_dim, theta), scaling)
        else:
            inv_freq = _default_inv_freq(rotary_dim, theta)
        positions = torch.arange(max_positions, dtype=torch.float32)[:, None]
        freqs = positions * inv_freq  # (P, D / 2): inv_freq is (D / 2,), or (P, D / 2) where it varies by position
        # Kept in float32 whatever the model dtype (cast at use, as transformers does).
        self.register_buffer("cos", freqs.cos() * attention_factor, persistent=False)
        self.register_buffer("sin", freqs.sin() * attention_factor, persistent=False)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox rotation of the first 2 * cos.shape[-1] dimensions of x; the rest pass through (partial rotary)."""
    rotary_dim = 2 * cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        return torch.cat((_rotate(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)  # (T, N, D / 2) each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_table: torch.Tensor,
                 sin_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q (T, H, D), k (T, KVH, D) rotated at their positions; the tables (P, rotary_dim / 2) are cast to q's dtype
    first, as transformers casts them."""
    cos = cos_table[positions][:, None, :].to(q.dtype)  # (T, 1, rotary_dim / 2)
    sin = sin_table[positions][:, None, :].to(q.dtype)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)
