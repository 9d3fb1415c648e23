"""torch.compile for the small elementwise layers, opt-in only (engine.torch_compile): each becomes one fused kernel.

The default on CUDA is their Triton kernels (batchgen.layers.triton_layers), which fuse the same ops without
importing inductor or compiling, seconds of every fresh process. Compiling stays for comparing against those
kernels and for the torch attention backend on CUDA, whose q/k norm and RoPE have no kernel of their own.
Only the pure functions are compiled (once each, with dynamic shapes, shared by every layer instance).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn


@functools.cache
def compiled(fn: Callable) -> Callable:
    return torch.compile(fn, dynamic=True)


def compile_small_layers(model: nn.Module) -> None:
    """Switches every layer that offers `use_compiled()` to its compiled function."""
    for layer in model.modules():
        if hasattr(layer, "use_compiled"):
            layer.use_compiled()
