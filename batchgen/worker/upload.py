"""One host-to-device copy for several small host arrays, of any integer or float dtypes."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

import numpy as np
import torch

from batchgen.layers.staging import ALIGN_BYTES, aligned_length


def upload_packed(arrays: Sequence[np.ndarray], device: torch.device, pinned: bool) -> list[torch.Tensor]:
    """The arrays on the device, each with its host shape and dtype: views into one byte buffer that one
    (non-blocking, from pinned memory when `pinned`) copy fills. A step's eager inputs are a handful of arrays of a
    few KB each, where every separate copy costs the host a pinned staging buffer and a launch of its own."""
    spans, total = [], 0  # each array's elements in the buffer seen as its dtype
    for array in arrays:
        start = total // array.itemsize
        spans.append(slice(start, start + array.size))
        total += aligned_length(array.nbytes, 1)
    host = torch.empty(max(total, ALIGN_BYTES), dtype=torch.uint8, pin_memory=pinned)
    # The whole buffer seen once per dtype (it is a multiple of 64 bytes long): each array is then one slice.
    dtypes = {array.dtype for array in arrays}
    staging = {dtype: host.numpy().view(dtype) for dtype in dtypes}
    for array, span in zip(arrays, spans, strict=True):
        staging[array.dtype][span] = array.ravel()
    device_bytes = host.to(device, non_blocking=True)
    packed = {dtype: device_bytes.view(_torch_dtype(dtype)) for dtype in dtypes}
    # One torch call per array (a slice then a reshape would be two): each costs the host about a microsecond.
    return [packed[array.dtype].as_strided(array.shape, _contiguous_strides(array.shape), span.start)
            for array, span in zip(arrays, spans, strict=True)]


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A C-contiguous array's strides, in elements."""
    strides, stride = [], 1
    for size in reversed(shape):
        strides.append(stride)
        stride *= size
    return tuple(reversed(strides))


@cache
def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype)).dtype
