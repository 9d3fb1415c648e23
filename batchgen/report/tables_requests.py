"""Request latencies: TTFT, TPOT and end-to-end latency percentiles by finish reason."""

from __future__ import annotations

import pandas as pd

from batchgen.report.aggregate import percentiles
from batchgen.report.run_data import Run

LATENCY_COLUMNS = ["ttft_ms", "tpot_ms", "latency_ms"]


def requests_table(runs: list[Run]) -> pd.DataFrame:
    frames = []
    for run in runs:
        completions = run.completions[["finish_reason", "num_output_tokens", *LATENCY_COLUMNS]].copy()
        completions["run"] = run.label
        frames.append(completions)
    if not frames:
        return pd.DataFrame()
    rows = pd.concat(frames, ignore_index=True)
    by = ["run", "finish_reason"]
    counts = rows.groupby(by, sort=False).agg(requests=("finish_reason", "size"),
                                              output_tokens_mean=("num_output_tokens", "mean"))
    return counts.join(percentiles(rows, by, LATENCY_COLUMNS, (50, 90, 99))).reset_index()
