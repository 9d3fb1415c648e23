"""Token sampling on the device: greedy, temperature, top-k, top-p, min-p; returns only token ids.

Random draws come from a counter-based hash of (seed, position, vocab index) instead of a torch.Generator, so a
request's sample depends only on its seed and the position being sampled, never on the batch it shares or on step
timing: a seeded request reproduces run to run and across preemption, with no host sync and no per-row loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.layers.token_bitmask import apply_token_bitmask
from batchgen.sampling_params import SamplingParams

_MASK32 = 0xFFFFFFFF
_SEED_MODULUS = 1 << 63
_SALT = 0x9E3779B9  # 2**32 / golden ratio


@dataclass
class SamplingTensors:
    # Every tensor is None when all rows are greedy: argmax needs none of them.
    temperatures: torch.Tensor | None  # (B,) float32, 0 = greedy row
    top_ks: torch.Tensor | None  # (B,) int64, 0 = off; None when no row uses top-k
    top_ps: torch.Tensor | None  # (B,) float32; None when no row uses top-p
    min_ps: torch.Tensor | None  # (B,) float32; None when no row uses min-p
    seeds: torch.Tensor | None  # (B,) int64, per-request seed
    positions: torch.Tensor | None  # (B,) int64, index in the sequence of the token being sampled
    all_greedy: bool

    @classmethod
    def from_params(
        cls, params: list[SamplingParams], seeds: list[int], positions: list[int], device: torch.device | str
    ) -> SamplingTensors:
        """Seeds may be any integers; they are reduced modulo 2**63."""
        sampled = [p for p in params if not p.greedy]  # greedy rows ignore the filters
        if not sampled:
            return cls(None, None, None, None, None, None, all_greedy=True)
        # Two host arrays, so the step pays two copies to the device rather than one per field. Pinned, so that
        # the copies queue behind the device's work instead of waiting for it.
        pinned = torch.device(device).type == "cuda"
        floats = torch.tensor([[p.temperature for p in params], [p.top_p for p in params], [p.min_p for p in params]],
                              dtype=torch.float32, pin_memory=pinned).to(device, non_blocking=True)
        ints = torch.tensor([[max(p.top_k, 0) for p in params], [seed % _SEED_MODULUS for seed in seeds], positions],
                            dtype=torch.int64, pin_memory=pinned).to(device, non_blocking=True)
        temperatures, top_ps, min_ps = floats
        top_ks, seeds_tensor, positions_tensor = ints
        return cls(
            temperatures=temperatures,
            top_ks=top_ks if any(p.top_k > 0 for p in sampled) else None,
            top_ps=top_ps if any(p.top_p < 1 for p in sampled) else None,
            min_ps=min_ps if any(p.min_p > 0 for p in sampled) else None,
            seeds=seeds_tensor,
            positions=positions_tensor,
            all_greedy=False,
        )


def sample(logits: torch.Tensor, tensors: SamplingTensors, token_bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """logits (B, V), any float dtype -> (B,) int64 token ids on the same device.

    token_bitmask: (B, ceil(V / 32)) int32, packed allowed tokens (structured output), applied before anything else.
    """
    if token_bitmask is not None:
        logits = apply_token_bitmask(logits, token_bitmask)
    greedy_ids = logits.argmax(dim=-1)
    if tensors.all_greedy:
        return greedy_ids
    greedy_rows = tensors.temperatures == 0
    inv_temperatures = 1.0 / torch.where(greedy_rows, 1.0, tensors.temperatures)
    if tensors.top_ks is not None or tensors.top_ps is not None or tensors.min_ps is not None:
        logits = logits.float() * inv_temperatures.unsqueeze(1)
        inv_temperatures = torch.ones_like(inv_temperatures)
        if tensors.top_ks is not None or tensors.top_ps is not None:
            logits = _apply_top_k_top_p(logits, tensors.top_ks, tensors.top_ps)
        if tensors.min_ps is not None:
            logits = _apply_min_p(logits, tensors.min_ps)
    row_keys = _row_keys(tensors.seeds, tensors.positions)
    if logits.is_cuda:
        from batchgen.layers.sampler_triton import gumbel_argmax

        sampled_ids = gumbel_argmax(logits, inv_temperatures, row_keys)
    else:
        # The exponential race in log space: argmax(logits / T - log(-log U)) samples softmax(logits / T).
        gumbel = _uniform(row_keys, logits.shape[1]).log_().neg_().log_()
        sampled_ids = (logits.float() * inv_temperatures.unsqueeze(1)).sub_(gumbel).argmax(dim=-1)
    return torch.where(greedy_rows, greedy_ids, sampled_ids)


def _apply_top_k_top_p(logits: torch.Tensor, top_ks: torch.Tensor | None, top_ps: torch.Tensor | None) -> torch.Tensor:
    """Masks (-inf) tokens outside each row's top k, then outside the nucleus of what is left."""
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    if top_ks is not None:
        ranks = torch.arange(logits.shape[1], device=logits.device)
        k = torch.where(top_ks > 0, top_ks, logits.shape[1]).unsqueeze(1)
        sorted_logits.masked_fill_(ranks >= k, float("-inf"))
    if top_ps is not None:
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1).sub_(sorted_probs)
        # A token stays while the mass ranked above it is short of p: the top token always stays.
        outside = (mass_before >= top_ps.unsqueeze(1)) & (top_ps < 1).unsqueeze(1)
        sorted_logits.masked_fill_(outside, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_ids, sorted_logits)


def _apply_min_p(logits: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_ps.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche bijection (Thomas Mueller's integer hash), in place on int64 values in [0, 2**32).

    Its multiplier is below 2**27, so every product stays below 2**59: no int64 overflow, on any device.
    """
    for _ in range(2):
        x ^= x >> 16
        x.mul_(0x45D9F3B).bitwise_and_(_MASK32)
    x ^= x >> 16
    return x


def _row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(B,) int64 in [0, 2**32): one hash key per (seed, position)."""
    row_keys = _mix32(seeds & _MASK32)
    row_keys = _mix32(row_keys ^ ((seeds >> 32) & _MASK32))
    return _mix32(row_keys ^ (positions & _MASK32))


def _uniform(row_keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(B, V) float32 in (0, 1), a pure function of (row key, vocab index)."""
    # Salted because the mix maps 0 to 0: seed 0 at position 0 must not pin vocab index 0 to the smallest draw.
    column_keys = _mix32(torch.arange(_SALT, _SALT + vocab_size, device=row_keys.device, dtype=torch.int64))
    bits = _mix32(row_keys.unsqueeze(1) ^ column_keys.unsqueeze(0))
    # 23 bits plus a half stay exact in float32 and strictly inside (0, 1): with 24 bits the largest value rounds
    # to 1.0, and log(-log(1)) = -inf would turn a masked (-inf) logit into NaN, which argmax picks.
    return (bits >> 9).float().add_(0.5).mul_(1.0 / (1 << 23))
