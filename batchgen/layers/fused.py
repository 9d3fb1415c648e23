"""The elementwise layers around a linear layer, folded into its Triton GEMV where that runs (decode steps replayed
in CUDA graphs, and every decode-sized input of an fp8 linear, layers/fp8.py): the residual add and RMSNorm (Llama's
or Gemma's) before the qkv and gate/up projections, SiLU-and-mul after gate/up. Everywhere else the same layers run
unfused, as before.

Each fusion has a switch, read at call time (set it before the engine captures its graphs), so the benchmarks can
time the model with and without it.
"""

from __future__ import annotations

import torch

from batchgen.layers.activation import SiluAndMul
from batchgen.layers.fp8 import Fp8Linear
from batchgen.layers.linear import Linear
from batchgen.layers.norms import RMSNorm

FUSE_ADD_RMS_NORM = True  # qkv and gate/up projections compute the residual add and RMSNorm before them
FUSE_SILU_AND_MUL = True  # with FUSE_ADD_RMS_NORM: the gate/up projection returns silu(gate) * up


def norm_then_linear(norm: RMSNorm, linear: Linear | Fp8Linear, hidden: torch.Tensor,
                     residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(norm(hidden + residual)), hidden + residual); without a residual (the first layer):
    (linear(norm(hidden)), hidden)."""
    if FUSE_ADD_RMS_NORM and linear.runs_triton(hidden, fused_norm=True):
        return linear.add_rms_norm_forward(hidden, residual, norm.weight, norm.eps, gemma_style=norm.gemma_style)
    if residual is None:
        return linear(norm(hidden)), hidden
    normed, residual = norm(hidden, residual)
    return linear(normed), residual


def norm_then_gate_up(norm: RMSNorm, gate_up: Linear | Fp8Linear, act: SiluAndMul, hidden: torch.Tensor,
                      residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(act(gate_up(norm(hidden + residual))), hidden + residual) for act = silu(gate) * up: the whole of it one
    GEMV launch where that runs."""
    if FUSE_SILU_AND_MUL and FUSE_ADD_RMS_NORM and gate_up.runs_triton(hidden, fused_norm=True):
        return gate_up.add_rms_norm_forward(hidden, residual, norm.weight, norm.eps, silu_and_mul=True,
                                            gemma_style=norm.gemma_style)
    projected, residual = norm_then_linear(norm, gate_up, hidden, residual)
    return act(projected), residual
