"""Shard directories and the marker a finished shard leaves for the merge (the split itself: io/shard_split.py)."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import pyarrow as pa

from batchgen.io.schema import STEPS_SCHEMA
from batchgen.io.writers import write_json_atomic

MARKER_FILE = "shard.json"  # written when a shard has finished: the merge's proof that the shard is complete
SHARD_DIR_PATTERN = re.compile(r"shard-(\d{5})-of-(\d{5})")
# steps.parquet of a merged or multi-actor run: every step keeps the shard (rank, actor) that ran it.
SHARDED_STEPS_SCHEMA = STEPS_SCHEMA.append(pa.field("shard", pa.int32(), nullable=False))


def shard_dir_name(num_shards: int, shard_index: int) -> str:
    return f"shard-{shard_index:05d}-of-{num_shards:05d}"


@dataclass
class ShardMarker:
    """What the merge needs to know of a finished shard beyond its Parquet files."""

    num_shards: int
    shard_index: int
    num_input_rows: int  # rows in the whole input (after data.limit), so the merge can name missing ones
    started_at: float  # unix seconds of this shard's last attempt
    finished_at: float
    shard_by: str = "index"  # data.shard_by (shards written before it existed were split by index)
    split_digest: str | None = None  # ShardSplit.digest over the whole input

    def write(self, shard_dir: Path) -> None:
        write_json_atomic(shard_dir / MARKER_FILE, asdict(self))

    @classmethod
    def read(cls, shard_dir: Path) -> ShardMarker:
        return cls(**json.loads((shard_dir / MARKER_FILE).read_text()))
