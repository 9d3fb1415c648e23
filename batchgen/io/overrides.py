"""Per-row sampling overrides: which fields count, and what values they accept."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from batchgen.io.errors import RowError
from batchgen.io.values import as_integer, as_number, as_token_ids, short_repr


@dataclass(frozen=True)
class OverrideRule:
    parse: Callable[[Any], Any]  # the normalized value, or None when the value is invalid
    requirement: str


def _integer_from(minimum: int) -> Callable[[Any], int | None]:
    def parse(value: Any) -> int | None:
        number = as_integer(value)
        return number if number is not None and number >= minimum else None

    return parse


def _number_in(low: float, high: float | None, low_inclusive: bool) -> Callable[[Any], float | None]:
    def parse(value: Any) -> float | None:
        number = as_number(value)
        if number is None or (high is not None and number > high):
            return None
        return number if number > low or (low_inclusive and number == low) else None

    return parse


def _stop_strings(value: Any) -> list[str] | None:
    strings = [value] if isinstance(value, str) else value
    if not isinstance(strings, list) or not all(isinstance(s, str) and s for s in strings):
        return None
    return strings


def _flag(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _json_schema(value: Any) -> dict | str | None:
    return value if isinstance(value, dict) or _text(value) else None


def _choices(value: Any) -> list[str] | None:
    return value if isinstance(value, list) and value and all(isinstance(c, str) for c in value) else None


OVERRIDE_RULES: dict[str, OverrideRule] = {
    "n": OverrideRule(_integer_from(1), "a positive integer"),
    "max_tokens": OverrideRule(_integer_from(1), "a positive integer"),
    "temperature": OverrideRule(_number_in(0.0, None, low_inclusive=True), "a number >= 0"),
    "top_p": OverrideRule(_number_in(0.0, 1.0, low_inclusive=False), "a number in (0, 1]"),
    "top_k": OverrideRule(_integer_from(-1), "an integer >= -1 (0 or -1: off)"),
    "min_p": OverrideRule(_number_in(0.0, 1.0, low_inclusive=True), "a number in [0, 1]"),
    "seed": OverrideRule(_integer_from(0), "a non-negative integer"),
    "stop": OverrideRule(_stop_strings, "a non-empty string or a list of non-empty strings"),
    "stop_token_ids": OverrideRule(as_token_ids, "a list of non-negative integers"),
    "ignore_eos": OverrideRule(_flag, "a boolean"),
    "guided_json": OverrideRule(_json_schema, "a JSON schema (an object, or its JSON text)"),
    "guided_regex": OverrideRule(_text, "a non-empty string"),
    "guided_choice": OverrideRule(_choices, "a non-empty list of strings"),
    "guided_grammar": OverrideRule(_text, "a non-empty string"),
}
OVERRIDE_FIELDS = tuple(OVERRIDE_RULES)


def parse_overrides(record: dict[str, Any]) -> dict[str, Any]:
    """The overrides a row sets, normalized (a single stop string becomes a list); null means not set."""
    overrides = {}
    for name, rule in OVERRIDE_RULES.items():
        value = record.get(name)
        if value is None:
            continue
        parsed = rule.parse(value)
        if parsed is None:
            raise RowError(f"{name}={short_repr(value)} is invalid: must be {rule.requirement}")
        overrides[name] = parsed
    return overrides
