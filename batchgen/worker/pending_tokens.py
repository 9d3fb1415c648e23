"""Pending tokens: with async scheduling a step is queued before the step that samples its input tokens has finished,
so those tokens are still on the device when it is built.

The scheduler marks each such output slot PENDING_TOKEN until the sampled ids reach the host. `PendingTokens` owns
the rest: the device tensor every sampling route writes a step's ids into, which request each of its rows belongs
to, and the step inputs' `pending_rows` that point a pending token at its row. The model's embedding reads the
tokens from there (`InputIdsWithPending`), so no step waits for the one before it.
"""

from __future__ import annotations

import numpy as np
import torch

from batchgen.core.request import PENDING_TOKEN, Request
from batchgen.layers.embedding import InputIdsWithPending


class PendingTokens:
    def __init__(self, max_rows: int, device: torch.device):
        # (max_rows,) int64: the latest launched step's sampled ids, row i holding its i-th sample's
        self.ids = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self._rows: dict[int, int] = {}  # id(request) -> its row in ids

    def sampled(self, requests: list[Request], sample_rows: list[int]) -> None:
        """The step just launched samples requests[sample_rows[i]]'s next token into ids[i]."""
        self._rows = {id(requests[row]): i for i, row in enumerate(sample_rows)}

    def row(self, request: Request) -> int:
        """The row of ids that holds the request's pending token."""
        return self._rows[id(request)]

    def rows(self, requests: list[Request], token_ids: list[int]) -> np.ndarray:
        """(T,) int64 for one token per request: the row of ids where the token is pending, else -1."""
        rows = self._rows
        return np.array([rows[id(request)] if token_id == PENDING_TOKEN else -1
                         for request, token_id in zip(requests, token_ids, strict=True)], dtype=np.int64)

    def input_ids(self, ids: torch.Tensor, pending_rows: torch.Tensor) -> InputIdsWithPending:
        """A step's ids on the device as the model takes them: pending_rows (T,) as StepInputs.pending_rows."""
        return InputIdsWithPending(ids, pending_rows, self.ids)
