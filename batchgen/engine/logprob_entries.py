"""Log-probability entries as a Python API user reads them: {token_id, text, logprob, rank, top: [{token_id, text,
logprob}]}, and each token's text."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, overload

import numpy as np

from batchgen.core.prompt_logprobs import PromptLogprobs
from batchgen.engine.detokenizer import Detokenizer


class TokenTexts:
    """Each token's own text (special tokens included), decoded once per token id; None without a tokenizer."""

    def __init__(self, detokenizer: Detokenizer | None):
        self._tokenizer = None if detokenizer is None else detokenizer.tokenizer
        self._texts: dict[int, str] = {}
        # The texts decoded so far by token id, for lookups of whole arrays: (V,) str objects and whether each is set.
        self._table = np.empty(0, dtype=object)
        self._in_table = np.zeros(0, dtype=bool)

    def text(self, token_id: int) -> str | None:
        if self._tokenizer is None:
            return None
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode([token_id])
        return text

    def texts(self, token_ids: np.ndarray) -> np.ndarray | None:
        """The texts of an array of token ids, as an object array of its shape: one indexing of the table, after the
        ids it lacks are added (each decoded once)."""
        if self._tokenizer is None:
            return None
        if token_ids.size and token_ids.max() >= len(self._table):
            size = int(token_ids.max()) + 1
            self._table = np.concatenate([self._table, np.empty(size - len(self._table), dtype=object)])
            self._in_table = np.concatenate([self._in_table, np.zeros(size - len(self._in_table), dtype=bool)])
        missing = np.unique(token_ids[~self._in_table[token_ids]])
        self._table[missing] = [self.text(token_id) for token_id in missing.tolist()]
        self._in_table[missing] = True
        return self._table[token_ids]


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
