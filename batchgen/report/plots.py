"""The report's plots, drawn with matplotlib (the `report` extra) into PNG files."""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from batchgen.report.run_data import Run
from batchgen.report.tables_runs import DEVICE_TIME, HOST_TIME
from batchgen.report.tables_steps import labelled_steps

MAX_LINES = 10  # series per sweep plot: more make an unreadable legend
LABEL_WIDTH = 40  # characters per line of a run's label beside its bars
COMPONENTS = [*HOST_TIME, *DEVICE_TIME, "wait_ms"]
THROUGHPUT_POINTS = 50  # points per run: the window spans len(steps) / 50 steps


@dataclass
class PlotFile:
    path: Path
    title: str


class Plotter:
    """Draws each plot into out_dir; per-run plots (the step timeline) only for the first max_runs runs."""

    def __init__(self, out_dir: Path, max_runs: int):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        self.plt = plt
        self.out_dir = out_dir
        self.max_runs = max_runs
        self.files: list[PlotFile] = []

    def _save(self, fig, name: str, title: str) -> None:
        fig.suptitle(title)
        fig.tight_layout()
        path = self.out_dir / f"{name}.png"
        fig.savefig(path, dpi=90, bbox_inches="tight")  # legends placed beside the axes stay inside
        self.plt.close(fig)
        self.files.append(PlotFile(path, title))

    def draw_all(self, runs: list[Run], keys: list[str], runs_table: pd.DataFrame) -> list[PlotFile]:
        with_steps = [run for run in runs if run.readable("steps.parquet")][: self.max_runs]
        for number, run in enumerate(with_steps):
            self.step_timeline(run, number)
        if with_steps:
            self.step_components(with_steps)
            self.decode_vs_batch(with_steps)
            self.throughput_over_time(with_steps)
        with_completions = [run for run in runs if run.readable("completions.parquet")][: self.max_runs]
        if with_completions:
            self.latency_cdfs(with_completions)
        for key in keys:
            self.sweep(runs_table, keys, key)
        return self.files

    def step_timeline(self, run: Run, number: int) -> None:
        steps = labelled_steps(run)
        fig, ax = self.plt.subplots(figsize=(9, 4))
        profiled = steps["step"].isin(run.kernels["step"]) if run.kernels is not None else steps["step"] < 0
        for (kind, mode), group in steps[~profiled].groupby(["kind", "mode"]):
            ax.plot(group["step"], group["step_ms"], ".", markersize=4, label=f"{kind} / {mode}")
        if profiled.any():
            ax.plot(steps.loc[profiled, "step"], steps.loc[profiled, "step_ms"], "x", color="black", markersize=5,
                    label="profiled (slowed by the profiler)")
            if (~profiled).any():  # the scale of the unprofiled steps; a profiled step may run off the top
                ax.set_ylim(0, steps.loc[~profiled, "step_ms"].max() * 1.2)
        ax.set_xlabel("step index")
        ax.set_ylabel("step time (ms)")
        batch = ax.twinx()
        batch.plot(steps["step"], steps["num_seqs"], color="grey", linewidth=0.8, alpha=0.6, label="batch size")
        batch.set_ylabel("batch size (sequences)")
        batch.set_ylim(0, steps["num_seqs"].max() * 1.1 + 1)
        handles, labels = ax.get_legend_handles_labels()
        extra_handles, extra_labels = batch.get_legend_handles_labels()
        ax.legend(handles + extra_handles, labels + extra_labels, loc="upper right", fontsize=8)
        self._save(fig, f"timeline_{number}", f"Step timeline: {run.label}")

    def step_components(self, runs: list[Run]) -> None:
        """One stacked bar per run and step group (kind, graph or eager, bucket), each on its own row."""
        steps = pd.concat([labelled_steps(run) for run in runs], ignore_index=True)
        medians = steps.groupby(["run", "kind", "mode", "bucket"], sort=False)[COMPONENTS].median()
        names = [_group_name(runs, *index) for index in medians.index]
        rows = np.arange(len(names))  # positions, not names: runs whose names read alike keep their own bars
        label_lines = sum(name.count("\n") + 1 for name in names)
        fig, ax = self.plt.subplots(figsize=(10, 1.5 + 0.15 * len(names) + 0.15 * label_lines))
        left = np.zeros(len(names))
        for column in COMPONENTS:
            ax.barh(rows, medians[column].to_numpy(), left=left, label=column.removesuffix("_ms"))
            left += medians[column].to_numpy()
        ax.set_yticks(rows, names)
        ax.invert_yaxis()  # first run on top
        ax.set_xlabel("median time per step (ms)")
        ax.set_ylabel("step group")
        ax.tick_params(axis="y", labelsize=7)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), title="component")
        self._save(fig, "step_components", "Median step time by component")

    def decode_vs_batch(self, runs: list[Run]) -> None:
        fig, ax = self.plt.subplots(figsize=(8, 4.5))
        buckets: set[int] = set()
        for run in runs:
            steps = labelled_steps(run)
            decode = steps[steps["kind"] == "decode"]
            for mode, group in decode.groupby("mode"):
                line = group.groupby("num_seqs")["step_ms"].median()
                ax.plot(line.index, line.to_numpy(), marker="o", markersize=3, label=_short(f"{run.label} {mode}"))
            if run.figures:
                buckets.update(run.figures.cuda_graph_sizes)
        top = ax.get_xlim()[1]
        for size in sorted(b for b in buckets if b <= top):
            ax.axvline(size, color="grey", linestyle=":", linewidth=0.7)
        if buckets:
            ax.plot([], [], color="grey", linestyle=":", label="CUDA-graph capture sizes")
        ax.set_xlabel("batch size (sequences)")
        ax.set_ylabel("median decode step time (ms)")
        ax.legend(fontsize=7)
        self._save(fig, "decode_vs_batch", "Decode step time against batch size")

    def throughput_over_time(self, runs: list[Run]) -> None:
        """Sampled tokens per second over a sliding window of steps: every scheduled sequence samples one token (a
        prefill chunk that does not finish its prompt is the exception, so prefill-heavy stretches read high)."""
        fig, ax = self.plt.subplots(figsize=(8, 4))
        for run in runs:
            steps = run.steps
            window = max(1, len(steps) // THROUGHPUT_POINTS)
            tokens = steps["num_seqs"].rolling(window).sum()
            seconds = steps["step_ms"].rolling(window).sum() / 1000
            ax.plot(steps["step_ms"].cumsum() / 1000, tokens / seconds, label=_short(run.label))
        ax.set_xlabel("engine time (s)")
        ax.set_ylabel("output tokens per second")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
        self._save(fig, "throughput_over_time", "Output tok/s over the run")

    def latency_cdfs(self, runs: list[Run]) -> None:
        fig, axes = self.plt.subplots(1, 2, figsize=(10, 4))
        for ax, column, name in zip(axes, ["ttft_ms", "tpot_ms"], ["TTFT", "TPOT"], strict=True):
            for run in runs:
                values = np.sort(run.completions[column].dropna().to_numpy())
                if len(values):
                    ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post",
                            label=_short(run.label))
            ax.set_xlabel(f"{name} (ms)")
            ax.set_ylabel("fraction of requests")
            ax.set_title(f"{name} CDF")
            ax.legend(fontsize=7)
        self._save(fig, "latency_cdf", "Request latency distributions")

    def sweep(self, table: pd.DataFrame, keys: list[str], key: str) -> None:
        """Output tok/s against `key`, one series per combination of the other keys: lines over a numeric key,
        grouped bars over a categorical one (a line between categories would suggest values in between)."""
        done = table[table["output_tok_s"].notna()]
        if done[key].nunique() < 2:
            return
        others = [k for k in keys if k != key]
        groups = list(done.groupby(others, sort=True)) if others else [((), done)]
        shown = groups[:MAX_LINES]
        named = [(_series_name(others, values), group) for values, group in shown]
        numeric = pd.to_numeric(done[key], errors="coerce")
        fig, ax = self.plt.subplots(figsize=(7, 4))
        if numeric.notna().all():
            for name, group in named:
                group = group.assign(x=numeric[group.index]).sort_values("x")
                ax.plot(group["x"], group["output_tok_s"], marker="o", label=name)
        else:
            self._grouped_bars(ax, named, key)
        ax.set_xlabel(key)
        ax.set_ylabel("output tok/s")
        ax.legend(fontsize=7)
        more = f" (first {MAX_LINES} of {len(groups)} series)" if len(groups) > MAX_LINES else ""
        self._save(fig, f"sweep_{_file_name(key)}", f"Output tok/s against {key}{more}")

    @staticmethod
    def _grouped_bars(ax, named: list[tuple[str, pd.DataFrame]], key: str) -> None:
        """One group of bars per value of `key`, one bar per series (repeats of a setting averaged); the values'
        labels slanted to stay apart."""
        categories = sorted({str(value) for _, group in named for value in group[key]})
        positions = np.arange(len(categories))
        width = 0.8 / len(named)
        for number, (name, group) in enumerate(named):
            heights = group.groupby(group[key].astype(str))["output_tok_s"].mean().reindex(categories)
            ax.bar(positions + (number - (len(named) - 1) / 2) * width, heights.to_numpy(), width, label=name)
        ax.set_xticks(positions, categories, rotation=30, ha="right", rotation_mode="anchor")


def _series_name(others: list[str], values) -> str:
    values = values if isinstance(values, tuple) else (values,)
    return _short(" ".join(f"{k}={v}" for k, v in zip(others, values, strict=True)) or "output tok/s")


def _group_name(runs: list[Run], run: str, kind: str, mode: str, bucket: int) -> str:
    """The step group, under its run's whole label (wrapped) when there are several runs."""
    prefix = "\n".join(textwrap.wrap(run, LABEL_WIDTH)) + "\n" if len(runs) > 1 else ""
    return f"{prefix}{kind}/{mode}" + (f"/{bucket}" if bucket else "")


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _file_name(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", key)
