"""The elementwise layers before a linear layer, folded into its Triton GEMV where that runs (decode steps replayed
in CUDA graphs); everywhere else the same layers run unfused, as before.

Each fusion has a switch, read at call time (set it before the engine captures its graphs), so the benchmarks can
time the model with and without it.
"""

from __future__ import annotations

import torch

from batchgen.layers.activation import SiluAndMul
from batchgen.layers.linear import Linear
from batchgen.layers.norms import RMSNorm

FUSE_SILU_AND_MUL = False  # measured slower on an H200 (bench_fused: 5.4 vs 4.75 us); kept for other GPUs
FUSE_ADD_RMS_NORM = True  # qkv and gate/up projections compute the residual add and RMSNorm before them


def norm_then_linear(norm: RMSNorm, linear: Linear, hidden: torch.Tensor,
                     residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(norm(hidden + residual)), hidden + residual); without a residual (the first layer):
    (linear(norm(hidden)), hidden)."""
    if FUSE_ADD_RMS_NORM and linear.runs_triton(hidden):
        return linear.add_rms_norm_forward(hidden, residual, norm.weight, norm.eps)
    if residual is None:
        return linear(norm(hidden)), hidden
    normed, residual = norm(hidden, residual)
    return linear(normed), residual


def silu_and_mul_then_linear(act: SiluAndMul, linear: Linear, gate_up: torch.Tensor) -> torch.Tensor:
    """linear(act(gate_up)) for act = silu(gate) * up."""
    if FUSE_SILU_AND_MUL and linear.runs_triton(gate_up):
        return linear.silu_and_mul_forward(gate_up)
    return linear(act(gate_up))
