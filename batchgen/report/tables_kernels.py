"""Kernel timelines (kernels.parquet, written with job.profile_steps): per-step gaps and kernels by share of time,
as in the pegainfer post."""

from __future__ import annotations

import pandas as pd

from batchgen.report.run_data import Run


def _kernels(runs: list[Run]) -> pd.DataFrame:
    frames = []
    for run in runs:
        if run.kernels is not None and len(run.kernels):
            frame = run.kernels.copy()
            frame["run"] = run.label
            frame["mode"] = frame["cuda_graph"].map({True: "graph", False: "eager"})
            frames.append(frame)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def kernel_steps_table(runs: list[Run]) -> pd.DataFrame:
    """Per profiled step: wall (first start to last end), kernel time, gap time between kernels, gap share."""
    kernels = _kernels(runs)
    if kernels.empty:
        return kernels
    kernels["end_us"] = kernels["start_us"] + kernels["duration_us"]
    table = kernels.groupby(["run", "step", "kind", "mode"], sort=False).agg(
        kernels=("name", "size"), wall_us=("end_us", "max"), first_us=("start_us", "min"),
        kernel_us=("duration_us", "sum"), gap_us=("gap_before_us", "sum")).reset_index()
    table["wall_us"] -= table.pop("first_us")
    table["gap_pct"] = 100 * table["gap_us"] / table["wall_us"]
    return table


TOP_KERNELS = 20


def kernel_share_table(runs: list[Run], top: int = TOP_KERNELS) -> pd.DataFrame:
    """The `top` kernels by share of kernel time within each run, step kind and mode: %, average µs, launches per
    step (all of them in the `total_us` sum)."""
    kernels = _kernels(runs)
    if kernels.empty:
        return kernels
    group = ["run", "kind", "mode"]
    per_name = kernels.groupby([*group, "name"], sort=False).agg(
        total_us=("duration_us", "sum"), launches=("duration_us", "size")).reset_index()
    totals = kernels.groupby(group, sort=False).agg(group_us=("duration_us", "sum"), steps=("step", "nunique"))
    table = per_name.join(totals, on=group)
    table["time_pct"] = 100 * table["total_us"] / table["group_us"]
    table["avg_us"] = table["total_us"] / table["launches"]
    table["launches_per_step"] = table["launches"] / table["steps"]
    table["order"] = table["run"].map({run.label: i for i, run in enumerate(runs)})
    table = table.sort_values(["order", "kind", "mode", "time_pct"], ascending=[True, True, True, False])
    table = table.groupby(group, sort=False).head(top)
    return table[[*group, "name", "time_pct", "avg_us", "launches_per_step", "total_us"]].reset_index(drop=True)
