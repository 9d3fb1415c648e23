"""Triton kernels for paged attention; same interface and semantics as `attention_torch`.

The KV cache is (num_blocks, block_size, num_kv_heads, head_dim) per layer; token p of sequence b lives at
cache[block_tables[b, p // block_size], p % block_size]. Every kernel gathers K/V token by token through the block
table, so any block size works and a KV tile may span several cache blocks.

decode_attention is replayed inside CUDA graphs: its grid depends only on the batch size, head counts and static
config, context lengths are read from GPU memory inside the kernel, and it never syncs with the host.

A sliding window W (per layer, static) limits the query at position p to keys p - W < k <= p: the kernels start
their KV loop at the window's first tile and mask the rest; without a window they get W = _NO_WINDOW.

A soft cap C (per layer, static: Gemma 2's attn_logit_softcapping) turns each scaled score s into C * tanh(s / C)
before the mask. It is a constexpr (SOFTCAP, in the kernels' log2 units; 0.0 for none): without a cap the kernels
compile exactly as before.

Cascade decode: when every sequence of a decode batch starts with the same physical KV blocks (prefix caching, or
n > 1 samples of one prompt), `shared_prefix_len` (a 1-element device tensor, see `shared_prefix`) names how many
leading positions they share. `_shared_prefix_kernel` then reads that prefix once for all sequences, as a
tensor-core tile of (sequence, query head) rows, and `_decode_kernel` reads only each sequence's own rest; both write
partial softmaxes that `_decode_reduce_kernel` merges. Without cascade, the splits of `_decode_kernel` merge their
partials themselves: the last one to finish does. The prefix kernel ignores sliding windows: windowed layers do
not cascade (a window would cut the prefix differently for every row).

An fp8 cache (float8_e4m3fn, Triton's fp8e4nv: compute capability 8.9 or newer) is written clamped to its range and
read as tiles converted to fp16 (or fp32 for fp32 queries) before tl.dot, with the queries in that dtype too
(`_dot_query`); a cache in the query's dtype compiles exactly as before.

Context lengths are read as int32 whatever the dtype of their tensor (the CUDA-graph buffers hold int64): int64
lengths make every position and tile bound of the KV loop 64-bit.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from batchgen.layers import pdl
from batchgen.layers.fp8_gemm_triton import HOPPER, gpu_limits
from batchgen.layers.pdl import launch_options, wait_for_previous
from batchgen.layers.triton_launch import DirectKernel

_MAX_SPLITS = 16  # of each sequence's own KV range, and (cascade) of the shared prefix
_LOG2E = 1.4426950408889634  # the kernels work in base 2 (exp2), with log2(e) folded into the softmax scale
_NO_WINDOW = 1 << 30  # longer than any context, and p - _NO_WINDOW stays inside int32
_FP8_MAX = tl.constexpr(448.0)  # float8_e4m3fn's largest finite value
_FP16_MAX = tl.constexpr(65504.0)


def _log2_softcap(softcap: float | None) -> float:
    """The kernels' SOFTCAP: the cap in their log2 units (scores carry log2(e) from the softmax scale); 0.0 for none."""
    return 0.0 if softcap is None else softcap * _LOG2E


def _dot_precision(dtype: torch.dtype) -> str:
    # Plain tf32 would cost fp32 runs ~3 decimal digits; tf32x3 keeps near-fp32 accuracy on tensor cores, where "ieee"
    # falls back to FMA dots that spill registers.
    return "tf32x3" if dtype == torch.float32 else "tf32"


@triton.jit
def to_cache_dtype(x, cache_dtype: tl.constexpr):
    """x in the cache's dtype; fp8 (scale 1.0, as attention_torch.to_cache_dtype) has no infinity, so values past
    its range are clamped rather than made NaN. A no-op for a cache in x's dtype."""
    if cache_dtype == tl.float8e4nv:
        x = tl.clamp(x.to(tl.float32), -_FP8_MAX, _FP8_MAX)
    return x.to(cache_dtype)


@triton.jit
def _dot_query(q, cache_dtype: tl.constexpr):
    """q in the dtype its dots with the cache's tiles run in. An fp8 tile converts to fp16 in one instruction per
    pair of values but to bf16 only through fp32, so bf16 queries against an fp8 cache compute in fp16 (clamped to
    its range; its 10-bit mantissa loses nothing of bf16's 7)."""
    if cache_dtype == tl.float8e4nv:
        if q.dtype == tl.bfloat16:
            q = tl.clamp(q.to(tl.float32), -_FP16_MAX, _FP16_MAX).to(tl.float16)
    return q


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kc_blk, stride_kc_off, stride_kc_h, stride_kc_d,
    stride_vc_blk, stride_vc_off, stride_vc_h, stride_vc_d,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)
    # (BLOCK_H, BLOCK_D)
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :] * stride_kd, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :] * stride_vd, mask=mask)
    kc = k_cache_ptr + blk * stride_kc_blk + off * stride_kc_off + h[:, None] * stride_kc_h + d[None, :] * stride_kc_d
    vc = v_cache_ptr + blk * stride_vc_blk + off * stride_vc_off + h[:, None] * stride_vc_h + d[None, :] * stride_vc_d
    tl.store(kc, to_cache_dtype(k, k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, to_cache_dtype(v, v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor,  # (T, KVH, D)
    v: torch.Tensor,  # (T, KVH, D)
    k_cache: torch.Tensor,  # (NB, BS, KVH, D)
    v_cache: torch.Tensor,  # (NB, BS, KVH, D)
    slot_mapping: torch.Tensor,  # (T,) int64, -1 = write nothing
) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip


@triton.jit
def _kv_tile_pointers(
    block_table, kc_head, vc_head, pos, valid,
    d, stride_kc_blk, stride_kc_off, stride_kc_d, stride_vc_blk, stride_vc_off, stride_vc_d,
    BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    """Pointers to the K and V rows of cache positions `pos` of one kv head, through a block table (whose entries
    are read where `valid`): (len(pos), BLOCK_D) each."""
    blk = tl.load(block_table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    off = pos % BLOCK_SIZE
    k_ptrs = kc_head + (blk * stride_kc_blk + off * stride_kc_off)[:, None] + d[None, :] * stride_kc_d
    v_ptrs = vc_head + (blk * stride_vc_blk + off * stride_vc_off)[:, None] + d[None, :] * stride_vc_d
    return k_ptrs, v_ptrs


@triton.jit
def _load_kv_tile(
    block_table, kc_head, vc_head, pos, valid, d, d_mask,
    stride_kc_blk, stride_kc_off, stride_kc_d,
    stride_vc_blk, stride_vc_off, stride_vc_d,
    BLOCK_SIZE: tl.constexpr, DTYPE: tl.constexpr,
):  # fmt: skip
    """The K and V rows of cache positions `pos` (zeros where not `valid`) of one kv head, through a block table,
    in DTYPE (the query's, see _dot_query): an fp8 cache's tiles are converted for tl.dot; a cache in DTYPE compiles
    no conversion."""
    k_ptrs, v_ptrs = _kv_tile_pointers(block_table, kc_head, vc_head, pos, valid, d, stride_kc_blk, stride_kc_off,
                                       stride_kc_d, stride_vc_blk, stride_vc_off, stride_vc_d, BLOCK_SIZE)
    kv_mask = valid[:, None] & d_mask[None, :]
    k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
    v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    return k.to(DTYPE), v.to(DTYPE)


@triton.jit
def _soft_capped(s, SOFTCAP: tl.constexpr):
    """SOFTCAP * tanh(s / SOFTCAP), the tanh from one exp of -2|x| (off by a few fp32 units of SOFTCAP at most;
    libdevice's tanh does not run in Triton's interpreter). Scale-free: it serves log2-unit scores and cap alike."""
    e = tl.exp(-2.0 * tl.abs(s) / SOFTCAP)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(s < 0, -t, t) * SOFTCAP


@triton.jit
def _scores(q, k, qk_scale, DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr):
    """The scaled scores (rows, BLOCK_N) of the queries q (rows, BLOCK_D) against the keys k (BLOCK_N, BLOCK_D), in
    log2 units; SOFTCAP > 0 (log2 units) soft-caps them."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if SOFTCAP > 0:
        s = _soft_capped(s, SOFTCAP)
    return s


@triton.jit
def _online_softmax(s, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """The scores s (rows, BLOCK_N; -inf for keys a row may not see) and values v (BLOCK_N, BLOCK_D), in the queries'
    dtype, folded into the online softmax: the new running max, sum and accumulator (log2 units). A row that sees no
    key yet (a padding row, or the first tiles of a sliding window) stays empty: max -inf, sum and accumulator 0,
    never NaN."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _softmax_tile(q, k, v, allowed, m_i, l_i, acc, qk_scale, DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr):
    """The keys k and values v of one tile (BLOCK_N, BLOCK_D), in q's dtype, folded into the online softmax of the
    queries q (rows, BLOCK_D) (`_online_softmax`). Keys where `allowed` (rows, BLOCK_N), or (1, BLOCK_N) for every
    row, is false get no weight."""
    s = tl.where(allowed, _scores(q, k, qk_scale, DOT_PRECISION, SOFTCAP), float("-inf"))
    return _online_softmax(s, v, m_i, l_i, acc, DOT_PRECISION)


@triton.jit
def _attend_kv_range(
    q, m_i, l_i, acc, lo, hi, block_table, kc_head, vc_head, d, d_mask, qk_scale,
    stride_kc_blk, stride_kc_off, stride_kc_d,
    stride_vc_blk, stride_vc_off, stride_vc_d,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    """Online softmax of the queries q (rows, BLOCK_D) over cache positions [lo, hi) of one kv head, read through
    `block_table` in tiles of BLOCK_N; returns the updated running max, sum and accumulator (log2 units)."""
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
        valid = pos < hi
        k, v = _load_kv_tile(block_table, kc_head, vc_head, pos, valid, d, d_mask,
                             stride_kc_blk, stride_kc_off, stride_kc_d, stride_vc_blk, stride_vc_off, stride_vc_d,
                             BLOCK_SIZE, q.dtype)  # (BLOCK_N, BLOCK_D) each
        m_i, l_i, acc = _softmax_tile(q, k, v, valid[None, :], m_i, l_i, acc, qk_scale, DOT_PRECISION, SOFTCAP)
    return m_i, l_i, acc


@triton.jit
def _attend_tile_read_early(
    q_ptrs, q_mask, m_i, l_i, acc, lo, hi, seq_len, block_table, kc_head, vc_head, d, d_mask, qk_scale,
    stride_kc_blk, stride_kc_off, stride_kc_d,
    stride_vc_blk, stride_vc_off, stride_vc_d,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Waits for the previous kernel (`wait_for_previous`) and attends over one tile of positions [lo, hi), hi <=
    lo + BLOCK_N, reading it before the wait: a decode step's positions before its own (seq_len - 1) are the KV of
    earlier steps; only its own row, which the kernel before stores, is read after the wait. Returns the running
    max, sum and accumulator from m_i, l_i, acc (`_softmax_tile`)."""
    pos = lo + tl.arange(0, BLOCK_N)
    valid = pos < hi
    k_ptrs, v_ptrs = _kv_tile_pointers(block_table, kc_head, vc_head, pos, valid, d, stride_kc_blk, stride_kc_off,
                                       stride_kc_d, stride_vc_blk, stride_vc_off, stride_vc_d, BLOCK_SIZE)
    earlier = (valid & (pos < seq_len - 1))[:, None] & d_mask[None, :]
    k = tl.load(k_ptrs, mask=earlier, other=0.0)
    v = tl.load(v_ptrs, mask=earlier, other=0.0)
    wait_for_previous(PDL)
    own = (valid & (pos == seq_len - 1))[:, None] & d_mask[None, :]
    k = tl.where(own, tl.load(k_ptrs, mask=own, other=0.0), k)
    v = tl.where(own, tl.load(v_ptrs, mask=own, other=0.0), v)
    q = _dot_query(tl.load(q_ptrs, mask=q_mask, other=0.0), kc_head.dtype.element_ty)
    return _softmax_tile(q, k.to(q.dtype), v.to(q.dtype), valid[None, :], m_i, l_i, acc, qk_scale, DOT_PRECISION,
                         SOFTCAP)


# Eager steps size block tables to their longest sequence: an unspecialized row stride spares a recompile (about
# a second) whenever that width first changes divisibility. The split count is chosen per batch-size bucket: as a
# plain (unspecialized) argument, one compile serves every bucket's CUDA graph.
@triton.jit(do_not_specialize=["stride_bt", "window", "num_splits", "num_slots", "short_context"])
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, shared_len_ptr, out_ptr, mid_o_ptr, mid_lse_ptr,
    arrivals_ptr, qk_scale, window,
    stride_qb, stride_qh, stride_qd,
    stride_kc_blk, stride_kc_off, stride_kc_h, stride_kc_d,
    stride_vc_blk, stride_vc_off, stride_vc_h, stride_vc_d,
    stride_bt,
    stride_ob, stride_oh, stride_od,
    num_splits, num_slots, short_context,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SHORT_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
    CASCADE: tl.constexpr, MERGE: tl.constexpr, GROUP_ROWS: tl.constexpr, MAX_SLOTS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One program per (sequence, kv head, split): all GROUP query heads share each K/V tile load.

    Partial results go to slot `split` of num_slots per (sequence, head); with one slot the output is final.
    CASCADE: the shared prefix [0, shared_len) is the prefix kernel's; this one reads from shared_len on, and
    `_decode_reduce_kernel` merges the partials.
    MERGE (several splits, no CASCADE): only the splits that hold a KV tile run, and the last of them to finish
    merges their partials itself (`arrivals` counts them per (sequence, kv head)); a context of one tile writes the
    output directly. A short context thus costs no second kernel, and a long one no extra launch.
    SHORT_N < BLOCK_N (a compile of its own, for launches of few programs: `short_context_positions`): a context of
    at most `short_context` positions is split in tiles of SHORT_N positions, over more programs that each read less,
    one tile each, which they read before the wait (`_attend_tile_read_early`); longer ones keep BLOCK_N tiles."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)  # the step's inputs, written before any of its kernels ran

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + g  # (BLOCK_G,)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM

    first = tl.maximum(seq_len - window, 0)  # the window's first position
    if CASCADE:
        first = tl.maximum(first, tl.load(shared_len_ptr))
    num_positions = seq_len - first
    tile = BLOCK_N
    if SHORT_N < BLOCK_N:
        tile = tl.where(num_positions <= short_context, SHORT_N, BLOCK_N)
    # Whole tiles per split; with one split the range is [first, seq_len).
    split_len = tl.maximum(tl.cdiv(tl.cdiv(num_positions, tile), num_splits), 1) * tile
    final = num_slots == 1
    if MERGE:
        active = tl.maximum(tl.cdiv(num_positions, split_len), 1)  # an empty context (padding row): split 0
        if split >= active:
            return
        final = active == 1
    lo = first + split * split_len
    hi = tl.minimum(lo + split_len, seq_len)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    kc_head = k_cache_ptr + kvh * stride_kc_h
    vc_head = v_cache_ptr + kvh * stride_vc_h
    # BLOCK_G is padded to >= 16 rows because tl.dot needs it; the padding rows are zero queries, never stored.
    q_ptrs = q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :] * stride_qd  # (BLOCK_G, BLOCK_D)
    q_mask = g_mask[:, None] & d_mask[None, :]
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    if tile == SHORT_N and SHORT_N < BLOCK_N:
        # A short context holds one short tile a split, and most of it is earlier steps' KV: read before the wait,
        # it is off the path that follows the kernel before (which, under pdl.early_start, runs long).
        m_i, l_i, acc = _attend_tile_read_early(
            q_ptrs, q_mask, m_i, l_i, acc, lo, hi, seq_len, bt_row, kc_head, vc_head, d, d_mask, qk_scale,
            stride_kc_blk, stride_kc_off, stride_kc_d, stride_vc_blk, stride_vc_off, stride_vc_d,
            BLOCK_SIZE, SHORT_N, DOT_PRECISION, SOFTCAP, PDL,
        )  # fmt: skip
    else:
        wait_for_previous(PDL)
        q = _dot_query(tl.load(q_ptrs, mask=q_mask, other=0.0), k_cache_ptr.dtype.element_ty)
        m_i, l_i, acc = _attend_kv_range(
            q, m_i, l_i, acc, lo, hi, bt_row, kc_head, vc_head, d, d_mask, qk_scale,
            stride_kc_blk, stride_kc_off, stride_kc_d, stride_vc_blk, stride_vc_off, stride_vc_d,
            BLOCK_SIZE, BLOCK_N, DOT_PRECISION, SOFTCAP,
        )  # fmt: skip

    # Empty ranges (padding rows, splits past the context) leave l_i == 0 and acc == 0: they output zeros.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out_mask = g_mask[:, None] & d_mask[None, :]
    if final:
        o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :] * stride_od
        tl.store(o_ptrs, (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # mid_o: (B, H, num_slots, HEAD_DIM) fp32, mid_lse: (B, H, num_slots) fp32 (log2 units), both contiguous.
        first_row = b * GROUP * tl.num_programs(1) + kvh * GROUP
        row = (first_row + g) * num_slots + split  # (BLOCK_G,)
        tl.store(mid_o_ptr + row[:, None] * HEAD_DIM + d[None, :], acc / l_safe[:, None], mask=out_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(mid_lse_ptr + row, lse, mask=g_mask)
        if MERGE:
            # Every thread's stores come before the count (acq_rel at GPU scope), and the last program's loads after.
            tl.debug_barrier()
            arrivals = arrivals_ptr + b * tl.num_programs(1) + kvh
            if tl.atomic_add(arrivals, 1) == active - 1:
                tl.store(arrivals, 0)  # every program of this launch has counted: ready for the next launch
                tl.debug_barrier()
                rows = first_row + tl.arange(0, GROUP_ROWS)  # (GROUP_ROWS,), not padded for tl.dot
                rows_mask = tl.arange(0, GROUP_ROWS) < GROUP
                merged = _merged_partials(mid_o_ptr, mid_lse_ptr, rows, rows_mask, active, num_slots, d, d_mask,
                                          HEAD_DIM, MAX_SLOTS)
                o_ptrs = (out_ptr + b * stride_ob + (kvh * GROUP + tl.arange(0, GROUP_ROWS))[:, None] * stride_oh
                          + d[None, :] * stride_od)
                tl.store(o_ptrs, merged.to(out_ptr.dtype.element_ty), mask=rows_mask[:, None] & d_mask[None, :])


@triton.jit
def _merged_partials(mid_o_ptr, mid_lse_ptr, rows, rows_mask, slots_used, num_slots, d, d_mask,
                     HEAD_DIM: tl.constexpr, MAX_SLOTS: tl.constexpr):
    """The partial softmaxes in slots [0, slots_used) of each (sequence, head) row, merged: (rows, BLOCK_D) fp32.
    Loads go to L2 (.cg): other programs, on other SMs, wrote the partials during this launch."""
    s = tl.arange(0, MAX_SLOTS)
    mask = rows_mask[:, None] & (s < slots_used)[None, :]  # (rows, MAX_SLOTS)
    slot = rows[:, None] * num_slots + s[None, :]
    lse = tl.load(mid_lse_ptr + slot, mask=mask, other=float("-inf"), cache_modifier=".cg")
    o = tl.load(mid_o_ptr + slot[:, :, None] * HEAD_DIM + d[None, None, :],
                mask=mask[:, :, None] & d_mask[None, None, :], other=0.0, cache_modifier=".cg")
    lse_max = tl.max(lse, 1)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    w = tl.exp2(lse - lse_max[:, None])  # 0 for empty splits
    den = tl.sum(w, 1)
    den = tl.where(den > 0, den, 1.0)
    return tl.sum(o * w[:, :, None], 1) / den[:, None]


# One compile serves every bucket's graph: the row count and split counts are plain arguments.
@triton.jit(do_not_specialize=["num_rows", "first_slot", "num_splits", "num_slots"])
def _shared_prefix_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, shared_len_ptr, mid_o_ptr, mid_lse_ptr,
    qk_scale,
    stride_qb, stride_qh, stride_qd,
    stride_kc_blk, stride_kc_off, stride_kc_h, stride_kc_d,
    stride_vc_blk, stride_vc_off, stride_vc_h, stride_vc_d,
    num_rows, first_slot, num_splits, num_slots,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One program per (tile of BLOCK_M query rows, kv head, prefix split). The rows are the (sequence, group head)
    pairs of the kv head, so each K/V tile of the shared prefix (read through row 0's block table) serves BLOCK_M
    queries at once: the prefix is read once per tile instead of once per sequence. Every decode query sits after
    the prefix, so no causal mask. Writes slot first_slot + split of each row's partial softmaxes."""
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    wait_for_previous(PDL)
    shared_len = tl.load(shared_len_ptr)

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    row_mask = rows < num_rows
    b = rows // GROUP
    heads = kvh * GROUP + rows % GROUP
    # Padding rows (context 0) must stay zeros: their query is masked and their partial gets no weight.
    live = row_mask & (tl.load(seq_lens_ptr + b, mask=row_mask, other=0) > 0)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(
        q_ptr + b[:, None] * stride_qb + heads[:, None] * stride_qh + d[None, :] * stride_qd,
        mask=live[:, None] & d_mask[None, :],
        other=0.0,
    )  # (BLOCK_M, BLOCK_D)
    q = _dot_query(q, k_cache_ptr.dtype.element_ty)

    tiles_per_split = tl.cdiv(tl.cdiv(shared_len, BLOCK_N), num_splits)
    lo = split * tiles_per_split * BLOCK_N
    hi = tl.minimum(lo + tiles_per_split * BLOCK_N, shared_len)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    kc_head = k_cache_ptr + kvh * stride_kc_h
    vc_head = v_cache_ptr + kvh * stride_vc_h
    m_i, l_i, acc = _attend_kv_range(
        q, m_i, l_i, acc, lo, hi, block_tables_ptr, kc_head, vc_head, d, d_mask, qk_scale,
        stride_kc_blk, stride_kc_off, stride_kc_d, stride_vc_blk, stride_vc_off, stride_vc_d,
        BLOCK_SIZE, BLOCK_N, DOT_PRECISION, SOFTCAP,
    )  # fmt: skip

    done = live & (l_i > 0)
    l_safe = tl.where(done, l_i, 1.0)
    slot = (b * GROUP * tl.num_programs(1) + heads) * num_slots + first_slot + split  # (BLOCK_M,)
    o = tl.where(done[:, None], acc / l_safe[:, None], 0.0)
    tl.store(mid_o_ptr + slot[:, None] * HEAD_DIM + d[None, :], o, mask=row_mask[:, None] & d_mask[None, :])
    tl.store(mid_lse_ptr + slot, tl.where(done, m_i + tl.log2(l_safe), float("-inf")), mask=row_mask)


@triton.jit(do_not_specialize=["num_slots"])
def _decode_reduce_kernel(
    mid_o_ptr, mid_lse_ptr, out_ptr,
    stride_ob, stride_oh, stride_od,
    num_slots,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MAX_SLOTS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One program per (sequence, query head): merges the partial softmaxes of every split and prefix split."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    wait_for_previous(PDL)
    row = b * tl.num_programs(1) + h + tl.arange(0, 1)  # (1,)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    out = _merged_partials(mid_o_ptr, mid_lse_ptr, row, row >= 0, num_slots, num_slots, d, d_mask, HEAD_DIM,
                           MAX_SLOTS)  # (1, BLOCK_D); row >= 0: the one row is real
    o_ptrs = out_ptr + b * stride_ob + h * stride_oh + d[None, :] * stride_od
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=d_mask[None, :])


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


# Programs per SM that the split KV aims for, by tile positions (benchmarks/sweep_decode_attention.py). More,
# shorter programs even out ragged contexts until the merge costs more than they gain; fp8's 128-position tiles
# reach that point at fewer. fp32's 32-position tiles, and the cascade kernels, split only to fill the SMs once, as
# they were tuned.
_PROGRAMS_PER_SM = {64: 14, 128: 8}


def _wide(head_dim: int, q_dtype: torch.dtype) -> bool:
    """Whether tiles get fewer rows: fp32 ones hold twice the bytes (and tf32x3 splits each into three), and heads
    over 128 wide more; smaller tiles avoid register spills."""
    return triton.next_power_of_2(head_dim) > 128 or q_dtype == torch.float32


def decode_tile(head_dim: int, q_dtype: torch.dtype, cache_dtype: torch.dtype) -> int:
    """KV positions per tile of the decode kernel. fp8 tiles of 128 positions hold the bytes of 16-bit ones of 64,
    and read an fp8 cache faster than 64-position ones (sweep_decode_attention)."""
    if _wide(head_dim, q_dtype):
        return 32
    return 128 if cache_dtype.itemsize == 1 else 64


def register_cap(block_n: int, device: torch.device) -> dict[str, int]:
    """The decode kernel's launch option that bounds its registers. Left alone, ptxas gives the one-split fp8
    compile (128-position tiles) over 200 registers a thread: two programs an SM. Capped for three, it spills
    nothing and reads faster at large batch."""
    return {"maxnreg": 168} if block_n == 128 and device.type == "cuda" else {}


# Short contexts in sparse launches read their KV in tiles of this many positions, under pdl.early_start (see
# decode_attention): faster at batch 1 with short contexts, no faster at larger batches or past one short tile a
# split.
SHORT_TILE = 32
_SHORT_TILE_PROGRAMS_PER_SM = 2  # a launch with at most this many programs an SM at its most splits is sparse


def short_context_positions(programs: int, num_splits: int, block_n: int, device: torch.device) -> int:
    """The longest context that the decode kernel reads in SHORT_TILE-position tiles; 0 for none.

    A launch of few (sequence, kv head) pairs puts at most a few programs on each SM even at its most splits, and a
    context of a few tiles leaves most of those splits empty: in shorter tiles, more programs read it, each less. A
    context past one short tile per split keeps the kernel's own tile."""
    if device.type != "cuda" or num_splits == 1 or block_n <= SHORT_TILE:
        return 0
    if programs * num_splits > _SHORT_TILE_PROGRAMS_PER_SM * _sm_count(device):
        return 0
    return num_splits * SHORT_TILE


def decode_early_read_limit(batch: int, num_kv_heads: int, head_dim: int, q_dtype: torch.dtype,
                            cache_dtype: torch.dtype, device: torch.device) -> int:
    """The longest context whose KV a decode launch of `batch` rows (no cascade) reads before its PDL wait under
    pdl.early_start, 0 for none: that of the short tiles of a sparse launch (`short_context_positions`)."""
    block_n = decode_tile(head_dim, q_dtype, cache_dtype)
    programs = batch * num_kv_heads
    return short_context_positions(programs, _default_num_splits(programs, device, block_n), block_n, device)


def _default_num_splits(programs: int, device: torch.device, block_n: int | None = None) -> int:
    """Splits of each of `programs` KV ranges (flash-decoding): enough for the launch to hold the programs per SM
    that its tile size wants (`_PROGRAMS_PER_SM`).

    Depends only on the batch bucket and static config, so each captured graph keeps a fixed launch config.
    """
    if device.type != "cuda":
        return 1
    target = _PROGRAMS_PER_SM.get(block_n, 1) * _sm_count(device)
    if programs >= target:
        return 1
    return min(_MAX_SPLITS, triton.next_power_of_2(triton.cdiv(target, programs)))


def decode_attention(
    q: torch.Tensor,  # (B, H, D)
    k_cache: torch.Tensor,  # (NB, BS, KVH, D)
    v_cache: torch.Tensor,  # (NB, BS, KVH, D)
    block_tables: torch.Tensor,  # (B, M) int32
    seq_lens: torch.Tensor,  # (B,) int32, 0 = padding row (outputs zeros)
    scale: float,
    sliding_window: int | None = None,
    *,
    softcap: float | None = None,  # scores s become softcap * tanh(s / softcap); None: no cap
    num_splits: int | None = None,  # power of two; None: chosen from B, KVH and the SM count
    # (1,) int32 on the device: the leading positions every real row shares with row 0 (`shared_prefix`); None:
    # no cascade. Not with a sliding window.
    shared_prefix_len: torch.Tensor | None = None,
    num_prefix_splits: int | None = None,  # splits of the shared prefix; None: chosen like num_splits
    # (>= B * KVH,) int32 zeros on the device, which every launch leaves zero: each (sequence, kv head)'s count of
    # finished splits. The engine keeps one for all layers and steps (graphs capture its address); None: a fresh one.
    split_arrivals: torch.Tensor | None = None,
) -> torch.Tensor:  # (B, H, D)
    batch, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if batch == 0:
        return out
    group = num_heads // num_kv_heads
    cascade = shared_prefix_len is not None
    block_d = max(16, triton.next_power_of_2(head_dim))
    wide = _wide(head_dim, q.dtype)
    block_n = decode_tile(head_dim, q.dtype, k_cache.dtype)
    if num_splits is None:
        num_splits = _default_num_splits(batch * num_kv_heads, q.device, None if cascade else block_n)
    assert 1 <= num_splits <= _MAX_SPLITS and num_splits & (num_splits - 1) == 0, \
        f"num_splits must be a power of two up to {_MAX_SPLITS}"
    assert not (cascade and sliding_window), "the shared-prefix kernel has no sliding window"
    prefix_block_m = 32 if wide else 64
    prefix_tiles = triton.cdiv(batch * group, prefix_block_m)
    if cascade and num_prefix_splits is None:
        num_prefix_splits = _default_num_splits(prefix_tiles * num_kv_heads, q.device)
    num_slots = num_splits + (num_prefix_splits if cascade else 0)
    assert num_slots <= 2 * _MAX_SPLITS, f"num_prefix_splits must be at most {_MAX_SPLITS}"
    if num_slots > 1:
        mid_o = torch.empty(batch, num_heads, num_slots, head_dim, dtype=torch.float32, device=q.device)
        mid_lse = torch.empty(batch, num_heads, num_slots, dtype=torch.float32, device=q.device)
    else:  # unused by the single-pass kernel, but fp32 like the split one's: one compile serves both
        mid_o = mid_lse = torch.empty(1, dtype=torch.float32, device=q.device)
    # A separate compile for one split: the merge's registers would cost the single pass occupancy at large batch.
    merge = not cascade and num_splits > 1
    # Short tiles are read before the wait, which pays only in steps of kernels that start early; elsewhere (eager
    # steps, a bucket's plain graph) the short compile's long-context loop runs slower than the plain compile's.
    early = merge and pdl.starts_early()
    short_context = short_context_positions(batch * num_kv_heads, num_splits, block_n, q.device) if early else 0
    if merge and (split_arrivals is None or split_arrivals.numel() < batch * num_kv_heads):
        split_arrivals = torch.zeros(batch * num_kv_heads, dtype=torch.int32, device=q.device)
    dot_precision = _dot_precision(q.dtype)
    pdl_options = launch_options(q.device)
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, shared_prefix_len if cascade else seq_lens, out, mid_o, mid_lse,
        split_arrivals if merge else seq_lens, scale * _LOG2E, sliding_window or _NO_WINDOW,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), block_tables.stride(0), *out.stride(),
        num_splits, num_slots, short_context,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d, BLOCK_N=block_n,
        SHORT_N=SHORT_TILE if short_context else block_n, DOT_PRECISION=dot_precision,
        SOFTCAP=_log2_softcap(softcap), CASCADE=cascade,
        MERGE=merge, GROUP_ROWS=triton.next_power_of_2(group),
        MAX_SLOTS=_MAX_SPLITS,
        # A third stage keeps one more K/V tile in flight, faster on bf16 at large batch
        # (benchmarks/sweep_decode_attention.py); the fp32 tiles stay at two for their shared memory.
        num_warps=4, num_stages=2 if wide else 3, **pdl_options, **register_cap(block_n, q.device),
    )  # fmt: skip
    if cascade:
        _shared_prefix_kernel[(prefix_tiles, num_kv_heads, num_prefix_splits)](
            q, k_cache, v_cache, block_tables, seq_lens, shared_prefix_len, mid_o, mid_lse,
            scale * _LOG2E,
            *q.stride(), *k_cache.stride(), *v_cache.stride(),
            batch * group, num_splits, num_prefix_splits, num_slots,
            GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
            BLOCK_M=prefix_block_m, BLOCK_D=block_d, BLOCK_N=block_n, DOT_PRECISION=dot_precision,
            SOFTCAP=_log2_softcap(softcap), num_warps=4, num_stages=2 if wide else 3, **pdl_options,
        )  # fmt: skip
        _decode_reduce_kernel[(batch, num_heads)](
            mid_o, mid_lse, out, *out.stride(),
            num_slots,
            HEAD_DIM=head_dim, BLOCK_D=block_d, MAX_SLOTS=2 * _MAX_SPLITS,
            num_warps=4, **pdl_options,
        )  # fmt: skip
    return out


@dataclass(frozen=True)
class PrefillConfig:
    """The prefill kernel's launch configuration. A query tile holds block_m rows: query positions times the query
    heads of one kv head (widened to hold at least one position); a KV tile holds block_n positions."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# From this context on (a step's longest sequence) KV tiles of 128 positions beat narrower ones: few of a query tile's
# keys then lie on its causal diagonal, where a wide tile computes scores that the mask throws away.
PREFILL_LONG_CONTEXT = 3072


def prefill_config(head_dim: int, q_dtype: torch.dtype, group: int, max_seq_len: int,
                   device: torch.device) -> PrefillConfig:
    """The prefill kernel's configuration for a head width, query dtype, query heads per kv head and the step's longest
    sequence; benchmarks/bench_prefill_attention.py --sweep times the others (benchmarks/RESULTS.md, 2026-11-28c).
    A query tile of 128 rows holds 128 / group positions: with four or more heads a group its diagonal is short, and
    64-position KV tiles lead even on short contexts. The wider KV tiles were measured on Hopper only, and their
    stages take most of its shared memory: a GPU with less keeps 32-position tiles."""
    if _wide(head_dim, q_dtype):
        return PrefillConfig(block_m=32, block_n=32, num_warps=4, num_stages=2)
    if gpu_limits(device).shared_memory_bytes < HOPPER.shared_memory_bytes:
        block_n = 32
    elif max_seq_len >= PREFILL_LONG_CONTEXT:
        block_n = 128
    else:
        block_n = 64 if group >= 4 else 32
    return PrefillConfig(block_m=128, block_n=block_n, num_warps=8, num_stages=3)


def prefill_warm_up_contexts(head_dim: int, q_dtype: torch.dtype, device: torch.device) -> tuple[int, ...]:
    """The longest sequence of each prefill step that a start's warm-up runs beside its short one, so that every launch
    configuration prefill_config picks on `device` is loaded (or compiled) before a job's first step."""
    if prefill_config(head_dim, q_dtype, 1, PREFILL_LONG_CONTEXT, device).block_n == 128:
        return (PREFILL_LONG_CONTEXT,)
    return ()


@triton.jit
def _tile_blocks(bt_row, start, kv_end, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The block-table entry of each cache position [start, start + BLOCK_N): (BLOCK_N,); 0 from kv_end on, where
    the entries are not read (they may lie past the table's row)."""
    # Per position rather than once per block: each thread reads the entries of its own rows, which is also what a
    # per-block read reshaped to positions compiles to under Triton 3.8; under 3.6 that reshape loses the rows'
    # alignment, and the K/V tiles load as scalars, unpipelined (both compiled for sm_90).
    pos = start + tl.arange(0, BLOCK_N)
    return tl.load(bt_row + pos // BLOCK_SIZE, mask=pos < kv_end, other=0)


@triton.jit
def _paged_kv_tile(
    blk, kc_head, vc_head, start, kv_end, d, d_mask, stride_kc_blk, stride_kc_off, stride_kc_d,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr, DTYPE: tl.constexpr,
):  # fmt: skip
    """The K and V rows (BLOCK_N, BLOCK_D) of cache positions [start, start + BLOCK_N) of one kv head, whose blocks
    are `blk` (`_tile_blocks`), in DTYPE (the query's, see _dot_query). MASKED: positions from kv_end on read zeros,
    their slots untouched; otherwise the whole tile lies below kv_end and only a head narrower than BLOCK_D masks."""
    pos = start + tl.arange(0, BLOCK_N)
    rows = blk.to(tl.int64) * stride_kc_blk + (pos % BLOCK_SIZE) * stride_kc_off  # (BLOCK_N,)
    offsets = rows[:, None] + d[None, :] * stride_kc_d  # (BLOCK_N, BLOCK_D)
    if MASKED:
        mask = (pos < kv_end)[:, None] & d_mask[None, :]
        k = tl.load(kc_head + offsets, mask=mask, other=0.0)
        v = tl.load(vc_head + offsets, mask=mask, other=0.0)
    elif HEAD_DIM == BLOCK_D:
        k = tl.load(kc_head + offsets)
        v = tl.load(vc_head + offsets)
    else:
        k = tl.load(kc_head + offsets, mask=d_mask[None, :], other=0.0)
        v = tl.load(vc_head + offsets, mask=d_mask[None, :], other=0.0)
    return k.to(DTYPE), v.to(DTYPE)


@triton.jit
def _attend_prefill_tiles(
    q, q_pos, m_i, l_i, acc, lo, hi, kv_end, window, bt_row, kc_head, vc_head, d, d_mask, qk_scale,
    stride_kc_blk, stride_kc_off, stride_kc_d,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr, MASKED: tl.constexpr, WINDOWED: tl.constexpr,
):  # fmt: skip
    """Online softmax of the queries q (BLOCK_M, BLOCK_D) at positions q_pos (BLOCK_M,) over the KV tiles that start
    at lo, lo + BLOCK_N, ... below hi (lo a multiple of BLOCK_N); returns the running max, sum and accumulator.
    MASKED: each row sees only the keys at or before its position (and, WINDOWED, inside its window), and positions
    from kv_end on are not read; otherwise every row sees every key of these tiles.

    Each iteration reads the next tile's block-table entries, for the iteration after. Read in the iteration that
    uses them, they make the K/V loads indirect, and Triton's pipeliner (3.6 to 3.8, compiled for sm_90) then waits
    at the top of every iteration for all the copies in flight: no tile's K/V would load while the tile before
    computes."""
    blk = _tile_blocks(bt_row, lo, kv_end, BLOCK_SIZE, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        k, v = _paged_kv_tile(blk, kc_head, vc_head, start, kv_end, d, d_mask, stride_kc_blk, stride_kc_off,
                              stride_kc_d, BLOCK_SIZE, BLOCK_N, HEAD_DIM, BLOCK_D, MASKED, q.dtype)
        blk = _tile_blocks(bt_row, start + BLOCK_N, kv_end, BLOCK_SIZE, BLOCK_N)
        s = _scores(q, k, qk_scale, DOT_PRECISION, SOFTCAP)  # (BLOCK_M, BLOCK_N)
        if MASKED:
            pos = start + tl.arange(0, BLOCK_N)
            allowed = pos[None, :] <= q_pos[:, None]
            if WINDOWED:
                allowed = allowed & (pos[None, :] > q_pos[:, None] - window)
            s = tl.where(allowed, s, float("-inf"))
        m_i, l_i, acc = _online_softmax(s, v, m_i, l_i, acc, DOT_PRECISION)
    return m_i, l_i, acc


# An unspecialized block-table row stride spares a recompile whenever the step's widest table first changes
# divisibility; the window's length is a plain argument, so one compile serves every windowed layer.
@triton.jit(do_not_specialize=["stride_bt", "window"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, out_ptr,
    qk_scale, window,
    stride_qt, stride_qh, stride_qd,
    stride_kc_blk, stride_kc_off, stride_kc_h, stride_kc_d,
    stride_bt,
    stride_ot, stride_oh, stride_od,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr, WINDOWED: tl.constexpr,
):  # fmt: skip
    """One program per (query tile, kv head, sequence); queries sit at the end of the sequence's context. The tile's
    BLOCK_M rows are BLOCK_Q query positions times the GROUP query heads of the kv head (row r: position r // GROUP,
    head r % GROUP), so each K/V tile it reads serves every head of the group.

    Under the causal mask a query tile's work grows with its position, and the GPU starts programs in grid order:
    each (kv head, sequence) starts from its last query tile (the most keys), so the launch ends on short tiles
    instead of a last wave of long ones, while the programs of one sequence and head still run together and share
    its K/V in L2.

    The KV loop runs over BLOCK_N-aligned tiles in up to three stages: where the window starts (WINDOWED only), the
    tiles every row of the query tile sees whole, which need no mask, and those on the causal diagonal."""
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + b)
    q_len = tl.load(query_start_loc_ptr + b + 1) - q_start
    if tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    ctx_len = seq_len - q_len  # cached prefix before this chunk
    first_q = ctx_len + tile * BLOCK_Q  # the tile's first query position
    hi = tl.minimum(first_q + BLOCK_Q, seq_len)  # one past its last

    r = tl.arange(0, BLOCK_M)
    q_idx = tile * BLOCK_Q + r // GROUP  # (BLOCK_M,) index in the chunk
    row_mask = (r < BLOCK_Q * GROUP) & (q_idx < q_len)
    q_pos = ctx_len + q_idx
    tok = (q_start + q_idx).to(tl.int64)
    head = kvh * GROUP + r % GROUP
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    io_mask = row_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :] * stride_qd, mask=io_mask,
                other=0.0)  # (BLOCK_M, BLOCK_D)
    q = _dot_query(q, k_cache_ptr.dtype.element_ty)

    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    kc_head = k_cache_ptr + kvh * stride_kc_h
    vc_head = v_cache_ptr + kvh * stride_kc_h
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    full_lo = 0
    full_hi = (first_q + 1) // BLOCK_N * BLOCK_N  # tiles wholly at or before the first query
    if WINDOWED:
        # The first query sees nothing before first_q - window + 1, the last everything from hi - window on.
        lo = tl.maximum(first_q - window + 1, 0) // BLOCK_N * BLOCK_N
        full_hi = tl.maximum(full_hi, lo)
        full_lo = tl.minimum(tl.cdiv(tl.maximum(hi - window, 0), BLOCK_N) * BLOCK_N, full_hi)
        m_i, l_i, acc = _attend_prefill_tiles(
            q, q_pos, m_i, l_i, acc, lo, full_lo, hi, window, bt_row, kc_head, vc_head, d, d_mask, qk_scale,
            stride_kc_blk, stride_kc_off, stride_kc_d,
            BLOCK_SIZE, BLOCK_N, HEAD_DIM, BLOCK_D, DOT_PRECISION, SOFTCAP, True, WINDOWED,
        )  # fmt: skip
    m_i, l_i, acc = _attend_prefill_tiles(
        q, q_pos, m_i, l_i, acc, full_lo, full_hi, hi, window, bt_row, kc_head, vc_head, d, d_mask, qk_scale,
        stride_kc_blk, stride_kc_off, stride_kc_d,
        BLOCK_SIZE, BLOCK_N, HEAD_DIM, BLOCK_D, DOT_PRECISION, SOFTCAP, False, WINDOWED,
    )  # fmt: skip
    m_i, l_i, acc = _attend_prefill_tiles(
        q, q_pos, m_i, l_i, acc, full_hi, hi, hi, window, bt_row, kc_head, vc_head, d, d_mask, qk_scale,
        stride_kc_blk, stride_kc_off, stride_kc_d,
        BLOCK_SIZE, BLOCK_N, HEAD_DIM, BLOCK_D, DOT_PRECISION, SOFTCAP, True, WINDOWED,
    )  # fmt: skip

    # Rows past the chunk (never stored) may have seen no key under a window: keep their division finite.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o_ptrs = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :] * stride_od
    tl.store(o_ptrs, (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty), mask=io_mask)


_prefill = DirectKernel(_prefill_kernel)


def prefill_attention(
    q: torch.Tensor,  # (T, H, D)
    k_cache: torch.Tensor,  # (NB, BS, KVH, D)
    v_cache: torch.Tensor,  # (NB, BS, KVH, D), laid out as k_cache
    block_tables: torch.Tensor,  # (B, M) int32
    query_start_loc: torch.Tensor,  # (B + 1,) int32
    seq_lens: torch.Tensor,  # (B,) int32, context + this chunk
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    sliding_window: int | None = None,
    *,
    softcap: float | None = None,  # scores s become softcap * tanh(s / softcap); None: no cap
    config: PrefillConfig | None = None,  # None: prefill_config's
) -> torch.Tensor:  # (T, H, D)
    out = torch.empty_like(q)
    num_tokens, num_heads, head_dim = q.shape
    batch = seq_lens.shape[0]
    if num_tokens == 0 or batch == 0 or max_query_len == 0:
        return out
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert k_cache.stride() == v_cache.stride(), "the K and V caches must share one layout"
    group = num_heads // num_kv_heads
    config = config or prefill_config(head_dim, q.dtype, group, max_seq_len, q.device)
    block_m = max(config.block_m, triton.next_power_of_2(group))
    block_q = block_m // group
    _prefill[(triton.cdiv(max_query_len, block_q), num_kv_heads, batch)](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
        scale * _LOG2E, sliding_window or _NO_WINDOW,
        *q.stride(), *k_cache.stride(), block_tables.stride(0), *out.stride(),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_N=config.block_n,
        DOT_PRECISION=_dot_precision(q.dtype),
        SOFTCAP=_log2_softcap(softcap), WINDOWED=sliding_window is not None,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out
