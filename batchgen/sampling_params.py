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

    def __post_init__(self) -> None:
        self.validate("sampling")

    def validate(self, prefix: str) -> None:
        _check(isinstance(self.n, int) and self.n > 0, f"{prefix}.n", self.n, "must be a positive integer")
        _check(isinstance(self.max_tokens, int) and self.max_tokens > 0, f"{prefix}.max_tokens", self.max_tokens,
               "must be a positive integer")
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def with_overrides(self, overrides: dict[str, Any]) -> SamplingParams:
        """A copy with per-row values; a single stop string becomes a list."""
        known = {f.name for f in fields(self)}
        unknown = set(overrides) - known
        _check(not unknown, "sampling", sorted(unknown), f"unknown options; known are {', '.join(sorted(known))}")
        values = dict(overrides)
        if isinstance(values.get("stop"), str):
            values["stop"] = [values["stop"]]
        if any(name in values for name in GUIDED_FIELDS):  # a row's guided_* option replaces the job's
            values = {**dict.fromkeys(GUIDED_FIELDS), **values}
        return replace(self, **values)
