"""Log-probability entries as a Python API user reads them: {token_id, text, logprob, rank, top: [{token_id, text,
logprob}]}, and each token's text."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, overload

import numpy as np
import pyarrow as pa

from batchgen.core.prompt_logprobs import PromptLogprobs
from batchgen.engine.detokenizer import Detokenizer


class TokenTexts:
    """Each token's own text (special tokens included), decoded once per token id; None without a tokenizer."""

    def __init__(self, detokenizer: Detokenizer | None):
        self._tokenizer = None if detokenizer is None else detokenizer.tokenizer
        self._texts: dict[int, str] = {}
        # For lookups of whole arrays: the texts decoded so far as one Arrow array, in the order they were first looked
        # up, and each token id's place in it (-1: not yet).
        self._decoded = pa.array([], type=pa.string())
        self._places = np.zeros(0, dtype=np.int32)

    def text(self, token_id: int) -> str | None:
        if self._tokenizer is None:
            return None
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode([token_id])
        return text

    def texts(self, token_ids: np.ndarray) -> pa.StringArray | None:
        """The texts of an array of token ids, flattened (C order), as one Arrow array gathered from the texts decoded
        so far, after the ids they lack are added (each decoded once): no Python object per id."""
        if self._tokenizer is None:
            return None
        token_ids = token_ids.reshape(-1)
        if token_ids.size and token_ids.max() >= len(self._places):
            grown = np.full(int(token_ids.max()) + 1, -1, dtype=np.int32)
            grown[:len(self._places)] = self._places
            self._places = grown
        missing = np.unique(token_ids[self._places[token_ids] < 0])
        if missing.size:
            self._places[missing] = np.arange(len(self._decoded), len(self._decoded) + missing.size, dtype=np.int32)
            self._decoded = pa.concat_arrays(
                [self._decoded, pa.array([self.text(token_id) for token_id in missing.tolist()], type=pa.string())])
        return self._decoded.take(self._places[token_ids])


def entry(token_id: int, logprob: float, rank: int, top_ids: list[int], top_logprobs: list[float],
          texts: TokenTexts, k: int) -> dict:
    """The token's entry with its request's k most likely tokens: the step computed the most any of its rows asks
    for."""
    return {"token_id": token_id, "text": texts.text(token_id), "logprob": logprob, "rank": rank,
            "top": [{"token_id": t, "text": texts.text(t), "logprob": lp}
                    for t, lp in zip(top_ids[:k], top_logprobs[:k], strict=True)]}


class PromptLogprobEntries(Sequence):
    """RequestOutput.prompt_logprobs: per prompt token {token_id, text, logprob, rank, top: [{token_id, text,
    logprob}]}, None where a token has none (the first; a scored continuation's context). The dicts are made on the
    first read of an entry; a job writes the arrays (`scored`) without them."""

    def __init__(self, scored: PromptLogprobs, texts: TokenTexts):
        self.scored = scored
        self.texts = texts
        self._entries: list[dict | None] | None = None

    def _all(self) -> list[dict | None]:
        if self._entries is None:
            s, texts = self.scored, self.texts
            self._entries = [None] * s.first + [
                entry(token_id, logprob, rank, top_ids, top_logprobs, texts, s.k)
                for token_id, logprob, rank, top_ids, top_logprobs in zip(
                    s.token_ids.tolist(), s.logprobs.tolist(), s.ranks.tolist(), s.top_ids.tolist(),
                    s.top_logprobs.tolist(), strict=True)
            ]
        return self._entries

    def __len__(self) -> int:
        return self.scored.next_position

    @overload
    def __getitem__(self, index: int) -> dict | None: ...

    @overload
    def __getitem__(self, index: slice) -> list[dict | None]: ...

    def __getitem__(self, index: int | slice) -> dict | None | list[dict | None]:
        return self._all()[index]

    def __iter__(self) -> Iterator[dict | None]:
        return iter(self._all())

    def __eq__(self, other: Any) -> bool:
        if isinstance(other, PromptLogprobEntries | list):
            return self._all() == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return repr(self._all())
