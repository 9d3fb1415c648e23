"""Temperature, top-k, top-p and min-p of large vocabularies without sorting a row (CUDA only).

sampler._apply_top_k_top_p sorts every row (151,936 logits for Qwen) to find two cuts. A row is too large for one
program's registers (filters_triton holds a small one whole), so here each row is split over several programs and
read three times, and only the few logits near a cut are ever looked at closely:

1. stats: each program bins its logits by their distance below the row's max, 1/8 nat a bin (a count histogram),
   and sums exp(x - max) for the softmax;
2. plan (a program per row): from the counts alone, the bins that may hold a cut. Top-k's is exact (counts); top-p's
   lies where the mass above a bin crosses p, which the counts bound within a bin's width either side;
3. compact: each program copies the logits of those bins (the candidates), in index order, to a per-row buffer and
   sums the mass of the bins above them;
4. select (a program per row): the exact cuts among the candidates, by search over int32 keys that order as the
   floats do (16 thresholds a pass), ties at a cut kept in index order, as the stable sort keeps them;
5. apply: each program writes its logits, -inf past the cuts or under min-p.

The kept set is the sort's: top-k counts ranks, top-p keeps a token while the mass ranked above it (after top-k,
renormalized) is short of p, min-p compares with the max probability of what is left. As in filters_triton,
probability sums are taken in another order than torch's cumsum, so a token whose top-p mass lies within rounding of
p may be cut differently; NaN logits rank first, as in the sort, but their rows' masses are NaN.

Every launch has a grid fixed by the batch and the vocabulary and nothing waits for the host, so CUDA graphs capture
it. The candidate buffer holds a whole row at worst (all logits within a bin of the cut); the candidate logits live
in the filtered output until the last pass overwrites it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.layers.pdl import launch_options, wait_for_previous
from batchgen.sample.filters_triton import _order_keys

_BINS = 256  # 254 bins of _BIN_WIDTH below the row's max, one for everything further below, one for -inf
_BIN_WIDTH = 0.125  # nats: a bin's tokens differ in probability by at most exp(0.125), 13%
# Widens the plan's bounds on a bin's mass far beyond the rounding of exp and of the bin edges, so that the bins it
# picks always hold the cut that the select pass computes.
_BOUND_MARGIN = 1e-3
_SELECT_BLOCK = 256  # candidates a select step reads at once
_FANOUT = 16  # thresholds a select pass tries at once: each pass narrows the cut's key range 16-fold
_PLAN_CHUNKS = 16  # chunk histograms the plan reads at once
_MIN_PROGRAMS = 264  # two programs per SM of an H100: smaller batches split rows into smaller chunks
_CHUNKS = (4096, 2048, 1024)  # logits a program of the row passes holds, largest first
# Per-row plan fields (int32): the first and last candidate bins, the tokens in the bins before them, the number of
# candidates, and whether top-k cuts (k below the row's count of logits above -inf). Constexpr, as kernels read them.
_FIRST, _LAST, _ABOVE, _CANDIDATES, _TOP_K_CUTS = (tl.constexpr(field) for field in range(5))
_PLAN_FIELDS = tl.constexpr(5)
_NO_CUT_KEY = tl.constexpr(-(2**31))  # below every logit's key: with the index limit at the vocabulary, all stay


@triton.jit
def _row_max(logits_ptr, stride, row, inv_temperatures_ptr, greedy_ids_ptr):
    """The row's largest logit times its 1 / T: the greedy id's."""
    logit = tl.load(logits_ptr + row.to(tl.int64) * stride + tl.load(greedy_ids_ptr + row)).to(tl.float32)
    return logit * tl.load(inv_temperatures_ptr + row)


@triton.jit
def _scaled_row(logits_ptr, stride, row, cols, valid, inv_temperatures_ptr, greedy_ids_ptr):
    """The row's logits at cols times its 1 / T (-inf past the row), and its max."""
    x = tl.load(logits_ptr + row.to(tl.int64) * stride + cols, mask=valid, other=float("-inf")).to(tl.float32)
    x = x * tl.load(inv_temperatures_ptr + row)
    return x, _row_max(logits_ptr, stride, row, inv_temperatures_ptr, greedy_ids_ptr)


@triton.jit
def _bins(x, row_max, BINS: tl.constexpr, BIN_WIDTH: tl.constexpr):
    """Each logit's bin by its distance below the row's max. A higher logit never lands in a later bin: NaN (first
    in the sort) in bin 0, and with a NaN max every number in the far bin."""
    distance = (row_max - x) * (1.0 / BIN_WIDTH)
    bins = tl.where(distance < BINS - 2, distance, BINS - 2)  # a NaN distance goes to the far bin
    bins = tl.where(bins > 0, bins, 0).to(tl.int32)
    bins = tl.where(x >= row_max, 0, bins)
    bins = tl.where(x == float("-inf"), BINS - 1, bins)
    return tl.where(x != x, 0, bins)


@triton.jit
def _stats_kernel(logits_ptr, stride, inv_temperatures_ptr, greedy_ids_ptr, sums_ptr, histograms_ptr,
                  VOCAB: tl.constexpr, CHUNK: tl.constexpr, BINS: tl.constexpr, BIN_WIDTH: tl.constexpr,
                  SUM: tl.constexpr, HISTOGRAM: tl.constexpr, PDL: tl.constexpr):
    """One program per (row, chunk): the chunk's sum of exp(x - max) (SUM) and its count of logits in each bin
    (HISTOGRAM)."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = cols < VOCAB
    at = row * tl.num_programs(1) + chunk
    wait_for_previous(PDL)
    x, row_max = _scaled_row(logits_ptr, stride, row, cols, valid, inv_temperatures_ptr, greedy_ids_ptr)
    if SUM:
        tl.store(sums_ptr + at, tl.sum(tl.where(valid, tl.exp(x - row_max), 0.0), axis=0))
    if HISTOGRAM:
        counts = tl.histogram(_bins(x, row_max, BINS, BIN_WIDTH), BINS, mask=valid)
        tl.store(histograms_ptr + at * BINS + tl.arange(0, BINS), counts)


@triton.jit
def _chunk_histograms(histograms_ptr, row, chunks, chunk_ids, BINS: tl.constexpr):
    """The bin counts of a row's chunks chunk_ids (zeros past the last chunk): (len(chunk_ids), BINS)."""
    at = (row * chunks + chunk_ids)[:, None] * BINS + tl.arange(0, BINS)[None, :]
    return tl.load(histograms_ptr + at, mask=(chunk_ids < chunks)[:, None], other=0)


@triton.jit
def _mass_fraction_above(upper, lower):
    """Per bin, a bound of the share of the mass in the bins before it: upper-bound bin masses above against
    lower-bound masses from the bin on give the upper bound, and the other way round the lower."""
    above = tl.cumsum(upper, axis=0) - upper
    rest = tl.cumsum(lower, axis=0, reverse=True)
    return tl.where(above > 0, above / (above + rest), 0.0)


@triton.jit
def _plan_kernel(histograms_ptr, top_ks_ptr, top_ps_ptr, plans_ptr, offsets_ptr, chunks, TOP_K: tl.constexpr,
                 TOP_P: tl.constexpr, BINS: tl.constexpr, BIN_WIDTH: tl.constexpr, MARGIN: tl.constexpr,
                 PLAN_CHUNKS: tl.constexpr, PDL: tl.constexpr):
    """One program per row: the bins whose logits the select pass must see (the candidates), and where each chunk's
    candidates start in the row's candidate buffer."""
    row = tl.program_id(0)
    bins = tl.arange(0, BINS)
    chunk_ids = tl.arange(0, PLAN_CHUNKS)
    wait_for_previous(PDL)
    counts = tl.zeros([BINS], tl.int32)
    for start in range(0, chunks, PLAN_CHUNKS):
        counts += tl.sum(_chunk_histograms(histograms_ptr, row, chunks, start + chunk_ids, BINS), axis=0)
    counts = tl.where(bins < BINS - 1, counts, 0)  # -inf logits stay -inf whatever a filter keeps
    before = tl.cumsum(counts, axis=0) - counts
    first = tl.full([], BINS, tl.int32)  # no candidates
    last = tl.full([], -1, tl.int32)
    kept = counts  # tokens each bin keeps after top-k
    top_k_cuts = tl.full([], 0, tl.int32)
    if TOP_K:
        k = tl.load(top_ks_ptr + row)
        top_k_cuts = ((k > 0) & (k < tl.sum(counts, axis=0))).to(tl.int32)
        kth_bin = tl.max(tl.where((before < k) & (counts > 0), bins, -1), axis=0)
        first = tl.where(top_k_cuts != 0, kth_bin, first)
        last = tl.where(top_k_cuts != 0, kth_bin, last)
        kept_by_k = tl.where(bins < kth_bin, counts, tl.where(bins == kth_bin, k - before, 0))
        kept = tl.where(top_k_cuts != 0, kept_by_k, counts)
    if TOP_P:
        p = tl.load(top_ps_ptr + row)
        # A token's exp(x - max) in bin b lies in [exp(-(b + 1) w), exp(-b w)]; the far bin's down to 0.
        high = tl.exp(-bins.to(tl.float32) * BIN_WIDTH) * (1 + MARGIN) * kept
        low = tl.where(bins < BINS - 2, tl.exp(-(bins + 1).to(tl.float32) * BIN_WIDTH), 0.0) * (1 - MARGIN) * kept
        # The last kept token lies in the last bin whose first token has less than p above it.
        surely_short = (kept > 0) & (_mass_fraction_above(high, low) < p)
        maybe_short = (kept > 0) & (_mass_fraction_above(low, high) < p)
        first = tl.where(p < 1, tl.max(tl.where(surely_short, bins, -1), axis=0), first)
        last = tl.where((p < 1) & (top_k_cuts == 0), tl.max(tl.where(maybe_short, bins, -1), axis=0), last)
    plan_ptr = plans_ptr + row * _PLAN_FIELDS
    tl.store(plan_ptr + _FIRST, first)
    tl.store(plan_ptr + _LAST, last)
    tl.store(plan_ptr + _ABOVE, tl.sum(tl.where(bins < first, counts, 0), axis=0))
    tl.store(plan_ptr + _TOP_K_CUTS, top_k_cuts)
    candidate_bins = ((bins >= first) & (bins <= last))[None, :]
    total = tl.full([], 0, tl.int32)
    for start in range(0, chunks, PLAN_CHUNKS):
        ids = start + chunk_ids
        per_chunk = tl.sum(tl.where(candidate_bins, _chunk_histograms(histograms_ptr, row, chunks, ids, BINS), 0),
                           axis=1)
        tl.store(offsets_ptr + row * chunks + ids, total + tl.cumsum(per_chunk, axis=0) - per_chunk,
                 mask=ids < chunks)
        total += tl.sum(per_chunk, axis=0)
    tl.store(plan_ptr + _CANDIDATES, total)


@triton.jit
def _compact_kernel(logits_ptr, stride, inv_temperatures_ptr, greedy_ids_ptr, plans_ptr, offsets_ptr, above_ptr,
                    candidate_x_ptr, candidate_ids_ptr, VOCAB: tl.constexpr, CHUNK: tl.constexpr,
                    BINS: tl.constexpr, BIN_WIDTH: tl.constexpr, MASS: tl.constexpr, PDL: tl.constexpr):
    """One program per (row, chunk): the chunk's candidates into the row's buffer, in index order, and (MASS) the
    chunk's sum of exp(x - max) over the bins before them."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = cols < VOCAB
    at = row * tl.num_programs(1) + chunk
    wait_for_previous(PDL)
    x, row_max = _scaled_row(logits_ptr, stride, row, cols, valid, inv_temperatures_ptr, greedy_ids_ptr)
    bins = _bins(x, row_max, BINS, BIN_WIDTH)
    first = tl.load(plans_ptr + row * _PLAN_FIELDS + _FIRST)
    candidate = valid & (bins >= first) & (bins <= tl.load(plans_ptr + row * _PLAN_FIELDS + _LAST))
    slots = row.to(tl.int64) * VOCAB + tl.load(offsets_ptr + at) + tl.cumsum(candidate.to(tl.int32), axis=0) - 1
    tl.store(candidate_x_ptr + slots, x, mask=candidate)
    tl.store(candidate_ids_ptr + slots, cols, mask=candidate)
    if MASS:
        tl.store(above_ptr + at, tl.sum(tl.where(valid & (bins < first), tl.exp(x - row_max), 0.0), axis=0))


@triton.jit
def _candidate_block(x_ptr, ids_ptr, start, count, row_max, norm, prior_cut, prior_index, COUNT: tl.constexpr,
                     BLOCK: tl.constexpr):
    """A block of a row's candidates: (keys, weights, vocab indices, valid). Weight: 1 (COUNT) or
    exp(x - max) / norm, and 0 for tokens past the prior cut (key below it, or equal with a larger index)."""
    offsets = start + tl.arange(0, BLOCK)
    valid = offsets < count
    x = tl.load(x_ptr + offsets, mask=valid, other=float("-inf"))
    ids = tl.load(ids_ptr + offsets, mask=valid, other=0)
    keys = _order_keys(x, valid).to(tl.int64)
    if COUNT:
        weights = valid.to(tl.float32)
    else:
        kept = valid & ((keys > prior_cut) | ((keys == prior_cut) & (ids <= prior_index)))
        weights = tl.where(kept, tl.exp(x - row_max) / norm, 0.0)
    return keys, weights, ids, valid


@triton.jit
def _select(x_ptr, ids_ptr, count, row_max, norm, offset, limit, prior_cut, prior_index, COUNT: tl.constexpr,
            BLOCK: tl.constexpr, FANOUT: tl.constexpr):
    """Where a stable descending sort of the candidates stops keeping: each token stays while `offset` (the weight
    of the tokens before the candidates) plus the weight ranked above it is under `limit`. -> (cut key, largest
    index kept among the tokens of that key; -1: none of them)."""
    lowest = tl.full([], 2**31 - 1, tl.int64)
    highest = tl.full([], -(2**31), tl.int64)
    for start in range(0, count, BLOCK):
        keys, _, _, valid = _candidate_block(x_ptr, ids_ptr, start, count, row_max, norm, prior_cut, prior_index,
                                             True, BLOCK)
        lowest = tl.minimum(lowest, tl.min(tl.where(valid, keys, 2**31 - 1), axis=0))
        highest = tl.maximum(highest, tl.max(keys, axis=0))
    # The smallest key t with less than limit above it (keys > t): that key is a candidate's, the cut. Between low
    # and high: low has limit or more above it (or is below every key), high less (or is the highest key).
    low = lowest - 1
    high = highest
    above_high = offset
    while high - low > 1:
        step = (high - low + FANOUT - 1) // FANOUT
        thresholds = tl.minimum(low + step * (tl.arange(0, FANOUT) + 1), high)  # the last one is high
        above = tl.zeros([FANOUT], tl.float32) + offset
        for start in range(0, count, BLOCK):
            keys, weights, _, _ = _candidate_block(x_ptr, ids_ptr, start, count, row_max, norm, prior_cut,
                                                   prior_index, COUNT, BLOCK)
            above += tl.sum(tl.where(keys[:, None] > thresholds[None, :], weights[:, None], 0.0), axis=0)
        short = above < limit  # false, then true along the thresholds
        any_short = tl.max(short.to(tl.int32), axis=0) > 0
        above_high = tl.where(any_short, tl.max(tl.where(short, above, float("-inf")), axis=0), above_high)
        high = tl.min(tl.where(short, thresholds, high), axis=0)
        low = tl.max(tl.where(short, low, thresholds), axis=0)
    # The tokens of the cut key, in index order (the buffer's), while the weight before them stays under limit.
    last_kept = tl.full([], -1, tl.int32)
    tied_before = tl.zeros([], tl.float32)
    for start in range(0, count, BLOCK):
        keys, weights, ids, _ = _candidate_block(x_ptr, ids_ptr, start, count, row_max, norm, prior_cut,
                                                 prior_index, COUNT, BLOCK)
        tied = tl.where(keys == high, weights, 0.0)
        before = above_high + tied_before + tl.cumsum(tied, axis=0) - tied
        last_kept = tl.maximum(last_kept, tl.max(tl.where((keys == high) & (before < limit), ids, -1), axis=0))
        tied_before += tl.sum(tied, axis=0)
    return high, last_kept


@triton.jit
def _kept_mass(x_ptr, ids_ptr, count, row_max, cut, cut_index, BLOCK: tl.constexpr):
    """The sum of exp(x - max) over the candidates a cut keeps."""
    total = tl.zeros([], tl.float32)
    for start in range(0, count, BLOCK):
        _, weights, _, _ = _candidate_block(x_ptr, ids_ptr, start, count, row_max, 1.0, cut, cut_index, False,
                                            BLOCK)
        total += tl.sum(weights, axis=0)
    return total


@triton.jit
def _sum_chunks(values_ptr, row, chunks, BLOCK: tl.constexpr):
    """The sum of a row's per-chunk values, in chunk order."""
    total = tl.zeros([], tl.float32)
    for start in range(0, chunks, BLOCK):
        ids = start + tl.arange(0, BLOCK)
        total += tl.sum(tl.load(values_ptr + row * chunks + ids, mask=ids < chunks, other=0.0), axis=0)
    return total


@triton.jit
def _select_kernel(logits_ptr, stride, inv_temperatures_ptr, greedy_ids_ptr, top_ks_ptr, top_ps_ptr, sums_ptr,
                   above_ptr, plans_ptr, candidate_x_ptr, candidate_ids_ptr, cuts_ptr, cut_indices_ptr, norms_ptr,
                   chunks, VOCAB: tl.constexpr, TOP_K: tl.constexpr, TOP_P: tl.constexpr, MIN_P: tl.constexpr,
                   BLOCK: tl.constexpr, FANOUT: tl.constexpr, PDL: tl.constexpr):
    """One program per row: the row's cut (key, largest kept index of that key) and, for min-p's softmax, the sum
    of exp(x - max) over what it keeps."""
    row = tl.program_id(0)
    wait_for_previous(PDL)
    row_max = _row_max(logits_ptr, stride, row, inv_temperatures_ptr, greedy_ids_ptr)
    cut = tl.full([], _NO_CUT_KEY, tl.int64)
    cut_index = tl.full([], VOCAB, tl.int32)
    norm = tl.zeros([], tl.float32)
    if TOP_P or MIN_P:
        norm = _sum_chunks(sums_ptr, row, chunks, BLOCK)  # the whole row's
    if TOP_K or TOP_P:
        plan_ptr = plans_ptr + row * _PLAN_FIELDS
        x_ptr = candidate_x_ptr + row.to(tl.int64) * VOCAB
        ids_ptr = candidate_ids_ptr + row.to(tl.int64) * VOCAB
        count = tl.load(plan_ptr + _CANDIDATES)
        mass_above = tl.zeros([], tl.float32)  # exp(x - max) of the bins before the candidates
        if TOP_P or MIN_P:
            mass_above = _sum_chunks(above_ptr, row, chunks, BLOCK)
        if TOP_K:
            if tl.load(plan_ptr + _TOP_K_CUTS) != 0:
                k = tl.load(top_ks_ptr + row).to(tl.float32)
                above = tl.load(plan_ptr + _ABOVE).to(tl.float32)
                cut, cut_index = _select(x_ptr, ids_ptr, count, row_max, 1.0, above, k, cut, cut_index, True, BLOCK,
                                         FANOUT)
                if TOP_P or MIN_P:
                    norm = mass_above + _kept_mass(x_ptr, ids_ptr, count, row_max, cut, cut_index, BLOCK)
        if TOP_P:
            p = tl.load(top_ps_ptr + row)
            if p < 1:
                cut_p, index_p = _select(x_ptr, ids_ptr, count, row_max, norm, mass_above / norm, p, cut, cut_index,
                                         False, BLOCK, FANOUT)
                # Top-p runs on what top-k keeps; rounding aside its cut comes first, else top-k's does.
                cut_index = tl.where(cut_p > cut, index_p,
                                     tl.where(cut_p == cut, tl.minimum(cut_index, index_p), cut_index))
                cut = tl.maximum(cut, cut_p)
                if MIN_P:
                    norm = mass_above + _kept_mass(x_ptr, ids_ptr, count, row_max, cut, cut_index, BLOCK)
    tl.store(cuts_ptr + row, cut.to(tl.int32))
    tl.store(cut_indices_ptr + row, cut_index)
    tl.store(norms_ptr + row, norm)


@triton.jit
def _apply_kernel(logits_ptr, stride, inv_temperatures_ptr, greedy_ids_ptr, min_ps_ptr, cuts_ptr, cut_indices_ptr,
                  norms_ptr, filtered_ptr, VOCAB: tl.constexpr, CHUNK: tl.constexpr, MIN_P: tl.constexpr,
                  PDL: tl.constexpr):
    """One program per (row, chunk): the filtered logits, -inf past the row's cut and, with min-p, where a
    probability is under min_p times the largest."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    valid = cols < VOCAB
    wait_for_previous(PDL)
    x, row_max = _scaled_row(logits_ptr, stride, row, cols, valid, inv_temperatures_ptr, greedy_ids_ptr)
    keys = _order_keys(x, valid)
    cut = tl.load(cuts_ptr + row)
    kept = (keys > cut) | ((keys == cut) & (cols <= tl.load(cut_indices_ptr + row)))
    if MIN_P:
        norm = tl.load(norms_ptr + row)
        probs = tl.exp(x - row_max) / norm
        kept = kept & ~(probs < (1.0 / norm) * tl.load(min_ps_ptr + row))  # the largest probability is 1 / norm
    tl.store(filtered_ptr + row.to(tl.int64) * VOCAB + cols, tl.where(kept, x, float("-inf")), mask=valid)


def _chunk_size(rows: int, vocab: int) -> int:
    """The largest chunk that still gives the row passes _MIN_PROGRAMS programs (the smallest otherwise)."""
    return next((chunk for chunk in _CHUNKS if rows * triton.cdiv(vocab, chunk) >= _MIN_PROGRAMS), _CHUNKS[-1])


def filter_large_vocab(logits: torch.Tensor, inv_temperatures: torch.Tensor, top_ks: torch.Tensor | None,
                       top_ps: torch.Tensor | None, min_ps: torch.Tensor | None, greedy_ids: torch.Tensor
                       ) -> torch.Tensor:
    """sampler._apply_filters of logits (B, V) times inv_temperatures (B,): top_ks (B,) int64 (0: off), top_ps (B,)
    float32 (1: off), min_ps (B,) float32; a filter whose tensor is None is not run. greedy_ids (B,) int64: each
    row's argmax (its logit is the row's max). -> (B, V) float32, -inf where a filter cuts."""
    rows, vocab = logits.shape
    device = logits.device
    filtered = torch.empty(rows, vocab, dtype=torch.float32, device=device)
    if rows == 0:
        return filtered
    chunk = _chunk_size(rows, vocab)
    chunks = triton.cdiv(vocab, chunk)
    top_k, top_p, min_p = top_ks is not None, top_ps is not None, min_ps is not None
    cuts = top_k or top_p
    sums = torch.empty(rows, chunks, dtype=torch.float32, device=device)
    above = torch.empty(rows, chunks, dtype=torch.float32, device=device)
    histograms = torch.empty(rows, chunks, _BINS if cuts else 1, dtype=torch.int32, device=device)
    plans = torch.empty(rows, _PLAN_FIELDS.value, dtype=torch.int32, device=device)
    offsets = torch.empty(rows, chunks, dtype=torch.int32, device=device)
    candidate_ids = torch.empty(rows, vocab if cuts else 1, dtype=torch.int32, device=device)
    row_cuts = torch.empty(rows, dtype=torch.int32, device=device)
    cut_indices = torch.empty(rows, dtype=torch.int32, device=device)
    norms = torch.empty(rows, dtype=torch.float32, device=device)
    unused = inv_temperatures  # stands in for the tensor of a filter no row uses: the kernels do not read it
    top_ks = unused if top_ks is None else top_ks
    top_ps = unused if top_ps is None else top_ps
    min_ps = unused if min_ps is None else min_ps
    row_args = (logits, logits.stride(0), inv_temperatures, greedy_ids)
    chunk_warps = chunk // 512
    options = {"enable_fp_fusion": False, **launch_options(device)}  # every pass rounds exp(x - max) alike
    _stats_kernel[(rows, chunks)](*row_args, sums, histograms, VOCAB=vocab, CHUNK=chunk, BINS=_BINS,
                                  BIN_WIDTH=_BIN_WIDTH, SUM=top_p or min_p, HISTOGRAM=cuts, num_warps=chunk_warps,
                                  **options)
    if cuts:
        _plan_kernel[(rows,)](histograms, top_ks, top_ps, plans, offsets, chunks, TOP_K=top_k, TOP_P=top_p,
                              BINS=_BINS, BIN_WIDTH=_BIN_WIDTH, MARGIN=_BOUND_MARGIN, PLAN_CHUNKS=_PLAN_CHUNKS,
                              num_warps=4, **options)
        _compact_kernel[(rows, chunks)](*row_args, plans, offsets, above, filtered, candidate_ids, VOCAB=vocab,
                                        CHUNK=chunk, BINS=_BINS, BIN_WIDTH=_BIN_WIDTH, MASS=top_p or min_p,
                                        num_warps=chunk_warps,
                                        **options)
    _select_kernel[(rows,)](*row_args, top_ks, top_ps, sums, above, plans, filtered, candidate_ids, row_cuts,
                            cut_indices, norms, chunks, VOCAB=vocab, TOP_K=top_k, TOP_P=top_p, MIN_P=min_p,
                            BLOCK=_SELECT_BLOCK, FANOUT=_FANOUT, num_warps=4, **options)
    _apply_kernel[(rows, chunks)](*row_args, min_ps, row_cuts, cut_indices, norms, filtered, VOCAB=vocab,
                                  CHUNK=chunk, MIN_P=min_p, num_warps=chunk_warps, **options)
    return filtered
