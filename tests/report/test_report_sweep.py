"""A real two-run sweep on CPU ends with its report: every file, valid PNGs, an HTML page with the images inside."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

pd = pytest.importorskip("pandas", reason="the report needs pandas (the report extra)")
image = pytest.importorskip("matplotlib.image", reason="the report's plots need matplotlib (the report extra)")

REPO = Path(__file__).resolve().parents[2]
KERNEL_COLUMNS = ["step", "kind", "cuda_graph", "name", "start_us", "duration_us", "gap_before_us"]
TABLES = ["runs", "eager_vs_graph", "per_step", "time_shares", "requests", "kernel_steps", "kernel_share"]


def run_module(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow
def test_cpu_sweep_writes_the_report_with_plots_and_kernels(tmp_path):
    sweep_dir = tmp_path / "sweep"
    done = run_module("batchgen", "-m", "job=shakespeare", "preset=smoke_test", "engine.enforce_eager=true,false",
                      "data.limit=4", "job.profile_steps=2", "job.progress=false", f"hydra.sweep.dir={sweep_dir}")
    assert done.returncode == 0, done.stderr[-2000:]
    report = sweep_dir / "report"
    assert f"Sweep report: {report / 'report.md'}" in done.stdout
    assert "output tok/s" in done.stdout  # each run's closing summary lines

    for run in ("0", "1"):
        assert pq.read_schema(sweep_dir / run / "kernels.parquet").names == KERNEL_COLUMNS
    for name in TABLES:
        assert (report / "tables" / f"{name}.parquet").exists(), name
    pngs = sorted(report.glob("*.png"))
    assert {"timeline_0.png", "timeline_1.png", "step_components.png", "decode_vs_batch.png",
            "throughput_over_time.png", "latency_cdf.png"} <= {p.name for p in pngs}
    for png in pngs:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert image.imread(png).ndim == 3
    page = (report / "report.html").read_text()
    assert page.count("src='data:image/png;base64,") == len(pngs)
    # Self-contained: no link out of the page (the images' base64 may spell "http" by chance, so they are left out).
    assert "http" not in re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "", page)
    pairs = pd.read_parquet(report / "tables" / "eager_vs_graph.parquet")
    assert pairs["tokens_identical"].tolist() == ["true"]  # greedy; on CPU both runs are eager anyway


def test_report_on_a_wrong_path_exits_non_zero_with_one_line(tmp_path):
    done = run_module("batchgen.report", str(tmp_path))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"batchgen-report: {tmp_path}: no run directories found (expected "
                                                "summary.json or steps.parquet in it or below it)"]
