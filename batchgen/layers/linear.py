"""nn.Linear with an opt-in Triton path for decode-sized inputs.

`Linear` keeps nn.Linear's parameters (`weight`, `bias`), so weight loading and tied embeddings work unchanged. It
runs F.linear until `use_triton()` switches it (the engine does so when CUDA graphs replay decode steps, through
`triton_layers.use_triton_layers`); from then on CUDA inputs of the few rows where `linear_triton.beats_cublas` go
through `linear_triton.small_m_linear`, which reads the weight at closer to full memory bandwidth than cuBLAS does
there.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Linear):
    """nn.Linear whose forward, once `use_triton()` is called, sends 2-D CUDA inputs of a few rows to the Triton
    GEMV; everything else (prefill, CPU, the default) stays F.linear."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(in_features, out_features, bias, device, dtype)
        self._kernels: ModuleType | None = None  # batchgen.layers.linear_triton, once use_triton() is called
        self._kernel_device_type = "cuda"

    def use_triton(self, device_type: str = "cuda") -> None:
        """device_type: where inputs take the kernel ("cpu" only for tests under TRITON_INTERPRET=1)."""
        from batchgen.layers import linear_triton  # Triton only once asked for

        self._kernels, self._kernel_device_type = linear_triton, device_type

    def runs_triton(self, x: torch.Tensor, fused_norm: bool = False) -> bool:
        """Whether a (rows, features) input x goes through the Triton GEMV; fused_norm: with the norm before it fused
        in (add_rms_norm_forward)."""
        return (self._kernels is not None and x.device.type == self._kernel_device_type and x.dim() == 2
                and x.shape[0] > 0
                and self._kernels.beats_cublas(x.shape[0], self.out_features, self.in_features,
                                               self.weight.element_size(), self._kernels.launch_thread_cap(x.device),
                                               fused_norm))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        return self.project(x, self.bias)

    def project(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ weight.T + bias, with the bias given (a row-parallel rank other than 0 adds none)."""
        if self.runs_triton(x):
            return self._kernels.small_m_linear(x, self.weight, bias)
        return F.linear(x, self.weight, bias)

    def add_rms_norm_forward(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                             eps: float, silu_and_mul: bool = False,
                             gemma_style: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(forward(rms_norm(x + residual) * norm_weight), x + residual) in one Triton launch (residual None: no add,
        x is the residual); only where runs_triton(x). silu_and_mul (a gate/up projection): silu(gate) * up of the
        forward instead, (T, out / 2). gemma_style: Gemma's norm (norms.gemma_rms_norm)."""
        return self._kernels.add_rms_norm_linear(x, residual, norm_weight, eps, self.weight, self.bias,
                                                 silu_and_mul=silu_and_mul, gemma_style=gemma_style)
