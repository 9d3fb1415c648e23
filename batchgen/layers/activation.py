"""Activations applied to fused projections."""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from batchgen.layers.compiled import compiled


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # (T, 2 * I) -> (T, I)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """silu(gate) * up on the output of a fused gate/up projection."""

    def __init__(self) -> None:
        super().__init__()
        self._fn = silu_and_mul
        self._kernels: ModuleType | None = None  # batchgen.layers.elementwise_triton, once use_triton() is called
        self._kernel_device_type = "cuda"

    def use_compiled(self) -> None:
        self._fn = compiled(silu_and_mul)

    def use_triton(self, device_type: str = "cuda") -> None:
        """Inputs on device_type take one Triton kernel ("cpu" only for tests under TRITON_INTERPRET=1)."""
        from batchgen.layers import elementwise_triton  # Triton only once asked for

        self._kernels, self._kernel_device_type = elementwise_triton, device_type

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self._kernels is not None and gate_up.device.type == self._kernel_device_type:
            return self._kernels.silu_and_mul(gate_up)
        return self._fn(gate_up)


def gelu_and_mul(gate_up: torch.Tensor, approximate: str) -> torch.Tensor:  # (T, 2 * I) -> (T, I)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate=approximate) * up


# transformers' activation names (config.hidden_activation, hidden_act) -> F.gelu's `approximate`
GELU_APPROXIMATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


class GeluAndMul(nn.Module):
    """gelu(gate) * up (GeGLU, Gemma's MLP) on the output of a fused gate/up projection, in torch (or compiled): the
    Triton GEMV fuses SiLU only."""

    def __init__(self, approximate: str) -> None:
        """approximate: F.gelu's, "tanh" (gelu_pytorch_tanh) or "none" (exact)."""
        super().__init__()
        self.approximate = approximate
        self._fn = gelu_and_mul

    def use_compiled(self) -> None:
        self._fn = compiled(gelu_and_mul)

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._fn(gate_up, self.approximate)
