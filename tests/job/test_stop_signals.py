"""SIGTERM and SIGINT on a real job: every finished row flushed, one line that says how to resume, 143 / 130, and
the resumed run holds exactly the rows of an uninterrupted one. Resuming with a changed configuration is refused."""

from __future__ import annotations

import json
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchgen.io.schema import read_metadata
from tests.helpers.common import REPO, batchgen, comparable, wait_for_parts

ROWS = 16
OVERRIDES = ["job=shakespeare", f"data.limit={ROWS}", "sampling.max_tokens=32", "engine.max_num_seqs=2",
             "job.flush_rows=2", "job.flush_seconds=3600"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("reference")
    result = batchgen(run_dir, *OVERRIDES)
    assert result.returncode == 0, result.stdout + result.stderr
    return run_dir / "completions.parquet"


def rows_on_disk(run_dir: Path) -> int:
    return sum(pq.read_metadata(part).num_rows for part in (run_dir / "completions.parts").glob("part-*.parquet"))


def stop_with(signum: signal.Signals, run_dir: Path) -> tuple[int, str]:
    process = batchgen(run_dir, *OVERRIDES, wait=False)
    wait_for_parts(run_dir, 1, process)
    process.send_signal(signum)
    output = process.communicate(timeout=300)[0].decode()
    return process.returncode, output


@pytest.mark.parametrize(("signum", "exit_code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_flushes_reports_once_and_resumes_exactly(tmp_path, reference, signum, exit_code):
    run_dir = tmp_path / "run"
    returncode, output = stop_with(signum, run_dir)
    assert returncode == exit_code, output
    assert "Traceback" not in output
    lines = [line for line in output.splitlines() if line.startswith("stopped by")]
    assert len(lines) == 1, output
    done = rows_on_disk(run_dir)
    assert lines[0].startswith(f"stopped by {signum.name} after {done} of {ROWS} rows; resume with: "), output
    assert 2 <= done < ROWS

    command = shlex.split(lines[0].split("resume with: ", 1)[1])
    assert command[:3] == ["python", "-m", "batchgen"]
    assert f"hydra.run.dir={run_dir}" in command and command[-1] == "job.resume=true"
    resumed = subprocess.run([sys.executable, *command[1:]], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert comparable(run_dir / "completions.parquet") == comparable(reference)


def test_resume_refuses_a_changed_configuration_unless_forced(tmp_path, reference):
    run_dir = tmp_path / "run"
    returncode, output = stop_with(signal.SIGTERM, run_dir)
    assert returncode == 143, output
    done = rows_on_disk(run_dir)

    refused = batchgen(run_dir, *OVERRIDES, "sampling.max_tokens=16", "engine.seed=5", "job.resume=true")
    assert refused.returncode == 2
    message = refused.stdout + refused.stderr
    assert "engine.seed: 0 -> 5" in message and "sampling.max_tokens: 32 -> 16" in message
    assert rows_on_disk(run_dir) == done  # nothing was written

    forced_dir = tmp_path / "forced"
    shutil.copytree(run_dir, forced_dir)
    forced = batchgen(forced_dir, *OVERRIDES, "engine.seed=5", "job.resume=force")
    assert forced.returncode == 0, forced.stdout + forced.stderr
    summary = json.loads((forced_dir / "summary.json").read_text())
    assert summary["resume_forced"]["differences"] == {"engine.seed": [0, 5]}
    assert summary["resume_forced"]["started_config"]["engine"]["seed"] == 0
    assert read_metadata(forced_dir / "completions.parquet")["resume_forced"]["differences"] == {"engine.seed": [0, 5]}

    # Throughput knobs may change: the resume goes on and ends with the rows of an uninterrupted run.
    allowed = batchgen(run_dir, *OVERRIDES, "engine.max_num_seqs=4", "job.flush_rows=1", "job.resume=true")
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr
    assert comparable(run_dir / "completions.parquet") == comparable(reference)
