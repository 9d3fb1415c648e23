"""A request's prompt log-probabilities as arrays (no torch), filled a step's slice at a time.

A scoring step computes thousands of prompt positions; one Python object per position costs the host more than the
step's forward, so each step's values are copied into these arrays whole, and completions.parquet's column is built
from them (io/logprob_arrays.py). Entries as dicts exist only where a Python API user reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class PromptLogprobs:
    """Per prompt position from `first` on: the prompt token's logprob given the tokens before it, its rank and the
    request's k most likely tokens there. Positions before `first` have none: the first prompt token, or the context
    of a scored continuation (engine/continuation.py)."""

    prompt: np.ndarray  # (T,) int64: the request's prompt token ids
    first: int
    k: int  # the alternatives kept per position
    num_recorded: int = 0
    # Allocated at the first record (a waiting request holds none), for every position from `first` on.
    _logprobs: np.ndarray | None = field(default=None, repr=False)  # (T - first,) float32
    _ranks: np.ndarray | None = field(default=None, repr=False)  # (T - first,) int32: 1 = the most likely token
    _top_ids: np.ndarray | None = field(default=None, repr=False)  # (T - first, k) int32, most likely first
    _top_logprobs: np.ndarray | None = field(default=None, repr=False)  # (T - first, k) float32

    @property
    def next_position(self) -> int:
        """The first position without a value: one past the last recorded."""
        return self.first + self.num_recorded

    def record(self, start: int, logprobs: np.ndarray, ranks: np.ndarray, top_ids: np.ndarray,
               top_logprobs: np.ndarray) -> None:
        """Values of the consecutive positions from `start` on (top_ids and top_logprobs (n, >= k)). Positions already
        recorded are skipped: a request recomputed after preemption scores its prompt again."""
        skip = self.next_position - start
        if skip < 0:
            raise RuntimeError(f"prompt logprobs: position {start} was scored before position {self.next_position}")
        count = len(logprobs) - skip
        if count <= 0:
            return
        if self._logprobs is None:
            size = len(self.prompt) - self.first
            self._logprobs = np.empty(size, dtype=np.float32)
            self._ranks = np.empty(size, dtype=np.int32)
            self._top_ids = np.empty((size, self.k), dtype=np.int32)
            self._top_logprobs = np.empty((size, self.k), dtype=np.float32)
        into = slice(self.num_recorded, self.num_recorded + count)
        self._logprobs[into] = logprobs[skip:]
        self._ranks[into] = ranks[skip:]
        self._top_ids[into] = top_ids[skip:, :self.k]
        self._top_logprobs[into] = top_logprobs[skip:, :self.k]
        self.num_recorded += count

    @property
    def token_ids(self) -> np.ndarray:
        """(P,) the scored tokens, P = num_recorded."""
        return self.prompt[self.first:self.next_position]

    @property
    def logprobs(self) -> np.ndarray:
        """(P,) float32."""
        return self._recorded(self._logprobs, np.float32)

    @property
    def ranks(self) -> np.ndarray:
        """(P,) int32."""
        return self._recorded(self._ranks, np.int32)

    @property
    def top_ids(self) -> np.ndarray:
        """(P, k) int32."""
        return self._recorded(self._top_ids, np.int32, (self.k,))

    @property
    def top_logprobs(self) -> np.ndarray:
        """(P, k) float32."""
        return self._recorded(self._top_logprobs, np.float32, (self.k,))

    def _recorded(self, values: np.ndarray | None, dtype: type, per_position: tuple[int, ...] = ()) -> np.ndarray:
        if values is None:
            return np.empty((0, *per_position), dtype=dtype)
        return values[:self.num_recorded]
