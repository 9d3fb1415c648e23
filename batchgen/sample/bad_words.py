"""`sampling.bad_words` as token sequences, the way vLLM tokenizes them."""

from __future__ import annotations

from typing import Any


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
