"""Grouped percentiles with the percentile in the column name (step_ms_p50, ttft_ms_p99)."""

from __future__ import annotations

import pandas as pd


def percentiles(frame: pd.DataFrame, by: list[str], columns: list[str], levels: tuple[int, ...]) -> pd.DataFrame:
    """One row per group: `<column>_p<level>` for each column and level (linear interpolation, as numpy)."""
    grouped = frame.groupby(by, sort=True, dropna=False)[columns]
    parts = []
    for level in levels:
        part = grouped.quantile(level / 100)
        parts.append(part.rename(columns={c: f"{c}_p{level}" for c in columns}))
    wide = pd.concat(parts, axis=1)
    ordered = [f"{c}_p{level}" for c in columns for level in levels]
    return wide[ordered]
