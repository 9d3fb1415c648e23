"""nn.Embedding with an opt-in Triton lookup (`embedding_triton`) that launches with PDL, for CUDA-graph decode
steps. It keeps nn.Embedding's `weight`, so weight loading and tied lm_heads work unchanged.

Only models whose next kernel takes part in PDL (Llama's first GEMV) use it: after GPT-2's lookups come torch ops,
and a kernel of our own would only add a compile to a fresh process.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn


class Embedding(nn.Embedding):
    """nn.Embedding whose forward, once `use_triton()` is called, looks 1-D ids on its device up with the kernel."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self._kernels: ModuleType | None = None  # batchgen.layers.embedding_triton, once use_triton() is called
        self._kernel_device_type = "cuda"

    def use_triton(self, device_type: str = "cuda") -> None:
        """device_type: where ids take the kernel ("cpu" only for tests under TRITON_INTERPRET=1)."""
        from batchgen.layers import embedding_triton  # Triton only once asked for

        self._kernels, self._kernel_device_type = embedding_triton, device_type

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (...) -> (..., embedding_dim)
        if self._kernels is not None and ids.device.type == self._kernel_device_type and ids.dim() == 1:
            return self._kernels.embedding(ids, self.weight)
        return F.embedding(ids, self.weight)
