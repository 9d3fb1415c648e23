"""Per-request sampling options, in vLLM's vocabulary."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any


def _check(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{key}={value!r} is invalid: {allowed}")


GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


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
        self.validate("sampling")

    def validate(self, prefix: str) -> None:
        _check(isinstance(self.n, int) and self.n > 0, f"{prefix}.n", self.n, "must be a positive integer")
        _check(isinstance(self.max_tokens, int) and (self.max_tokens > 0 or self.max_tokens == 0 and self.scoring),
               f"{prefix}.max_tokens", self.max_tokens, "must be a positive integer (0 only with prompt_logprobs)")
        _check(self.temperature >= 0, f"{prefix}.temperature", self.temperature, "must be >= 0")
        _check(0 < self.top_p <= 1, f"{prefix}.top_p", self.top_p, "must be in (0, 1]")
        _check(isinstance(self.top_k, int) and self.top_k >= -1, f"{prefix}.top_k", self.top_k,
               "must be a non-negative integer (0 or -1: off)")
        _check(0 <= self.min_p <= 1, f"{prefix}.min_p", self.min_p, "must be in [0, 1]")
        _check(self.truncate_prompt_tokens is None or self.truncate_prompt_tokens > 0,
               f"{prefix}.truncate_prompt_tokens", self.truncate_prompt_tokens, "must be a positive integer")
        _check(all(isinstance(s, str) and s for s in self.stop), f"{prefix}.stop", self.stop,
               "must be a list of non-empty strings")
        guided = [name for name in GUIDED_FIELDS if getattr(self, name) is not None]
        _check(len(guided) <= 1, f"{prefix}.{'/'.join(guided)}", "both set", "set at most one guided_* option")
        validate_penalties(self, prefix)

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

    def with_overrides(self, overrides: dict[str, Any]) -> SamplingParams:
        """A copy with per-row values; a single stop string becomes a list."""
        known = {f.name for f in fields(self)}
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
        return replace(self, **values)


MAX_LOGPROBS = 20  # vLLM's default max_logprobs


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def validate_penalties(params: SamplingParams, prefix: str) -> None:
    """The checks of the penalty, limit and logprobs fields; vocabulary bounds are checked by the engine."""
    _check(_is_number(params.repetition_penalty) and params.repetition_penalty > 0, f"{prefix}.repetition_penalty",
           params.repetition_penalty, "must be > 0 (1: off)")
    for key in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, key)
        _check(_is_number(value) and -2 <= value <= 2, f"{prefix}.{key}", value, "must be in [-2, 2] (0: off)")
    _check(isinstance(params.min_tokens, int) and params.min_tokens >= 0, f"{prefix}.min_tokens", params.min_tokens,
           "must be a non-negative integer")
    _check(params.max_tokens == 0 or params.min_tokens <= params.max_tokens, f"{prefix}.min_tokens",
           params.min_tokens, f"must be <= max_tokens ({params.max_tokens})")
    bias = params.logit_bias
    _check(isinstance(bias, dict) and all(isinstance(k, int) and k >= 0 and _is_number(v) for k, v in bias.items()),
           f"{prefix}.logit_bias", bias, "must map non-negative token ids to numbers")
    _check(isinstance(params.bad_words, list) and all(isinstance(w, str) and w.strip() for w in params.bad_words),
           f"{prefix}.bad_words", params.bad_words, "must be a list of non-empty strings")
    allowed = params.allowed_token_ids
    _check(allowed is None or (isinstance(allowed, list) and allowed and all(isinstance(t, int) and t >= 0
                                                                            for t in allowed)),
           f"{prefix}.allowed_token_ids", allowed, "must be a non-empty list of non-negative token ids")
    for key in ("logprobs", "prompt_logprobs"):
        value = getattr(params, key)
        _check(value is None or (isinstance(value, int) and 0 <= value <= MAX_LOGPROBS), f"{prefix}.{key}", value,
               f"must be an integer in [0, {MAX_LOGPROBS}]")
