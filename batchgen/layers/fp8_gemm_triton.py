"""A weight-only fp8 GEMM for the few rows of a decode batch (W8A16): y = x @ (weight * weight_scale).T + bias, x in
the model's dtype (bf16, fp16 or float32), weight float8_e4m3fn (N, K) row-major as stored, one float32 scale per
output channel or one for the whole tensor; y in x's dtype.

From 2 to about 128 rows a linear layer still does little but read its weight, yet torch._scaled_mm reads fp8 weights
there no faster than cuBLAS reads bf16 (benchmarks/RESULTS.md, 2026-11-27 second session). Here
each program streams its weight tiles through a software pipeline (num_stages tiles in flight), upcasts each tile to
x's dtype in registers and multiplies it on the tensor cores, accumulating in fp32; the scale and the bias apply to the
fp32 sums at the end, so x is never quantized.

Tiles: BLOCK_M rows of x (at least 16, the smallest side tl.dot takes), BLOCK_N weight rows (output channels) and
BLOCK_K features per step. With `weight_first` the product is computed transposed, weight tile (BLOCK_N, BLOCK_K) times
x tile (BLOCK_K, BLOCK_M): the upcast weight is then the dot's first operand, which Hopper's wgmma reads from
registers, and only x, which needs no conversion, goes through shared memory; as the second operand the upcast weight
would be written back to shared memory first.

Split-K: where the (M, N) tiles are too few to fill the GPU (Llama-3.1-8B's o_proj and down_proj have 4,096 rows: 64
tiles of 64), `split_k` programs share a tile, each summing its own range of K into its own fp32 slice of a
workspace; a second launch adds the slices in a fixed order, so the result does not depend on which program finished
first, then scales, adds the bias and casts.

Every launch depends on the shapes alone and never syncs with the host: the layer captures into CUDA graphs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from batchgen.layers.fp8 import FP8_DTYPE
from batchgen.layers.pdl import launch_options, wait_for_previous


@dataclass(frozen=True)
class GpuLimits:
    sm_count: int
    shared_memory_bytes: int  # the most shared memory one program may take


HOPPER = GpuLimits(sm_count=132, shared_memory_bytes=227 * 1024)  # an H100 SXM or an H200


@functools.cache
def gpu_limits(device: torch.device) -> GpuLimits:
    """`device`'s limits; off CUDA (Triton's CPU interpreter) those of an H100, so tests launch what it would."""
    if device.type != "cuda":
        return HOPPER
    properties = torch.cuda.get_device_properties(device)
    return GpuLimits(properties.multi_processor_count, properties.shared_memory_per_block_optin)


@dataclass(frozen=True)
class SmallMGemmConfig:
    block_m: int  # rows of x per tile: 16, 32 or 64
    block_n: int  # weight rows (output channels) per tile, a power of two of at least 16
    block_k: int  # features per step, a power of two of at least 16
    split_k: int  # programs per (M, N) tile, each summing a range of K steps (1: no workspace, no second launch)
    num_warps: int
    num_stages: int  # K steps whose loads are in flight at once
    weight_first: bool = True  # the weight tile is the dot's first operand (module docstring)


MIN_BLOCK = 16  # tl.dot's smallest tile side
MAX_BLOCK_M = 64
MAX_STAGES = 4
MAX_SPLIT_K = 16
# A split of fewer K steps leaves its pipeline little to overlap, and the workspace costs more than it saves.
MIN_K_STEPS_PER_SPLIT = 4
# The workspace of a split launch: one fp32 (M, N) slice per split, summed by one program per this many outputs.
SUM_BLOCK = 1024
DOT_PRECISION = {torch.bfloat16: "tf32", torch.float16: "tf32", torch.float32: "tf32x3"}  # tf32x3: near fp32


def block_m_for(rows: int) -> int:
    """The row tile of a `rows`-row launch: rows rounded up to a power of two, within 16..64."""
    return min(MAX_BLOCK_M, max(MIN_BLOCK, triton.next_power_of_2(rows)))


def stages_that_fit(block_m: int, block_n: int, block_k: int, x_element_size: int, weight_first: bool,
                    shared_memory_bytes: int) -> int:
    """The most pipeline stages (up to MAX_STAGES) whose tiles fit in a program's shared memory: each stage holds a
    weight tile (one byte an element) and an x tile; the fp32 accumulator's epilogue and, unless weight_first, the
    upcast weight tile take one buffer each besides."""
    stage = block_k * (block_n + block_m * x_element_size)
    fixed = block_m * block_n * 4 + (0 if weight_first else block_n * block_k * x_element_size)
    return max(1, min(MAX_STAGES, (shared_memory_bytes - fixed) // stage))


def split_k_for(tiles: int, k_steps: int, sm_count: int) -> int:
    """Doubles the programs per (M, N) tile while the tiles alone leave SMs idle and every split keeps at least
    MIN_K_STEPS_PER_SPLIT steps of K."""
    split = 1
    while tiles * split < sm_count and split < MAX_SPLIT_K and k_steps >= 2 * split * MIN_K_STEPS_PER_SPLIT:
        split *= 2
    return split


def fp8_small_m_config(rows: int, n: int, k: int, x_element_size: int = 2,
                       limits: GpuLimits = HOPPER) -> SmallMGemmConfig:
    """The launch of a `rows`-row product with an (n, k) fp8 weight, for x of x_element_size bytes an element.

    Tiles of 64 weight rows (one warpgroup's wgmma rows, the weight first) by the rows rounded up (`block_m_for`);
    256 features a step for tiles of up to 32 rows, 128 for 64 (half as many for float32 x), so a stage holds 16 KB
    of weight; as many stages as fit, up to MAX_STAGES; split-K as `split_k_for` asks. Not yet swept on a GPU:
    `bench_linear --dtype fp8 --sweep` times the alternatives.
    """
    block_m = block_m_for(rows)
    block_n = min(64, max(MIN_BLOCK, triton.next_power_of_2(n)))
    block_k = (256 if block_m <= 32 else 128) * 2 // x_element_size
    block_k = min(block_k, max(MIN_BLOCK, triton.next_power_of_2(k)))
    tiles = triton.cdiv(rows, block_m) * triton.cdiv(n, block_n)
    split = split_k_for(tiles, triton.cdiv(k, block_k), limits.sm_count)
    stages = stages_that_fit(block_m, block_n, block_k, x_element_size, True, limits.shared_memory_bytes)
    return SmallMGemmConfig(block_m, block_n, block_k, split, num_warps=4, num_stages=stages)


@triton.jit
def _scaled_and_biased(acc, w_scale_ptr, b_ptr, channels, PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr):
    """acc (fp32 sums of output channels `channels`, same shape or broadcast) times its scales, plus its bias."""
    if PER_CHANNEL:
        acc = acc * tl.load(w_scale_ptr + channels)
    else:
        acc = acc * tl.load(w_scale_ptr)
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + channels).to(tl.float32)
    return acc


@triton.jit(do_not_specialize=["M"])
def _w8a16_gemm_kernel(
    x_ptr, w_ptr, w_scale_ptr, b_ptr, out_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_split,
    PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr, TO_WORKSPACE: tl.constexpr, EVEN_K: tl.constexpr,
    WEIGHT_FIRST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program (i, j, s): rows i * BLOCK_M.., channels j * BLOCK_N.., K from s * k_per_split. Writes the scaled
    (M, N) output in x's dtype, or with TO_WORKSPACE the unscaled fp32 sums into slice s of the workspace."""
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows past M or N re-read the last one, so that only a partial K step needs a load mask; the stores are masked.
    x_rows = tl.minimum(offs_m, M - 1).to(tl.int64)
    channels = tl.minimum(offs_n, N - 1)
    x_ptrs = x_ptr + x_rows[None, :] * stride_xm + offs_k[:, None] * stride_xk  # (BLOCK_K, BLOCK_M)
    w_ptrs = w_ptr + channels.to(tl.int64)[:, None] * stride_wn + offs_k[None, :] * stride_wk  # (BLOCK_N, BLOCK_K)
    dtype = x_ptr.dtype.element_ty
    if WEIGHT_FIRST:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    wait_for_previous(PDL)
    for k0 in range(k_begin, k_end, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs + k0 * stride_wk)
            x = tl.load(x_ptrs + k0 * stride_xk)
        else:
            in_k = k0 + offs_k < K
            w = tl.load(w_ptrs + k0 * stride_wk, mask=in_k[None, :], other=0.0)
            x = tl.load(x_ptrs + k0 * stride_xk, mask=in_k[:, None], other=0.0)
        w = w.to(dtype)
        if WEIGHT_FIRST:
            acc = tl.dot(w, x, acc, input_precision=DOT_PRECISION)
        else:
            acc = tl.dot(tl.trans(x), tl.trans(w), acc, input_precision=DOT_PRECISION)
    if not WEIGHT_FIRST:
        acc = tl.trans(acc)  # (BLOCK_N, BLOCK_M), as the stores below take it
    mask = (offs_n[:, None] < N) & (offs_m[None, :] < M)
    if TO_WORKSPACE:
        slice_ptrs = out_ptr + pid_k * stride_split + offs_m[None, :] * N + offs_n[:, None]
        tl.store(slice_ptrs, acc, mask=mask)
    else:
        acc = _scaled_and_biased(acc, w_scale_ptr, b_ptr, channels[:, None], PER_CHANNEL, HAS_BIAS)
        out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _sum_splits_kernel(
    workspace_ptr, w_scale_ptr, b_ptr, out_ptr, M, N,
    SPLIT_K: tl.constexpr, PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """out (M, N) contiguous = the sum of the workspace's SPLIT_K (M, N) slices, first to last, scaled and biased."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    size = M * N
    mask = offs < size
    wait_for_previous(PDL)
    acc = tl.load(workspace_ptr + offs, mask=mask, other=0.0)
    for split in tl.static_range(1, SPLIT_K):
        acc += tl.load(workspace_ptr + split * size + offs, mask=mask, other=0.0)
    acc = _scaled_and_biased(acc, w_scale_ptr, b_ptr, offs % N, PER_CHANNEL, HAS_BIAS)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def fp8_small_m_gemm(
    x: torch.Tensor,  # (M, K): bfloat16, float16 or float32
    weight: torch.Tensor,  # (N, K) float8_e4m3fn
    weight_scale: torch.Tensor,  # (N,) or one value, float32: row n stands for weight[n] * weight_scale[n]
    bias: torch.Tensor | None = None,  # (N,) in x's dtype
    config: SmallMGemmConfig | None = None,  # None: fp8_small_m_config's for these shapes and x's device
) -> torch.Tensor:  # (M, N) in x's dtype
    """x @ (weight * weight_scale).T + bias with x kept in its dtype (weight-only quantization), fp32-accumulated;
    any M, N and K (partial tiles are masked)."""
    assert x.dim() == 2 and weight.dim() == 2 and weight.shape[1] == x.shape[1], (
        f"x {tuple(x.shape)} against weight {tuple(weight.shape)}")
    assert x.dtype in DOT_PRECISION, f"x is {x.dtype}: the fp8 GEMM takes {', '.join(map(str, DOT_PRECISION))}"
    num_rows, k = x.shape
    n = weight.shape[0]
    per_channel = weight_scale.numel() == n
    assert weight.dtype == FP8_DTYPE and weight_scale.dtype == torch.float32, (
        f"the fp8 GEMM takes a float8_e4m3fn weight and float32 scales: {weight.dtype}, {weight_scale.dtype}")
    assert weight_scale.numel() == 1 or (per_channel and weight_scale.is_contiguous()), (
        f"one scale per row or one in all: scales {tuple(weight_scale.shape)} for weight {tuple(weight.shape)}")
    assert bias is None or (bias.shape == (n,) and bias.is_contiguous()), f"bias {tuple(bias.shape)} for {n} rows"
    out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    if num_rows == 0 or n == 0:
        return out
    if config is None:
        config = fp8_small_m_config(num_rows, n, k, x.element_size(), gpu_limits(x.device))
    k_steps = triton.cdiv(k, config.block_k)
    steps_per_split = max(1, triton.cdiv(k_steps, config.split_k))
    split = max(1, triton.cdiv(k_steps, steps_per_split))  # no split without a step of its own
    target = out if split == 1 else torch.empty(split, num_rows, n, dtype=torch.float32, device=x.device)
    bias_or_unused = weight if bias is None else bias  # a pointer the kernels never read without HAS_BIAS
    grid = (triton.cdiv(num_rows, config.block_m), triton.cdiv(n, config.block_n), split)
    _w8a16_gemm_kernel[grid](
        x, weight, weight_scale, bias_or_unused, target,
        num_rows, n, k, steps_per_split * config.block_k,
        *x.stride(), *weight.stride(), out.stride(0), num_rows * n,
        PER_CHANNEL=per_channel, HAS_BIAS=bias is not None, TO_WORKSPACE=split > 1,
        EVEN_K=k % config.block_k == 0, WEIGHT_FIRST=config.weight_first, DOT_PRECISION=DOT_PRECISION[x.dtype],
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages, **launch_options(x.device),
    )  # fmt: skip
    if split > 1:
        _sum_splits_kernel[(triton.cdiv(num_rows * n, SUM_BLOCK),)](
            target, weight_scale, bias_or_unused, out, num_rows, n,
            SPLIT_K=split, PER_CHANNEL=per_channel, HAS_BIAS=bias is not None, BLOCK=SUM_BLOCK, num_warps=4,
            **launch_options(x.device),
        )  # fmt: skip
    return out
