"""Triton building for an sm_90 GPU in a process without one, and a small kernel to build.

Triton compiles (front end, LLVM, ptxas) without a GPU; only its driver asks the device what to build for. Inside
`cpu_target()` a launch on CPU tensors goes as far as Triton's compile path (running the kernel would fail), which is
what compile ahead's dry run and disk-cache lookups use.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver

from batchgen.worker.compile_pool import TargetDriver


class CpuTargetDriver(TargetDriver):
    """A compile process's driver, with the stream a launch asks for."""

    def get_current_stream(self, device: int) -> int:
        return 0


@contextlib.contextmanager
def cpu_target() -> Iterator[None]:
    """Triton builds for sm_90 inside; after it, for the driver it had (a lazily made one: none before)."""
    previous = driver._active
    driver.set_active(CpuTargetDriver(GPUTarget("cuda", 90, 32)))
    try:
        yield
    finally:
        driver.set_active(previous)


@triton.jit
def scale_kernel(x_ptr, out_ptr, n, factor, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) * factor, mask=mask)


def scale(x: torch.Tensor, factor: float, out: torch.Tensor, block: int = 64) -> None:
    """out = x * factor."""
    scale_kernel[(triton.cdiv(x.numel(), block),)](x, out, x.numel(), factor, BLOCK=block)
