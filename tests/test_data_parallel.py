"""Data parallel on one machine, on CPU: torchrun ranks (gloo) and engine.data_parallel_size=2 give the rows of a
single-process run, row for row; a killed rank costs only its unfinished rows, and resume finishes them."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchgen.runners.ranks import PARENT_MERGES_ENV

REPO = Path(__file__).resolve().parent.parent
TIMING_COLUMNS = ["ttft_ms", "tpot_ms", "latency_ms"]
JOB = ["job=shakespeare", "data.limit=24", "sampling.max_tokens=16", "engine.device=cpu", "job.progress=false"]
SAMPLING = {"greedy": ["sampling.temperature=0"], "seeded": []}  # the Shakespeare job samples at temperature 0.8


def batchgen(*arguments: str, launcher: tuple[str, ...] = (sys.executable, "-m", "batchgen"), wait: bool = True,
             cwd: Path = REPO) -> subprocess.CompletedProcess | subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if not wait:
        return subprocess.Popen([*launcher, *arguments], cwd=cwd, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)
    return subprocess.run([*launcher, *arguments], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def comparable(run_dir: Path) -> list[dict]:
    return pq.read_table(run_dir / "completions.parquet").drop_columns(TIMING_COLUMNS).to_pylist()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory):
    """reference(sampling, *overrides) -> the completions of a single-process run, computed once each."""
    runs: dict[tuple[str, ...], list[dict]] = {}

    def get(sampling: str, *overrides: str) -> list[dict]:
        key = (sampling, *overrides)
        if key not in runs:
            run_dir = tmp_path_factory.mktemp("reference")
            result = batchgen(f"hydra.run.dir={run_dir}", *JOB, *SAMPLING[sampling], *overrides)
            assert result.returncode == 0, result.stdout + result.stderr
            runs[key] = comparable(run_dir)
        return runs[key]

    return get


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_data_parallel_size_2_equals_a_single_process(tmp_path, reference, sampling):
    result = batchgen(f"hydra.run.dir={tmp_path}", *JOB, *SAMPLING[sampling], "engine.data_parallel_size=2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert comparable(tmp_path) == reference(sampling)
    shards = pq.read_table(tmp_path / "steps.parquet").column("shard").to_pylist()
    assert set(shards) == {0, 1}
    assert sorted(p.name for p in tmp_path.glob("shard-*")) == ["shard-00000-of-00002", "shard-00001-of-00002"]


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_torchrun_ranks_agree_on_one_run_dir_and_rank_0_merges(tmp_path, reference, sampling):
    if shutil.which("torchrun") is None:
        pytest.skip("torchrun is not on PATH")
    # No hydra.run.dir: each rank's Hydra picks a directory from its own clock, and rank 0's must win.
    launcher = ("torchrun", "--nproc-per-node", "2", "--master-port", str(29500 + os.getpid() % 1000), "-m",
                "batchgen")
    result = batchgen(*JOB, *SAMPLING[sampling], launcher=launcher, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    (merged,) = tmp_path.glob("outputs/shakespeare/*/completions.parquet")
    assert comparable(merged.parent) == reference(sampling)
    assert len(list(tmp_path.glob("outputs/shakespeare/*/shard-*/shard.json"))) == 2


def rank_pid(parent: subprocess.Popen, rank: int) -> int | None:
    """The pid of the spawned child with RANK=rank, read from /proc."""
    children = Path(f"/proc/{parent.pid}/task/{parent.pid}/children").read_text().split()
    for pid in children:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ and f"{PARENT_MERGES_ENV}=1".encode() in environ:
            return int(pid)
    return None


def wait_for_parts(shard_dir: Path, count: int, process: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while len(list((shard_dir / "completions.parts").glob("part-*.parquet"))) < count:
        assert process.poll() is None, process.stdout.read().decode()
        assert time.monotonic() < deadline, "the rank wrote no parts in time"
        time.sleep(0.05)


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the rank's pid in /proc (Linux)")
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_a_killed_rank_loses_only_its_unfinished_rows_and_resume_finishes_them(tmp_path, reference, sampling):
    overrides = [*SAMPLING[sampling], "data.limit=48", "sampling.max_tokens=48", "engine.max_num_seqs=4",
                 "job.flush_rows=1", "engine.data_parallel_size=2"]
    parent = batchgen(f"hydra.run.dir={tmp_path}", *JOB, *overrides, wait=False)
    wait_for_parts(tmp_path / "shard-00001-of-00002", 3, parent)
    pid = rank_pid(parent, 1)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    output = parent.communicate(timeout=600)[0].decode()
    assert parent.returncode != 0 and "ranks [1] of 2 failed" in output and "job.resume=true" in output
    assert (tmp_path / "shard-00000-of-00002" / "shard.json").exists()  # rank 0 finished its shard
    assert not (tmp_path / "completions.parquet").exists()

    resumed = batchgen(f"hydra.run.dir={tmp_path}", *JOB, *overrides, "job.resume=true")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    unsharded = reference(sampling, "data.limit=48", "sampling.max_tokens=48", "engine.max_num_seqs=4")
    assert comparable(tmp_path) == unsharded
    steps = pq.read_table(tmp_path / "steps.parquet").to_pandas()
    # Rank 0 had finished: the resume skips its shard; rank 1 resumes as attempt 1.
    assert steps.groupby("shard")["attempt"].max().to_dict() == {0: 0, 1: 1}
