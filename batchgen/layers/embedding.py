"""nn.Embedding with an opt-in Triton lookup (`embedding_triton`) that launches with PDL, for CUDA-graph decode
steps. It keeps nn.Embedding's `weight`, so weight loading and tied lm_heads work unchanged.

Only models whose next kernel takes part in PDL (Llama's first GEMV) use it: after GPT-2's lookups come torch ops,
and a kernel of our own would only add a compile to a fresh process.

A step's ids may come as InputIdsWithPending: a step is queued before the step that samples its input token has
finished, so that token is still on the device. The Triton lookup reads it there itself; in torch, filling it in
takes four small kernels (a clamp, a gather, a compare, a select).
"""

from __future__ import annotations

from types import ModuleType
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn


class InputIdsWithPending(NamedTuple):
    """A step's input ids (T,) of which some are pending tokens (worker/pending_tokens.py): token t is
    pending_ids[pending_rows[t]] where pending_rows[t] >= 0, else ids[t]."""

    ids: torch.Tensor
    pending_rows: torch.Tensor
    pending_ids: torch.Tensor

    def filled(self) -> torch.Tensor:
        return torch.where(self.pending_rows >= 0, self.pending_ids[self.pending_rows.clamp(min=0)], self.ids)


def token_ids(ids: torch.Tensor | InputIdsWithPending) -> torch.Tensor:
    """The ids as a tensor, pending tokens filled in."""
    return ids.filled() if isinstance(ids, InputIdsWithPending) else ids


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

    def forward(self, ids: torch.Tensor | InputIdsWithPending) -> torch.Tensor:  # (...) -> (..., embedding_dim)
        pending = ids if isinstance(ids, InputIdsWithPending) else None
        plain = ids.ids if pending else ids
        if self._kernels is not None and plain.device.type == self._kernel_device_type and plain.dim() == 1:
            if pending:
                return self._kernels.embedding(plain, self.weight, pending.pending_rows, pending.pending_ids)
            return self._kernels.embedding(plain, self.weight)
        return F.embedding(token_ids(ids), self.weight)
