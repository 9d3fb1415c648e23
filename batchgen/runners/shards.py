"""Shards: a deterministic split of the input rows by global row index, each shard in its own directory.

Row `index` goes to shard `index % num_shards`. Striding (rather than contiguous ranges) gives every shard the same
mix of long and short prompts when the input is sorted or clustered, so data-parallel ranks finish together; the
merge sorts by index either way. Rows keep their global index, so ids, seeds and resume do not depend on K.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

import pyarrow as pa

from batchgen.io.schema import STEPS_SCHEMA
from batchgen.io.writers import write_json_atomic

MARKER_FILE = "shard.json"  # written when a shard has finished: the merge's proof that the shard is complete
SHARD_DIR_PATTERN = re.compile(r"shard-(\d{5})-of-(\d{5})")
# steps.parquet of a merged or multi-actor run: every step keeps the shard (rank, actor) that ran it.
SHARDED_STEPS_SCHEMA = STEPS_SCHEMA.append(pa.field("shard", pa.int32(), nullable=False))

Row = TypeVar("Row")


def shard_dir_name(num_shards: int, shard_index: int) -> str:
    return f"shard-{shard_index:05d}-of-{num_shards:05d}"


def shard_rows(rows: Sequence[Row], num_shards: int, shard_index: int) -> list[Row]:
    """The rows whose position in the input is shard_index modulo num_shards (all of them when num_shards=1)."""
    return list(rows[shard_index::num_shards])


def shard_indices(num_input_rows: int, num_shards: int, shard_index: int) -> range:
    return range(shard_index, num_input_rows, num_shards)


@dataclass
class ShardMarker:
    """What the merge needs to know of a finished shard beyond its Parquet files."""

    num_shards: int
    shard_index: int
    num_input_rows: int  # rows in the whole input (after data.limit), so the merge can name missing ones
    started_at: float  # unix seconds of this shard's last attempt
    finished_at: float

    def write(self, shard_dir: Path) -> None:
        write_json_atomic(shard_dir / MARKER_FILE, asdict(self))

    @classmethod
    def read(cls, shard_dir: Path) -> ShardMarker:
        return cls(**json.loads((shard_dir / MARKER_FILE).read_text()))
