"""One data-parallel rank: shard RANK of WORLD_SIZE on its GPU (gpus.rank_device: cuda:LOCAL_RANK, shared with
engine.ranks_per_gpu, cuda:LOCAL_RANK * engine.tensor_parallel_size with tensor parallelism) or the CPU, as torchrun
starts them.

Under torchrun the ranks agree on one run directory (Hydra picks one per process from the clock, so rank 0's
wins, broadcast over a gloo group), each runs its shard, and rank 0 merges once all have passed a barrier.
Ranks started by `engine.data_parallel_size` get the directory from their parent, which merges itself, and the
parent's split of the input (parent_split.py). Either way the ranks start generating together (start_barrier.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from batchgen.config import Config
from batchgen.job.run import GivenSplit
from batchgen.runners.gpus import rank_device
from batchgen.runners.local import run_local
from batchgen.runners.merge import merge_shards
from batchgen.runners.parent_split import wait_for_parent_split
from batchgen.runners.start_barrier import (
    PARENT_MERGES_ENV,
    START_BARRIER_ENV,
    FileStartBarrier,
    GlooStartBarrier,
    StartBarrier,
)

# Ranks wait for the slowest one at the end; a shard of a large job can take many hours.
RANK_WAIT = timedelta(hours=48)


@dataclass(frozen=True)
class Rank:
    rank: int
    world_size: int
    local_rank: int

    @classmethod
    def from_env(cls) -> Rank | None:
        """The rank torchrun (or the spawner) set in the environment; None for a single process."""
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size <= 1:
            return None
        return cls(int(os.environ["RANK"]), world_size, int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))


def rank_config(config: Config, rank: Rank) -> Config:
    return replace(config, data=replace(config.data, num_shards=rank.world_size, shard_index=rank.rank))


def _agreed_run_dir(run_dir: Path) -> Path:
    chosen = [str(run_dir)]
    dist.broadcast_object_list(chosen, src=0)
    return Path(chosen[0])


def run_shard(config: Config, run_dir: Path, barrier: StartBarrier,
              given_split: GivenSplit | None = None) -> dict[str, Any]:
    summary = run_local(config, run_dir, barrier.wait, given_split)
    barrier.wait()  # a rank that had nothing to generate has not passed it yet: the others wait for it
    return summary


def run_rank(config: Config, run_dir: Path, rank: Rank) -> dict[str, Any]:
    """Returns rank 0's merged summary under torchrun, else this rank's shard summary."""
    config = rank_config(config, rank)
    if config.engine.device != "cpu" and torch.cuda.is_available():
        torch.cuda.set_device(rank_device(rank.local_rank, config.engine))
    if os.environ.get(PARENT_MERGES_ENV) == "1":
        barrier = FileStartBarrier(Path(os.environ[START_BARRIER_ENV]), rank.rank, rank.world_size)
        return run_shard(config, run_dir, barrier, wait_for_parent_split)
    dist.init_process_group("gloo", rank=rank.rank, world_size=rank.world_size, timeout=RANK_WAIT)
    try:
        run_dir = _agreed_run_dir(run_dir)
        summary = run_shard(config, run_dir, GlooStartBarrier())
        dist.barrier()
        return merge_shards(run_dir) if rank.rank == 0 else summary
    finally:
        dist.destroy_process_group()
