"""The report's tables from run directories with known numbers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pd = pytest.importorskip("pandas", reason="the report needs pandas (the report extra)")

from batchgen.report.build import build_report, write_report  # noqa: E402
from batchgen.report.discover import ReportInputError  # noqa: E402
from batchgen.report.summary_fields import read_figures  # noqa: E402
from tests.helpers.report_runs import completion, step, summary, write_run  # noqa: E402

TIMES = dict(schedule_ms=0.5, prepare_ms=0.5, forward_ms=2.0, sample_ms=1.0)


@pytest.fixture
def sweep(tmp_path):
    """Two runs differing only in engine.enforce_eager, with hand-computable tables."""
    write_run(tmp_path / "0", ["job=x", "engine.enforce_eager=true"], summary(100.0),
              [step(0, "prefill", 10.0), *(step(i + 1, "decode", ms, **TIMES) for i, ms in enumerate([2, 4, 6]))],
              [completion(0, [5, 6], ttft_ms=10), completion(1, [7, 8], ttft_ms=20)],
              [{"step": 5, "kind": "decode", "cuda_graph": False, "name": n, "start_us": s, "duration_us": d,
                "gap_before_us": g} for n, s, d, g in [("a", 0, 10, 0), ("b", 15, 5, 5), ("a", 25, 10, 5)]])
    write_run(tmp_path / "1", ["job=x", "engine.enforce_eager=False"], summary(150.0),
              [step(0, "prefill", 10.0), *(step(i + 1, "decode", ms, padded_size=4) for i, ms in enumerate([1, 2, 3]))],
              [completion(0, [5, 6], ttft_ms=30), completion(1, [7, 9], ttft_ms=40)])
    return tmp_path


def table(report, name):
    return report.tables[name][1]


def test_runs_are_labelled_by_the_overrides_that_differ(sweep):
    runs = table(build_report([sweep]), "runs")
    assert list(runs["run"]) == ["engine.enforce_eager=true", "engine.enforce_eager=false"]
    assert list(runs["output_tok_s"]) == [100.0, 150.0]
    assert list(runs["errors"]) == [1, 1]
    assert list(runs["status"]) == ["complete", "complete"]


def test_eager_vs_graph_pairs_runs_and_compares_tokens_row_by_row(sweep):
    pairs = table(build_report([sweep]), "eager_vs_graph")
    row = pairs.iloc[0].to_dict()
    assert len(pairs) == 1
    assert row["eager_output_tok_s"] == 100.0 and row["graph_output_tok_s"] == 150.0
    assert row["e2e_speedup_x"] == 1.5
    assert row["eager_decode_step_ms_p50"] == 4.0 and row["graph_decode_step_ms_p50"] == 2.0
    assert row["step_speedup_x"] == 2.0
    assert (row["tokens_identical"], row["identical_rows"], row["compared_rows"]) == ("false", 1, 2)


def test_graph_decode_median_leaves_out_the_eager_decode_steps_of_a_graph_run(tmp_path):
    """A graph run decodes eagerly above its largest bucket; those steps are not the graph's."""
    write_run(tmp_path / "0", ["engine.enforce_eager=true"], summary(1.0), [step(0, "decode", 4.0)],
              [completion(0, [1])])
    write_run(tmp_path / "1", ["engine.enforce_eager=false"], summary(1.0),
              [step(0, "decode", 1.0, padded_size=4), step(1, "decode", 9.0), step(2, "decode", 9.0)],
              [completion(0, [1])])
    row = table(build_report([tmp_path]), "eager_vs_graph").iloc[0]
    assert (row["eager_decode_step_ms_p50"], row["graph_decode_step_ms_p50"]) == (4.0, 1.0)


def test_sampled_runs_compare_tokens_too(tmp_path):
    sampled = summary(1.0, config={"sampling": {"temperature": 0.8}})
    for number, eager in enumerate(["true", "false"]):
        write_run(tmp_path / str(number), [f"engine.enforce_eager={eager}"], sampled, [step(0, "decode", 1.0)],
                  [completion(0, [1])])
    row = table(build_report([tmp_path]), "eager_vs_graph").iloc[0]
    assert (row["tokens_identical"], row["identical_rows"]) == ("true", 1)  # seeded rows sample alike


def test_per_step_percentiles_by_kind_mode_and_bucket(sweep):
    steps = table(build_report([sweep]), "per_step").set_index(["run", "kind", "mode", "bucket"])
    eager = steps.loc[("engine.enforce_eager=true", "decode", "eager", 0)]
    assert eager["steps"] == 3 and eager["step_ms_p50"] == 4.0 and eager["step_ms_p90"] == pytest.approx(5.6)
    assert eager["forward_ms_p50"] == 2.0 and eager["padding_seqs_mean"] == 0
    graph = steps.loc[("engine.enforce_eager=false", "decode", "graph", 4)]
    assert graph["step_ms_p50"] == 2.0 and graph["padding_seqs_mean"] == 2.0 and graph["num_seqs_mean"] == 2.0


def test_time_shares_split_device_host_wait_and_the_rest(sweep):
    shares = table(build_report([sweep]), "time_shares").set_index("run").loc["engine.enforce_eager=true"]
    assert shares["step_ms_total"] == 22.0  # 10 + 2 + 4 + 6; three decode steps of 3 ms device, 1 ms host
    assert shares["device_pct"] == pytest.approx(100 * 9 / 22)
    assert shares["host_pct"] == pytest.approx(100 * 3 / 22)
    assert shares["other_pct"] == pytest.approx(100 * 10 / 22)
    assert shares["bound"] == "host"


def test_request_percentiles_by_finish_reason(sweep):
    requests = table(build_report([sweep]), "requests").set_index("run").loc["engine.enforce_eager=true"]
    assert requests["requests"] == 2
    assert (requests["ttft_ms_p50"], requests["ttft_ms_p90"]) == (15.0, 19.0)
    assert requests["ttft_ms_p99"] == pytest.approx(19.9)


def test_kernel_tables_sum_gaps_and_rank_kernels(sweep):
    report = build_report([sweep])
    per_step = table(report, "kernel_steps").iloc[0]
    assert (per_step["kernels"], per_step["wall_us"], per_step["kernel_us"], per_step["gap_us"]) == (3, 35, 25, 10)
    assert per_step["gap_pct"] == pytest.approx(100 * 10 / 35)
    share = table(report, "kernel_share")
    assert list(share["name"]) == ["a", "b"]
    assert list(share["time_pct"]) == [80.0, 20.0]
    assert list(share["avg_us"]) == [10.0, 5.0]
    assert list(share["launches_per_step"]) == [2.0, 1.0]


def test_without_overrides_labels_come_from_the_config(tmp_path):
    for number, seqs in enumerate([8, 16]):
        write_run(tmp_path / str(number), None, summary(1.0, config={"engine": {"max_num_seqs": seqs}}),
                  [step(0, "decode", 1.0)], [completion(0, [1])])
    assert list(table(build_report([tmp_path]), "runs")["run"]) == ["engine.max_num_seqs=8",
                                                                    "engine.max_num_seqs=16"]


def test_a_killed_run_is_listed_as_incomplete(sweep):
    write_run(sweep / "2", ["job=x", "engine.enforce_eager=true", "engine.max_num_seqs=4"], None,
              [step(0, "prefill", 1.0)], None)
    report = build_report([sweep])
    runs = table(report, "runs").set_index("path")
    assert runs.loc[str(sweep / "2"), "status"] == "incomplete: missing summary.json, completions.parquet"
    assert len(table(report, "eager_vs_graph")) == 1
    write_report(report, sweep / "report", plots=False)
    assert (sweep / "report" / "report.md").exists()


def test_an_empty_or_missing_path_is_an_error_naming_it(tmp_path):
    with pytest.raises(ReportInputError, match=f"{tmp_path}: no run directories found"):
        build_report([tmp_path])
    with pytest.raises(ReportInputError, match="no such directory"):
        build_report([tmp_path / "nope"])


def test_summary_figures_read_todays_and_a_scoped_shape():
    flat = summary(7.0)
    nested = {"job": {"error_rows": 1, **{k: flat[k] for k in ("rows", "finish_reasons", "prompt_tokens",
                                                              "output_tokens")}},
              "this_attempt": {"attempt": 0, "wall_seconds": 2.0, "prompt_tokens_per_s": 5.0,
                               "output_tokens_per_s": 7.0},
              "attempt": 0, "engine": flat["engine"], "config": flat["config"]}
    assert read_figures(flat) == read_figures(nested)


def test_write_report_writes_every_table_as_parquet_and_markdown(sweep):
    report = build_report([sweep])
    md = write_report(report, sweep / "report", plots=False)
    for name in ("runs", "eager_vs_graph", "per_step", "time_shares", "requests", "kernel_steps", "kernel_share"):
        assert pd.read_parquet(sweep / "report" / "tables" / f"{name}.parquet").equals(table(report, name))
    text = md.read_text()
    assert "| engine.enforce_eager=true | true |" in text and "## Eager vs CUDA graph" in text


def test_the_report_never_imports_torch():
    code = "import sys, batchgen.report.__main__, batchgen.report.build; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert done.stdout.strip() == "False"
