"""How many torch intra-op threads the engine's process runs."""

from __future__ import annotations

import os

import torch


def intra_op_threads(requested: int | None, device: torch.device, tensor_parallel_size: int = 1) -> int | None:
    """requested: engine.cpu_threads. None keeps torch's default.

    With a GPU the host only stages small tensors, and torch's default pool (a thread per core, spinning after each
    parallel op) competes with the other processes on the machine, such as the other data-parallel ranks. On CPU the
    processes of one machine share its cores: the data-parallel ranks (LOCAL_WORLD_SIZE, set by torchrun and by
    engine.data_parallel_size), each with its tensor-parallel ranks."""
    if requested is not None:
        return requested
    if device.type == "cuda":
        return 1
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) * tensor_parallel_size
    return max(1, torch.get_num_threads() // processes) if processes > 1 else None
