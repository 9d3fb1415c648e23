"""Per-step medians and p90 by step kind, graph or eager, and padded bucket."""

from __future__ import annotations

import pandas as pd

from batchgen.job.summary import TIME_COLUMNS
from batchgen.report.aggregate import percentiles
from batchgen.report.run_data import Run

GROUP = ["run", "kind", "mode", "bucket"]


def labelled_steps(run: Run) -> pd.DataFrame:
    """steps.parquet with the run's label, mode (graph | eager), bucket (padded size, 0 when eager) and padding."""
    steps = run.steps.copy()
    steps["run"] = run.label
    steps["mode"] = steps["cuda_graph"].map({True: "graph", False: "eager"})
    steps["bucket"] = steps["padded_size"].fillna(0).astype(int)
    steps["padding_seqs"] = (steps["padded_size"] - steps["num_seqs"]).fillna(0)
    return steps


def per_step_table(runs: list[Run]) -> pd.DataFrame:
    frames = [labelled_steps(run) for run in runs]
    if not frames:
        return pd.DataFrame()
    steps = pd.concat(frames, ignore_index=True)
    grouped = steps.groupby(GROUP, sort=False)
    counts = grouped.agg(steps=("step", "size"), num_seqs_mean=("num_seqs", "mean"),
                         padding_seqs_mean=("padding_seqs", "mean"))
    table = counts.join(percentiles(steps, GROUP, list(TIME_COLUMNS), (50, 90)))
    return table.reset_index()
