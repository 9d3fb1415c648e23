"""Host staging for device buffers that one copy fills (a CUDA graph's static inputs, a step's packed arrays)."""

from __future__ import annotations

import torch

# Each array starts on a 64-byte boundary of a packed buffer: Triton specializes kernels on 16-byte-aligned
# pointers, so a misaligned view would compile a second variant of every kernel it feeds.
ALIGN_BYTES = 64
PAGEABLE_STAGING_BYTES = 64 << 10  # the largest staging buffer of a static device buffer kept pageable


def aligned_length(count: int, itemsize: int) -> int:
    """`count` elements of `itemsize` bytes, rounded up to a whole number of 64-byte lines."""
    per_line = ALIGN_BYTES // itemsize
    return -(-count // per_line) * per_line


def staging_buffer(nbytes: int, cuda: bool) -> torch.Tensor:
    """A host byte buffer whose one copy fills a static device buffer (a CUDA graph's inputs).

    Up to PAGEABLE_STAGING_BYTES it is pageable: the driver copies it into its own staging memory before the copy
    call returns, and the device has it sooner than by a DMA from pinned memory. A larger one, which the driver
    might stage in chunks while the host waits, is fresh from torch's pinned-memory cache, which reuses a buffer
    only after its copy has run. Either way the host may stage the next step while this one is still queued."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda and nbytes > PAGEABLE_STAGING_BYTES)
