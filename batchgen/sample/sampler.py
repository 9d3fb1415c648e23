"""Token sampling on the device, one pipeline for eager steps and captured decode graphs: structured-output bitmask,
bias and penalties, then greedy argmax or temperature, top-k, top-p, min-p and the seeded draw.

Random draws come from a counter-based hash of (seed, position, vocab index) instead of a torch.Generator, so a
request's sample depends only on its seed and the position being sampled, never on the batch it shares or on step
timing: a seeded request reproduces run to run and across preemption, with no host sync and no per-row loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.sample.bad_words import apply_bad_words
from batchgen.sample.batch import SamplingTensors
from batchgen.sample.bitmask import apply_token_bitmask
from batchgen.sample.penalties import apply_penalties, count_sampled

_MASK32 = 0xFFFFFFFF
_SALT = 0x9E3779B9  # 2**32 / golden ratio
# Up to this vocabulary a row fits one program's registers, and the filters run with the draw in one Triton kernel
# (filters_triton). Larger ones are filtered by filters_large_triton, which finds the cuts without sorting, in batches
# of at least LARGE_VOCAB_FILTERS_MIN_ROWS rows; smaller batches sort in torch. benchmarks/bench_sampling.py times
# both on a GPU by moving this limit: sort-free was faster from one row on (benchmarks/RESULTS.md, 2026-11-27c).
FILTERED_DRAW_MAX_VOCAB = 4096
LARGE_VOCAB_FILTERS_MIN_ROWS = 1


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # (B,) int64
    logits: torch.Tensor  # (B, V) after the bitmask, bias and penalties; before temperature
    filtered: torch.Tensor | None  # (B, V) float32 after temperature and the filters, when a filter ran
    inv_temperature: torch.Tensor | None  # (B,) float32, 1 for greedy rows; None when all rows are greedy

    def processed_logits(self) -> torch.Tensor:
        """The logits the draw sampled from (greedy rows: after penalties, without temperature)."""
        if self.filtered is not None:
            return self.filtered
        if self.inv_temperature is None:
            return self.logits
        return self.logits.float() * self.inv_temperature.unsqueeze(1)


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


def _draw(logits: torch.Tensor, t: SamplingTensors, greedy_ids: torch.Tensor | None) -> SamplerOutput:
    if greedy_ids is None:
        greedy_ids = logits.argmax(dim=-1)
    if t.all_greedy:
        return SamplerOutput(greedy_ids, logits, None, None)
    filters = t.top_k is not None or t.top_p is not None or t.min_p is not None
    if logits.is_cuda:
        return _draw_cuda(logits, t, greedy_ids, filters)
    scaled = logits.float() * t.inv_temperature.unsqueeze(1)
    filtered = _apply_filters(scaled, t) if filters else None
    # The exponential race in log space: argmax(logits / T - log(-log U)) samples softmax(logits / T).
    gumbel = _uniform(_row_keys(t.seed, t.position), logits.shape[1]).log_().neg_().log_()
    sampled_ids = (scaled if filtered is None else filtered).sub(gumbel).argmax(dim=-1)
    return SamplerOutput(torch.where(t.temperature == 0, greedy_ids, sampled_ids), logits, filtered, t.inv_temperature)


def _draw_cuda(logits: torch.Tensor, t: SamplingTensors, greedy_ids: torch.Tensor, filters: bool) -> SamplerOutput:
    """The same draw in Triton kernels: with the filters in one kernel for small vocabularies; for larger ones after
    the filters' own kernels, or torch's sort in batches too small to gain from them."""
    if filters and logits.shape[1] <= FILTERED_DRAW_MAX_VOCAB:
        from batchgen.sample.filters_triton import filtered_draw

        token_ids, filtered = filtered_draw(logits, t.temperature, t.inv_temperature, t.top_k, t.top_p, t.min_p,
                                            t.seed, t.position, greedy_ids)
        return SamplerOutput(token_ids, logits, filtered, t.inv_temperature)
    from batchgen.sample.draw_triton import seeded_draw

    filtered = None
    if filters and len(logits) >= LARGE_VOCAB_FILTERS_MIN_ROWS:
        from batchgen.sample.filters_large_triton import filter_large_vocab

        filtered = filter_large_vocab(logits, t.inv_temperature, t.top_k, t.top_p, t.min_p, greedy_ids)
    elif filters:
        filtered = _apply_filters(logits.float() * t.inv_temperature.unsqueeze(1), t)
    token_ids = seeded_draw(logits if filtered is None else filtered, t.temperature, t.inv_temperature, t.seed,
                            t.position, greedy_ids, scale=filtered is None)
    return SamplerOutput(token_ids, logits, filtered, t.inv_temperature)


def _apply_filters(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Top-k, top-p and min-p of logits already divided by the temperatures."""
    if t.top_k is not None or t.top_p is not None:
        logits = _apply_top_k_top_p(logits, t.top_k, t.top_p)
    if t.min_p is not None:
        logits = _apply_min_p(logits, t.min_p)
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
