"""engine.data_parallel_size=N: starts N copies of this command as ranks 0..N-1 of one run, waits, and merges.

Each child is `python -m batchgen` with the same overrides, the parent's run directory and the rank in its
environment (as torchrun would set it), and the directory of the ranks' start barrier, which the parent empties
first and completes for every child that exits (start_barrier.py). While they start, the parent weighs the input
for their split by work (parent_split.py). A child that dies costs only its shard's unfinished rows: the others
finish, the parent reports the failure, and the same command with job.resume=true finishes the rest.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from batchgen.config import Config
from batchgen.runners.errors import RankFailedError
from batchgen.runners.gpus import check_gpus
from batchgen.runners.merge import merge_shards
from batchgen.runners.parent_split import ParentSplit
from batchgen.runners.start_barrier import PARENT_MERGES_ENV, START_BARRIER_ENV, arrival_file

log = logging.getLogger(__name__)

START_BARRIER_DIR = ".start-barrier"
# Keys the parent sets for its children itself.
_PARENT_KEYS = ("engine.data_parallel_size", "hydra.run.dir", "hydra.output_subdir")


def _override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def child_command(task_overrides: list[str], run_dir: Path) -> list[str]:
    kept = [o for o in task_overrides if _override_key(o) not in _PARENT_KEYS]
    # The parent already wrote .hydra/; the children would race to rewrite it.
    return [sys.executable, "-m", "batchgen", *kept, "engine.data_parallel_size=1", f"hydra.run.dir={run_dir}",
            "hydra.output_subdir=null"]


def child_env(rank: int, world_size: int, start_barrier: Path) -> dict[str, str]:
    return {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size), PARENT_MERGES_ENV: "1", START_BARRIER_ENV: str(start_barrier)}


def _empty_directory(path: Path) -> Path:
    """`path`, empty: an earlier attempt's arrivals must not let this attempt's ranks through."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def arrive_when_exited(child: subprocess.Popen, start_barrier: Path, rank: int) -> threading.Thread:
    """A thread that, once the child has exited, passes the start barrier on its behalf."""
    def wait_and_arrive() -> None:
        child.wait()
        arrival_file(start_barrier, rank).touch()

    thread = threading.Thread(target=wait_and_arrive, name=f"rank-{rank}-exit", daemon=True)
    thread.start()
    return thread


def run_data_parallel(config: Config, run_dir: Path, task_overrides: list[str]) -> dict[str, Any]:
    world_size = config.engine.data_parallel_size
    command = child_command(task_overrides, run_dir)
    log.info("Starting %d data-parallel ranks in %s", world_size, run_dir)
    start_barrier = _empty_directory(run_dir / START_BARRIER_DIR)
    split = ParentSplit(run_dir) if config.data.shard_by == "work" else None
    extra_env, pass_fds = (split.child_env(), split.pass_fds) if split else ({}, ())
    children = [subprocess.Popen(command, env={**child_env(rank, world_size, start_barrier), **extra_env},
                                 pass_fds=pass_fds)
                for rank in range(world_size)]
    watchers = [arrive_when_exited(child, start_barrier, rank) for rank, child in enumerate(children)]
    try:
        if split is not None:
            split.spawned()
            split.publish(config, world_size)  # while the ranks import torch
        check_gpus(config)  # torch's import here while the ranks import theirs; they leave the check to this process
        codes = [child.wait() for child in children]
    except BaseException:
        for child in children:
            child.terminate()
        for child in children:
            child.wait()
        raise
    finally:
        if split is not None:
            split.close()
            split.remove()
        for watcher in watchers:
            watcher.join()
        shutil.rmtree(start_barrier, ignore_errors=True)
    failed = [rank for rank, code in enumerate(codes) if code != 0]
    if failed:
        raise RankFailedError(f"data-parallel ranks {failed} of {world_size} failed (exit codes "
                              f"{[codes[r] for r in failed]}); the finished rows are kept under {run_dir}: "
                              f"run the same command with job.resume=true hydra.run.dir={run_dir} to finish")
    summary = merge_shards(run_dir)
    log.info("Done: %d rows from %d ranks -> %s", summary["rows"], world_size, run_dir)
    return summary
