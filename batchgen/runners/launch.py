"""Picks how a job runs: Ray Data actors, N spawned ranks, a torchrun rank, or this process alone."""

from __future__ import annotations

from pathlib import Path

from batchgen.config import Config
from batchgen.runners.data_parallel import run_data_parallel
from batchgen.runners.local import run_local
from batchgen.runners.ranks import Rank, run_rank


def launch(config: Config, run_dir: Path, task_overrides: list[str]) -> None:
    """task_overrides: the command line's overrides, which spawned ranks repeat."""
    if config.runner.name == "ray":
        from batchgen.runners.ray_data import run_ray  # Ray is an optional extra: imported only when chosen

        run_ray(config, run_dir)
    elif config.engine.data_parallel_size > 1:
        run_data_parallel(config, run_dir, task_overrides)
    elif (rank := Rank.from_env()) is not None:
        run_rank(config, run_dir, rank)
    else:
        run_local(config, run_dir)
