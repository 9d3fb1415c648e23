"""The report's plots, read back from their figure objects: what is drawn, where, and whether the labels collide."""

from __future__ import annotations

from itertools import combinations
from pathlib import Path

import pytest

pd = pytest.importorskip("pandas", reason="the report needs pandas (the report extra)")
pytest.importorskip("matplotlib", reason="the report's plots need matplotlib (the report extra)")

from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402

from batchgen.report.build import build_report  # noqa: E402
from batchgen.report.plots import Plotter  # noqa: E402
from tests.helpers.report_runs import step, summary, write_run  # noqa: E402

PRESETS = ["smoke_test", "medium_generation", "near_context_limit", "long_generation"]
TIMES = dict(schedule_ms=0.5, prepare_ms=0.5, forward_ms=2.0, sample_ms=1.0)


class FigureKeepingPlotter(Plotter):
    """Saves as the report does and keeps each figure for the test to read."""

    def __init__(self, out_dir: Path):
        super().__init__(out_dir, max_runs=8)
        self.figures: dict = {}

    def _save(self, fig, name: str, title: str) -> None:
        super()._save(fig, name, title)
        self.figures[name] = fig


def plotter_and_report(path: Path):
    (path / "plots").mkdir()
    return FigureKeepingPlotter(path / "plots"), build_report([path])


def sweep_axes(path: Path, key: str):
    plotter, report = plotter_and_report(path)
    plotter.sweep(report.tables["runs"][1], report.keys, key)
    return plotter.figures[f"sweep_{key}"].axes[0]


def overlapping(labels) -> list[tuple[str, str]]:
    renderer = FigureCanvasAgg(labels[0].figure).get_renderer()  # the saved figure's canvas is gone with it
    boxes = [(label.get_text(), label.get_window_extent(renderer)) for label in labels]
    return [(a, b) for (a, box_a), (b, box_b) in combinations(boxes, 2) if box_a.overlaps(box_b)]


@pytest.fixture
def preset_sweep(tmp_path):
    """A preset sweep (categorical) crossed with engine.max_num_seqs (numeric); tok/s = 100 * seqs + preset."""
    number = 0
    for preset_number, preset in enumerate(PRESETS):
        for seqs in (4, 16):
            write_run(tmp_path / str(number), ["job=x", f"preset={preset}", f"engine.max_num_seqs={seqs}"],
                      summary(100.0 * seqs + preset_number), [step(0, "decode", 4.0)], None)
            number += 1
    return tmp_path


def test_a_categorical_sweep_is_grouped_bars_with_labels_apart(preset_sweep):
    ax = sweep_axes(preset_sweep, "preset")
    assert not ax.get_lines()
    categories = sorted(PRESETS)
    assert [label.get_text() for label in ax.get_xticklabels()] == categories
    assert [container.get_label() for container in ax.containers] == ["engine.max_num_seqs=16",
                                                                        "engine.max_num_seqs=4"]
    for container, seqs in zip(ax.containers, (16, 4), strict=True):
        assert [bar.get_height() for bar in container] == [100.0 * seqs + PRESETS.index(p) for p in categories]
    # Each group of bars sits over its own label, and the labels do not run into each other.
    centres = [[bar.get_x() + bar.get_width() / 2 for bar in container] for container in ax.containers]
    assert all(a < b for a, b in zip(centres[0], centres[1], strict=True))
    assert [round((a + b) / 2, 6) for a, b in zip(*centres, strict=True)] == list(ax.get_xticks())
    assert overlapping(ax.get_xticklabels()) == []


def test_a_numeric_sweep_stays_lines(preset_sweep):
    ax = sweep_axes(preset_sweep, "engine.max_num_seqs")
    assert not ax.containers
    lines = {line.get_label(): list(line.get_xdata()) for line in ax.get_lines()}
    assert lines == {f"preset={preset}": [4, 16] for preset in PRESETS}


def test_step_components_draw_one_bar_per_run_and_step_kind(tmp_path):
    """Labels alike in their first 30 characters once put several runs' bars on one row, stacked into one bar."""
    settings = [(2048, 4), (2048, 16), (4096, 4)]
    for number, (tokens, seqs) in enumerate(settings):
        overrides = ["job=x", f"engine.max_num_batched_tokens={tokens}", f"engine.max_num_seqs={seqs}"]
        steps = [step(0, "prefill", 10.0, **TIMES), *(step(i, "decode", 4.0 + seqs, **TIMES) for i in (1, 2, 3))]
        write_run(tmp_path / str(number), overrides, summary(100.0), steps, None)
    plotter, report = plotter_and_report(tmp_path)
    plotter.step_components(report.runs)
    ax = plotter.figures["step_components"].axes[0]
    labels = [label.get_text().replace("\n", " ") for label in ax.get_yticklabels()]
    assert labels == [f"engine.max_num_batched_tokens={tokens} engine.max_num_seqs={seqs} {kind}/eager"
                      for tokens, seqs in settings for kind in ("prefill", "decode")]
    for container in ax.containers:  # one per component, with one bar on each row
        assert sorted(bar.get_y() + bar.get_height() / 2 for bar in container) == list(ax.get_yticks())
    forward = next(c for c in ax.containers if c.get_label() == "forward")
    assert [bar.get_width() for bar in forward] == [2.0] * 6
    assert overlapping(ax.get_yticklabels()) == []
