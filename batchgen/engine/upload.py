"""One host-to-device copy for several small host arrays of one dtype."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

# Each array starts on a 64-byte boundary of the packed buffer (16 elements of 4 bytes or more): Triton specializes
# kernels on 16-byte-aligned pointers, so a misaligned view would compile a second variant of every kernel it feeds.
_ALIGN_ELEMENTS = 16


def upload_packed(arrays: Sequence[np.ndarray], device: torch.device, pinned: bool) -> list[torch.Tensor]:
    """The arrays on the device, each shaped as on the host: views into one buffer that one (non-blocking, from
    pinned memory when `pinned`) copy fills. A step's eager inputs are a handful of arrays of a few KB each, where
    every separate copy costs the host a pinned staging buffer and a launch of its own."""
    dtype = arrays[0].dtype
    assert all(a.dtype == dtype for a in arrays), f"one dtype per upload, got {[str(a.dtype) for a in arrays]}"
    offsets, total = [], 0
    for array in arrays:
        offsets.append(total)
        total += -(-array.size // _ALIGN_ELEMENTS) * _ALIGN_ELEMENTS
    host = torch.empty(max(total, 1), dtype=torch.from_numpy(arrays[0]).dtype, pin_memory=pinned)
    staging = host.numpy()
    for array, offset in zip(arrays, offsets, strict=True):
        staging[offset:offset + array.size] = array.ravel()
    packed = host.to(device, non_blocking=True)
    return [packed[offset:offset + array.size].view(array.shape) for array, offset in zip(arrays, offsets, strict=True)]
