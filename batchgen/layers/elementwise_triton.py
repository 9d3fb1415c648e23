"""RMSNorm (with the residual add before it; Llama's or Gemma's) and SiluAndMul as one Triton kernel each, for CUDA
inputs.

In torch they are six and three kernels; torch.compile fuses them too, but costs seconds of a fresh process
(importing inductor, compiling). Each kernel here rounds where the torch ops round, so both paths give the same
values. The row count is the grid, never an argument: one compile serves every batch size and captured graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.layers.pdl import launch_options, wait_for_previous
from batchgen.layers.triton_launch import DirectKernel


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, res_ptr, weight_ptr, out_ptr, res_out_ptr, eps,
    stride_x, stride_res, stride_out, stride_res_out,
    DIM: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GEMMA_STYLE: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """One program per row: out = weight * rms_norm(x + residual), res_out = x + residual (the sum in x's dtype).
    GEMMA_STYLE: out = rms_norm(x + residual) * (1 + weight) in fp32, rounded once (norms.gemma_rms_norm)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < DIM
    dtype = x_ptr.dtype.element_ty
    wait_for_previous(PDL)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(res_out_ptr + row * stride_res_out + offs, x, mask=mask)
    h = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(h * h, axis=0) / DIM + eps)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if GEMMA_STYLE:
        out = h * inv_rms * (1.0 + w)
    else:
        out = w * (h * inv_rms).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr, out_ptr, stride_in, stride_out,
    DIM: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Programs over (row, BLOCK columns): out = silu(gate) * up, gate and up the two halves of a row."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < DIM
    dtype = out_ptr.dtype.element_ty
    wait_for_previous(PDL)
    gate = tl.load(gate_up_ptr + row * stride_in + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + DIM + offs, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (silu * up).to(dtype), mask=mask)


_add_rms_norm = DirectKernel(_add_rms_norm_kernel)
_silu_and_mul = DirectKernel(_silu_and_mul_kernel)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as (rows, features) with unit stride along the features (a copy only where it is not already)."""
    if x.dim() != 2:
        x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def _num_warps(block: int) -> int:
    return max(1, min(8, block // 256))


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, gemma_style: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rms_norm(x + residual), x + residual), as norms.add_rms_norm; without a residual,
    (weight * rms_norm(x), x). gemma_style: as norms.add_gemma_rms_norm and gemma_rms_norm, in x's dtype."""
    shape, dim = x.shape, x.shape[-1]
    rows = _rows(x)
    out_dtype = x.dtype if gemma_style else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(rows.shape, dtype=out_dtype, device=x.device)
    summed = rows if residual is None else torch.empty_like(rows)
    res = rows if residual is None else _rows(residual)
    if rows.shape[0] > 0:
        block = triton.next_power_of_2(dim)
        _add_rms_norm[(rows.shape[0],)](
            rows, res, weight, out, summed, eps,
            rows.stride(0), res.stride(0), out.stride(0), summed.stride(0),
            DIM=dim, BLOCK=block, HAS_RESIDUAL=residual is not None, GEMMA_STYLE=gemma_style,
            num_warps=_num_warps(block),
            **launch_options(x.device),
        )  # fmt: skip
    if x.dim() == 2:  # a view costs a few microseconds of every launch
        return out, (x if residual is None else summed)
    return out.view(shape), (x if residual is None else summed.view(shape))


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # (..., 2 * I) -> (..., I)
    dim = gate_up.shape[-1] // 2
    rows = _rows(gate_up)
    out = torch.empty(rows.shape[0], dim, dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0] > 0:
        block = min(triton.next_power_of_2(dim), 1024)
        _silu_and_mul[(rows.shape[0], triton.cdiv(dim, block))](
            rows, out, rows.stride(0), out.stride(0), DIM=dim, BLOCK=block, num_warps=_num_warps(block),
            **launch_options(gate_up.device),
        )  # fmt: skip
    return out if gate_up.dim() == 2 else out.view(*gate_up.shape[:-1], dim)
