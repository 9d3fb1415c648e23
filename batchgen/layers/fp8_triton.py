"""Per-token fp8 quantization of activations, the input of Fp8Linear's torch._scaled_mm: one Triton launch reads x
once and writes its fp8 values and one scale per row (in torch: an abs, a max, a division, a clamp and a cast, each
a pass over x). One program per row; the launch depends on the shape alone, so it captures into CUDA graphs."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.layers.fp8 import FP8_DTYPE, FP8_MAX, MIN_AMAX

MAX_BLOCK_K = 4096  # features per load; a row wider than this takes two passes over it (the max, then the store)


@triton.jit
def _quantize_rows_kernel(x_ptr, out_ptr, scale_ptr, stride_xm, stride_om, K, FP8_MAX: tl.constexpr,
                          MIN_AMAX: tl.constexpr, BLOCK_K: tl.constexpr, ONE_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    out_row = out_ptr + row * stride_om
    offs = tl.arange(0, BLOCK_K)
    if ONE_BLOCK:  # the row stays in registers between the max and the store
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x)), MIN_AMAX) / FP8_MAX
        tl.store(scale_ptr + row, scale)
        q = tl.clamp(x / scale, -FP8_MAX, FP8_MAX)
        tl.store(out_row + offs, q.to(out_ptr.dtype.element_ty), mask=offs < K)
    else:
        amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.max(amax), MIN_AMAX) / FP8_MAX
        tl.store(scale_ptr + row, scale)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
            q = tl.clamp(x / scale, -FP8_MAX, FP8_MAX)
            tl.store(out_row + k0 + offs, q.to(out_ptr.dtype.element_ty), mask=k0 + offs < K)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K), unit stride along K -> fp8 (M, K) and float32 scales (M, 1): each row divided by its absolute maximum
    / 448 (fp8.quantize_rows_reference)."""
    assert x.dim() == 2 and x.stride(1) == 1, f"x {tuple(x.shape)} with strides {x.stride()}"
    num_rows, k = x.shape
    out = torch.empty(num_rows, k, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(num_rows, 1, dtype=torch.float32, device=x.device)
    if num_rows == 0:
        return out, scale
    block_k = min(triton.next_power_of_2(k), MAX_BLOCK_K)
    _quantize_rows_kernel[(num_rows,)](
        x, out, scale, x.stride(0), out.stride(0), k, FP8_MAX=FP8_MAX, MIN_AMAX=MIN_AMAX, BLOCK_K=block_k,
        ONE_BLOCK=block_k >= k, num_warps=max(1, min(8, block_k // 512)),
    )  # fmt: skip
    return out, scale
