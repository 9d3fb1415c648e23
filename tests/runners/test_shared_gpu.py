"""engine.ranks_per_gpu: data-parallel ranks that share a GPU, each with its share of the memory budget. The choice of
GPU and the budget on CPU; on a GPU, two ranks sharing it give the rows of a single process."""

from __future__ import annotations

import re

import pytest
import torch

from batchgen.config import ConfigError
from batchgen.core.kv_sizing import kv_budget_bytes
from batchgen.runners.gpus import check_gpus, rank_device
from tests.cli.test_config import composed
from tests.runners.test_data_parallel import JOB, batchgen, comparable


@pytest.fixture
def one_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)


def test_ranks_sharing_a_gpu_need_fewer_gpus(one_gpu):
    check_gpus(composed("job=shakespeare", "engine.data_parallel_size=3", "engine.ranks_per_gpu=3"))
    with pytest.raises(ConfigError, match=r"engine.data_parallel_size=4 x engine.tensor_parallel_size=1 at 3 a GPU "
                                          r"needs 2 GPUs; this machine has 1"):
        check_gpus(composed("job=shakespeare", "engine.data_parallel_size=4", "engine.ranks_per_gpu=3"))
    with pytest.raises(ConfigError, match=r"engine.data_parallel_size=2 x engine.tensor_parallel_size=1 needs 2 GPUs"):
        check_gpus(composed("job=shakespeare", "engine.data_parallel_size=2"))


def test_ranks_per_gpu_is_validated(one_gpu):
    with pytest.raises(ConfigError, match=r"engine.ranks_per_gpu=3: more than the 2 data-parallel rank"):
        check_gpus(composed("job=shakespeare", "engine.data_parallel_size=2", "engine.ranks_per_gpu=3"))
    with pytest.raises(ConfigError, match="engine.ranks_per_gpu"):
        composed("job=shakespeare", "engine.ranks_per_gpu=0")
    with pytest.raises(ConfigError, match="ranks share a GPU only without tensor parallelism"):
        composed("job=shakespeare", "engine.data_parallel_size=2", "engine.ranks_per_gpu=2",
                 "engine.tensor_parallel_size=2")


def test_consecutive_ranks_share_a_gpu_and_tensor_parallel_ranks_take_their_own():
    shared = composed("job=shakespeare", "engine.data_parallel_size=6", "engine.ranks_per_gpu=3").engine
    assert [rank_device(rank, shared) for rank in range(6)] == [0, 0, 0, 1, 1, 1]
    split = composed("job=shakespeare", "engine.data_parallel_size=3", "engine.tensor_parallel_size=2").engine
    assert [rank_device(rank, split) for rank in range(3)] == [0, 2, 4]


def test_ranks_sharing_a_gpu_split_its_memory_budget():
    gib = 2**30
    assert kv_budget_bytes(100 * gib, 0.9, 1, 2 * gib) == 88 * gib
    # Three engines on one GPU: together they stay within the GPU's budget, each less its own peak.
    shares = [kv_budget_bytes(100 * gib, 0.9, 3, 2 * gib) for _ in range(3)]
    assert shares[0] == 28 * gib and sum(shares) + 3 * 2 * gib <= 0.9 * 100 * gib


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_two_ranks_sharing_one_gpu_equal_a_single_process(tmp_path):
    gpu_job = [argument for argument in JOB if argument != "engine.device=cpu"] + ["sampling.temperature=0"]
    single = batchgen(f"hydra.run.dir={tmp_path / 'single'}", *gpu_job)
    assert single.returncode == 0, single.stdout + single.stderr
    shared = batchgen(f"hydra.run.dir={tmp_path / 'shared'}", *gpu_job, "engine.data_parallel_size=2",
                      "engine.ranks_per_gpu=2")
    assert shared.returncode == 0, shared.stdout + shared.stderr
    output = shared.stdout + shared.stderr
    assert "2 data-parallel ranks at 2 a GPU on 1 GPU(s)" in output
    assert comparable(tmp_path / "shared") == comparable(tmp_path / "single")
    # Each rank's KV budget is its half of the GPU's, less its own peak: at most half the single process's blocks.
    (alone,) = budget_blocks(single.stdout + single.stderr)
    halves = budget_blocks(output)
    assert len(halves) == 2 and all(0.45 * alone <= half <= alone / 2 for half in halves)


def budget_blocks(output: str) -> list[int]:
    return [int(blocks) for blocks in re.findall(r"the memory budget allows (\d+)\)", output)]
