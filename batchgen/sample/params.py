"""Per-request sampling options, in vLLM's vocabulary."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any


def _check(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{key}={value!r} is invalid: {allowed}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class ValueRange:
    """The values a numeric option allows; `requirement` says so in words."""

    requirement: str
    low: float
    high: float = math.inf
    low_open: bool = False
    integer: bool = False

    def allows(self, value: Any) -> bool:
        if not (isinstance(value, int) and not isinstance(value, bool) if self.integer else _is_number(value)):
            return False
        return (value > self.low if self.low_open else value >= self.low) and value <= self.high


# The numeric options' rules, for the job's defaults and for each row's overrides (io/overrides.py).
VALUE_RANGES = {
    "n": ValueRange("a positive integer", 1, integer=True),
    "temperature": ValueRange("a number >= 0", 0),
    "top_p": ValueRange("a number in (0, 1]", 0, 1, low_open=True),
    "top_k": ValueRange("an integer >= -1 (0 or -1: off)", -1, integer=True),
    "min_p": ValueRange("a number in [0, 1]", 0, 1),
    "repetition_penalty": ValueRange("a number > 0 (1: off)", 0, low_open=True),
    "presence_penalty": ValueRange("a number in [-2, 2] (0: off)", -2, 2),
    "frequency_penalty": ValueRange("a number in [-2, 2] (0: off)", -2, 2),
    "min_tokens": ValueRange("a non-negative integer", 0, integer=True),
}
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
MAX_LOGPROBS = 20  # vLLM's default max_logprobs


@dataclass
class SamplingParams:
    n: int = 1  # completions per prompt; they share the prompt's KV blocks
    max_tokens: int = 16
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None  # None: the engine derives one from its seed and the request index
    stop: list[str] = field(default_factory=list)  # stop strings, excluded from the completion
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    truncate_prompt_tokens: int | None = None  # keep only the last N prompt tokens
    # Structured output (at most one; needs the `guided` extra): the completion follows a JSON schema (a dict or its
    # JSON text), a regular expression, one of the choices, or a Lark/GBNF grammar.
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Penalties and limits (vLLM's meanings); the defaults cost nothing.
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt and output: positive logits / p, else * p
    presence_penalty: float = 0.0  # subtracted once from each token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens are generated
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    bad_words: list[str] = field(default_factory=list)  # words never generated (their last token is banned)
    allowed_token_ids: list[int] | None = None  # only these tokens may be generated
    # Log-probabilities: the k most likely alternatives per generated (or prompt) token, besides the chosen one.
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        for key, rule in VALUE_RANGES.items():
            value = getattr(self, key)
            _check(rule.allows(value), f"sampling.{key}", value, f"must be {rule.requirement}")
        _check(isinstance(self.max_tokens, int) and (self.max_tokens > 0 or self.max_tokens == 0 and self.scoring),
               "sampling.max_tokens", self.max_tokens, "must be a positive integer (0 only with prompt_logprobs)")
        _check(self.truncate_prompt_tokens is None or self.truncate_prompt_tokens > 0,
               "sampling.truncate_prompt_tokens", self.truncate_prompt_tokens, "must be a positive integer")
        _check(all(isinstance(s, str) and s for s in self.stop), "sampling.stop", self.stop,
               "must be a list of non-empty strings")
        guided = [name for name in GUIDED_FIELDS if getattr(self, name) is not None]
        _check(len(guided) <= 1, f"sampling.{'/'.join(guided)}", "both set", "set at most one guided_* option")
        _check(self.max_tokens == 0 or self.min_tokens <= self.max_tokens, "sampling.min_tokens", self.min_tokens,
               f"must be <= max_tokens ({self.max_tokens})")
        bias = self.logit_bias
        _check(isinstance(bias, dict) and all(isinstance(k, int) and k >= 0 and _is_number(v) for k, v in bias.items()),
               "sampling.logit_bias", bias, "must map non-negative token ids to numbers")
        _check(isinstance(self.bad_words, list) and all(isinstance(w, str) and w.strip() for w in self.bad_words),
               "sampling.bad_words", self.bad_words, "must be a list of non-empty strings")
        allowed = self.allowed_token_ids
        _check(allowed is None or (isinstance(allowed, list) and allowed and all(isinstance(t, int) and t >= 0
                                                                                for t in allowed)),
               "sampling.allowed_token_ids", allowed, "must be a non-empty list of non-negative token ids")
        for key in ("logprobs", "prompt_logprobs"):
            value = getattr(self, key)
            _check(value is None or (isinstance(value, int) and 0 <= value <= MAX_LOGPROBS), f"sampling.{key}", value,
                   f"must be an integer in [0, {MAX_LOGPROBS}]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def scoring(self) -> bool:
        """A scoring-only request: prompt log-probabilities, no generated token (max_tokens=0)."""
        return self.max_tokens == 0 and self.prompt_logprobs is not None

    @property
    def uses_penalty_state(self) -> bool:
        """Whether sampling needs this request's device rows (token counts, prompt mask, bias, stop mask)."""
        return (self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.min_tokens > 0 or bool(self.logit_bias) or bool(self.bad_words)
                or self.allowed_token_ids is not None)


def row_params(defaults: SamplingParams, overrides: dict[str, Any], row_index: int) -> SamplingParams:
    """A row's parameters: the job's defaults with the row's overrides (a single stop string or bad word becomes a
    list, logit_bias keys may be digits); a ValueError names the row and the option. A row without overrides shares
    the defaults' object (parameters are never changed in place)."""
    if not overrides:
        return defaults
    try:
        known = {f.name for f in fields(defaults)}
        unknown = set(overrides) - known
        _check(not unknown, "sampling", sorted(unknown), f"unknown options; known are {', '.join(sorted(known))}")
        values = dict(overrides)
        for key in ("stop", "bad_words"):
            if isinstance(values.get(key), str):
                values[key] = [values[key]]
        if isinstance(values.get("logit_bias"), dict):  # JSON object keys are strings
            bias = values["logit_bias"]
            _check(all(str(k).isdigit() for k in bias), "sampling.logit_bias", bias, "keys must be token ids")
            values["logit_bias"] = {int(k): v for k, v in bias.items()}
        if any(name in values for name in GUIDED_FIELDS):  # a row's guided_* option replaces the job's
            values = {**dict.fromkeys(GUIDED_FIELDS), **values}
        return replace(defaults, **values)
    except ValueError as exc:
        raise ValueError(f"row {row_index}: {exc}") from None


_CACHED_OVERRIDE_TYPES = (int, float, str, bool)  # hashable, and compared with their type in the key


class RowParams:
    """row_params for the rows of one job: rows whose overrides are the same values share one SamplingParams,
    built and checked once. Rows often set only max_tokens or a temperature, from few distinct values, and building
    a row's parameters (replace and its checks) costs more than reading the row."""

    def __init__(self, defaults: SamplingParams):
        self.defaults = defaults
        self._by_overrides: dict[tuple[tuple[str, type, Any], ...], SamplingParams] = {}

    def __call__(self, overrides: dict[str, Any], row_index: int) -> SamplingParams:
        if not overrides:
            return self.defaults
        # The type is in the key: 1, 1.0 and True are equal keys, and are not the same option values.
        key = tuple((name, type(value), value) for name, value in overrides.items())
        if not all(key_type in _CACHED_OVERRIDE_TYPES for _, key_type, _ in key):  # lists and dicts: built per row
            return row_params(self.defaults, overrides, row_index)
        params = self._by_overrides.get(key)
        if params is None:  # a ValueError (naming this row) leaves nothing cached: the next such row raises its own
            params = self._by_overrides[key] = row_params(self.defaults, overrides, row_index)
        return params
