"""Type checks for values read from untrusted rows: each returns the normalized value, or None if invalid."""

from __future__ import annotations

import math
from typing import Any

REPR_LIMIT = 80


def as_integer(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    # pandas writes integer columns that have missing values as float columns.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def as_number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def as_token_ids(value: Any) -> list[int] | None:
    if not isinstance(value, list):
        return None
    # type(), not isinstance: a bool is an int but no token id. Both passes run in C, not a generator per id: a job of
    # pre-tokenized prompts reads millions of ids.
    if value and (not set(map(type, value)) <= {int} or min(value) < 0):
        return None
    return value


def short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= REPR_LIMIT else text[: REPR_LIMIT - 3] + "..."
