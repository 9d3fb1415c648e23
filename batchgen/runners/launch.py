"""Picks how a job runs: Ray Data actors, N spawned ranks, a torchrun rank, or this process alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from batchgen.config import Config
from batchgen.runners.data_parallel import run_data_parallel
from batchgen.runners.local import run_local
from batchgen.runners.ranks import Rank, run_rank


def launch(config: Config, run_dir: Path, task_overrides: list[str]) -> dict[str, Any]:
    """Returns the run's summary (a rank other than 0: its shard's). task_overrides: the command line's overrides,
    which spawned ranks repeat."""
    if config.runner.name == "ray":
        from batchgen.runners.ray_data import run_ray  # Ray is an optional extra: imported only when chosen

        return run_ray(config, run_dir)
    if config.engine.data_parallel_size > 1:
        return run_data_parallel(config, run_dir, task_overrides)
    if (rank := Rank.from_env()) is not None:
        return run_rank(config, run_dir, rank)
    return run_local(config, run_dir)
