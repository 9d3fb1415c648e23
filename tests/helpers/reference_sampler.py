"""The sampler as it was before the pipeline (main at 95bdcea), kept as the reference its tokens must equal.

Random draws come from a counter-based hash of (seed, position, vocab index) instead of a torch.Generator, so a
request's sample depends only on its seed and the position being sampled, never on the batch it shares or on step
timing: a seeded request reproduces run to run and across preemption, with no host sync and no per-row loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.sample.params import SamplingParams

# The filters and the hash did not change; the reference keeps the old orchestration around them.
from batchgen.sample.sampler import _apply_min_p, _apply_top_k_top_p, _row_keys, _uniform

_SEED_MODULUS = 1 << 63


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


def sample(logits: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
    """logits (B, V), any float dtype -> (B,) int64 token ids on the same device."""
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
    # The exponential race in log space: argmax(logits / T - log(-log U)) samples softmax(logits / T).
    gumbel = _uniform(_row_keys(tensors.seeds, tensors.positions), logits.shape[1]).log_().neg_().log_()
    sampled_ids = (logits.float() * inv_temperatures.unsqueeze(1)).sub_(gumbel).argmax(dim=-1)
    return torch.where(greedy_rows, greedy_ids, sampled_ids)
