"""Builds the report of a set of runs and writes it: report.md, report.html, PNGs, tables/<name>.parquet."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from batchgen.report.discover import find_run_dirs
from batchgen.report.labels import label_runs
from batchgen.report.plots import PlotFile
from batchgen.report.render import html_page, markdown
from batchgen.report.run_data import Run, load_run
from batchgen.report.tables_kernels import TOP_KERNELS, kernel_share_table, kernel_steps_table
from batchgen.report.tables_pairs import eager_graph_table
from batchgen.report.tables_requests import requests_table
from batchgen.report.tables_runs import runs_table, time_shares_table
from batchgen.report.tables_steps import per_step_table

PLOTS_HINT = 'Plots need matplotlib: pip install -e ".[report]"'


@dataclass
class Report:
    runs: list[Run]
    keys: list[str]  # the settings that differ between the runs
    tables: dict[str, tuple[str, pd.DataFrame]]  # name -> (heading, table)
    notes: list[str] = field(default_factory=list)
    plots: list[PlotFile] = field(default_factory=list)


def build_report(paths: list[Path]) -> Report:
    runs = [load_run(path) for path in find_run_dirs(paths)]
    keys = label_runs(runs)
    stepped = [run for run in runs if run.readable("steps.parquet")]
    completed = [run for run in runs if run.readable("completions.parquet")]
    tables = {
        "runs": ("Runs", runs_table(runs, keys)),
        "eager_vs_graph": ("Eager vs CUDA graph", eager_graph_table(runs)),
        "per_step": ("Per step, by kind, mode and padded bucket", per_step_table(stepped)),
        "time_shares": ("Where the time goes (share of summed step time)", time_shares_table(stepped)),
        "requests": ("Requests, by finish reason", requests_table(completed)),
        "kernel_steps": ("Kernels: per profiled step", kernel_steps_table(runs)),
        "kernel_share": (f"Kernels by share of time (top {TOP_KERNELS} per run, kind and mode)",
                         kernel_share_table(runs)),
    }
    incomplete = [run for run in runs if not run.complete]
    notes = [f"{len(runs)} runs" + (f", {len(incomplete)} incomplete (killed or still running)" if incomplete else "")]
    return Report(runs, keys, tables, notes)


def draw_plots(report: Report, out_dir: Path, max_runs: int) -> None:
    try:
        from batchgen.report.plots import Plotter

        plotter = Plotter(out_dir, max_runs)
    except ImportError:
        report.notes.append(PLOTS_HINT)
        return
    report.plots = plotter.draw_all(report.runs, report.keys, report.tables["runs"][1])
    if len(report.runs) > max_runs:
        report.notes.append(f"Per-run plots show the first {max_runs} runs (--max-run-plots).")


def write_report(report: Report, out_dir: Path, plots: bool = True, max_runs: int = 8) -> Path:
    """Writes everything into out_dir; returns the path of report.md."""
    (out_dir / "tables").mkdir(parents=True, exist_ok=True)
    if plots:
        draw_plots(report, out_dir, max_runs)
    sections = [(name, heading, frame) for name, (heading, frame) in report.tables.items()
                if not frame.empty or name in ("runs", "eager_vs_graph")]
    for name, _, frame in sections:
        frame.to_parquet(out_dir / "tables" / f"{name}.parquet", index=False)
    title = "batchgen report"
    (out_dir / "report.html").write_text(html_page(title, sections, report.plots, report.notes))
    md_path = out_dir / "report.md"
    md_path.write_text(markdown(title, sections, report.plots, report.notes))
    return md_path
