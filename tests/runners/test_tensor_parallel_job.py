"""engine.tensor_parallel_size=2 through `python -m batchgen` on CPU: the rows of a single-process run, also as two
data-parallel ranks of two tensor-parallel ranks each; a follower killed mid-run stops the job with one line naming
it, keeping the finished rows, and resume finishes; SIGTERM to the job stops its followers too; fp8 weights split
too; a size the model cannot split is a one-line configuration error."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchgen.config import ConfigError
from batchgen.runners.gpus import check_gpus
from tests.cli.test_config import composed
from tests.helpers.common import wait_for_parts
from tests.runners.test_data_parallel import JOB, batchgen, comparable

LINUX_PROC = pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the follower in /proc (Linux)")
# Rows flushed one at a time, few at once: the job runs long enough to be interrupted after some rows are written.
SLOW = ["data.limit=32", "sampling.max_tokens=32", "engine.max_num_seqs=2", "job.flush_rows=1"]
TP = "engine.tensor_parallel_size=2"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory):
    """reference(*overrides) -> the completions of a single-process run, computed once each."""
    runs: dict[tuple[str, ...], list[dict]] = {}

    def get(*overrides: str) -> list[dict]:
        if overrides not in runs:
            run_dir = tmp_path_factory.mktemp("reference")
            result = batchgen(f"hydra.run.dir={run_dir}", *JOB, *overrides)
            assert result.returncode == 0, result.stdout + result.stderr
            runs[overrides] = comparable(run_dir)
        return runs[overrides]

    return get


def children(process: subprocess.Popen) -> list[int]:
    return [int(pid) for pid in Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()]


def exited(pid: int) -> bool:
    """Whether the process is gone (or a zombie its parent has not reaped)."""
    status = Path(f"/proc/{pid}/stat")
    return not status.exists() or status.read_text().split(") ")[1].startswith("Z")


def test_tensor_parallel_size_2_equals_a_single_process(tmp_path, reference):
    result = batchgen(f"hydra.run.dir={tmp_path}", *JOB, TP)  # the Shakespeare job samples at temperature 0.8
    assert result.returncode == 0, result.stdout + result.stderr
    assert comparable(tmp_path) == reference()
    assert pq.read_table(tmp_path / "completions.parquet").num_rows == 24


def test_data_parallel_ranks_of_two_tensor_parallel_ranks_each_equal_a_single_process(tmp_path, reference):
    small = ("data.limit=8", "sampling.max_tokens=8")
    result = batchgen(f"hydra.run.dir={tmp_path}", *JOB, *small, TP, "engine.data_parallel_size=2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert comparable(tmp_path) == reference(*small)
    assert len(list(tmp_path.glob("shard-*/shard.json"))) == 2


@LINUX_PROC
def test_a_killed_follower_stops_the_job_in_one_line_and_resume_finishes(tmp_path, reference):
    job = batchgen(f"hydra.run.dir={tmp_path}", *JOB, *SLOW, TP, wait=False)
    wait_for_parts(tmp_path, 3, job)
    (follower,) = children(job)
    os.kill(follower, signal.SIGKILL)
    output = job.communicate(timeout=300)[0].decode()
    assert job.returncode == 1, output
    (line,) = [line for line in output.splitlines() if "tensor-parallel rank" in line]
    assert f"tensor-parallel rank 1 of 2 (pid {follower}) exited on signal SIGKILL" in line
    assert "job.resume=true" in line and "Traceback" not in output
    kept = len(list((tmp_path / "completions.parts").glob("part-*.parquet")))
    assert kept >= 3 and not (tmp_path / "completions.parquet").exists()

    resumed = batchgen(f"hydra.run.dir={tmp_path}", *JOB, *SLOW, TP, "job.resume=true")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert comparable(tmp_path) == reference(*SLOW)
    steps = pq.read_table(tmp_path / "steps.parquet").column("attempt").to_pylist()
    assert set(steps) == {0, 1}


@LINUX_PROC
def test_sigterm_stops_the_followers_with_the_job(tmp_path, reference):
    job = batchgen(f"hydra.run.dir={tmp_path}", *JOB, *SLOW, TP, wait=False)
    wait_for_parts(tmp_path, 2, job)
    (follower,) = children(job)
    job.send_signal(signal.SIGTERM)
    output = job.communicate(timeout=300)[0].decode()
    assert job.returncode == 128 + signal.SIGTERM, output
    assert "stopped by SIGTERM" in output and "Traceback" not in output
    assert exited(follower)

    resumed = batchgen(f"hydra.run.dir={tmp_path}", *JOB, *SLOW, TP, "job.resume=true")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert comparable(tmp_path) == reference(*SLOW)


def test_a_size_that_does_not_split_the_model_is_a_config_error(tmp_path):
    result = batchgen(f"hydra.run.dir={tmp_path}", *JOB, "engine.tensor_parallel_size=3")
    assert result.returncode == 2
    assert ("engine.tensor_parallel_size=3 is invalid: it must divide the model's num_attention_heads (4)"
            in result.stdout + result.stderr)
    with pytest.raises(ConfigError, match="runner=ray runs one GPU an actor"):
        composed("job=shakespeare", "runner=ray", TP)


def test_fp8_weights_with_tensor_parallel_size_2_equal_a_single_process(tmp_path, reference):
    result = batchgen(f"hydra.run.dir={tmp_path}", *JOB, "model.quantization=fp8", TP)
    assert result.returncode == 0, result.stdout + result.stderr
    assert comparable(tmp_path) == reference("model.quantization=fp8")


def test_data_parallel_times_tensor_parallel_gpus_must_exist(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 4)
    config = composed("job=shakespeare", "engine.data_parallel_size=2", TP)
    check_gpus(config)
    with pytest.raises(ConfigError, match=r"engine.data_parallel_size=3 x engine.tensor_parallel_size=2 needs 6 GPUs; "
                                          r"this machine has 4"):
        check_gpus(composed("job=shakespeare", "engine.data_parallel_size=3", TP))
