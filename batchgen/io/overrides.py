"""Per-row sampling overrides: which fields count, and what values they accept."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from batchgen.io.errors import RowError
from batchgen.io.values import as_integer, as_number, as_token_ids, short_repr
from batchgen.sample.params import VALUE_RANGES, ValueRange


@dataclass(frozen=True)
class OverrideRule:
    parse: Callable[[Any], Any]  # the normalized value, or None when the value is invalid
    requirement: str


def _in_range(rule: ValueRange) -> OverrideRule:
    """A numeric option; VALUE_RANGES holds the rules that SamplingParams checks the job's values by too."""

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
    "n": _in_range(VALUE_RANGES["n"]),
    "max_tokens": _in_range(ValueRange("a positive integer", 1, integer=True)),
    "temperature": _in_range(VALUE_RANGES["temperature"]),
    "top_p": _in_range(VALUE_RANGES["top_p"]),
    "top_k": _in_range(VALUE_RANGES["top_k"]),
    "min_p": _in_range(VALUE_RANGES["min_p"]),
    "seed": _in_range(ValueRange("a non-negative integer", 0, integer=True)),
    "stop": OverrideRule(_stop_strings, "a non-empty string or a list of non-empty strings"),
    "stop_token_ids": OverrideRule(as_token_ids, "a list of non-negative integers"),
    "ignore_eos": OverrideRule(_flag, "a boolean"),
    "guided_json": OverrideRule(_json_schema, "a JSON schema (an object, or its JSON text)"),
    "guided_regex": OverrideRule(_text, "a non-empty string"),
    "guided_choice": OverrideRule(_choices, "a non-empty list of strings"),
    "guided_grammar": OverrideRule(_text, "a non-empty string"),
    "repetition_penalty": _in_range(VALUE_RANGES["repetition_penalty"]),
    "presence_penalty": _in_range(VALUE_RANGES["presence_penalty"]),
    "frequency_penalty": _in_range(VALUE_RANGES["frequency_penalty"]),
    "min_tokens": _in_range(VALUE_RANGES["min_tokens"]),
    "logit_bias": OverrideRule(_logit_bias, "an object of token id -> number"),
    "bad_words": OverrideRule(_stop_strings, "a non-empty string or a list of non-empty strings"),
    "allowed_token_ids": OverrideRule(_token_id_list, "a non-empty list of non-negative integers"),
    "logprobs": _in_range(ValueRange("a non-negative integer", 0, integer=True)),
    "prompt_logprobs": _in_range(ValueRange("a non-negative integer", 0, integer=True)),
}
OVERRIDE_FIELDS = tuple(OVERRIDE_RULES)


_RULE_POSITIONS = {name: position for position, name in enumerate(OVERRIDE_RULES)}


def parse_overrides(record: dict[str, Any]) -> dict[str, Any]:
    """The overrides a row sets, normalized (a single stop string becomes a list), in OVERRIDE_RULES' order (the
    first invalid one is the one reported); null means not set."""
    names = [name for name in record if name in _RULE_POSITIONS]  # a row's few fields, not every rule, looked up
    if not names:
        return {}
    overrides = {}
    for name in sorted(names, key=_RULE_POSITIONS.__getitem__):
        value = record[name]
        if value is None:
            continue
        rule = OVERRIDE_RULES[name]
        parsed = rule.parse(value)
        if parsed is None:
            raise RowError(f"{name}={short_repr(value)} is invalid: must be {rule.requirement}")
        overrides[name] = parsed
    return overrides
