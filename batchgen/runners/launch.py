"""Picks how a job runs: Ray Data actors, N spawned ranks, a torchrun rank, or this process alone."""

from __future__ import annotations

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
    """On CUDA each rank takes a GPU: data-parallel ranks (engine.data_parallel_size, or torchrun's on this host)
    times tensor-parallel ranks of each."""
    engine = config.engine
    if not runs_on_cuda(config):
        return
    data_parallel = engine.data_parallel_size if engine.data_parallel_size > 1 else int(
        os.environ.get("LOCAL_WORLD_SIZE", "1"))
    needed, present = data_parallel * engine.tensor_parallel_size, torch.cuda.device_count()
    if needed > present:
        raise ConfigError(f"engine.data_parallel_size={data_parallel} x engine.tensor_parallel_size="
                          f"{engine.tensor_parallel_size} needs {needed} GPUs; this machine has {present}")
