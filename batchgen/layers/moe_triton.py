"""A mixture-of-experts layer as Triton kernels grouped by expert: routing, then one GEMM launch per projection over
all experts.

Rows are the (token, j) pairs, R = T * top_k of them, pair p = token p // top_k's j-th expert. The kernels:
1. `_route_kernel` (a program per token): softmax over the router logits, the top_k by repeated argmax, the
   renormalization; each pair takes its rank among its expert's rows by an atomic increment of the expert's count.
2. `_place_kernel`: each expert's rows get consecutive slots, its run of slots padded to a whole number of
   BLOCK_M-row blocks, in expert order; slot = the expert's first slot + the pair's rank.
3. `_expert_gemm_kernel` twice: a program per (block, BLOCK_N outputs) finds its block's expert from the counts,
   gathers its rows' inputs and multiplies them by that expert's weight tile. gate/up computes silu(gate) * up into
   (R, I); down multiplies by each row's routing weight into (R, H).
4. `_sum_pairs_kernel`: each token's top_k rows summed in float32, (T, H).
fp8 expert weights (layers/moe.py) come with one float32 scale per (expert, output row): the GEMM upcasts each weight
tile to the activations' dtype as it loads it and multiplies each output's fp32 sum by its row's scale.

The order of rows inside an expert's blocks depends on the order of the atomics, but a row's result does not depend
on where in the block it sits: the outputs are deterministic. Every shape depends on T alone (the grid covers the
most blocks any routing can need, R // BLOCK_M + min(E, R); the programs of blocks past the last exit at once), and
nothing syncs with the host, so the whole layer captures into CUDA graphs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


class MoeTiles(NamedTuple):
    block_m: int  # rows (pairs) per block; each expert's rows are padded to whole blocks
    block_n: int  # output features per program
    block_k: int  # input features per step of the dot
    num_warps: int
    num_stages: int


def moe_tiles(num_pairs: int, num_experts: int, dtype: torch.dtype) -> MoeTiles:
    """The tiles of a launch over num_pairs rows: blocks of about the rows an active expert gets (decode steps: a
    few, padded to tl.dot's 16; prefill: hundreds, where 64-row blocks read each weight tile fewer times)."""
    rows_per_expert = num_pairs / min(num_experts, num_pairs)
    block_k = 32 if dtype == torch.float32 else 64  # fp32 tiles hold twice the bytes
    if rows_per_expert <= 16:
        return MoeTiles(16, 64, block_k, num_warps=4, num_stages=4)
    if rows_per_expert <= 32:
        return MoeTiles(32, 64, block_k, num_warps=4, num_stages=4)
    return MoeTiles(64, 128 if dtype != torch.float32 else 64, block_k, num_warps=8, num_stages=3)


def _dot_precision(dtype: torch.dtype) -> str:
    # As the attention kernels: tf32x3 keeps fp32 models near fp32 accuracy on tensor cores.
    return "tf32x3" if dtype == torch.float32 else "tf32"


@triton.jit
def _route_kernel(
    logits_ptr, weights_ptr, ids_ptr, ranks_ptr, counts_ptr, stride_logits,
    E: tl.constexpr, E_PAD: tl.constexpr, TOP_K: tl.constexpr, TOP_K_PAD: tl.constexpr, RENORMALIZE: tl.constexpr,
):  # fmt: skip
    """One program per token: weights and expert ids of its top_k pairs, most probable first, and each pair's rank
    among its expert's rows."""
    token = tl.program_id(0).to(tl.int64)
    offs_e = tl.arange(0, E_PAD)
    logits = tl.load(logits_ptr + token * stride_logits + offs_e, mask=offs_e < E, other=-float("inf"))
    logits = logits.to(tl.float32)
    exps = tl.exp(logits - tl.max(logits, axis=0))
    probs = exps / tl.sum(exps, axis=0)
    probs = tl.where(offs_e < E, probs, -1.0)  # padding experts are never chosen
    offs_j = tl.arange(0, TOP_K_PAD)
    chosen_weights = tl.zeros((TOP_K_PAD,), dtype=tl.float32)
    chosen_ids = tl.zeros((TOP_K_PAD,), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(probs, axis=0)
        chosen_weights = tl.where(offs_j == j, tl.max(probs, axis=0), chosen_weights)
        chosen_ids = tl.where(offs_j == j, best, chosen_ids)
        probs = tl.where(offs_e == best, -1.0, probs)
    if RENORMALIZE:
        chosen_weights = chosen_weights / tl.sum(chosen_weights, axis=0)
    valid = offs_j < TOP_K
    ranks = tl.atomic_add(counts_ptr + chosen_ids, 1, mask=valid)
    pairs = token * TOP_K + offs_j
    tl.store(weights_ptr + pairs, chosen_weights, mask=valid)
    tl.store(ids_ptr + pairs, chosen_ids, mask=valid)
    tl.store(ranks_ptr + pairs, ranks, mask=valid)


@triton.jit
def _expert_blocks(counts_ptr, E: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """(counts, each expert's number of blocks, the cumulative blocks through each expert), (E_PAD,) each; padding
    experts count zero rows."""
    offs_e = tl.arange(0, E_PAD)
    counts = tl.load(counts_ptr + offs_e, mask=offs_e < E, other=0)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    return counts, blocks, tl.cumsum(blocks, axis=0)


@triton.jit(do_not_specialize=["num_pairs"])
def _place_kernel(
    ids_ptr, ranks_ptr, counts_ptr, slots_ptr, num_pairs,
    E: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    """slots[first slot of pair p's expert + p's rank] = p, for BLOCK_P pairs a program."""
    offs_p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    mask = offs_p < num_pairs
    experts = tl.load(ids_ptr + offs_p, mask=mask, other=0)
    ranks = tl.load(ranks_ptr + offs_p, mask=mask, other=0)
    _, blocks, block_ends = _expert_blocks(counts_ptr, E, E_PAD, BLOCK_M)
    first_slots = (block_ends - blocks) * BLOCK_M  # (E_PAD,)
    offs_e = tl.arange(0, E_PAD)
    first = tl.sum(tl.where(experts[:, None] == offs_e[None, :], first_slots[None, :], 0), axis=1)  # (BLOCK_P,)
    tl.store(slots_ptr + first + ranks, offs_p, mask=mask)


@triton.jit
def _expert_gemm_kernel(
    a_ptr, w_ptr, w_scale_ptr, out_ptr, route_weights_ptr, slots_ptr, counts_ptr,
    stride_am, stride_we, stride_wn, stride_se, stride_om,
    N: tl.constexpr, K: tl.constexpr, E: tl.constexpr, E_PAD: tl.constexpr, A_ROWS_PER_TOKEN: tl.constexpr,
    GATE_UP: tl.constexpr, HAS_W_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """out[p, n] for the rows p of one block and BLOCK_N outputs n, with the block's expert weight w[e] (N', K):
    GATE_UP (N' = 2N, input row p // A_ROWS_PER_TOKEN: the token): silu(a w_gate^T) * (a w_up^T); else (input row
    p): (a w^T) times p's routing weight. HAS_W_SCALE: w is fp8, and row n of w[e] stands for w[e, n] * scale[e, n]."""
    pid_m = tl.program_id(0)
    counts, blocks, block_ends = _expert_blocks(counts_ptr, E, E_PAD, BLOCK_M)
    expert = tl.sum((block_ends <= pid_m).to(tl.int32), axis=0)  # experts whose blocks all come before this one
    if expert >= E:
        return  # past the last block
    offs_e = tl.arange(0, E_PAD)
    first_slot = tl.sum(tl.where(offs_e == expert, (block_ends - blocks) * BLOCK_M, 0), axis=0)
    count = tl.sum(tl.where(offs_e == expert, counts, 0), axis=0)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    valid_m = offs_m - first_slot < count  # the expert's last block is padded
    rows = tl.load(slots_ptr + offs_m, mask=valid_m, other=0).to(tl.int64)  # (BLOCK_M,) pairs
    a_rows = a_ptr + (rows // A_ROWS_PER_TOKEN)[:, None] * stride_am
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    valid_n = offs_n < N
    w_expert = w_ptr + expert.to(tl.int64) * stride_we
    w_cols = w_expert + offs_n[None, :].to(tl.int64) * stride_wn  # (1, BLOCK_N): w's rows, read as columns
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if GATE_UP:
        w_up_cols = w_cols + N * stride_wn
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # a loop, not unrolled: the compiler pipelines its loads num_stages deep
        offs_k = k0 + tl.arange(0, BLOCK_K)
        valid_k = offs_k < K
        a = tl.load(a_rows + offs_k[None, :], mask=valid_m[:, None] & valid_k[None, :], other=0.0)
        w_mask = valid_k[:, None] & valid_n[None, :]
        w = tl.load(w_cols + offs_k[:, None], mask=w_mask, other=0.0).to(a.dtype)  # (BLOCK_K, BLOCK_N)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        if GATE_UP:
            w_up = tl.load(w_up_cols + offs_k[:, None], mask=w_mask, other=0.0).to(a.dtype)
            acc_up = tl.dot(a, w_up, acc_up, input_precision=DOT_PRECISION)
    if HAS_W_SCALE:
        w_scale = w_scale_ptr + expert.to(tl.int64) * stride_se + offs_n
        acc *= tl.load(w_scale, mask=valid_n, other=0.0)[None, :]
        if GATE_UP:
            acc_up *= tl.load(w_scale + N, mask=valid_n, other=0.0)[None, :]
    dtype = out_ptr.dtype.element_ty
    # Rounded where the torch reference rounds: each projection's output, silu(gate), and the product.
    projected = acc.to(dtype).to(tl.float32)
    if GATE_UP:
        silu = (projected / (1.0 + tl.exp(-projected))).to(dtype).to(tl.float32)
        result = silu * acc_up.to(dtype).to(tl.float32)
    else:
        result = projected * tl.load(route_weights_ptr + rows, mask=valid_m, other=0.0)[:, None]
    out_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, result.to(dtype), mask=valid_m[:, None] & valid_n[None, :])


@triton.jit
def _sum_pairs_kernel(
    pairs_ptr, out_ptr, stride_pairs, stride_out,
    H: tl.constexpr, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """out[t] = sum over j of pairs[t * TOP_K + j], in float32, j in order."""
    token = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs_h < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(pairs_ptr + (token * TOP_K + j) * stride_pairs + offs_h, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * stride_out + offs_h, acc.to(out_ptr.dtype.element_ty), mask=mask)


class ExpertPlacement(NamedTuple):
    """Where each (token, j) pair's row goes: the routing, and the rows grouped by expert in padded blocks."""

    weights: torch.Tensor  # (T * top_k,) float32
    expert_ids: torch.Tensor  # (T * top_k,) int32
    counts: torch.Tensor  # (E,) int32: rows per expert
    slots: torch.Tensor  # (max_blocks * block_m,) int32: the pair in each slot (slots past an expert's count unset)
    max_blocks: int  # the most blocks any routing of T tokens can fill


def place_pairs(router_logits: torch.Tensor, top_k: int, renormalize: bool, block_m: int) -> ExpertPlacement:
    """Routes (T, E) logits and lays the pairs out by expert, in blocks of block_m slots."""
    num_tokens, num_experts = router_logits.shape
    num_pairs = num_tokens * top_k
    device = router_logits.device
    weights = torch.empty(num_pairs, dtype=torch.float32, device=device)
    expert_ids = torch.empty(num_pairs, dtype=torch.int32, device=device)
    ranks = torch.empty(num_pairs, dtype=torch.int32, device=device)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    max_blocks = num_pairs // block_m + min(num_experts, num_pairs)
    slots = torch.empty(max_blocks * block_m, dtype=torch.int32, device=device)
    experts_pad = triton.next_power_of_2(num_experts)
    _route_kernel[(num_tokens,)](
        router_logits, weights, expert_ids, ranks, counts, router_logits.stride(0),
        E=num_experts, E_PAD=experts_pad, TOP_K=top_k, TOP_K_PAD=triton.next_power_of_2(top_k),
        RENORMALIZE=renormalize, num_warps=1 if experts_pad <= 128 else 4,
    )  # fmt: skip
    block_p = 64
    _place_kernel[(triton.cdiv(num_pairs, block_p),)](
        expert_ids, ranks, counts, slots, num_pairs,
        E=num_experts, E_PAD=experts_pad, BLOCK_M=block_m, BLOCK_P=block_p, num_warps=4,
    )  # fmt: skip
    return ExpertPlacement(weights, expert_ids, counts, slots, max_blocks)


def _expert_gemm(a: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None, out: torch.Tensor,
                 placement: ExpertPlacement, a_rows_per_token: int, gate_up: bool, tiles: MoeTiles) -> None:
    num_experts, rows, features = weight.shape
    n = rows // 2 if gate_up else rows
    if weight_scale is not None:
        assert weight.dtype == torch.float8_e4m3fn and weight_scale.shape == (num_experts, rows), (
            f"fp8 experts take one scale per (expert, row): {weight.dtype} {tuple(weight.shape)}, scales "
            f"{tuple(weight_scale.shape)}")
        assert weight_scale.stride(1) == 1, f"scales {tuple(weight_scale.shape)} with strides {weight_scale.stride()}"
    grid = (placement.max_blocks, triton.cdiv(n, tiles.block_n))
    _expert_gemm_kernel[grid](
        a, weight, weight if weight_scale is None else weight_scale, out, placement.weights, placement.slots,
        placement.counts, a.stride(0), weight.stride(0), weight.stride(1),
        0 if weight_scale is None else weight_scale.stride(0), out.stride(0),
        N=n, K=features, E=num_experts, E_PAD=triton.next_power_of_2(num_experts),
        A_ROWS_PER_TOKEN=a_rows_per_token, GATE_UP=gate_up, HAS_W_SCALE=weight_scale is not None,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        DOT_PRECISION=_dot_precision(a.dtype), num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip


def sparse_moe(hidden: torch.Tensor, router_logits: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
               top_k: int, renormalize: bool, gate_up_scale: torch.Tensor | None = None,
               down_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The MoE layer's output (T, H) for hidden (T, H), router logits (T, E), gate/up (E, 2I, H), down (E, H, I);
    for fp8 weights, their scales gate_up_scale (E, 2I) and down_scale (E, H)."""
    num_tokens, hidden_size = hidden.shape
    if num_tokens == 0:
        return hidden.new_empty(0, hidden_size)
    hidden = hidden.contiguous()
    num_experts, intermediate_size = down.shape[0], down.shape[2]
    num_pairs = num_tokens * top_k
    tiles = moe_tiles(num_pairs, num_experts, hidden.dtype)
    placement = place_pairs(router_logits, top_k, renormalize, tiles.block_m)
    activated = hidden.new_empty(num_pairs, intermediate_size)
    _expert_gemm(hidden, gate_up, gate_up_scale, activated, placement, top_k, gate_up=True, tiles=tiles)
    pair_outputs = hidden.new_empty(num_pairs, hidden_size)
    _expert_gemm(activated, down, down_scale, pair_outputs, placement, 1, gate_up=False, tiles=tiles)
    out = torch.empty_like(hidden)
    block_h = min(triton.next_power_of_2(hidden_size), 1024)
    _sum_pairs_kernel[(num_tokens, triton.cdiv(hidden_size, block_h))](
        pair_outputs, out, pair_outputs.stride(0), out.stride(0), H=hidden_size, TOP_K=top_k, BLOCK_H=block_h,
        num_warps=4,
    )  # fmt: skip
    return out
