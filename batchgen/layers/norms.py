"""RMSNorm as Llama-family models compute it, optionally fused with the residual add before it; and Gemma's, which
scales by (1 + weight) and rounds differently.

(GPT-2 uses torch's LayerNorm directly.)
"""

from __future__ import annotations

from types import ModuleType
from typing import ClassVar

import torch
from torch import nn

from batchgen.layers.compiled import compiled


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # (..., dim) -> (..., dim)
    # Normalize in float32, cast back before the weight multiply: the order transformers uses.
    x_float = x.float()
    normed = x_float * torch.rsqrt(x_float.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the residual stream's add fused into the next norm."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # (..., dim) -> (..., dim)
    """RMSNorm as Gemma computes it: scaled by (1 + weight), all in float32, rounded to x's dtype once at the end."""
    x_float = x.float()
    normed = x_float * torch.rsqrt(x_float.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).to(x.dtype)


def add_gemma_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(gemma_rms_norm(x + residual), x + residual)."""
    summed = x + residual
    return gemma_rms_norm(summed, weight, eps), summed


class RMSNorm(nn.Module):
    # Whether the norm computes as gemma_rms_norm, not rms_norm: the Triton kernels that fuse it take this flag.
    gemma_style: ClassVar[bool] = False

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self._norm, self._add_norm = rms_norm, add_rms_norm
        self._kernels: ModuleType | None = None  # batchgen.layers.elementwise_triton, once use_triton() is called
        self._kernel_device_type = "cuda"

    def use_compiled(self) -> None:
        self._norm, self._add_norm = compiled(rms_norm), compiled(add_rms_norm)

    def use_triton(self, device_type: str = "cuda") -> None:
        """Inputs on device_type take one Triton kernel ("cpu" only for tests under TRITON_INTERPRET=1)."""
        from batchgen.layers import elementwise_triton  # Triton only once asked for

        self._kernels, self._kernel_device_type = elementwise_triton, device_type

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """rms_norm(x), or with a residual: (rms_norm(x + residual), x + residual)."""
        if self._kernels is not None and x.device.type == self._kernel_device_type:
            normed, summed = self._kernels.add_rms_norm(x, residual, self.weight, self.eps,
                                                        gemma_style=self.gemma_style)
            return normed if residual is None else (normed, summed)
        if residual is None:
            return self._norm(x, self.weight, self.eps)
        return self._add_norm(x, residual, self.weight, self.eps)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm (`gemma_rms_norm`): the checkpoint's weight is zero-centred, zero being the identity scale.
    Llama's order (round, then multiply by the weight) would give other bf16 values than transformers'."""

    gemma_style = True

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)
        self._norm, self._add_norm = gemma_rms_norm, add_gemma_rms_norm

    def use_compiled(self) -> None:
        self._norm, self._add_norm = compiled(gemma_rms_norm), compiled(add_gemma_rms_norm)
