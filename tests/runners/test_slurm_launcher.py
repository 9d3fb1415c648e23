"""SLURM through Hydra's submitit launcher, tested with its local executor: a sharded job as an array of shard jobs
plus the merge (the multirun callback), and a sweep as one job per value."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="needs the [slurm] extra (hydra-submitit-launcher)")

REPO = Path(__file__).resolve().parents[2]
TIMING_COLUMNS = ["ttft_ms", "tpot_ms", "latency_ms"]
JOB = ["job=shakespeare", "data.limit=12", "sampling.max_tokens=8", "engine.device=cpu", "job.progress=false"]


def batchgen(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchgen", *arguments], cwd=REPO, capture_output=True, text=True,
                          timeout=600)


def comparable(run_dir: Path) -> list[dict]:
    return pq.read_table(run_dir / "completions.parquet").drop_columns(TIMING_COLUMNS).to_pylist()


def test_shard_array_through_submitit_merges_to_the_single_run(tmp_path):
    reference = batchgen(f"hydra.run.dir={tmp_path / 'reference'}", *JOB)
    assert reference.returncode == 0, reference.stderr
    sweep = tmp_path / "sweep"
    result = batchgen("-m", "hydra/launcher=submitit_local", *JOB, "data.num_shards=3", "data.shard_index=range(3)",
                      f"hydra.sweep.dir={sweep}")
    assert result.returncode == 0, result.stdout + result.stderr
    assert comparable(sweep) == comparable(tmp_path / "reference")
    assert set(pq.read_table(sweep / "steps.parquet").column("shard").to_pylist()) == {0, 1, 2}


def test_sweep_through_submitit_runs_one_job_per_value(tmp_path):
    result = batchgen("-m", "hydra/launcher=submitit_local", *JOB, "sampling.max_tokens=3,5",
                      f"hydra.sweep.dir={tmp_path}")
    assert result.returncode == 0, result.stdout + result.stderr
    for run, max_tokens in (("0", 3), ("1", 5)):
        completions = pq.read_table(tmp_path / run / "completions.parquet").to_pandas()
        assert (completions["num_output_tokens"] == max_tokens).all()
    assert not (tmp_path / "completions.parquet").exists()  # not sharded: nothing to merge


def test_shipped_slurm_launcher_config_composes():
    result = batchgen("hydra/launcher=slurm", "job=shakespeare", "hydra.launcher.partition=gpu", "--cfg", "hydra")
    assert result.returncode == 0, result.stderr
    assert "SlurmLauncher" in result.stdout
    assert "gpus_per_node: 1" in result.stdout and "partition: gpu" in result.stdout
