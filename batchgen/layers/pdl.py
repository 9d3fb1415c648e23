"""Programmatic dependent launch (PDL, Hopper and later) for the kernels of a decode step.

A decode step at small batch is a chain of a few hundred short kernels, each of which waits for the one before it
to finish, then pays its own start-up: launching its programs and the first round trip to memory. Launched with
PDL, a kernel's programs start while the previous kernel still runs. Everything a kernel reads before it calls
`wait_for_previous` must not be written by any kernel of the step (model weights, the KV cache of earlier
positions): the GEMVs request their weight tile there, so the weight read overlaps the previous kernel. Everything
else, and every store, comes after the wait, which returns once the previous kernel has finished and its writes are
visible. A kernel lets the next one start (`wait_for_previous` does, right after the wait), so at most one kernel
runs ahead: its programs hold their weight tiles while they wait.

Only Triton kernels take part; any other kernel is launched as usual, and the next PDL launch waits for it whole.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

ENABLED = True  # read at each launch (set it before the engine captures its graphs), so benchmarks can time both


@functools.cache
def _hopper_or_later(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: a CUDA device of compute capability 9.0 or later (older ones
    have no griddepcontrol instruction), never Triton's CPU interpreter."""
    if not ENABLED or device.type != "cuda":
        return False
    return _hopper_or_later(device)


def launch_options(device: torch.device) -> dict[str, bool]:
    """The kernel arguments of a PDL-aware launch: its PDL constexpr and Triton's launch_pdl option, both on or both
    off (a kernel launched with PDL must wait before it reads what the previous kernel wrote)."""
    enabled = pdl_enabled(device)
    return {"PDL": enabled, "launch_pdl": enabled}


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """Waits until the previous kernel of the stream has finished and its writes are visible, then lets the next
    kernel start; without PDL, nothing."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
