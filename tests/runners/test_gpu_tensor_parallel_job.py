"""On two GPUs: a follower killed mid-run stops `python -m batchgen` with engine.tensor_parallel_size=2 (NCCL, CUDA
graphs) in one line and exit status 1, keeping the finished rows, and resume finishes every row once. Rank 0 once
waited forever there, for the collective aborted for the dead rank (benchmarks/RESULTS.md, 2026-11-28); the CPU form
of this test is in test_tensor_parallel_job.py."""

from __future__ import annotations

import os
import signal
import subprocess

import pyarrow.parquet as pq
import pytest
import torch

from tests.helpers.common import wait_for_parts
from tests.runners.test_data_parallel import batchgen
from tests.runners.test_tensor_parallel_job import LINUX_PROC, TP, children

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]

ROWS = 640  # the Shakespeare job's prompts
# Two rows at a time, each flushed on its own: the job runs long enough on a GPU to be killed after a few rows.
SLOW = ["job=shakespeare", "job.progress=false", "sampling.max_tokens=64", "engine.max_num_seqs=2", "job.flush_rows=1",
        TP]
STOP_SECONDS = 120  # from the kill to the job's exit; a rank 0 left waiting fails here instead of blocking the suite


@LINUX_PROC
def test_a_killed_follower_stops_the_gpu_job_in_one_line_and_resume_finishes(tmp_path):
    job = batchgen(f"hydra.run.dir={tmp_path}", *SLOW, wait=False)
    try:
        wait_for_parts(tmp_path, 3, job)
        (follower,) = children(job)
        os.kill(follower, signal.SIGKILL)
        output = job.communicate(timeout=STOP_SECONDS)[0].decode()
    except subprocess.TimeoutExpired:
        pytest.fail(f"the job did not stop within {STOP_SECONDS} s of its follower's kill")
    finally:
        if job.poll() is None:  # stopped by hand: a failed wait for parts, or the limit above
            job.kill()
            job.wait()
    assert job.returncode == 1, output
    (line,) = [line for line in output.splitlines() if "tensor-parallel rank" in line]
    assert f"tensor-parallel rank 1 of 2 (pid {follower}) exited on signal SIGKILL" in line
    assert "job.resume=true" in line and "Traceback" not in output
    assert not (tmp_path / "completions.parquet").exists()

    resumed = batchgen(f"hydra.run.dir={tmp_path}", *SLOW, "job.resume=true")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    completions = pq.read_table(tmp_path / "completions.parquet", columns=["index", "sample_index"]).to_pylist()
    assert completions == [{"index": index, "sample_index": 0} for index in range(ROWS)]
