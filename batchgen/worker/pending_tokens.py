"""Pending tokens: async scheduling queues a step before the step that samples its input tokens has finished, so
those tokens are still on the device (their output slots hold PENDING_TOKEN until the host has them). The model's
embedding reads them where the sampler wrote them (`InputIdsWithPending`), so no step waits for the one before."""

from __future__ import annotations

import numpy as np
import torch

from batchgen.core.request import PENDING_TOKEN, Request
from batchgen.layers.embedding import InputIdsWithPending


class PendingTokens:
    """The device tensor every sampling route writes a step's ids into, which request each of its rows belongs to,
    and how a later step's inputs point at them (`StepInputs.pending_rows`)."""

    def __init__(self, max_rows: int, device: torch.device):
        self.ids = torch.zeros(max_rows, dtype=torch.int64, device=device)  # the latest step's, by sampling row
        self._rows: dict[int, int] = {}  # id(request) -> its row in ids

    def sampled(self, requests: list[Request], sample_rows: list[int]) -> None:
        """The step just launched samples requests[sample_rows[i]]'s next token into ids[i]."""
        self._rows = {id(requests[row]): i for i, row in enumerate(sample_rows)}

    def row(self, request: Request) -> int:
        return self._rows[id(request)]

    def rows(self, requests: list[Request], token_ids: list[int]) -> np.ndarray:
        """(T,) int64 for one token per request: its row in ids where it is pending, else -1."""
        rows = self._rows
        return np.array([rows[id(request)] if token_id == PENDING_TOKEN else -1
                         for request, token_id in zip(requests, token_ids, strict=True)], dtype=np.int64)

    def input_ids(self, ids: torch.Tensor, pending_rows: torch.Tensor) -> InputIdsWithPending:
        """A step's ids on the device as the model takes them."""
        return InputIdsWithPending(ids, pending_rows, self.ids)
