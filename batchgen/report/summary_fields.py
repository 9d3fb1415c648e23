"""The figures the report takes from a run's summary.json, looked up in one place.

summary.json keeps job totals (all attempts) and this attempt's figures: at the top level, and (from the reliability
work on) repeated under the scopes `job` and `this_attempt`. Every key the report reads is looked up here, scope
first, top level second, so a change of shape is mended in this file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TOTAL_SCOPES = ("job", "")
ATTEMPT_SCOPES = ("this_attempt", "")


def _lookup(summary: dict[str, Any], key: str, scopes: tuple[str, ...]) -> Any:
    for scope in scopes:
        holder = summary if not scope else summary.get(scope)
        if isinstance(holder, dict) and key in holder:
            return holder[key]
    return None


@dataclass
class SummaryFigures:
    rows: int | None
    errors: int
    prompt_tokens: int | None
    output_tokens: int | None
    wall_s: float | None
    prompt_tok_s: float | None
    output_tok_s: float | None
    device: str | None
    cuda_graph_sizes: list[int]
    config: dict[str, Any]


def read_figures(summary: dict[str, Any]) -> SummaryFigures:
    reasons = _lookup(summary, "finish_reasons", TOTAL_SCOPES) or {}
    errors = _lookup(summary, "error_rows", TOTAL_SCOPES)
    engine = summary.get("engine") or {}
    return SummaryFigures(
        rows=_lookup(summary, "rows", TOTAL_SCOPES),
        errors=int(reasons.get("error", 0) if errors is None else errors),
        prompt_tokens=_lookup(summary, "prompt_tokens", TOTAL_SCOPES),
        output_tokens=_lookup(summary, "output_tokens", TOTAL_SCOPES),
        wall_s=_lookup(summary, "wall_seconds", ATTEMPT_SCOPES),
        prompt_tok_s=_lookup(summary, "prompt_tokens_per_s", ATTEMPT_SCOPES),
        output_tok_s=_lookup(summary, "output_tokens_per_s", ATTEMPT_SCOPES),
        device=engine.get("device"),
        cuda_graph_sizes=list(engine.get("cuda_graph_sizes") or []),
        config=summary.get("config") or {},
    )
