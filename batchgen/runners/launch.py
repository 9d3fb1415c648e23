"""Picks how a job runs: Ray Data actors, N spawned ranks, a torchrun rank, or this process alone."""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any

import torch

from batchgen.config import Config, ConfigError
from batchgen.io.atomic import DirectoryLock
from batchgen.runners.data_parallel import run_data_parallel
from batchgen.runners.local import run_local
from batchgen.runners.ranks import Rank, run_rank
from batchgen.worker.compile_pool import close_started, start_ahead
from batchgen.worker.triton_start import start_triton_in_background

log = logging.getLogger(__name__)


def launch(config: Config, run_dir: Path, task_overrides: list[str]) -> dict[str, Any]:
    """Returns the run's summary (a rank other than 0: its shard's). task_overrides: the command line's overrides,
    which spawned ranks repeat. A process that writes the run directory holds its lock (DirectoryLock) meanwhile:
    the Ray driver and the data-parallel parent here, a local job or rank (in its shard's directory) in Job.run."""
    if config.runner.name == "ray":
        from batchgen.runners.ray_data import run_ray  # Ray is an optional extra: imported only when chosen

        with DirectoryLock(run_dir):
            return run_ray(config, run_dir)
    check_gpus(config)
    if config.engine.data_parallel_size > 1:
        with DirectoryLock(run_dir):
            return run_data_parallel(config, run_dir, task_overrides)
    if runs_on_cuda(config):
        start_triton_in_background()  # first: its imports of Triton, before any thread's
        start_ahead(config.engine)  # on a fresh machine: compile processes that start up while the input is read
    else:
        close_started()  # the command line's, started ahead of torch for a GPU that torch does not find
    if (rank := Rank.from_env()) is not None:
        return run_rank(config, run_dir, rank)
    return run_local(config, run_dir)


def runs_on_cuda(config: Config) -> bool:
    return config.engine.device != "cpu" and torch.cuda.is_available()


def check_gpus(config: Config) -> None:
    """On CUDA each rank takes a GPU, or a share of one (engine.ranks_per_gpu): data-parallel ranks
    (engine.data_parallel_size, or torchrun's on this host) times tensor-parallel ranks of each."""
    engine = config.engine
    if not runs_on_cuda(config):
        return
    data_parallel = engine.data_parallel_size if engine.data_parallel_size > 1 else int(
        os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if engine.ranks_per_gpu > data_parallel:
        raise ConfigError(f"engine.ranks_per_gpu={engine.ranks_per_gpu}: more than the {data_parallel} data-parallel "
                          f"rank(s) (engine.data_parallel_size) that would share a GPU")
    needed = math.ceil(data_parallel / engine.ranks_per_gpu) * engine.tensor_parallel_size
    present = torch.cuda.device_count()
    shared = f" at {engine.ranks_per_gpu} a GPU" if engine.ranks_per_gpu > 1 else ""
    if needed > present:
        raise ConfigError(f"engine.data_parallel_size={data_parallel} x engine.tensor_parallel_size="
                          f"{engine.tensor_parallel_size}{shared} needs {needed} GPUs; this machine has {present}")
    if shared and engine.data_parallel_size > 1:  # said once, by the parent of the ranks
        log.info("%d data-parallel ranks%s on %d GPU(s), each with 1/%d of engine.gpu_memory_utilization",
                 data_parallel, shared, needed, engine.ranks_per_gpu)
