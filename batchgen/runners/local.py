"""A job in this process: the whole input, or one shard of it in <run dir>/shard-<i>-of-<K>/."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from batchgen.config import Config
from batchgen.job import Job
from batchgen.runners.shards import ShardMarker, shard_dir_name


def shard_run_dir(config: Config, run_dir: Path) -> Path:
    data = config.data
    return run_dir if data.num_shards == 1 else run_dir / shard_dir_name(data.num_shards, data.shard_index)


def run_local(config: Config, run_dir: Path) -> dict[str, Any]:
    """Runs the job (or its shard); a finished shard leaves shard.json for the merge."""
    directory = shard_run_dir(config, run_dir)
    job = Job(config, directory)
    started_at = time.time()
    summary = job.run()
    if config.data.num_shards > 1:
        ShardMarker(config.data.num_shards, config.data.shard_index, job.num_input_rows, started_at,
                    time.time()).write(directory)
    return summary
