"""Switches layers to their Triton kernels on CUDA; the CPU path and the reference tests keep the plain functions.

Layers that offer `use_triton()`: RMSNorm (with its residual add; Gemma's too) and SiluAndMul, the fused q/k-norm +
RoPE + K/V store of Llama and Gemma attention, the small-M GEMV of `Linear`, and `Embedding`'s lookup. Gemma's GeGLU
offers none: it stays in torch.
"""

from __future__ import annotations

from torch import nn

from batchgen.layers.activation import SiluAndMul
from batchgen.layers.embedding import Embedding
from batchgen.layers.linear import Linear
from batchgen.layers.norms import RMSNorm


def use_triton_layers(model: nn.Module, gemv: bool, elementwise: bool = True) -> None:
    """Switches every layer that offers `use_triton()` to its Triton kernel; `Linear`s and `Embedding`s only if
    `gemv`, RMSNorm and SiluAndMul only if `elementwise` (not when they are compiled).

    The GEMV and the PDL lookup pay off only replayed in CUDA graphs: launched from Python, a Triton kernel costs
    more host time than it saves over cuBLAS or torch.
    """
    for layer in model.modules():
        skipped = ((isinstance(layer, (Linear, Embedding)) and not gemv)
                   or (isinstance(layer, (RMSNorm, SiluAndMul)) and not elementwise))
        if hasattr(layer, "use_triton") and not skipped:
            layer.use_triton()
