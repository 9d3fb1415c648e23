"""Data parallel on one machine, on CPU: torchrun ranks (gloo) and engine.data_parallel_size=2 give the rows of a
single-process run, row for row; the ranks start generating together; a killed rank costs only its unfinished rows,
and resume finishes them."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchgen.config import ConfigError
from batchgen.job.run import run_job
from batchgen.runners.data_parallel import arrive_when_exited
from batchgen.runners.ranks import run_shard
from batchgen.runners.shards import MARKER_FILE, shard_dir_name
from batchgen.runners.start_barrier import PARENT_MERGES_ENV, FileStartBarrier, StartBarrier, arrival_file
from tests.cli.test_config import composed
from tests.runners.test_shards import key_paths

REPO = Path(__file__).resolve().parents[2]
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


@pytest.mark.parametrize(("sampling", "shard_by"), [("greedy", "work"), ("seeded", "work"), ("seeded", "index")])
def test_data_parallel_size_2_equals_a_single_process(tmp_path, reference, sampling, shard_by):
    result = batchgen(f"hydra.run.dir={tmp_path}", *JOB, *SAMPLING[sampling], "engine.data_parallel_size=2",
                      f"data.shard_by={shard_by}")
    assert result.returncode == 0, result.stdout + result.stderr
    assert comparable(tmp_path) == reference(sampling)
    shards = pq.read_table(tmp_path / "steps.parquet").column("shard").to_pylist()
    assert set(shards) == {0, 1}
    assert sorted(p.name for p in tmp_path.glob("shard-*")) == ["shard-00000-of-00002", "shard-00001-of-00002"]
    assert not (tmp_path / ".start-barrier").exists() and not (tmp_path / ".shard-split").exists()
    # A split by work: the parent weighed the input while the ranks started (their taking it: test_parent_split.py).
    assert ("Weighed the 24 input rows" in result.stdout + result.stderr) == (shard_by == "work")

    # The ranks passed the start barrier together: no engine loop began before every engine was ready.
    ranks = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("shard-*/summary.json"))]
    ready = max(rank["this_attempt"]["engine_ready_at"] for rank in ranks)
    assert all(rank["generation"]["started_at"] >= ready for rank in ranks)
    merged = json.loads((tmp_path / "summary.json").read_text())
    generation = merged["generation"]
    assert generation["output_tokens"] == merged["output_tokens"]
    assert generation["started_at"] == min(rank["generation"]["started_at"] for rank in ranks)
    assert generation["finished_at"] == max(rank["generation"]["finished_at"] for rank in ranks)
    assert [shard["engine_start_seconds"] for shard in merged["shards"]] == [
        rank["this_attempt"]["time_seconds"]["engine_start"] for rank in ranks]
    # One schema for every summary: each rank's is a local run's.
    assert key_paths(ranks[0]) <= key_paths(merged)
    assert merged["job"]["error_rows"] == 0 and merged["this_attempt"]["rows"] == merged["rows"] == 24


def test_the_parent_checks_the_gpus_while_its_ranks_start_and_stops_them_when_the_check_fails(tmp_path, monkeypatch):
    import batchgen.runners.data_parallel as data_parallel

    started: list[subprocess.Popen] = []
    real_popen = subprocess.Popen

    def popen(command: list[str], env: dict[str, str], pass_fds: tuple[int, ...]) -> subprocess.Popen:
        # A rank still starting up; were it never stopped, the test would fail when it ends.
        started.append(real_popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env, pass_fds=pass_fds))
        return started[-1]

    def missing_gpus(config) -> None:
        assert len(started) == 2 and all(child.poll() is None for child in started)  # the ranks started first
        raise ConfigError("engine.data_parallel_size=2 x engine.tensor_parallel_size=1 needs 2 GPUs; this machine "
                          "has 1")

    monkeypatch.setattr(data_parallel.subprocess, "Popen", popen)
    monkeypatch.setattr(data_parallel, "check_gpus", missing_gpus)
    config = composed("job=shakespeare", "engine.data_parallel_size=2", "engine.device=cpu")
    with pytest.raises(ConfigError, match="needs 2 GPUs"):
        data_parallel.run_data_parallel(config, tmp_path, [])
    assert all(child.poll() is not None for child in started)  # stopped and reaped
    assert not (tmp_path / data_parallel.START_BARRIER_DIR).exists()


class CountingBarrier(StartBarrier):
    def __init__(self) -> None:
        super().__init__()
        self.waits = 0

    def _wait(self) -> None:
        self.waits += 1


def test_file_start_barrier_waits_until_every_rank_has_arrived(tmp_path):
    def other_rank_arrives(seconds: float) -> None:
        pauses.append(seconds)
        arrival_file(tmp_path, 1).touch()

    pauses: list[float] = []
    barrier = FileStartBarrier(tmp_path, 0, 2, pause=other_rank_arrives)
    barrier.wait()
    assert len(pauses) == 1 and arrival_file(tmp_path, 0).exists()
    barrier.wait()  # once passed, it stays passed
    assert len(pauses) == 1


def test_a_rank_that_exits_passes_the_start_barrier_for_the_others(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    arrive_when_exited(child, tmp_path, 1).join(timeout=60)
    assert child.returncode == 3 and arrival_file(tmp_path, 1).exists()


def test_a_rank_with_nothing_to_generate_still_passes_the_start_barrier(tmp_path):
    shard = tmp_path / shard_dir_name(2, 1)
    shard.mkdir()
    (shard / MARKER_FILE).write_text("{}")
    (shard / "summary.json").write_text('{"rows": 3}')
    config = composed("job=shakespeare", "data.num_shards=2", "data.shard_index=1", "job.resume=true")
    barrier = CountingBarrier()
    assert run_shard(config, tmp_path, barrier) == {"rows": 3}
    assert barrier.waits == 1


def test_the_job_waits_for_the_ranks_once_its_engine_is_ready_and_before_generating(tmp_path):
    def wait_for_ranks() -> None:
        waited.append((time.time(), list(tmp_path.glob("*.parts/*.parquet"))))

    waited: list[tuple[float, list[Path]]] = []
    config = composed("job=shakespeare", "data.limit=4", "sampling.max_tokens=4", "engine.device=cpu",
                      "job.progress=false", "job.flush_rows=1")
    summary, _ = run_job(config, tmp_path, wait_for_ranks)
    ((waited_at, parts_written),) = waited
    assert parts_written == [] and list(tmp_path.glob("*.parquet"))
    assert summary["this_attempt"]["engine_ready_at"] <= waited_at <= summary["generation"]["started_at"]
    assert summary["generation"]["output_tokens"] == summary["output_tokens"] == 16
    assert summary["this_attempt"]["time_seconds"]["wait_for_ranks"] >= 0


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
