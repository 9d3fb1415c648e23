"""Data-parallel ranks start generating together: each waits, once its engine is ready, for every other rank.

Engine start (model load, compilation, graph capture) takes each rank a different time; without the barrier the
ranks' engine loops would only partly overlap and the first ones would run alone for a while. Each rank passes the
barrier exactly once: when its engine is ready, or, for a rank with nothing to generate (a finished shard being
resumed), right away.

Under torchrun the barrier is the gloo group's; torchrun stops every rank when one fails. Ranks spawned by
engine.data_parallel_size share a directory instead: a rank arrives by creating rank-<i> in it, and the parent
creates the file of a rank that exited, so a rank that dies before its engine is ready holds no one back.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

START_BARRIER_ENV = "BATCHGEN_START_BARRIER"  # the directory of the spawner's file barrier
PARENT_MERGES_ENV = "BATCHGEN_PARENT_MERGES"  # set by the data_parallel_size spawner for its children
POLL_SECONDS = 0.05


def arrival_file(directory: Path, rank: int) -> Path:
    return directory / f"rank-{rank}"


class StartBarrier:
    """wait() blocks until every rank has called it (or exited); calls after the first return at once."""

    def __init__(self) -> None:
        self.passed = False

    def wait(self) -> None:
        if not self.passed:
            self._wait()
            self.passed = True

    def _wait(self) -> None:
        raise NotImplementedError


class GlooStartBarrier(StartBarrier):
    def _wait(self) -> None:
        import torch.distributed as dist  # here: the data-parallel parent imports this module, never torch

        dist.barrier()


class FileStartBarrier(StartBarrier):
    def __init__(self, directory: Path, rank: int, world_size: int,
                 pause: Callable[[float], None] = time.sleep) -> None:
        super().__init__()
        self.directory, self.rank, self.world_size, self.pause = Path(directory), rank, world_size, pause

    def _wait(self) -> None:
        arrival_file(self.directory, self.rank).touch()
        while not all(arrival_file(self.directory, rank).exists() for rank in range(self.world_size)):
            self.pause(POLL_SECONDS)
