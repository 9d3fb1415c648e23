"""Temperature, top-k, top-p, min-p and the seeded draw of a small vocabulary's rows in one kernel (CUDA only).

In torch the filters are a sort, a scatter and a dozen elementwise launches, which take a small vocabulary's decode
step longer than this one kernel. Here one program holds a whole row and finds each filter's cut without sorting: a
bisection over int32 keys that order as the floats do (NaN above everything, as torch's descending sort puts it).
Tokens tied at a cut are kept in index order, as a stable sort keeps them (sampler._apply_top_k_top_p sorts stably).
Probability sums are taken in another order than torch's cumsum, so a token whose top-p mass lies within rounding of
p may be cut differently.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.layers.pdl import launch_options, wait_for_previous
from batchgen.sample.draw_triton import _SALT, _argmax, _gumbel


@triton.jit
def _order_keys(x, valid):
    """int32 keys that order as the float32 values do, NaN highest; the lowest for columns past the row."""
    bits = (x + 0.0).to(tl.int32, bitcast=True)  # -0.0 + 0.0 is 0.0: torch's sort ties the two zeros
    keys = tl.where(x != x, 2**31 - 1, bits ^ ((bits >> 31) & 0x7FFFFFFF))
    return tl.where(valid, keys, -(2**31))


@triton.jit
def _keep_ranked_before(keys, weights, limit, valid):
    """What a stable descending sort keeps while the tokens ranked above hold less than `limit` of `weights`
    (1 a token for top-k, probabilities for top-p; 0 past the row)."""
    # The smallest t with less than limit above it (keys > t): keys above the lowest key >= t are kept, and the
    # tokens of that key in index order while the weight before them stays under limit.
    low = tl.full([], -(2**31) - 1, tl.int64)  # limit or more above it
    high = tl.full([], 2**31 - 1, tl.int64)  # less than limit above it
    for _ in range(33):
        middle = (low + high) // 2
        below_limit = tl.sum(tl.where(keys.to(tl.int64) > middle, weights, 0), axis=0) < limit
        high = tl.where(below_limit, middle, high)
        low = tl.where(below_limit, low, middle)
    cut = tl.min(tl.where(valid & (keys.to(tl.int64) >= high), keys, 2**31 - 1), axis=0)
    tied = tl.where(keys == cut, weights, 0)
    before = tl.sum(tl.where(keys > cut, weights, 0), axis=0) + tl.cumsum(tied, axis=0) - tied
    return (keys > cut) | ((keys == cut) & (before < limit))


@triton.jit
def _softmax(x):
    exps = tl.exp(x - tl.max(x, axis=0))
    return exps / tl.sum(exps, axis=0)


@triton.jit
def _filtered_draw_kernel(logits_ptr, stride, temperatures_ptr, inv_temperatures_ptr, top_ks_ptr, top_ps_ptr,
                          min_ps_ptr, seeds_ptr, positions_ptr, greedy_ids_ptr, out_ptr, filtered_ptr,
                          VOCAB: tl.constexpr, TOP_K: tl.constexpr, TOP_P: tl.constexpr, MIN_P: tl.constexpr,
                          SALT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    valid = cols < VOCAB
    gumbel = _gumbel(tl.load(seeds_ptr + row), tl.load(positions_ptr + row), cols, SALT)
    wait_for_previous(PDL)
    inv_temperature = tl.load(inv_temperatures_ptr + row)
    x = tl.load(logits_ptr + row * stride + cols, mask=valid, other=float("-inf")).to(tl.float32) * inv_temperature
    if TOP_K or TOP_P:
        keys = _order_keys(x, valid)
        if TOP_K:
            k = tl.load(top_ks_ptr + row)
            k = tl.where((k > 0) & (k < VOCAB), k, VOCAB).to(tl.float32)
            x = tl.where(_keep_ranked_before(keys, valid.to(tl.float32), k, valid), x, float("-inf"))
        if TOP_P:
            p = tl.load(top_ps_ptr + row)
            keep = _keep_ranked_before(keys, _softmax(x), p, valid)
            x = tl.where(keep, x, tl.where(p < 1, float("-inf"), x))
    if MIN_P:
        probs = _softmax(x)
        x = tl.where(probs < tl.max(probs, axis=0) * tl.load(min_ps_ptr + row), float("-inf"), x)
    tl.store(filtered_ptr + row * VOCAB + cols, x, mask=valid)
    _, _, winner = _argmax(x - gumbel, cols)
    greedy = tl.load(temperatures_ptr + row) == 0
    tl.store(out_ptr + row, tl.where(greedy, tl.load(greedy_ids_ptr + row), winner.to(tl.int64)))


def filtered_draw(logits: torch.Tensor, temperatures: torch.Tensor, inv_temperatures: torch.Tensor,
                  top_ks: torch.Tensor | None, top_ps: torch.Tensor | None, min_ps: torch.Tensor | None,
                  seeds: torch.Tensor, positions: torch.Tensor, greedy_ids: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """sampler._draw's filtered path for logits (B, V <= sampler.FILTERED_DRAW_MAX_VOCAB); a filter whose tensor is
    None is not run. -> (B,) int64 token ids (greedy rows: their greedy_ids), (B, V) float32 filtered logits
    (multiplied by inv_temperatures)."""
    rows, vocab = logits.shape
    token_ids = torch.empty(rows, dtype=torch.int64, device=logits.device)
    filtered = torch.empty(rows, vocab, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return token_ids, filtered
    block = triton.next_power_of_2(vocab)
    unused = temperatures  # stands in for the tensor of a filter no row uses: the kernel does not read it
    _filtered_draw_kernel[(rows,)](
        logits, logits.stride(0), temperatures, inv_temperatures, unused if top_ks is None else top_ks,
        unused if top_ps is None else top_ps, unused if min_ps is None else min_ps, seeds, positions, greedy_ids,
        token_ids, filtered, VOCAB=vocab, TOP_K=top_ks is not None, TOP_P=top_ps is not None,
        MIN_P=min_ps is not None, SALT=_SALT, BLOCK=block, num_warps=max(1, min(8, block // 256)),
        enable_fp_fusion=False, **launch_options(logits.device))
    return token_ids, filtered
