"""The job end to end: `python -m batchgen` in a subprocess, its three files, bad input, kill and resume."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchgen.config import JobConfig
from batchgen.engine.outputs import RequestOutput
from batchgen.io.readers import PromptRow
from batchgen.io.schema import read_metadata
from batchgen.job.progress import Progress
from batchgen.job.run import WrittenFront
from tests.helpers.common import REPO, batchgen, comparable, wait_for_parts, write_lines


def test_shakespeare_job_writes_three_files(tmp_path):
    result = batchgen(tmp_path, "job=shakespeare", "preset=smoke_test", "data.limit=40")
    assert result.returncode == 0, result.stdout + result.stderr
    completions = pq.read_table(tmp_path / "completions.parquet").to_pandas()
    assert list(completions["index"]) == list(range(40))
    assert completions["id"].is_unique and completions["id"].iloc[0] == "bench-00000"
    assert (completions["num_prompt_tokens"] == 4).all() and (completions["num_output_tokens"] == 8).all()
    assert (completions["finish_reason"] == "length").all() and completions["error"].isna().all()
    assert (completions["completion"].str.len() == 8).all()  # one character per token
    steps = pq.read_table(tmp_path / "steps.parquet").to_pandas()
    assert set(steps["kind"]) <= {"prefill", "decode", "mixed"} and len(steps) > 0
    assert steps["num_decode_tokens"].sum() + steps["num_prefill_tokens"].sum() == steps["num_tokens"].sum()
    assert steps["step"].is_monotonic_increasing and not steps["cuda_graph"].any()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["rows"] == 40 and summary["output_tokens"] == 320 and summary["output_tokens_per_s"] > 0
    assert summary["config"]["sampling"]["max_tokens"] == 8
    # 40 rows of 4 + 8 tokens, one 16-token block each, all running at once: the cache holds just that.
    assert summary["engine"]["kv_blocks"] == 40
    assert "40 largest of the job's 40 rows" in summary["engine"]["kv_blocks_reason"]
    engine_start = summary["this_attempt"]["time_seconds"]["engine_start"]
    assert 0 < summary["engine"]["load_seconds"] + summary["engine"]["kv_sizing_seconds"] <= engine_start
    assert read_metadata(tmp_path / "completions.parquet")["config"]["job"]["name"] == "shakespeare"
    assert not (tmp_path / "completions.parts").exists()
    assert "Done: 40 rows (0 errors)" in result.stdout + result.stderr


def test_main_job_imports_no_transformers(tmp_path):
    """transformers costs about a second of start-up; the main job's model and tokenizer need none of it, nor its
    text prompts the chat templates' jinja2."""
    command = [sys.executable, "-X", "importtime", "-m", "batchgen", f"hydra.run.dir={tmp_path}", "engine.device=cpu",
               "job.progress=false", "job=shakespeare", "data.limit=1"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()
                if line.startswith("import time:")}
    assert "torch" in imported and "transformers" not in imported and "jinja2" not in imported


def test_summary_scopes_and_where_the_time_went(tmp_path):
    result = batchgen(tmp_path, "job=shakespeare", "preset=smoke_test", "data.limit=12", "engine.max_num_seqs=4")
    assert result.returncode == 0, result.stdout + result.stderr
    summary_text = (tmp_path / "summary.json").read_text()
    summary = json.loads(summary_text)
    job, attempt = summary["job"], summary["this_attempt"]
    assert job["rows"] == attempt["rows"] == 12 and job["error_rows"] == 0 and job["attempts"] == 1
    assert job["output_tokens"] == attempt["output_tokens"] == 96 and job["steps"] == attempt["steps"]
    steps = pq.read_table(tmp_path / "steps.parquet").to_pandas()
    times = attempt["time_seconds"]
    # The steps' step_ms are the engine loop minus what ran outside every step; the job's phases make up its wall
    # time, the process's start-up comes before it.
    assert times["steps"] == pytest.approx(steps["step_ms"].sum() / 1000)
    assert times["outside_steps"] >= 0
    job_seconds = sum(times.values()) - times["startup"]
    assert job_seconds == pytest.approx(attempt["wall_seconds"]) == pytest.approx(summary["wall_seconds"])
    assert (steps["job_ms"] <= steps["step_ms"]).all() and (steps["job_ms"] >= 0).all()

    # Resuming a finished run has nothing to do and keeps its summary.
    again = batchgen(tmp_path, "job=shakespeare", "preset=smoke_test", "data.limit=12", "job.resume=true")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "Nothing to do" in again.stdout + again.stderr
    assert (tmp_path / "summary.json").read_text() == summary_text


def test_summary_accounts_for_the_process_from_its_start(tmp_path):
    """time_seconds starts at the process's creation: its start-up (split into startup_phases) until the job starts,
    then the job's phases; the log says where the time went in one line."""
    started = time.monotonic()  # the clock of perf_counter, shared by the processes of one machine on Linux
    result = batchgen(tmp_path, "job=shakespeare", "preset=smoke_test", "data.limit=4")
    process_seconds = time.monotonic() - started
    assert result.returncode == 0, result.stdout + result.stderr
    attempt = json.loads((tmp_path / "summary.json").read_text())["this_attempt"]
    times, phases = attempt["time_seconds"], attempt["startup_phases"]
    interpreter = ["interpreter"] if Path("/proc/self/stat").exists() else []  # known from /proc only
    assert list(phases) == [*interpreter, "cli_imports", "hydra", "config", "engine_imports", "launch"]
    assert all(seconds >= 0 for seconds in [*times.values(), *phases.values()]), (times, phases)
    assert times["startup"] == pytest.approx(sum(phases.values()))
    assert phases["engine_imports"] > 0  # torch is imported there
    assert 0 < times["startup"] < sum(times.values()) <= process_seconds
    lines = [line for line in (result.stdout + result.stderr).splitlines() if "Time to the final files" in line]
    assert len(lines) == 1 and "start-up" in lines[0] and "engine imports" in lines[0], lines
    for phase in ("read input", "open outputs", "engine start", "engine loop", "engine close", "finish"):
        assert f"{phase} " in lines[0]


def test_each_steps_parts_fit_inside_its_step_ms(tmp_path):
    """On CPU every part is host time spent on the step itself, so the parts add up to no more than step_ms, even
    with async scheduling launching the next step before this one's results are applied."""
    result = batchgen(tmp_path, "job=shakespeare", "preset=smoke_test", "data.limit=12", "engine.max_num_seqs=4")
    assert result.returncode == 0, result.stdout + result.stderr
    steps = pq.read_table(tmp_path / "steps.parquet").to_pandas()
    parts = steps[["schedule_ms", "prepare_ms", "forward_ms", "sample_ms", "wait_ms"]].sum(axis="columns")
    assert (parts <= steps["step_ms"] + 1e-9).all(), steps[["step", "kind", "forward_ms", "step_ms"]].to_string()
    assert (steps["num_tokens"] > 0).all() and (steps["forward_ms"] > 0).all() and (steps["step_ms"] > 0).all()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["this_attempt"]["time_seconds"]["steps"] == pytest.approx(steps["step_ms"].sum() / 1000)


def test_empty_input_warns_or_fails_naming_the_file(tmp_path):
    prompts = tmp_path / "empty.jsonl"
    prompts.write_text("")
    warned = batchgen(tmp_path / "warn", "job=shakespeare", f"data.path={prompts}")
    assert warned.returncode == 0, warned.stdout + warned.stderr
    assert [line for line in (warned.stdout + warned.stderr).splitlines() if "WARNING" in line] == [
        line for line in (warned.stdout + warned.stderr).splitlines() if "empty.jsonl has no rows" in line]
    assert pq.read_table(tmp_path / "warn" / "completions.parquet").num_rows == 0
    failed = batchgen(tmp_path / "fail", "job=shakespeare", f"data.path={prompts}", "data.on_empty=fail")
    assert failed.returncode == 2 and "empty.jsonl: no rows" in failed.stdout + failed.stderr
    assert not (tmp_path / "fail").exists()




def test_malformed_row_fails_fast_naming_file_and_line(tmp_path):
    prompts = write_lines(tmp_path / "prompts.jsonl", ['{"prompt": "ROMEO:"}', '{"prompt": "JULIET:"', '{"x": 1}'])
    result = batchgen(tmp_path / "run", "job=shakespeare", f"data.path={prompts}", "data.id_field=null")
    assert result.returncode == 2
    output = result.stdout + result.stderr
    assert "prompts.jsonl" in output and "line 2" in output
    assert not (tmp_path / "run" / "completions.parquet").exists()


def test_own_prompts_without_the_jobs_id_field_say_how_to_number_them(tmp_path):
    """job=shakespeare takes ids from an `id` field, which one's own prompts may lack."""
    prompts = write_lines(tmp_path / "prompts.jsonl", ['{"prompt": "ROMEO:"}'])
    result = batchgen(tmp_path / "run", "job=shakespeare", f"data.path={prompts}")
    assert result.returncode == 2
    [error] = [line for line in (result.stdout + result.stderr).splitlines() if "ERROR" in line]
    assert f"{prompts}: line 1: missing id field 'id'" in error
    assert "data.id_field=null" in error and "data.id_field=<field>" in error


def test_malformed_rows_are_recorded_under_skip(tmp_path):
    prompts = write_lines(tmp_path / "prompts.jsonl", [
        '{"prompt": "ROMEO:"}', '{"prompt": "JULIET:"', '{"x": 1}', '{"prompt": "KING:", "max_tokens": 3}',
        '{"prompt": "' + "x" * 300 + '"}',
    ])
    result = batchgen(tmp_path, "job=shakespeare", f"data.path={prompts}", "data.id_field=null",
                      "data.on_error=skip", "sampling.max_tokens=5")
    assert result.returncode == 0, result.stdout + result.stderr
    rows = pq.read_table(tmp_path / "completions.parquet").to_pylist()
    assert [r["id"] for r in rows] == ["0", "1", "2", "3", "4"]
    assert [r["finish_reason"] for r in rows][1:3] == ["error", "error"]
    assert "line 2" in rows[1]["error"] and "line 3" in rows[2]["error"]
    assert rows[0]["num_output_tokens"] == 5 and rows[3]["num_output_tokens"] == 3
    assert rows[4]["finish_reason"] == "error" and "max_model_len" in rows[4]["error"]


def test_a_row_whose_overrides_conflict_with_the_job_becomes_an_error_row(tmp_path):
    """Each value is valid alone (the reader's check); together with the job's max_tokens it is not."""
    prompts = write_lines(tmp_path / "prompts.jsonl", [
        '{"prompt": "ROMEO:"}', '{"prompt": "KING:", "min_tokens": 9}', '{"prompt": "JULIET:", "n": 2}'])
    result = batchgen(tmp_path, "job=shakespeare", f"data.path={prompts}", "data.id_field=null",
                      "sampling.max_tokens=5")
    assert result.returncode == 0, result.stdout + result.stderr
    rows = pq.read_table(tmp_path / "completions.parquet").to_pylist()
    assert [(r["index"], r["sample_index"], r["finish_reason"]) for r in rows] == [
        (0, 0, "length"), (1, 0, "error"), (2, 0, "length"), (2, 1, "length")]
    assert rows[1]["error"] == "row 1: sampling.min_tokens=9 is invalid: must be <= max_tokens (5)"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["rows"] == 4 and summary["job"]["error_rows"] == 1


def test_the_summary_counts_the_prompt_tokens_that_ran(tmp_path):
    """An over-long prompt becomes an error row before it runs: its length stays in its row, not in the totals."""
    prompts = write_lines(tmp_path / "prompts.jsonl", [
        '{"prompt": "ROMEO:"}', '{"prompt": "' + "x" * 5000 + '"}', '{"prompt": "KING:"}'])
    result = batchgen(tmp_path, "job=shakespeare", f"data.path={prompts}", "data.id_field=null",
                      "sampling.max_tokens=3")
    assert result.returncode == 0, result.stdout + result.stderr
    rows = pq.read_table(tmp_path / "completions.parquet").to_pylist()
    assert [r["finish_reason"] for r in rows] == ["length", "error", "length"]
    assert [r["num_prompt_tokens"] for r in rows] == [6, 5000, 5]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["prompt_tokens"] == summary["job"]["prompt_tokens"] == summary["this_attempt"]["prompt_tokens"] == 11
    assert summary["prompt_tokens_per_s"] * summary["wall_seconds"] == pytest.approx(11)
    assert summary["job"]["error_rows"] == 1 and summary["output_tokens"] == 6


def test_progress_counts_the_prompt_tokens_that_ran():
    progress = Progress(3, 0, JobConfig(progress=False))
    ran = RequestOutput(0, "ROMEO:", [1] * 6, "abc", [2, 3, 4], "length")
    never_ran = RequestOutput(1, "x" * 5000, [1] * 5000, None, [], "error", error="the prompt has 5000 tokens")
    failed_while_running = RequestOutput(2, "KING:", [1] * 5, None, [2], "error", error="the grammar refused a token")
    progress.update([ran, never_ran, failed_while_running])
    progress.close()
    assert (progress.prompt_tokens, progress.output_tokens, progress.errors) == (11, 4, 2)






@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_killed_job_resumes_to_the_uninterrupted_result(tmp_path, sampling):
    overrides = ["job=shakespeare", "data.limit=48", "sampling.max_tokens=48", "engine.max_num_seqs=4",
                 "job.flush_rows=1"]
    if sampling == "greedy":
        overrides.append("sampling.temperature=0")
    reference = batchgen(tmp_path / "reference", *overrides)
    assert reference.returncode == 0, reference.stdout + reference.stderr

    run_dir = tmp_path / "killed"
    process = batchgen(run_dir, *overrides, wait=False)
    wait_for_parts(run_dir, 6, process)
    process.send_signal(signal.SIGKILL)
    process.wait()
    # Only complete parts: the kill may land while a part is still being written under its .tmp name.
    finished = sum(pq.read_metadata(part).num_rows for part in (run_dir / "completions.parts").glob("part-*.parquet"))
    assert 6 <= finished < 48

    resumed = batchgen(run_dir, *overrides, "job.resume=true")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert comparable(run_dir / "completions.parquet") == comparable(tmp_path / "reference" / "completions.parquet")
    steps = pq.read_table(run_dir / "steps.parquet").to_pandas()
    assert steps["attempt"].max() == 1
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["job"]["rows"] == 48 and summary["this_attempt"]["rows"] == 48 - finished
    assert summary["this_attempt"]["attempt"] == summary["attempt"] == 1 and summary["job"]["attempts"] == 2
    # kill -9 may take the killed attempt's unflushed steps with it, so the job's steps are at least this attempt's.
    assert summary["job"]["steps"] == len(steps) >= summary["this_attempt"]["steps"] == summary["steps"]


def test_existing_results_need_resume(tmp_path):
    first = batchgen(tmp_path, "job=shakespeare", "preset=smoke_test", "data.limit=4")
    assert first.returncode == 0
    again = batchgen(tmp_path, "job=shakespeare", "preset=smoke_test", "data.limit=4")
    assert again.returncode != 0 and "job.resume=true" in again.stdout + again.stderr


def test_multirun_sweep_writes_one_run_per_value(tmp_path):
    command = [sys.executable, "-m", "batchgen", "-m", "job=shakespeare", "preset=smoke_test", "data.limit=4",
               "engine.device=cpu", "job.progress=false", "sampling.max_tokens=3,5", f"hydra.sweep.dir={tmp_path}"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    for run, max_tokens in (("0", 3), ("1", 5)):
        completions = pq.read_table(tmp_path / run / "completions.parquet").to_pandas()
        assert (completions["num_output_tokens"] == max_tokens).all()
        assert (tmp_path / run / "steps.parquet").exists() and (tmp_path / run / "summary.json").exists()


def test_rows_that_finish_out_of_order_grow_the_completions_file_without_a_merge(tmp_path: Path) -> None:
    """Rows of different lengths finish out of order: the completions file still grows as parts are written (a row
    group each; a merge at the end writes one), and holds what a run that flushed no part holds."""
    prompts = write_lines(tmp_path / "prompts.jsonl", [json.dumps({"prompt": "ROMEO:", "max_tokens": 1 + 7 * row % 9})
                                                       for row in range(24)])
    overrides = ["job=shakespeare", f"data.path={prompts}", "data.id_field=null", "engine.max_num_seqs=4",
                 "job.flush_seconds=3600"]
    parted = batchgen(tmp_path / "parted", *overrides, "job.flush_rows=4")
    whole = batchgen(tmp_path / "whole", *overrides, "job.flush_rows=1000")
    assert parted.returncode == 0 and whole.returncode == 0, parted.stderr[-2000:] + whole.stderr[-2000:]

    completions = tmp_path / "parted" / "completions.parquet"
    assert pq.ParquetFile(completions).metadata.num_row_groups > 1
    assert comparable(completions) == comparable(tmp_path / "whole" / "completions.parquet")


def test_the_written_front_is_the_first_row_with_a_sample_to_write() -> None:
    samples = {0: 1, 2: 2, 5: 1}
    front = WrittenFront.of([row(index) for index in (0, 2, 5)], samples.__getitem__)
    assert front.first_unwritten() == 0
    front.written([output(2), output(0)])
    assert front.first_unwritten() == 2  # row 2 has a second sample to write
    front.written([output(5), output(2)])
    assert front.first_unwritten() == math.inf
    assert WrittenFront.of([row(index) for index in (2, 0)], samples.__getitem__) is None  # not in index order


def row(index: int) -> PromptRow:
    return PromptRow(index=index, id=str(index), prompt="x", prompt_token_ids=None, overrides={})


def output(index: int) -> RequestOutput:
    return RequestOutput(request_id=index, prompt="x", prompt_token_ids=[1], text="", token_ids=[],
                         finish_reason="length")
