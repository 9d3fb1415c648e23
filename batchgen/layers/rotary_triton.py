"""One Triton kernel between the QKV projection and attention: Qwen3's (or Gemma 3's) q/k RMSNorm, RoPE, and the K/V
cache store.

The reference path runs these as separate ops (on CUDA, torch.compile still makes four kernels of the norm and
rotation, plus the store): at batch 1 each costs a launch of a few microseconds for a few kilobytes of work, in
every layer. One launch reads the step's fused q/k/v rows once and writes the rotated q and the cache.

With partial rotary (Phi-3/4: the cos/sin tables are narrower than the head) only the leading dims of each head
rotate; the rest are copied (and normed with the head, where there is a q/k norm).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.layers.attention_triton import to_cache_dtype
from batchgen.layers.pdl import launch_options, wait_for_previous
from batchgen.layers.triton_launch import DirectKernel


@triton.jit
def _normed(x, rstd, w, dtype: tl.constexpr, GEMMA_STYLE: tl.constexpr):
    """One piece (heads, BLOCK) of RMS-normed heads in fp32, rounded like the reference: weight * (x * rstd).to(dtype),
    or with GEMMA_STYLE (norms.gemma_rms_norm) x * rstd * (1 + weight) rounded once.

    rstd: (heads, 1); w: (1, BLOCK), that piece of the norm weight, fp32."""
    if GEMMA_STYLE:
        return (x * rstd * (1.0 + w)).to(dtype).to(tl.float32)
    return (w * (x * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)


@triton.jit
def _rstd(sum_sq, eps, HEAD_DIM: tl.constexpr):
    """1 / RMS of each head (heads, 1) from its sum of squares (heads,)."""
    return tl.rsqrt(sum_sq / HEAD_DIM + eps)[:, None]


@triton.jit
def _rotate_and_store_kernel(
    qkv_ptr, positions_ptr, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
    slot_mapping_ptr, eps,
    stride_qkv_t, stride_cos_p, stride_qo_t, stride_qo_h,
    stride_kc_blk, stride_kc_off, stride_kc_h, stride_vc_blk, stride_vc_off, stride_vc_h,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    PASS: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr, BLOCK_HEAD: tl.constexpr,
    BLOCK_Q_HEADS: tl.constexpr, BLOCK_KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    QK_NORM: tl.constexpr, GEMMA_STYLE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Two programs per token: its q heads, and its k and v heads, each as (heads, BLOCK) tiles: the two rotary
    halves (HALF wide each) and, with partial rotary, the PASS dimensions after them that pass through unrotated.

    A program per head would wait on the same chain of dependent loads (position, then tables and rows) as many
    times as there are heads, which at large batch costs every layer."""
    t = tl.program_id(0).to(tl.int64)
    is_kv = tl.program_id(1) == 1
    dtype = q_out_ptr.dtype.element_ty
    # Positions, slots, the tables and the norm weights are the step's inputs or the model's, written before any of
    # its kernels ran: their dependent round trips overlap the QKV projection (PDL); only the qkv row waits for it.
    pos = tl.load(positions_ptr + t)
    slot = tl.load(slot_mapping_ptr + t)
    i = tl.arange(0, BLOCK_HALF)[None, :]  # (1, BLOCK_HALF): the rotary dims are rotated as two halves
    i_mask = i < HALF
    if PASS > 0:
        j = 2 * HALF + tl.arange(0, BLOCK_PASS)[None, :]  # (1, BLOCK_PASS): the dims after them (partial rotary)
        j_mask = j < HEAD_DIM
    # The reference casts the fp32 tables to the model dtype before rotating.
    cos = tl.load(cos_ptr + pos * stride_cos_p + i, mask=i_mask, other=0.0).to(dtype).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_cos_p + i, mask=i_mask, other=0.0).to(dtype).to(tl.float32)
    if QK_NORM:
        norm_ptr = tl.where(is_kv, k_norm_ptr, q_norm_ptr)
        norm_w1 = tl.load(norm_ptr + i, mask=i_mask, other=0.0).to(tl.float32)
        norm_w2 = tl.load(norm_ptr + HALF + i, mask=i_mask, other=0.0).to(tl.float32)
        if PASS > 0:
            norm_w3 = tl.load(norm_ptr + j, mask=j_mask, other=0.0).to(tl.float32)
    wait_for_previous(PDL)
    row = qkv_ptr + t * stride_qkv_t
    if not is_kv:
        head = tl.arange(0, BLOCK_Q_HEADS)[:, None]
        mask = (head < NUM_HEADS) & i_mask
        q_at = row + head * HEAD_DIM
        q1 = tl.load(q_at + i, mask=mask, other=0.0).to(tl.float32)
        q2 = tl.load(q_at + HALF + i, mask=mask, other=0.0).to(tl.float32)
        if PASS > 0:
            pass_mask = (head < NUM_HEADS) & j_mask
            q3 = tl.load(q_at + j, mask=pass_mask, other=0.0).to(tl.float32)
        if QK_NORM:
            sum_sq = tl.sum(q1 * q1, 1) + tl.sum(q2 * q2, 1)
            if PASS > 0:
                sum_sq += tl.sum(q3 * q3, 1)
            rstd = _rstd(sum_sq, eps, HEAD_DIM)
            q1 = _normed(q1, rstd, norm_w1, dtype, GEMMA_STYLE)
            q2 = _normed(q2, rstd, norm_w2, dtype, GEMMA_STYLE)
            if PASS > 0:
                q3 = _normed(q3, rstd, norm_w3, dtype, GEMMA_STYLE)
        q_out = q_out_ptr + t * stride_qo_t + head * stride_qo_h
        tl.store(q_out + i, (q1 * cos - q2 * sin).to(dtype), mask=mask)
        tl.store(q_out + HALF + i, (q2 * cos + q1 * sin).to(dtype), mask=mask)
        if PASS > 0:
            tl.store(q_out + j, q3.to(dtype), mask=pass_mask)
    else:
        if slot >= 0:  # padding rows of a graph bucket write no K/V
            g = tl.arange(0, BLOCK_KV_HEADS)[:, None]
            mask = (g < NUM_KV_HEADS) & i_mask
            d = tl.arange(0, BLOCK_HEAD)[None, :]  # V is copied whole
            v_mask = (g < NUM_KV_HEADS) & (d < HEAD_DIM)
            blk = slot // BLOCK_SIZE
            off = slot % BLOCK_SIZE
            k_at = row + (NUM_HEADS + g) * HEAD_DIM
            v_at = k_at + NUM_KV_HEADS * HEAD_DIM
            # Every load before the first store: the compiler cannot tell that a cache store leaves the qkv row
            # alone, so a load placed after one waits for it (one more round trip for each such load).
            k1 = tl.load(k_at + i, mask=mask, other=0.0).to(tl.float32)
            k2 = tl.load(k_at + HALF + i, mask=mask, other=0.0).to(tl.float32)
            if PASS > 0:
                pass_mask = (g < NUM_KV_HEADS) & j_mask
                k3 = tl.load(k_at + j, mask=pass_mask, other=0.0).to(tl.float32)
            v = tl.load(v_at + d, mask=v_mask)
            if QK_NORM:
                sum_sq = tl.sum(k1 * k1, 1) + tl.sum(k2 * k2, 1)
                if PASS > 0:
                    sum_sq += tl.sum(k3 * k3, 1)
                rstd = _rstd(sum_sq, eps, HEAD_DIM)
                k1 = _normed(k1, rstd, norm_w1, dtype, GEMMA_STYLE)
                k2 = _normed(k2, rstd, norm_w2, dtype, GEMMA_STYLE)
                if PASS > 0:
                    k3 = _normed(k3, rstd, norm_w3, dtype, GEMMA_STYLE)
            cache_dtype = k_cache_ptr.dtype.element_ty
            k_out = k_cache_ptr + blk * stride_kc_blk + off * stride_kc_off + g * stride_kc_h
            tl.store(k_out + i, to_cache_dtype((k1 * cos - k2 * sin).to(dtype), cache_dtype), mask=mask)
            tl.store(k_out + HALF + i, to_cache_dtype((k2 * cos + k1 * sin).to(dtype), cache_dtype), mask=mask)
            if PASS > 0:
                tl.store(k_out + j, to_cache_dtype(k3.to(dtype), cache_dtype), mask=pass_mask)
            v_out = v_cache_ptr + blk * stride_vc_blk + off * stride_vc_off + g * stride_vc_h
            tl.store(v_out + d, to_cache_dtype(v, cache_dtype), mask=v_mask)


_rotate_and_store = DirectKernel(_rotate_and_store_kernel)


def rotate_and_store(
    qkv: torch.Tensor,  # (T, (H + 2 * KVH) * D): q heads, then k heads, then v heads
    positions: torch.Tensor,  # (T,) int64
    cos: torch.Tensor,  # (P, R / 2) float32: R = D, or with partial rotary the leading R dims of each head that rotate
    sin: torch.Tensor,  # (P, R / 2) float32
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None,  # (q weight (D,), k weight (D,), eps): Qwen3, Gemma 3
    k_cache: torch.Tensor,  # (NB, BS, KVH, D)
    v_cache: torch.Tensor,  # (NB, BS, KVH, D)
    slot_mapping: torch.Tensor,  # (T,) int64, -1 = write nothing
    num_heads: int,
    num_kv_heads: int,
    gemma_style: bool = False,  # the q/k norms compute as norms.gemma_rms_norm (Gemma 3)
) -> torch.Tensor:  # (T, H, D): q, normed and rotated
    num_tokens = qkv.shape[0]
    head_dim = k_cache.shape[-1]
    assert qkv.stride(1) == 1 and cos.stride(1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q
    q_weight, k_weight, eps = qk_norm if qk_norm is not None else (qkv, qkv, 0.0)  # unread without QK_NORM
    half = cos.shape[1]
    passed = head_dim - 2 * half
    _rotate_and_store[(num_tokens, 2)](
        qkv, positions, cos, sin, q_weight, k_weight, q, k_cache, v_cache, slot_mapping, eps,
        qkv.stride(0), cos.stride(0), q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=half, PASS=passed,
        BLOCK_HALF=triton.next_power_of_2(half), BLOCK_PASS=triton.next_power_of_2(max(passed, 1)),
        BLOCK_HEAD=triton.next_power_of_2(head_dim), BLOCK_Q_HEADS=triton.next_power_of_2(num_heads),
        BLOCK_KV_HEADS=triton.next_power_of_2(num_kv_heads), BLOCK_SIZE=k_cache.shape[1],
        QK_NORM=qk_norm is not None, GEMMA_STYLE=gemma_style, num_warps=4, **launch_options(qkv.device),
    )  # fmt: skip
    return q
