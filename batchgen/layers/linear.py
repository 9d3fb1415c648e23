"""nn.Linear with an opt-in Triton path for decode-sized inputs.

`Linear` keeps nn.Linear's parameters (`weight`, `bias`), so weight loading and tied embeddings work unchanged. It
runs F.linear until `use_triton()` switches it (the engine does so when CUDA graphs replay decode steps, through
`compiled.use_triton_layers`); from then on CUDA inputs of the few rows where `linear_triton.beats_cublas` go through
`linear_triton.small_m_linear`, which reads the weight at closer to full memory bandwidth than cuBLAS does there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Linear):
    """nn.Linear whose forward, once `use_triton()` is called, sends 2-D CUDA inputs of a few rows to the Triton
    GEMV; everything else (prefill, CPU, the default) stays F.linear."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(in_features, out_features, bias, device, dtype)
        self._small_m_linear: Callable[..., torch.Tensor] | None = None
        self._beats_cublas: Callable[[int, int], bool] | None = None

    def use_triton(self) -> None:
        from batchgen.layers.linear_triton import beats_cublas, small_m_linear  # Triton only once asked for

        self._small_m_linear, self._beats_cublas = small_m_linear, beats_cublas

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        if (self._small_m_linear is not None and x.is_cuda and x.dim() == 2 and x.shape[0] > 0
                and self._beats_cublas(x.shape[0], self.out_features)):
            return self._small_m_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)
