"""On CUDA: jobs of a sweep run one after another in one process give back every byte of GPU memory, and a
profiled job sees the kernels inside replayed CUDA graphs."""

from __future__ import annotations

import gc
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from hydra import compose, initialize_config_dir

from batchgen.cli.main import CONF_DIR, to_config
from batchgen.config import Config
from batchgen.job.run import run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def shakespeare_config(*overrides: str) -> Config:
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["job=shakespeare", "data.limit=32", "job.progress=false", *overrides])
    return to_config(cfg)


def test_three_jobs_in_one_process_return_gpu_memory(tmp_path: Path):
    torch.cuda.synchronize()
    # Earlier tests' garbage, cached blocks and cuBLAS workspaces (which empty_cache keeps) are not the jobs' to give
    # back: a job's close() frees every workspace, so one left from before would read as memory returned twice.
    gc.collect()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    start = torch.cuda.memory_reserved()
    setups = [["engine.enforce_eager=true"], ["engine.enforce_eager=false"],
              ["engine.enforce_eager=false", "engine.torch_compile=false", "job.profile_steps=2"]]
    for number, overrides in enumerate(setups):
        summary = run(shakespeare_config(*overrides), tmp_path / str(number))
        assert summary["rows"] == 32
        assert torch.cuda.memory_reserved() == start, overrides


def test_profiled_steps_list_the_kernels_of_replayed_graphs(tmp_path: Path):
    run(shakespeare_config("engine.enforce_eager=false", "job.profile_steps=3"), tmp_path)
    kernels = pq.read_table(tmp_path / "kernels.parquet").to_pandas()
    graph = kernels[kernels["cuda_graph"]]
    assert graph["step"].nunique() == 3
    assert (graph.groupby("step").size() > 10).all()  # a 4-layer GPT-2 step is dozens of kernels, not one launch
    assert (graph["duration_us"] > 0).all() and (graph["gap_before_us"] >= 0).all()
