"""The runs table (one row per run) and where each run's engine time goes."""

from __future__ import annotations

import pandas as pd

from batchgen.report.answers import exact_match
from batchgen.report.run_data import Run

DEVICE_TIME = ["forward_ms", "sample_ms"]
HOST_TIME = ["schedule_ms", "prepare_ms"]


def runs_table(runs: list[Run], keys: list[str]) -> pd.DataFrame:
    """One row per run; with an exact_match column (the share of completions giving their input row's answer, see
    report/answers.py) when some run's input has an answer key."""
    rows = []
    for run in runs:
        f = run.figures
        answers = exact_match(run.path, {"path": run.config.get("data.path"), "format": run.config.get("data.format")})
        rows.append({
            "run": run.label,
            **{key: run.params.get(key) for key in keys},
            "status": "complete" if run.complete else "incomplete: missing " + ", ".join(run.missing),
            "rows": f.rows if f else None,
            "errors": f.errors if f else None,
            "prompt_tokens": f.prompt_tokens if f else None,
            "output_tokens": f.output_tokens if f else None,
            "wall_s": f.wall_s if f else None,
            "prompt_tok_s": f.prompt_tok_s if f else None,
            "output_tok_s": f.output_tok_s if f else None,
            "device": f.device if f else None,
            "exact_match": answers.share if answers else None,
            "path": str(run.path),
        })
    table = pd.DataFrame(rows)
    if "exact_match" in table and table["exact_match"].isna().all():
        table = table.drop(columns="exact_match")
    return table


def time_shares_table(runs: list[Run]) -> pd.DataFrame:
    """Shares of the summed step time: device work (forward + sample), host work (schedule + prepare), waiting for
    the device, and the rest (committing tokens, detokenizing, writing). A run whose device share is under half is
    host-bound."""
    rows = []
    for run in runs:
        steps = run.steps
        total = steps["step_ms"].sum()
        if total <= 0:
            continue
        device = steps[DEVICE_TIME].sum().sum()
        host = steps[HOST_TIME].sum().sum()
        wait = steps["wait_ms"].sum()
        rows.append({
            "run": run.label,
            "steps": len(steps),
            "step_ms_total": total,
            "device_pct": 100 * device / total,
            "host_pct": 100 * host / total,
            "wait_pct": 100 * wait / total,
            "other_pct": 100 * (total - device - host - wait) / total,
            "bound": "device" if device >= total / 2 else "host",
        })
    return pd.DataFrame(rows)
