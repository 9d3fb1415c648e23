"""Activations applied to fused projections."""

from __future__ import annotations

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

    def use_compiled(self) -> None:
        self._fn = compiled(silu_and_mul)

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._fn(gate_up)
