"""Pending tokens: async scheduling queues a step before the step that samples its input tokens has finished, so
those tokens are still on the device (their output slots hold PENDING_TOKEN until the host has them). The model's
embedding reads them where the sampler wrote them (`InputIdsWithPending`), so no step waits for the one before."""

from __future__ import annotations

import operator

import numpy as np
import torch

from batchgen.core.request import PENDING_TOKEN, Request
from batchgen.layers.embedding import InputIdsWithPending


class PendingTokens:
    """The device tensor every sampling route writes a step's ids into, which request each of its rows belongs to,
    and how a later step's inputs point at them (`StepInputs.pending_rows`)."""

    def __init__(self, max_rows: int, device: torch.device):
        self.ids = torch.zeros(max_rows, dtype=torch.int64, device=device)  # the latest step's, by sampling row
        self._sampled: list[Request] = []  # the latest step's sampling requests, by their row in ids
        self._rows: dict[int, int] | None = {}  # id(request) -> its row in ids; None until a lookup needs it

    def sampled(self, requests: list[Request], sample_rows: list[int]) -> None:
        """The step just launched samples requests[sample_rows[i]]'s next token into ids[i]."""
        # sample_rows ascend, so when every request samples (a decode step), row i is request i.
        self._sampled = requests if len(sample_rows) == len(requests) else [requests[row] for row in sample_rows]
        self._rows = None

    def row(self, request: Request) -> int:
        return self._row_of()[id(request)]

    def rows(self, requests: list[Request], token_ids: list[int]) -> np.ndarray:
        """(T,) int64 for one token per request: its row in ids where it is pending, else -1."""
        sampled = self._sampled
        if (len(requests) == len(sampled) and all(map(operator.is_, requests, sampled))
                and token_ids.count(PENDING_TOKEN) == len(token_ids)):
            return np.arange(len(requests), dtype=np.int64)  # the previous decode step's rows, all still pending
        rows = self._row_of()
        return np.array([rows[id(request)] if token_id == PENDING_TOKEN else -1
                         for request, token_id in zip(requests, token_ids, strict=True)], dtype=np.int64)

    def _row_of(self) -> dict[int, int]:
        if self._rows is None:
            self._rows = {id(request): i for i, request in enumerate(self._sampled)}
        return self._rows

    def input_ids(self, ids: torch.Tensor, pending_rows: torch.Tensor) -> InputIdsWithPending:
        """A step's ids on the device as the model takes them."""
        return InputIdsWithPending(ids, pending_rows, self.ids)
