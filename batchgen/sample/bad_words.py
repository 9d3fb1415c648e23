"""`sampling.bad_words`: tokenized the way vLLM tokenizes them, matched against each row's output on the host, and
banned on the device (one-token words are in the state row's bias instead)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from batchgen.sample.state import TokenHistory


def bad_words_token_ids(words: list[str], tokenizer: Any | None) -> list[list[int]]:
    """Each word as it starts a text and, when that tokenizes differently with the same length, as it follows a
    space: so the word is banned at the beginning and in the middle of a text. tokenizer: the model's (a
    transformers or a fast tokenizer), None when it has none."""
    if not words:
        return []
    if tokenizer is None:
        raise ValueError("sampling.bad_words needs a tokenizer; the model has none")
    sequences: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        sequences.append(plain)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    return sequences


def bad_word_candidates(histories: list[TokenHistory | None]) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(row, expected last token, banned token) of each multi-token word that the device must check. vLLM's rule on
    output tokens: a word's last token is banned when the tokens before it end the output. All but the latest
    output token are known here; the device compares that one (it may still be pending)."""
    rows, expected, banned = [], [], []
    for row, history in enumerate(histories):
        if history is None:
            continue
        outputs = history.output_token_ids
        for ids in history.bad_words_token_ids:
            prefix_len = len(ids) - 1
            if prefix_len == 0 or prefix_len > len(outputs):
                continue
            if prefix_len > 1 and outputs[-prefix_len:-1] != ids[:-2]:
                continue
            rows.append(row)
            expected.append(ids[-2])
            banned.append(ids[-1])
    if not rows:
        return None
    return (np.array(rows, dtype=np.int64), np.array(expected, dtype=np.int64), np.array(banned, dtype=np.int64))


@dataclass
class BadWordCandidates:
    """The candidates on the device: where a row's latest token is the expected one, the word's last token is
    banned."""

    batch_rows: torch.Tensor  # (C,) int64
    expected_last: torch.Tensor  # (C,) int64: the prefix's last token
    banned: torch.Tensor  # (C,) int64: the word's last token
    last_tokens: torch.Tensor  # (B,) int64: each batch row's latest token, on the device


def apply_bad_words(logits: torch.Tensor, c: BadWordCandidates) -> torch.Tensor:
    match = c.last_tokens.index_select(0, c.batch_rows) == c.expected_last
    penalty = torch.where(match, float("-inf"), 0.0).to(logits.dtype)
    # Accumulate: the same (row, token) may be listed twice, and adding 0 or -inf is order-independent.
    return logits.index_put((c.batch_rows, c.banned), penalty, accumulate=True)
