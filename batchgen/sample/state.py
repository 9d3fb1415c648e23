"""Per-request sampling state on the device, in rows that persist across steps (as BlockTables does for block
tables): output token counts, updated on the device from each step's sampled ids (so a pending token is counted
before the host knows it), a prompt-token mask, a static bias and the min_tokens stop mask.

Only requests that use a penalty, bias, allowed_token_ids, bad words or min_tokens get a row; the others share the
neutral row 0. The tensors are allocated on first use and grow by doubling; `version` changes when they move, so
graphs that captured the old tensors are not replayed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from batchgen.sample.params import SamplingParams
from batchgen.sample.penalties import NEG_INF, SamplingStateRows

INITIAL_ROWS = 64


@dataclass(frozen=True, slots=True)
class TokenHistory:
    """What the penalty stages read of a row's request (only rows whose parameters use penalty state have one)."""

    key: object  # the request: it holds its state row until released, and is kept alive so that its id stays unique
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # the latest may still be pending on the device
    eos_token_id: int | None
    bad_words_token_ids: list[list[int]]  # sampling_params.bad_words, tokenized


class SamplingState:
    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.device = device
        self.rows_tensors: SamplingStateRows | None = None
        self.version = 0
        self._held: dict[int, tuple[object, int]] = {}  # id(key) -> (key, row)
        self._free_rows: list[int] = []  # popped lowest first

    def rows(self, params: list[SamplingParams], histories: list[TokenHistory | None]) -> list[int]:
        """Each row's state row (0 for a row without history), new rows initialised on the device first."""
        return [0 if history is None else self._row(p, history) for p, history in zip(params, histories, strict=True)]

    def release(self, keys: list[object]) -> None:
        for key in keys:
            held = self._held.pop(id(key), None)
            if held is not None:
                self._free_rows.append(held[1])

    def _row(self, params: SamplingParams, history: TokenHistory) -> int:
        held = self._held.get(id(history.key))
        if held is not None:
            return held[1]
        if not self._free_rows:
            self._free_rows = sorted(self._grow(), reverse=True)
        row = self._free_rows.pop()
        self._held[id(history.key)] = (history.key, row)
        self._initialise(row, params, history)
        return row

    def _grow(self) -> range:
        old = self.rows_tensors
        old_rows = 0 if old is None else old.output_counts.shape[0]
        rows = max(INITIAL_ROWS, 2 * old_rows)
        shape = (rows, self.vocab_size)
        new = SamplingStateRows(
            output_counts=torch.zeros(shape, dtype=torch.float32, device=self.device),
            prompt_mask=torch.zeros(shape, dtype=torch.bool, device=self.device),
            bias=torch.zeros(shape, dtype=torch.float32, device=self.device),
            stop_mask=torch.zeros(shape, dtype=torch.bool, device=self.device),
        )
        if old is not None:
            for name in ("output_counts", "prompt_mask", "bias", "stop_mask"):
                getattr(new, name)[:old_rows].copy_(getattr(old, name))
        self.rows_tensors = new
        self.version += 1
        return range(max(old_rows, 1), rows)  # row 0 stays neutral

    def _initialise(self, row: int, params: SamplingParams, history: TokenHistory) -> None:
        vocab = self.vocab_size
        prompt_mask = np.zeros(vocab, dtype=np.bool_)
        prompt_mask[history.prompt_token_ids] = True
        bias = np.zeros(vocab, dtype=np.float32)
        if params.allowed_token_ids is not None:
            bias[:] = NEG_INF
            bias[params.allowed_token_ids] = 0.0
        for token, value in params.logit_bias.items():
            bias[token] += value
        bias[[ids[0] for ids in history.bad_words_token_ids if len(ids) == 1]] = NEG_INF
        stop_mask = np.zeros(vocab, dtype=np.bool_)
        if params.min_tokens > 0:
            stop_mask[[t for t in (history.eos_token_id, *params.stop_token_ids) if t is not None]] = True
        state = self.rows_tensors
        state.output_counts[row].zero_()  # queued behind earlier steps, which may still count into a freed row
        pinned = self.device.type == "cuda"
        for target, values in ((state.prompt_mask[row], prompt_mask), (state.bias[row], bias),
                               (state.stop_mask[row], stop_mask)):
            host = torch.from_numpy(values)
            target.copy_(host.pin_memory() if pinned else host, non_blocking=pinned)
