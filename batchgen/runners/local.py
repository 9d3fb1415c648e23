"""A job in this process: the whole input, or one shard of it in <run dir>/shard-<i>-of-<K>/."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from batchgen.config import Config
from batchgen.job.run import GivenSplit, run_job
from batchgen.job.run_outputs import SUMMARY_FILE
from batchgen.runners.shards import MARKER_FILE, ShardMarker, shard_dir_name

log = logging.getLogger(__name__)


def shard_run_dir(config: Config, run_dir: Path) -> Path:
    data = config.data
    return run_dir if data.num_shards == 1 else run_dir / shard_dir_name(data.num_shards, data.shard_index)


def run_local(config: Config, run_dir: Path, wait_for_ranks: Callable[[], None] | None = None,
              given_split: GivenSplit | None = None) -> dict[str, Any]:
    """Runs the job (or its shard); a finished shard leaves shard.json for the merge. wait_for_ranks: a
    data-parallel rank's start barrier (Job.run); given_split: its parent's split of the input (Job)."""
    directory = shard_run_dir(config, run_dir)
    if config.data.num_shards > 1 and config.job.resume and (directory / MARKER_FILE).exists():
        # Resuming a data-parallel run restarts every rank; a finished shard need not load the model again.
        log.info("Shard %d of %d already finished in %s", config.data.shard_index, config.data.num_shards, directory)
        return json.loads((directory / SUMMARY_FILE).read_text())
    started_at = time.time()
    summary, job = run_job(config, directory, wait_for_ranks, given_split)
    if config.data.num_shards > 1:
        ShardMarker(config.data.num_shards, config.data.shard_index, job.num_input_rows, started_at, time.time(),
                    config.data.shard_by, job.split_digest).write(directory)
    return summary
