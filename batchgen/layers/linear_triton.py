"""A Triton GEMV for linear layers at small M (decode: 1..MAX_M tokens): y = x @ weight.T + bias.

At these sizes a linear layer is a read of its weight and little else, and cuBLAS reaches only a fraction of the
memory bandwidth there. Each program owns BLOCK_N output features: it reads its (BLOCK_N, K) weight slice once, in
a few wide loads that do not depend on each other, and applies it to all rows of x at once. Accumulation is always
in fp32. The launch depends only on the shapes and never syncs with the host, so the kernel captures into CUDA graphs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

MAX_M = 8  # the most rows of x one launch takes: all of them sit in registers next to the weight tile
# Above M = 1 the kernel's time grows with M * N (every row of x meets every weight row in registers) while cuBLAS's
# stays flat: on an H200 (benchmarks/bench_linear.py) it is ahead up to about this many outputs per launch.
MAX_OUTPUTS = 12288


def beats_cublas(m: int, n: int) -> bool:
    """Whether an (m, n)-output launch should take this kernel rather than cuBLAS: at M = 1 always, else if small."""
    return m == 1 or (m <= MAX_M and m * n <= MAX_OUTPUTS)


class LinearConfig(NamedTuple):
    block_n: int  # output features (weight rows) per program
    block_k: int  # input features per load (a power of two); K takes ceil(K / block_k) unrolled steps
    num_warps: int


@triton.jit
def _small_m_linear_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr,
    M, N,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om,
    K: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows past N re-read row N - 1, so every weight load is in bounds and unmasked; only the store is masked.
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    # Both operands load as 3-D tiles, (1, BLOCK_N, BLOCK_K) and (BLOCK_M, 1, BLOCK_K): while BLOCK_K spans every
    # lane and warp (16 bytes each), both get the same layout, so their product needs no layout conversion through
    # shared memory, and a single reduction (one cross-warp exchange) covers every (m, n).
    w_rows = w_ptr + rows[None, :, None] * stride_wn
    x_rows = x_ptr + offs_m[:, None, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)[None, None, :]
        if k0 + BLOCK_K <= K:
            w = tl.load(w_rows + offs_k * stride_wk, eviction_policy="evict_first")  # (1, BLOCK_N, BLOCK_K)
        else:
            w = tl.load(w_rows + offs_k * stride_wk, mask=offs_k < K, other=0.0, eviction_policy="evict_first")
        x = tl.load(x_rows + offs_k * stride_xk, mask=(offs_m[:, None, None] < M) & (offs_k < K), other=0.0)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=2)  # (BLOCK_M, BLOCK_N)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def default_config(n: int, k: int, element_size: int) -> LinearConfig:
    """Launch parameters for an (n, k) weight.

    A decode GEMV is latency-bound: a 1024x1024 bf16 weight (2 MB) is about what an H100 keeps in flight at once, so
    every weight byte should be requested in the first round trip. ptxas issues a thread's loads all at once only
    while they are few (it trades the rest for registers, and a load placed after the first multiply waits for it):
    so each thread loads two 16-byte vectors of weight, the warps of a program split K (up to 8 KB of a row per
    load; one cross-warp reduction at the end), and programs are small and many: 2 rows of a 1024-wide weight per
    4-warp program, still at least 256 programs (2 per SM of a 132-SM GPU) where N is small.
    """
    vec = 16 // element_size  # elements per 16-byte load
    block_k = min(triton.next_power_of_2(k), 8192 // element_size)
    num_warps = max(1, min(8, block_k // (32 * vec)))
    block_n = max(1, min(16, 2 * 32 * vec * num_warps // block_k))
    while block_n > 1 and triton.cdiv(n, block_n) < 256:
        block_n //= 2
    return LinearConfig(block_n, block_k, num_warps)


def small_m_linear(
    x: torch.Tensor,  # (M, K), M <= MAX_M
    weight: torch.Tensor,  # (N, K)
    bias: torch.Tensor | None = None,  # (N,)
    config: LinearConfig | None = None,  # None: default_config(N, K, ...)
) -> torch.Tensor:  # (M, N), x's dtype
    """F.linear(x, weight, bias) for at most MAX_M rows of x, fp32-accumulated."""
    num_rows, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k, f"x has {k} features, weight {tuple(weight.shape)}"
    assert num_rows <= MAX_M, f"small_m_linear takes at most {MAX_M} rows, got {num_rows}"
    assert x.dtype == weight.dtype, f"x is {x.dtype}, weight {weight.dtype}"
    out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    if num_rows == 0 or n == 0:
        return out
    if config is None:
        config = default_config(n, k, weight.element_size())
    _small_m_linear_kernel[(triton.cdiv(n, config.block_n),)](
        x, weight, weight if bias is None else bias, out,
        num_rows, n,
        *x.stride(), *weight.stride(), out.stride(0),
        K=k, HAS_BIAS=bias is not None,
        BLOCK_M=triton.next_power_of_2(num_rows), BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps,
    )  # fmt: skip
    return out
