"""Activations applied to fused projections."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """silu(gate) * up on the output of a fused gate/up projection."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:  # (T, 2 * I) -> (T, I)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
