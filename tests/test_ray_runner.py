"""runner=ray on CPU: a local Ray instance, two engine actors; the outputs equal a local run's, row for row."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from hydra import compose, initialize_config_dir

from batchgen.cli import CONF_DIR, to_config
from batchgen.config import Config
from batchgen.runners.local import run_local

ray = pytest.importorskip("ray", reason="runner=ray needs the [ray] extra")
ray_data = pytest.importorskip("batchgen.runners.ray_data", reason="ray.data is not installed")

TIMING_COLUMNS = ["ttft_ms", "tpot_ms", "latency_ms"]
JOB = ["job=shakespeare", "data.limit=24", "sampling.max_tokens=16", "engine.device=cpu", "job.progress=false"]
SAMPLING = {"greedy": ["sampling.temperature=0"], "seeded": []}


def job_config(*overrides: str) -> Config:
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        return to_config(compose("config", overrides=list(overrides)))


def comparable(run_dir: Path) -> list[dict]:
    return pq.read_table(run_dir / "completions.parquet").drop_columns(TIMING_COLUMNS).to_pylist()


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_ray_runner_equals_a_local_run(tmp_path, local_ray, sampling):
    run_local(job_config(*JOB, *SAMPLING[sampling]), tmp_path / "local")
    config = job_config(*JOB, *SAMPLING[sampling], "runner=ray", "runner.num_replicas=2", "runner.batch_size=5")
    summary = ray_data.run_ray(config, tmp_path / "ray")
    assert comparable(tmp_path / "ray") == comparable(tmp_path / "local")
    steps = pq.read_table(tmp_path / "ray" / "steps.parquet").to_pandas()
    assert len(steps) > 0 and set(steps["shard"]) <= {0, 1} and (steps["attempt"] == 0).all()
    assert summary["rows"] == 24 and summary["output_tokens"] == 24 * 16
    assert summary["engine"]["runner"] == "ray" and summary["engine"]["num_replicas"] == 2


def test_ray_runner_resumes_skipping_finished_rows(tmp_path, local_ray):
    config = job_config(*JOB, "sampling.temperature=0", "runner=ray", "runner.num_replicas=2", "job.resume=true")
    ray_data.run_ray(config, tmp_path)
    first = comparable(tmp_path)
    # Drop the last rows, as if the driver had died before writing them, and resume.
    table = pq.read_table(tmp_path / "completions.parquet")
    pq.write_table(table.slice(0, 10), tmp_path / "completions.parquet")
    summary = ray_data.run_ray(config, tmp_path)
    assert comparable(tmp_path) == first and summary["attempt"] == 1


def engine_actor_pids() -> list[int]:
    """The pids of live Ray worker processes running an EngineActor (Ray titles them after the operator)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                command = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if b"EngineActor" in command:
                pids.append(int(entry.name))
    return pids


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="finds the actors' pids in /proc (Linux)")
def test_a_killed_actor_is_restarted_and_its_rows_retried(tmp_path, local_ray):
    overrides = [*JOB, "sampling.temperature=0", "data.limit=32", "job.flush_rows=1", "job.flush_seconds=0.01"]
    run_local(job_config(*overrides), tmp_path / "local")
    config = job_config(*overrides, "runner=ray", "runner.num_replicas=2", "runner.batch_size=4")
    outcome: dict[str, object] = {}
    driver = threading.Thread(target=lambda: outcome.update(summary=ray_data.run_ray(config, tmp_path / "ray")))
    driver.start()
    parts = tmp_path / "ray" / "completions.parts"
    deadline = time.monotonic() + 300
    while not list(parts.glob("part-*.parquet")) or not engine_actor_pids():
        assert driver.is_alive() and time.monotonic() < deadline, "no batch finished in time"
        time.sleep(0.05)
    os.kill(engine_actor_pids()[0], signal.SIGKILL)
    driver.join(timeout=600)
    assert "summary" in outcome, "the Ray job did not finish after an actor was killed"
    assert comparable(tmp_path / "ray") == comparable(tmp_path / "local")
