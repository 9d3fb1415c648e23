"""Switches layers to their fused CUDA paths; the CPU path and the reference tests keep the plain functions.

- torch.compile for the small elementwise layers: each becomes one fused kernel instead of several. Only the pure
  functions are compiled (once each, with dynamic shapes, shared by every layer instance).
- Triton kernels for the layers that offer `use_triton()`: the fused q/k-norm + RoPE + K/V store, and the
  small-M GEMV of `Linear`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from batchgen.layers.linear import Linear


@functools.cache
def compiled(fn: Callable) -> Callable:
    return torch.compile(fn, dynamic=True)


def compile_small_layers(model: nn.Module) -> None:
    """Switches every layer that offers `use_compiled()` to its compiled function."""
    for layer in model.modules():
        if hasattr(layer, "use_compiled"):
            layer.use_compiled()


def use_triton_layers(model: nn.Module, gemv: bool) -> None:
    """Switches every layer that offers `use_triton()` to its Triton kernel; `Linear`s only if `gemv`.

    The GEMV pays off only replayed in CUDA graphs: launched from Python, a Triton kernel costs more host time than
    it saves over cuBLAS.
    """
    for layer in model.modules():
        if hasattr(layer, "use_triton") and (gemv or not isinstance(layer, Linear)):
            layer.use_triton()
