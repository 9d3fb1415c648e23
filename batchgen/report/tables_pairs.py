"""Eager vs CUDA graph, the NanoGPT post's table: runs that differ only in engine.enforce_eager, side by side."""

from __future__ import annotations

import pandas as pd

from batchgen.report.run_data import Run

EAGER_KEY = "engine.enforce_eager"


def eager_graph_pairs(runs: list[Run]) -> list[tuple[str, Run, Run]]:
    """(label of the other settings, eager run, graph run) for each pair differing only in enforce_eager."""
    by_rest: dict[tuple[tuple[str, str], ...], dict[str, Run]] = {}
    for run in runs:
        if EAGER_KEY not in run.params or not run.complete:
            continue
        rest = tuple((k, v) for k, v in run.params.items() if k != EAGER_KEY)
        by_rest.setdefault(rest, {}).setdefault(run.params[EAGER_KEY], run)
    pairs = []
    for rest, modes in by_rest.items():
        if "true" in modes and "false" in modes:
            label = " ".join(f"{k}={v}" for k, v in rest) or "all"
            pairs.append((label, modes["true"], modes["false"]))
    return pairs


def identical_rows(eager: Run, graph: Run) -> tuple[int, int]:
    """(rows whose output tokens are equal, rows compared), matching rows by index; a row in only one run differs."""
    a, b = _tokens_by_index(eager), _tokens_by_index(graph)
    equal = sum(tokens == b.get(index) for index, tokens in a.items())
    return equal, len(a.keys() | b.keys())


def _tokens_by_index(run: Run) -> dict[int, list[int]]:
    completions = run.completions
    return dict(zip(completions["index"].tolist(), (t.tolist() if t is not None else None
                                                    for t in completions["output_token_ids"]), strict=True))


def tokens_identical(equal: int, compared: int) -> str:
    """"true"/"false", sampled runs too: every row samples from its own seed, so eager and graph draw alike, and a
    "false" there means a last-bit difference between the two modes' kernels flipped a token."""
    return "true" if equal == compared else "false"


def median_decode_ms(run: Run, cuda_graph: bool) -> float:
    """Over the run's decode steps of one mode: a graph run still decodes eagerly above its largest bucket."""
    steps = run.steps
    return float(steps.loc[(steps["kind"] == "decode") & (steps["cuda_graph"] == cuda_graph), "step_ms"].median())


def eager_graph_table(runs: list[Run]) -> pd.DataFrame:
    rows = []
    for label, eager, graph in eager_graph_pairs(runs):
        eager_ms, graph_ms = median_decode_ms(eager, False), median_decode_ms(graph, True)
        equal, compared = identical_rows(eager, graph)
        eager_tok_s, graph_tok_s = eager.figures.output_tok_s, graph.figures.output_tok_s
        rows.append({
            "config": label,
            "prompt_tokens_max": eager.value("sampling.truncate_prompt_tokens"),
            "new_tokens_max": eager.value("sampling.max_tokens"),
            "eager_output_tok_s": eager_tok_s,
            "graph_output_tok_s": graph_tok_s,
            "e2e_speedup_x": graph_tok_s / eager_tok_s if eager_tok_s else None,
            "eager_decode_step_ms_p50": eager_ms,
            "graph_decode_step_ms_p50": graph_ms,
            "step_speedup_x": eager_ms / graph_ms if graph_ms else None,
            "tokens_identical": tokens_identical(equal, compared),
            "identical_rows": equal,
            "compared_rows": compared,
        })
    return pd.DataFrame(rows)
