"""torch.compile for the small elementwise layers on CUDA: each becomes one fused kernel instead of several.

Only the pure functions are compiled (once each, with dynamic shapes, shared by every layer instance); the CPU
path and the tests keep the plain functions.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn


@functools.cache
def compiled(fn: Callable) -> Callable:
    return torch.compile(fn, dynamic=True)


def compile_small_layers(model: nn.Module) -> int:
    """Switches every layer that offers `use_compiled()` to its compiled function; returns how many."""
    layers = [m for m in model.modules() if hasattr(m, "use_compiled")]
    for layer in layers:
        layer.use_compiled()
    return len(layers)
