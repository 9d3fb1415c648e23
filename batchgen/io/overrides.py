"""Per-row sampling overrides: which fields count, and what values they accept."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from batchgen.io.errors import RowError
from batchgen.io.values import as_integer, as_number, as_token_ids, short_repr
from batchgen.sample.params import VALUE_RANGES


@dataclass(frozen=True)
class OverrideRule:
    parse: Callable[[Any], Any]  # the normalized value, or None when the value is invalid
    requirement: str


def _integer_from(minimum: int) -> Callable[[Any], int | None]:
    def parse(value: Any) -> int | None:
        number = as_integer(value)
        return number if number is not None and number >= minimum else None

    return parse


def _in_range(name: str) -> OverrideRule:
    """The rule SamplingParams checks the job's value of `name` by (sample/params.py)."""
    rule = VALUE_RANGES[name]

    def parse(value: Any) -> int | float | None:
        number = as_integer(value) if rule.integer else as_number(value)
        return number if number is not None and rule.allows(number) else None

    return OverrideRule(parse, rule.requirement)


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


def _logit_bias(value: Any) -> dict[int, float] | None:
    """Token id (an integer, or its digits as a JSON object key) -> a number."""
    if not isinstance(value, dict):
        return None
    bias = {}
    for key, number in value.items():
        token = int(key) if isinstance(key, str) and key.isdigit() else as_integer(key)
        number = as_number(number)
        if token is None or token < 0 or number is None:
            return None
        bias[token] = number
    return bias


def _token_id_list(value: Any) -> list[int] | None:
    token_ids = as_token_ids(value)
    return token_ids if token_ids else None


OVERRIDE_RULES: dict[str, OverrideRule] = {
    "n": _in_range("n"),
    "max_tokens": OverrideRule(_integer_from(1), "a positive integer"),
    "temperature": _in_range("temperature"),
    "top_p": _in_range("top_p"),
    "top_k": _in_range("top_k"),
    "min_p": _in_range("min_p"),
    "seed": OverrideRule(_integer_from(0), "a non-negative integer"),
    "stop": OverrideRule(_stop_strings, "a non-empty string or a list of non-empty strings"),
    "stop_token_ids": OverrideRule(as_token_ids, "a list of non-negative integers"),
    "ignore_eos": OverrideRule(_flag, "a boolean"),
    "guided_json": OverrideRule(_json_schema, "a JSON schema (an object, or its JSON text)"),
    "guided_regex": OverrideRule(_text, "a non-empty string"),
    "guided_choice": OverrideRule(_choices, "a non-empty list of strings"),
    "guided_grammar": OverrideRule(_text, "a non-empty string"),
    "repetition_penalty": _in_range("repetition_penalty"),
    "presence_penalty": _in_range("presence_penalty"),
    "frequency_penalty": _in_range("frequency_penalty"),
    "min_tokens": _in_range("min_tokens"),
    "logit_bias": OverrideRule(_logit_bias, "an object of token id -> number"),
    "bad_words": OverrideRule(_stop_strings, "a non-empty string or a list of non-empty strings"),
    "allowed_token_ids": OverrideRule(_token_id_list, "a non-empty list of non-negative integers"),
    "logprobs": OverrideRule(_integer_from(0), "a non-negative integer"),
    "prompt_logprobs": OverrideRule(_integer_from(0), "a non-negative integer"),
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
