"""A kernel that runs the draw's Gumbel term and its lower bound on given bits (tests only)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.sample.draw_triton import _gumbel_lower_bound, _gumbel_of

_BLOCK = 1 << 16


@triton.jit
def _bound_kernel(bits_ptr, lower_ptr, gumbel_ptr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    bits = tl.load(bits_ptr + offsets)
    tl.store(lower_ptr + offsets, _gumbel_lower_bound(bits))
    tl.store(gumbel_ptr + offsets, _gumbel_of(bits))


def bounds_and_gumbels(bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bits: int32 in [0, 2**23), a multiple of _BLOCK of them -> (the lower bounds, the Gumbel terms), float32."""
    lower = torch.empty(bits.shape, dtype=torch.float32, device=bits.device)
    gumbel = torch.empty_like(lower)
    # As the draw launches its kernel: without fused multiply-adds, which would round the bound otherwise.
    _bound_kernel[(bits.numel() // _BLOCK,)](bits, lower, gumbel, BLOCK=_BLOCK, enable_fp_fusion=False)
    return lower, gumbel
