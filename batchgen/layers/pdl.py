"""Programmatic dependent launch (PDL, Hopper and later) for the kernels of a decode step.

A decode step at small batch is a chain of a few hundred short kernels, each of which waits for the one before it
to finish, then pays its own start-up: launching its programs and the first round trip to memory. Launched with
PDL, a kernel's programs start while the previous kernel still runs. Everything a kernel reads before it calls
`wait_for_previous` must not be written by any kernel of the step (model weights, the KV cache of earlier
positions): the GEMVs request their weight tile there, so the weight read overlaps the previous kernel. Everything
else, and every store, comes after the wait, which returns once the previous kernel has finished and its writes are
visible.

A kernel lets the next one start right after its wait, so at most one kernel runs ahead: its programs hold their
weight tiles while they wait. Inside `early_start`, kernels let the next one start before they wait instead, which
is as safe (a kernel finishes only after its own wait, so after the kernel before it): several kernels then sit
resident, their weights requested. That queues more reads at once, so a kernel that reads memory after its wait
waits longer for it; it pays only in steps whose attention reads its KV before the wait
(`attention_triton.decode_early_read_limit`).

Only Triton kernels take part; any other kernel is launched as usual, and the next PDL launch waits for it whole.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
import triton
import triton.language as tl

ENABLED = True  # read at each launch (set it before the engine captures its graphs), so benchmarks can time both
# The PDL launch argument of a kernel: off, on, or on with the next kernel started before the wait (constexpr, as
# Triton requires of the globals a kernel reads).
OFF, ON, EARLY = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
_early = False  # inside early_start


@functools.cache
def _hopper_or_later(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: a CUDA device of compute capability 9.0 or later (older ones
    have no griddepcontrol instruction), never Triton's CPU interpreter."""
    if not ENABLED or device.type != "cuda":
        return False
    return _hopper_or_later(device)


@contextlib.contextmanager
def early_start(enabled: bool = True) -> Iterator[None]:
    """Kernels launched inside let the next kernel start before they wait (when enabled and PDL is on)."""
    global _early
    previous, _early = _early, enabled
    try:
        yield
    finally:
        _early = previous


def starts_early() -> bool:
    """Whether launches now are inside `early_start` (enabled)."""
    return _early


def launch_options(device: torch.device) -> dict[str, int | bool]:
    """The kernel arguments of a PDL-aware launch: its PDL constexpr (OFF, ON or EARLY) and Triton's launch_pdl
    option, both on or both off (a kernel launched with PDL must wait before it reads what the previous kernel
    wrote)."""
    if not pdl_enabled(device):
        return {"PDL": OFF.value, "launch_pdl": False}
    return {"PDL": (EARLY if _early else ON).value, "launch_pdl": True}


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """Waits until the previous kernel of the stream has finished and its writes are visible, and lets the next
    kernel start: after the wait with PDL ON, before it with EARLY; without PDL, nothing."""
    if PDL == EARLY:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    elif PDL == ON:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
