"""Pooling (job.task=embed and classify): each request's final hidden states (after the model's last norm) become
one vector on the device, per request, across its prefill chunks.

- last: the last prompt token's state; cls: the first token's; mean: the average over the prompt, summed in float32
  chunk by chunk (a request's sum restarts with the chunk at position 0, so a recompute after preemption starts
  over).
- classify: the last token that is not the model's pad token (transformers' *ForSequenceClassification takes the
  rightmost non-pad token; the last token when the model has no pad id), scored by the model's head into logits.

Between chunks a request holds a row of a float32 (rows, hidden) table; in the step that computes its last prompt
token its output (embedding or logits, float32) is copied to the host, without a sync.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional

from batchgen.core.request import Request
from batchgen.core.request_rows import RequestRows
from batchgen.core.scheduler import SchedulerOutput

INITIAL_ROWS = 64


@dataclass
class _Entry:
    row: int
    position: int | None = None  # the pooled prompt position (None: mean over all), set when the row is taken


@dataclass
class PooledStep:
    """The outputs of the requests that completed their prompt in a step."""

    rows: list[int]  # step rows, parallel to values
    values: torch.Tensor  # (R, D) float32 on the host (pinned on CUDA), filled when the step's event completes

    def entries(self) -> dict[int, list[float]]:
        """{step row: its output}; read after the step's event."""
        return dict(zip(self.rows, self.values.tolist(), strict=True))


class Pooler:
    def __init__(self, method: str, hidden_size: int, device: torch.device, normalize: bool = False,
                 head: Callable[[torch.Tensor], torch.Tensor] | None = None, pad_token_id: int | None = None):
        """method: last | mean | cls; head (classify): pooled states (N, hidden) in the model's dtype -> logits,
        with pad_token_id the token the last-token pooling skips."""
        self.method = method
        self.normalize = normalize
        self.head = head
        self.pad_token_id = pad_token_id
        self.device = device
        self._pinned = device.type == "cuda"
        self.table = torch.zeros(INITIAL_ROWS, hidden_size, dtype=torch.float32, device=device)  # (rows, hidden)
        self._rows = RequestRows(_Entry, range(INITIAL_ROWS))

    def pooled_position(self, prompt_token_ids: list[int]) -> int | None:
        """The prompt position whose hidden state is pooled; None for mean pooling (every position)."""
        if self.method == "mean":
            return None
        if self.method == "cls":
            return 0
        position = len(prompt_token_ids) - 1
        if self.pad_token_id is not None:
            while position > 0 and prompt_token_ids[position] == self.pad_token_id:
                position -= 1
        return position

    def max_cached_tokens(self, prompt_token_ids: list[int]) -> int:
        """How many leading prompt tokens may come from the prefix cache: those before the pooled position."""
        position = self.pooled_position(prompt_token_ids)
        return 0 if position is None else position

    def _grow(self) -> range:
        size = len(self.table)
        self.table = torch.cat([self.table, torch.zeros_like(self.table)])
        return range(size, 2 * size)

    def _entry(self, request: Request) -> _Entry:
        entry, new = self._rows.entry(request, self._grow)
        if new:
            entry.position = self.pooled_position(request.prompt_token_ids)
        return entry

    def pool(self, step: SchedulerOutput, query_start_loc: np.ndarray, hidden: torch.Tensor) -> PooledStep | None:
        """Adds the step's hidden states (T, hidden) to its requests' rows (query_start_loc: each step row's first
        token in hidden); returns the outputs of those whose prompt this step completes, None when none does."""
        self._rows.release(step.preempted)  # they start over
        summed_rows: list[int] = []  # mean: each step row's table row, and its number of tokens
        summed_counts: list[int] = []
        restarted: list[int] = []  # mean: table rows whose sum starts with this chunk
        captured_rows: list[int] = []  # position pooling: table rows that take a token's state, and the token
        captured_tokens: list[int] = []
        done_step_rows: list[int] = []
        done_table_rows: list[int] = []
        done_lengths: list[int] = []
        for step_row, (request, count, end) in enumerate(zip(step.requests, step.num_scheduled_tokens,
                                                             step.computed_ends, strict=True)):
            entry = self._entry(request)
            begin = end - count
            if entry.position is None:
                summed_rows.append(entry.row)
                summed_counts.append(count)
                if begin == 0:
                    restarted.append(entry.row)
            elif begin <= entry.position < end:
                captured_rows.append(entry.row)
                captured_tokens.append(int(query_start_loc[step_row]) + entry.position - begin)
            if end == request.num_prompt_tokens:
                done_step_rows.append(step_row)
                done_table_rows.append(entry.row)
                done_lengths.append(end)
        if restarted:
            self.table.index_fill_(0, self._index(restarted), 0.0)
        if summed_rows:
            token_rows = np.repeat(np.array(summed_rows, dtype=np.int64), summed_counts)
            self.table.index_add_(0, self._index(token_rows), hidden.float())
        if captured_rows:
            states = hidden.index_select(0, self._index(captured_tokens)).float()
            self.table.index_copy_(0, self._index(captured_rows), states)
        if not done_step_rows:
            return None
        return PooledStep(done_step_rows, self._outputs(done_table_rows, done_lengths, hidden.dtype))

    def _outputs(self, table_rows: list[int], lengths: list[int], dtype: torch.dtype) -> torch.Tensor:
        """The finished requests' outputs (R, D) float32, copied to the host without a sync."""
        pooled = self.table.index_select(0, self._index(table_rows))  # (R, hidden)
        if self.method == "mean":
            pooled = pooled / torch.tensor(lengths, dtype=torch.float32).to(self.device).unsqueeze(1)
        if self.head is not None:
            pooled = self.head(pooled.to(dtype)).float()  # (R, num_labels)
        elif self.normalize:
            pooled = functional.normalize(pooled, dim=-1)
        host = torch.empty(pooled.shape, dtype=torch.float32, pin_memory=self._pinned)
        return host.copy_(pooled, non_blocking=True)

    def _index(self, values: list[int] | np.ndarray) -> torch.Tensor:
        return torch.as_tensor(values, dtype=torch.int64).to(self.device, non_blocking=True)

    def release(self, requests: list[Request]) -> None:
        """Frees finished requests' rows."""
        self._rows.release(requests)
