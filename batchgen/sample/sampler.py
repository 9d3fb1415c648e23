"""Token sampling on the device, one pipeline for eager steps and captured decode graphs: structured-output bitmask,
bias and penalties, then greedy argmax or temperature, top-k, top-p, min-p and the seeded draw.

Random draws come from a counter-based hash of (seed, position, vocab index) instead of a torch.Generator, so a
request's sample depends only on its seed and the position being sampled, never on the batch it shares or on step
timing: a seeded request reproduces run to run and across preemption, with no host sync and no per-row loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from batchgen.sample.bitmask import apply_token_bitmask
from batchgen.sample.params import SamplingParams
from batchgen.sample.penalties import (
    BadWordCandidates,
    PenaltyTensors,
    SamplingStateRows,
    apply_bad_words,
    apply_penalties,
    count_sampled,
)

_MASK32 = 0xFFFFFFFF
_SEED_MODULUS = 1 << 63
_SALT = 0x9E3779B9  # 2**32 / golden ratio
# Up to this vocabulary a row fits one program's registers, and the filters run with the draw in one Triton kernel
# (sampler_filters_triton); larger ones sort in torch.
FILTERED_DRAW_MAX_VOCAB = 4096


FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition", "presence", "frequency", "block_stops")
INT_FIELDS = ("top_k", "seed", "position", "state_row")
# What a row that uses nothing holds (also the padding rows of a graph bucket): greedy, no filter, no penalty.
NEUTRAL_FLOATS = (0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0)
NEUTRAL_INTS = (0, 0, 0, 0)


@dataclass(frozen=True)
class SamplingFeatures:
    """The stages a step runs. Fixed per step (and per captured graph): shapes never depend on the data, and a
    stage no row uses is not run at all."""

    random: bool = False  # some row draws (temperature > 0)
    top_k: bool = False
    top_p: bool = False
    min_p: bool = False
    penalties: bool = False  # some row uses its per-request state rows (penalties, bias, min_tokens, ...)
    bitmask: bool = False  # a structured-output token bitmask

    @property
    def any(self) -> bool:
        return self != SamplingFeatures()


@dataclass
class PackedSampling:
    """A step's per-row sampling parameters on the host, one float and one int array, so that the step pays one
    copy of each to the device (or into a graph's static buffers)."""

    features: SamplingFeatures
    floats: np.ndarray  # (len(FLOAT_FIELDS), B) float32
    ints: np.ndarray  # (len(INT_FIELDS), B) int64

    @classmethod
    def from_params(cls, params: list[SamplingParams], seeds: list[int], positions: list[int],
                    state_rows: list[int] | None = None, block_stops: list[bool] | None = None) -> PackedSampling:
        """Seeds may be any integers; they are reduced modulo 2**63. Greedy rows keep their filter values: the
        filters do not change an argmax."""
        n = len(params)
        sampled = [p for p in params if not p.greedy]  # greedy rows ignore the filters
        penalties = state_rows is not None and any(state_rows)
        if not sampled and not penalties:  # argmax alone (the common greedy step): neutral rows, no per-row work
            return cls(SamplingFeatures(), np.repeat(np.array(NEUTRAL_FLOATS, dtype=np.float32)[:, None], n, axis=1),
                       np.repeat(np.array(NEUTRAL_INTS, dtype=np.int64)[:, None], n, axis=1))
        floats = np.empty((len(FLOAT_FIELDS), n), dtype=np.float32)
        ints = np.empty((len(INT_FIELDS), n), dtype=np.int64)
        floats[0] = [p.temperature for p in params]
        floats[1] = [p.top_p for p in params]
        floats[2] = [p.min_p for p in params]
        floats[3] = [p.repetition_penalty for p in params]
        floats[4] = [p.presence_penalty for p in params]
        floats[5] = [p.frequency_penalty for p in params]
        floats[6] = block_stops if block_stops is not None else 0.0
        ints[0] = [max(p.top_k, 0) for p in params]
        ints[1] = [seed % _SEED_MODULUS for seed in seeds]
        ints[2] = positions
        ints[3] = state_rows if state_rows is not None else 0
        features = SamplingFeatures(
            random=bool(sampled),
            top_k=any(p.top_k > 0 for p in sampled),
            top_p=any(p.top_p < 1 for p in sampled),
            min_p=any(p.min_p > 0 for p in sampled),
            penalties=penalties,
        )
        return cls(features, floats, ints)

    def to_device(self, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        # Pinned, so that the copies queue behind the device's work instead of waiting for it.
        pinned = torch.device(device).type == "cuda"
        floats, ints = torch.from_numpy(self.floats), torch.from_numpy(self.ints)
        if pinned:
            floats, ints = floats.pin_memory(), ints.pin_memory()
        return floats.to(device, non_blocking=True), ints.to(device, non_blocking=True)


@dataclass
class SamplingTensors:
    # The filter tensors are None when no sampled row uses them; every draw tensor is None when all rows are greedy.
    temperatures: torch.Tensor | None  # (B,) float32, 0 = greedy row
    top_ks: torch.Tensor | None  # (B,) int64, 0 = off
    top_ps: torch.Tensor | None  # (B,) float32
    min_ps: torch.Tensor | None  # (B,) float32
    seeds: torch.Tensor | None  # (B,) int64, per-request seed
    positions: torch.Tensor | None  # (B,) int64, index in the sequence of the token being sampled
    all_greedy: bool
    penalties: PenaltyTensors | None = None
    bitmask: torch.Tensor | None = None  # (B, ceil(V / 32)) int32, applied first
    bad_words: BadWordCandidates | None = None  # eager steps only: their count depends on the data

    @classmethod
    def from_params(
        cls, params: list[SamplingParams], seeds: list[int], positions: list[int], device: torch.device | str
    ) -> SamplingTensors:
        """Seeds may be any integers; they are reduced modulo 2**63."""
        packed = PackedSampling.from_params(params, seeds, positions)
        return cls.from_packed(packed.features, *packed.to_device(device))

    @classmethod
    def from_packed(cls, features: SamplingFeatures, floats: torch.Tensor, ints: torch.Tensor,
                    state: SamplingStateRows | None = None, bitmask: torch.Tensor | None = None) -> SamplingTensors:
        """Views of packed device tensors (a step's own, or a graph's static buffers) for the stages `features`
        runs."""
        temperatures, top_ps, min_ps, repetition, presence, frequency, block_stops = floats
        top_ks, seeds, positions, state_rows = ints
        random = features.random
        penalties = None
        if features.penalties:
            penalties = PenaltyTensors(state, state_rows, repetition, presence, frequency, block_stops)
        return cls(
            temperatures=temperatures if random else None,
            top_ks=top_ks if features.top_k else None,
            top_ps=top_ps if features.top_p else None,
            min_ps=min_ps if features.min_p else None,
            seeds=seeds if random else None,
            positions=positions if random else None,
            all_greedy=not random,
            penalties=penalties,
            bitmask=bitmask if features.bitmask else None,
        )


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # (B,) int64
    logits: torch.Tensor  # (B, V) after the bitmask, bias and penalties; before temperature
    filtered: torch.Tensor | None  # (B, V) float32 after temperature and the filters, when a filter ran
    inv_temperatures: torch.Tensor | None  # (B,) float32, 1 for greedy rows; None when all rows are greedy

    def processed_logits(self) -> torch.Tensor:
        """The logits the draw sampled from (greedy rows: after penalties, without temperature)."""
        if self.filtered is not None:
            return self.filtered
        if self.inv_temperatures is None:
            return self.logits
        return self.logits.float() * self.inv_temperatures.unsqueeze(1)


def sample(logits: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
    """logits (B, V), any float dtype -> (B,) int64 token ids on the same device."""
    return run_sampler(logits, tensors).token_ids


def run_sampler(logits: torch.Tensor, tensors: SamplingTensors,
                greedy_ids: torch.Tensor | None = None) -> SamplerOutput:
    """The whole pipeline: bitmask -> bias, min_tokens and penalties -> bad words -> greedy argmax | temperature ->
    top-k/top-p -> min-p -> seeded draw; then the sampled ids count into the requests' output counts.
    greedy_ids: the rows' argmax of these logits where the caller has it (a decode graph's), taken as the greedy
    rows' ids unless a stage before the draw changes the logits."""
    if tensors.bitmask is not None:
        logits = apply_token_bitmask(logits, tensors.bitmask)
    if tensors.penalties is not None:
        logits = apply_penalties(logits, tensors.penalties)
    if tensors.bad_words is not None:
        logits = apply_bad_words(logits, tensors.bad_words)
    changed = tensors.bitmask is not None or tensors.penalties is not None or tensors.bad_words is not None
    output = _draw(logits, tensors, None if changed else greedy_ids)
    if tensors.penalties is not None:
        count_sampled(tensors.penalties, output.token_ids)
    return output


def _draw(logits: torch.Tensor, tensors: SamplingTensors, greedy_ids: torch.Tensor | None) -> SamplerOutput:
    if greedy_ids is None:
        greedy_ids = logits.argmax(dim=-1)
    if tensors.all_greedy:
        return SamplerOutput(greedy_ids, logits, None, None)
    filters = tensors.top_ks is not None or tensors.top_ps is not None or tensors.min_ps is not None
    if logits.is_cuda:
        return _draw_cuda(logits, tensors, greedy_ids, filters)
    greedy_rows = tensors.temperatures == 0
    inv_temperatures = 1.0 / torch.where(greedy_rows, 1.0, tensors.temperatures)
    scaled = logits.float() * inv_temperatures.unsqueeze(1)
    filtered = _apply_filters(scaled, tensors) if filters else None
    # The exponential race in log space: argmax(logits / T - log(-log U)) samples softmax(logits / T).
    gumbel = _uniform(_row_keys(tensors.seeds, tensors.positions), logits.shape[1]).log_().neg_().log_()
    sampled_ids = (scaled if filtered is None else filtered).sub(gumbel).argmax(dim=-1)
    return SamplerOutput(torch.where(greedy_rows, greedy_ids, sampled_ids), logits, filtered, inv_temperatures)


def _draw_cuda(logits: torch.Tensor, tensors: SamplingTensors, greedy_ids: torch.Tensor,
               filters: bool) -> SamplerOutput:
    """The same draw in Triton kernels: with the filters in one kernel for small vocabularies, after torch's sort
    for larger ones."""
    if filters and logits.shape[1] <= FILTERED_DRAW_MAX_VOCAB:
        from batchgen.sample.filters_triton import filtered_draw

        token_ids, filtered, inv_temperatures = filtered_draw(
            logits, tensors.temperatures, tensors.top_ks, tensors.top_ps, tensors.min_ps, tensors.seeds,
            tensors.positions, greedy_ids)
        return SamplerOutput(token_ids, logits, filtered, inv_temperatures)
    from batchgen.sample.draw_triton import seeded_draw

    filtered = None
    if filters:
        inv_temperatures = 1.0 / torch.where(tensors.temperatures == 0, 1.0, tensors.temperatures)
        filtered = _apply_filters(logits.float() * inv_temperatures.unsqueeze(1), tensors)
    token_ids, inv_temperatures = seeded_draw(logits if filtered is None else filtered, tensors.temperatures,
                                              tensors.seeds, tensors.positions, greedy_ids, scale=filtered is None)
    return SamplerOutput(token_ids, logits, filtered, inv_temperatures)


def _apply_filters(logits: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
    """Top-k, top-p and min-p of logits already divided by the temperatures."""
    if tensors.top_ks is not None or tensors.top_ps is not None:
        logits = _apply_top_k_top_p(logits, tensors.top_ks, tensors.top_ps)
    if tensors.min_ps is not None:
        logits = _apply_min_p(logits, tensors.min_ps)
    return logits


def _apply_top_k_top_p(logits: torch.Tensor, top_ks: torch.Tensor | None, top_ps: torch.Tensor | None) -> torch.Tensor:
    """Masks (-inf) tokens outside each row's top k, then outside the nucleus of what is left."""
    # Stable, so that tokens tied at a cut are kept in index order, as the Triton filters keep them.
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True, stable=True)
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
