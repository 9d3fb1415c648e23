"""A Triton GEMV for linear layers at small M (decode: 1..MAX_M tokens): y = x @ weight.T + bias.

At these sizes a linear layer is a read of its weight and little else, and cuBLAS reaches only a fraction of the
memory bandwidth there. Each program owns BLOCK_N output features: it reads its (BLOCK_N, K) weight slice once, in
a few wide loads that do not depend on each other, and applies it to all rows of x at once. Accumulation is always
in fp32. The launch depends only on the shapes and never syncs with the host, so the kernel captures into CUDA graphs.

An fp8 weight (layers/fp8.py) comes with one float32 scale per row: the kernel upcasts the fp8 values as it reads
them and multiplies each output's fp32 sum by its row's scale, so a decode step reads half the weight bytes of bf16.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from batchgen.layers.pdl import launch_options, wait_for_previous

MAX_M = 8  # the most rows of x one launch takes: all of them sit in registers next to the weight tile
# Above M = 1 the kernel's time grows with BLOCK_M * N (every row of the tile meets every weight row in registers)
# while cuBLAS's stays flat: a multi-row launch whose row tile times N is above this goes to cuBLAS.
MAX_OUTPUTS = 24576
# A weight this small is read in a couple of microseconds by cuBLAS too (the launch dominates): the kernel would only
# add a compile per shape to a fresh process (the main job's 128-wide GPT-2 has no weight above 256 KB).
MIN_WEIGHT_BYTES = 1 << 20


def block_m(m: int) -> int:
    """The row tile of an m-row launch: m rounded up to a power of two, so that a weight shape compiles at most four
    times (tiles of 1, 2, 4 and 8 rows) however many batch sizes the CUDA graphs capture. One tile of MAX_M rows for
    every m > 1 would compile less, but do four times the work at M = 2."""
    return triton.next_power_of_2(m)


def beats_cublas(m: int, n: int, k: int, element_size: int, max_threads: int | None = None,
                 fused_norm: bool = False) -> bool:
    """Whether an m-row launch on an (n, k) weight should take this kernel rather than cuBLAS: for weights that are
    not tiny, at M = 1 always, else if the launch's row tile times N is small and its tile fits (`tile_fits`), and,
    with the norm fused in (`add_rms_norm_linear`; else the norm runs as its own kernel before cuBLAS), if its
    programs pay little for normalizing x (`norm_pass_is_cheap`). max_threads: as default_config's."""
    if n * k * element_size < MIN_WEIGHT_BYTES or m > MAX_M:
        return False
    if m == 1:
        return True
    if block_m(m) * n > MAX_OUTPUTS or not tile_fits(m, n, k, element_size, max_threads):
        return False
    return not fused_norm or norm_pass_is_cheap(m, n, k, element_size, max_threads)


@functools.cache
def norm_pass_is_cheap(m: int, n: int, k: int, element_size: int, max_threads: int | None = None) -> bool:
    """Whether an m-row launch with the norm fused in has at least twice as many weight rows a program as rows of x.
    Every program normalizes the tile's rows itself, a pass over all of K, so its norm work against its weight reads
    grows with rows of x per weight row: Llama-3.1-8B's qkv at 4 rows (2 weight rows a program) ran slower than the
    separate norm and cuBLAS, Qwen3-0.6B's (8 weight rows a program) faster (benchmarks/RESULTS.md, 2026-11-29,
    third session)."""
    config = default_config(n, k, element_size, max_threads, block_m(m), fused_norm=True)
    return config.block_n >= 2 * block_m(m)


# The most products (row tile x BLOCK_N x BLOCK_K, fp32) that one thread of a multi-row launch holds in a K step.
# Past it the tile spills out of registers and the launch runs many times slower than cuBLAS: Llama-3.1-8B's o_proj
# and down_proj at M = 4 hold 2,048 and doubled the step, its fp8 weights at M = 8 made it 80 times slower
# (benchmarks/RESULTS.md, 2026-11-27), while Qwen3-0.6B's gate/up at M = 4 (1,024) still beat cuBLAS.
MAX_TILE_PER_THREAD = 1024


@functools.cache
def tile_fits(m: int, n: int, k: int, element_size: int, max_threads: int | None = None) -> bool:
    """Whether an m-row launch's tile, with default_config's launch parameters, stays within MAX_TILE_PER_THREAD
    products a thread."""
    rows = block_m(m)
    config = default_config(n, k, element_size, max_threads, rows)
    return rows * config.block_n * config.block_k <= MAX_TILE_PER_THREAD * 32 * config.num_warps


class LinearConfig(NamedTuple):
    block_n: int  # output features (weight rows) per program
    block_k: int  # input features per load (a power of two); K takes ceil(K / block_k) unrolled steps
    num_warps: int


# What the kernel computes from its input rows before the dot (X_OP; constexpr, as Triton requires of globals):
PLAIN = tl.constexpr(0)  # x as given
ADD_RMS_NORM = tl.constexpr(1)  # rms_norm(x + residual) * norm weight: the residual add and RMSNorm fused in
ADD_GEMMA_RMS_NORM = tl.constexpr(2)  # the same with Gemma's norm (norms.gemma_rms_norm): scaled by (1 + weight)


@triton.jit(do_not_specialize=["M"])
def _small_m_linear_kernel(
    x_ptr, w_ptr, w_scale_ptr, b_ptr, out_ptr,
    res_ptr, norm_w_ptr, res_out_ptr, eps,
    M, N,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_rm, stride_rom,
    K: tl.constexpr, HAS_W_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, X_OP: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    SILU_AND_MUL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """N outputs; with SILU_AND_MUL the weight holds 2N rows, gate then up, and output j is silu(gate_j) * up_j."""
    if SILU_AND_MUL:
        # The program's BLOCK_N weight rows pair gate j with up N + j, adjacent, so the accumulator splits in two.
        offs_n = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        idx = tl.arange(0, BLOCK_N)
        outputs = tl.program_id(0) * (BLOCK_N // 2) + idx // 2
        rows = (tl.minimum(outputs, N - 1) + (idx % 2) * N).to(tl.int64)
    else:
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        # Rows past N re-read row N - 1, so every weight load is in bounds and unmasked; only the store is masked.
        rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    # Both operands load as 3-D tiles, (1, BLOCK_N, BLOCK_K) and (BLOCK_M, 1, BLOCK_K): while BLOCK_K spans every
    # lane and warp, each lane holding the same features of both (`_load_weight`), they get the same layout, so their
    # product needs no layout conversion between lanes, and a single reduction (one cross-warp exchange) covers every
    # (m, n).
    w_rows = w_ptr + rows[None, :, None] * stride_wn
    x_rows = x_ptr + offs_m[:, None, None] * stride_xm
    # The first weight chunk is requested before anything else: the norm's pass over x runs while it is in flight,
    # and with PDL so does the end of the kernel that writes x. So is the norm's weight: loaded after the wait, it
    # came only after the pass over x (its reduction's barrier), one more round trip on every fused launch.
    w_first = _load_weight(w_rows, stride_wk, 0, K, BLOCK_K, x_ptr)
    if X_OP != PLAIN:
        norm_w_first = _load_norm_weight(norm_w_ptr, 0, K, BLOCK_K)
    wait_for_previous(PDL)
    if X_OP != PLAIN:
        res_rows = res_ptr + offs_m[:, None, None] * stride_rm
        sum_sq = tl.zeros((BLOCK_M, 1, 1), dtype=tl.float32)
        for k0 in tl.static_range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)[None, None, :]
            mask = (offs_m[:, None, None] < M) & (offs_k < K)
            h = _load_summed(x_rows, res_rows, stride_xk, offs_k, mask, HAS_RESIDUAL)
            if k0 == 0:
                h_first = h  # kept for the dot: the store below may alias x as far as the compiler knows
            if HAS_RESIDUAL:
                if tl.program_id(0) == 0:  # hands the new residual on; nobody reads res_out in this launch
                    tl.store(res_out_ptr + offs_m[:, None, None] * stride_rom + offs_k, h, mask=mask)
            h = h.to(tl.float32)
            sum_sq += tl.sum(h * h, axis=2, keep_dims=True)
        inv_rms = tl.rsqrt(sum_sq / K + eps)  # (BLOCK_M, 1, 1)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)[None, None, :]
        if k0 == 0:
            w = w_first
        else:
            w = _load_weight(w_rows, stride_wk, k0, K, BLOCK_K, x_ptr)  # (1, BLOCK_N, BLOCK_K)
        mask = (offs_m[:, None, None] < M) & (offs_k < K)
        dtype = x_ptr.dtype.element_ty
        # Each step rounds to x's dtype where the unfused torch ops do, so both paths feed the dot the same values.
        if X_OP != PLAIN:
            if k0 == 0:
                h = h_first.to(tl.float32)
            else:
                h = _load_summed(x_rows, res_rows, stride_xk, offs_k, mask, HAS_RESIDUAL).to(tl.float32)
            norm_w = norm_w_first if k0 == 0 else _load_norm_weight(norm_w_ptr, k0, K, BLOCK_K)
            if X_OP == ADD_GEMMA_RMS_NORM:
                x = (h * inv_rms * (1.0 + norm_w)).to(dtype)
            else:
                x = (norm_w * (h * inv_rms).to(dtype).to(tl.float32)).to(dtype)
        else:
            x = tl.load(x_rows + offs_k * stride_xk, mask=mask, other=0.0)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=2)  # (BLOCK_M, BLOCK_N)
    if HAS_W_SCALE:
        acc *= tl.load(w_scale_ptr + rows)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows).to(tl.float32)[None, :]
    if SILU_AND_MUL:  # rounded where the unfused projection and SiluAndMul round
        dtype = out_ptr.dtype.element_ty
        gate, up = tl.split(tl.reshape(acc.to(dtype).to(tl.float32), (BLOCK_M, BLOCK_N // 2, 2)))
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        acc = silu * up  # (BLOCK_M, BLOCK_N // 2)
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def _load_weight(w_rows, stride_wk, k0: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr, x_ptr):
    """Features k0 .. k0 + BLOCK_K of the program's weight rows, loaded as many a lane as a 16-byte load of x holds.
    Left to itself the compiler loads 16 bytes a lane of each: 16 features of an fp8 weight against 8 of a 16-bit x,
    and it then moved every weight byte between lanes to x's layout. Offsets written as k // lane * lane + k % lane are
    the same offsets, contiguous only lane by lane as far as the compiler can tell, so it loads that many."""
    lane: tl.constexpr = 128 // x_ptr.dtype.element_ty.primitive_bitwidth
    k = tl.arange(0, BLOCK_K)
    if w_rows.dtype.element_ty.primitive_bitwidth * lane < 128:
        k = k // lane * lane + k % lane
    offs_k = k0 + k[None, None, :]
    if k0 + BLOCK_K <= K:
        w = tl.load(w_rows + offs_k * stride_wk, eviction_policy="evict_first")
    else:
        w = tl.load(w_rows + offs_k * stride_wk, mask=offs_k < K, other=0.0, eviction_policy="evict_first")
    return w


@triton.jit
def _load_norm_weight(norm_w_ptr, k0: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_k = k0 + tl.arange(0, BLOCK_K)[None, None, :]
    return tl.load(norm_w_ptr + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)


@triton.jit
def _load_summed(x_rows, res_rows, stride_xk, offs_k, mask, HAS_RESIDUAL: tl.constexpr):
    """x + residual in x's dtype (as torch adds them), or x alone."""
    x = tl.load(x_rows + offs_k * stride_xk, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_rows + offs_k, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    return x


def default_config(n: int, k: int, element_size: int, max_threads: int | None = None, rows: int = 1,
                   fused_norm: bool = False) -> LinearConfig:
    """Launch parameters for an (n, k) weight and a row tile of `rows` (`block_m`); max_threads: the most threads a
    launch should take (`launch_thread_cap`), None for no cap; fused_norm: the launch normalizes x first
    (`add_rms_norm_linear`).

    A one-row tile takes `one_row_config`'s, and so does a two-row tile of a weight of LARGE_WEIGHT_BYTES or more
    without the norm fused in: under the launch cap the warp-split programs hold 16 of its rows, a tile that ran
    Llama-3.1-8B's down projection slower than cuBLAS, the one-row programs faster (benchmarks/RESULTS.md,
    2026-11-29, fourth session). Other tiles of several rows take the programs whose warps split K
    (`warp_split_config`) with half the warps: every row of the tile adds BLOCK_N partial sums to the reduction
    across a program's threads at the end; with half the threads, each taking twice the span of K, that reduction is
    half as wide.
    """
    if rows == 1 or (rows == 2 and not fused_norm and is_large_weight(n, k, element_size)):
        return one_row_config(n, k, element_size, max_threads, fused_norm)
    config = warp_split_config(n, k, element_size, max_threads)
    return config._replace(num_warps=max(1, config.num_warps // 2))


# A one-row launch with the norm fused in, on a large weight: weight rows per program, the widest K step (features)
# and the features per warp, so that each thread requests two 16-byte vectors of each fp8 row and four of each 16-bit
# one.
FUSED_NORM_ROWS = 8
FUSED_NORM_MAX_BLOCK_K = 4096
FUSED_NORM_FEATURES_PER_WARP = 1024
# The weight size from which one_row_config gives the launches for large weights. Qwen3-0.6B's projections (2 to 12
# MiB) ran their chain faster with those too, but its fp8 decode step slower (benchmarks/RESULTS.md, 2026-11-29,
# second session), so smaller weights keep the two-warp programs.
LARGE_WEIGHT_BYTES = 16 << 20


def is_large_weight(n: int, k: int, element_size: int) -> bool:
    return n * k * element_size >= LARGE_WEIGHT_BYTES


def one_row_config(n: int, k: int, element_size: int, max_threads: int | None = None,
                   fused_norm: bool = False) -> LinearConfig:
    """The launch of a one-row GEMV (a decode step at batch 1), chosen on a decode step's chain of projections in one
    CUDA graph (`benchmarks/bench_gemv_chain.py --sweep`) and on the decode step (b1_latency) of Llama-3.1-8B's and
    Qwen3-0.6B's shapes, fp8 and bf16 (benchmarks/RESULTS.md, 2026-11-29, second session).

    A weight of LARGE_WEIGHT_BYTES or more:
    - With the norm fused in, every program first normalizes x itself, a pass over all of K, so fewer programs with
      more weight rows pay for it less often: FUSED_NORM_ROWS rows, all of K in one step (up to
      FUSED_NORM_MAX_BLOCK_K), which also keeps the normalized x in registers for the dot, and one warp per
      FUSED_NORM_FEATURES_PER_WARP features, whatever the cap.
    - fp8 weights otherwise: 2 rows, 2 KB steps, one warp.
    - 16-bit weights otherwise: programs of two warps (`two_warp_config`) where their launch fits under the cap; where
      it does not, programs of one warp with the same rows and half the K step (the same loads a thread) if those
      fit, else the programs whose warps split K (`warp_split_config`; an lm_head).
    A smaller weight, fused norm or not: fp8 4 rows, 2 KB steps, two warps; 16-bit the two-warp programs where they fit
    under the cap, else the warp-split ones.
    """
    large = is_large_weight(n, k, element_size)
    if fused_norm and large:
        block_k = min(triton.next_power_of_2(k), FUSED_NORM_MAX_BLOCK_K)
        return LinearConfig(FUSED_NORM_ROWS, block_k, max(1, block_k // FUSED_NORM_FEATURES_PER_WARP))
    if element_size == 1:
        rows, warps = (2, 1) if large else (4, 2)
        return LinearConfig(rows, min(triton.next_power_of_2(k), 2048), warps)
    two_warps = two_warp_config(n, k, element_size)
    one_warp = LinearConfig(two_warps.block_n, max(1, two_warps.block_k // 2), 1)
    for config in (two_warps, one_warp) if large else (two_warps,):
        if max_threads is None or triton.cdiv(n, config.block_n) * 32 * config.num_warps <= max_threads:
            return config
    return warp_split_config(n, k, element_size, max_threads)


TWO_WARP_LOADS = 16  # 16-byte weight loads per thread in a two-warp program


def two_warp_config(n: int, k: int, element_size: int) -> LinearConfig:
    """Programs of two warps, each thread requesting TWO_WARP_LOADS 16-byte vectors of weight before the PDL wait:
    the reduction across warps at the end is between two, and a launch takes fewer of the GPU's threads, so more of
    the next kernel's programs start early. Fewer loads a thread, more, or programs of one warp or four were
    slower (on Qwen3-0.6B's projections)."""
    vec = 16 // element_size  # elements per 16-byte load
    block_k = min(triton.next_power_of_2(k), 8192 // element_size)
    loads_per_row = max(1, block_k // (2 * 32 * vec))
    return LinearConfig(max(1, TWO_WARP_LOADS // loads_per_row), block_k, 2)


def warp_split_config(n: int, k: int, element_size: int, max_threads: int | None) -> LinearConfig:
    """Programs whose warps split K: one_row_config's for a 16-bit one-row launch that programs of one or two warps
    would take past the cap (an lm_head), and, with half the warps, default_config's for tiles of several rows.

    A decode GEMV is latency-bound: a 1024x1024 bf16 weight (2 MB) is about what an H100 keeps in flight at once, so
    every weight byte should be requested in the first round trip. ptxas issues a thread's loads all at once only
    while they are few (it trades the rest for registers, and a load placed after the first multiply waits for it):
    so each thread loads two 16-byte vectors of weight, the warps of a program split K (up to 8 KB of a row per
    load; one cross-warp reduction at the end), and programs are small and many: 2 rows of a 1024-wide weight per
    4-warp program, still at least 256 programs (2 per SM of a 132-SM GPU) where N is small.

    Under the cap, a program then takes twice the rows (loads) as often as needed, up to MAX_BLOCK_N: in a decode
    step the next kernel's programs start (PDL) only in the slots this one leaves free, to request their weight
    while it runs. A weight too large to fit under the cap even so (an lm_head) takes programs of twice the rows.
    """
    vec = 16 // element_size  # elements per 16-byte load
    block_k = min(triton.next_power_of_2(k), 8192 // element_size)
    num_warps = max(1, min(8, block_k // (32 * vec)))
    block_n = max(1, min(16, 2 * 32 * vec * num_warps // block_k))
    while block_n > 1 and triton.cdiv(n, block_n) < 256:
        block_n //= 2
    threads_per_program = 32 * num_warps
    if max_threads is None:
        return LinearConfig(block_n, block_k, num_warps)
    if triton.cdiv(n, MAX_BLOCK_N) * threads_per_program > max_threads:
        # Many waves long whatever the block: bandwidth-bound, it reads faster with twice the bytes in flight per
        # thread (bench_linear --sweep).
        return LinearConfig(2 * block_n, block_k, num_warps)
    while triton.cdiv(n, block_n) * threads_per_program > max_threads:
        block_n *= 2
    return LinearConfig(block_n, block_k, num_warps)


MAX_BLOCK_N = 16  # the most weight rows per program that the launch cap asks for
# A launch takes at most 1 / LAUNCH_SHARE of the threads the GPU holds at once, leaving slots for the next kernel's
# programs to start early (PDL).
LAUNCH_SHARE = 4


@functools.cache
def launch_thread_cap(device: torch.device) -> int | None:
    """The most threads a GEMV launch on `device` takes (default_config's max_threads); None off CUDA."""
    if device.type != "cuda":
        return None
    properties = torch.cuda.get_device_properties(device)
    return properties.multi_processor_count * properties.max_threads_per_multi_processor // LAUNCH_SHARE


def small_m_linear(
    x: torch.Tensor,  # (M, K), M <= MAX_M
    weight: torch.Tensor,  # (N, K)
    bias: torch.Tensor | None = None,  # (N,)
    config: LinearConfig | None = None,  # None: default_config(N, K, ...)
    *,
    silu_and_mul: bool = False,
    weight_scale: torch.Tensor | None = None,  # (N,) float32, for an fp8 weight
) -> torch.Tensor:  # (M, N), x's dtype; (M, N / 2) with silu_and_mul
    """F.linear(x, weight, bias) for at most MAX_M rows of x, fp32-accumulated. silu_and_mul: weight (and bias) hold
    gate then up rows, as a fused gate/up projection's do, and the result is SiluAndMul of the projection.
    weight_scale: the weight is float8_e4m3fn, and its row n stands for weight[n] * weight_scale[n]."""
    assert weight.shape[1] == x.shape[1], f"x has {x.shape[1]} features, weight {tuple(weight.shape)}"
    return _launch(x, weight, bias, config, PLAIN, silu_and_mul=silu_and_mul, weight_scale=weight_scale)


def add_rms_norm_linear(
    x: torch.Tensor,  # (M, K), M <= MAX_M
    residual: torch.Tensor | None,  # (M, K) contiguous, or None (the first layer: no add)
    norm_weight: torch.Tensor,  # (K,)
    eps: float,
    weight: torch.Tensor,  # (N, K)
    bias: torch.Tensor | None = None,  # (N,)
    config: LinearConfig | None = None,
    *,
    silu_and_mul: bool = False,
    gemma_style: bool = False,
    weight_scale: torch.Tensor | None = None,  # (N,) float32, for an fp8 weight
) -> tuple[torch.Tensor, torch.Tensor]:  # (M, N) (or (M, N / 2) with silu_and_mul), and the new residual (M, K)
    """(F.linear(rms_norm(x + residual) * norm_weight, weight, bias), x + residual) in one launch: every program
    normalizes the few rows itself (K is a hidden size: a few KB), program 0 writes x + residual to a new tensor.
    Without a residual: (F.linear(rms_norm(x) * norm_weight, ...), x). silu_and_mul, weight_scale: as
    small_m_linear's. gemma_style: Gemma's norm (norms.gemma_rms_norm) instead of Llama's."""
    assert weight.shape[1] == x.shape[1], f"x has {x.shape[1]} features, weight {tuple(weight.shape)}"
    assert norm_weight.shape == (x.shape[1],), f"norm weight {tuple(norm_weight.shape)} for {x.shape[1]} features"
    x_op = ADD_GEMMA_RMS_NORM if gemma_style else ADD_RMS_NORM
    if residual is None:
        out = _launch(x, weight, bias, config, x_op, norm_weight=norm_weight, eps=eps, silu_and_mul=silu_and_mul,
                      weight_scale=weight_scale)
        return out, x
    assert residual.shape == x.shape and residual.stride(1) == 1, f"residual {tuple(residual.shape)}, x {x.shape}"
    summed = torch.empty_like(residual)
    out = _launch(x, weight, bias, config, x_op, residual, norm_weight, eps, summed, silu_and_mul=silu_and_mul,
                  weight_scale=weight_scale)
    return out, summed


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: LinearConfig | None,
            x_op: tl.constexpr, residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
            eps: float = 0.0, residual_out: torch.Tensor | None = None, silu_and_mul: bool = False,
            weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    num_rows = x.shape[0]
    n, k = weight.shape
    assert num_rows <= MAX_M, f"the small-M linear takes at most {MAX_M} rows, got {num_rows}"
    if weight_scale is None:
        assert x.dtype == weight.dtype, f"x is {x.dtype}, weight {weight.dtype}"
    else:
        assert weight.dtype == torch.float8_e4m3fn and weight_scale.shape == (n,) and weight_scale.stride(0) == 1, (
            f"an fp8 GEMV takes a float8_e4m3fn weight and one scale per row: {weight.dtype} {tuple(weight.shape)}, "
            f"scales {tuple(weight_scale.shape)}")
    assert not silu_and_mul or n % 2 == 0, f"a gate/up weight has an even number of rows, got {n}"
    num_outputs = n // 2 if silu_and_mul else n
    out = torch.empty(num_rows, num_outputs, dtype=x.dtype, device=x.device)
    if num_rows == 0 or n == 0:
        if residual_out is not None:
            residual_out.copy_(x + residual)
        return out
    if config is None:
        config = default_config(n, k, weight.element_size(), launch_thread_cap(x.device), block_m(num_rows),
                                fused_norm=x_op != PLAIN)
    block_n = max(2, config.block_n) if silu_and_mul else config.block_n  # a gate and an up row at least
    unused = weight  # a pointer the kernel never reads, for arguments that this X_OP does not take
    _small_m_linear_kernel[(triton.cdiv(n, block_n),)](
        x, weight, unused if weight_scale is None else weight_scale, unused if bias is None else bias, out,
        unused if residual is None else residual, unused if norm_weight is None else norm_weight,
        unused if residual_out is None else residual_out, eps,
        num_rows, num_outputs,
        *x.stride(), *weight.stride(), out.stride(0),
        0 if residual is None else residual.stride(0), 0 if residual_out is None else residual_out.stride(0),
        K=k, HAS_W_SCALE=weight_scale is not None, HAS_BIAS=bias is not None, X_OP=x_op.value,
        HAS_RESIDUAL=residual is not None, SILU_AND_MUL=silu_and_mul,
        BLOCK_M=block_m(num_rows), BLOCK_N=block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, **launch_options(x.device),
    )  # fmt: skip
    return out
