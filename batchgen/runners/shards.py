"""Shards: a deterministic split of the input rows, each shard in its own directory.

The split depends only on the input and the configuration, never on how fast a shard goes, so every shard (and
every resume of it) computes the same assignment on its own. It is made one row at a time, in input order, so a
shard keeps only its own rows while it reads:
- data.shard_by=work (the default): each row goes to the shard with the least estimated work so far (its prompt
  tokens plus n * max_tokens: what the row can cost), ties to the lowest shard. Greedy list scheduling leaves the
  shards' estimates at most the largest row's work apart, so data-parallel ranks finish together.
- data.shard_by=index: row `index` goes to shard `index % num_shards`; a row's shard follows from its index alone.
Rows keep their global index, so ids, seeds and resume do not depend on the split; the merge sorts by index.
"""

from __future__ import annotations

import hashlib
import heapq
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


class ShardSplit:
    """Assigns the input rows to shards one at a time, in input order (see the module docstring)."""

    def __init__(self, num_shards: int, by: str):
        self.num_shards = num_shards
        self.by = by
        self._loads = [(0, shard) for shard in range(num_shards)]  # a heap of (estimated work so far, shard)
        self._assignment = hashlib.sha256()

    def shard_of(self, index: int, work: int) -> int:
        """The shard of row `index`, whose estimated work is `work` (unused by the index split)."""
        if self.by == "index":
            shard = index % self.num_shards
        else:
            load, shard = self._loads[0]
            heapq.heapreplace(self._loads, (load + work, shard))
        self._assignment.update(shard.to_bytes(4, "little"))
        return shard

    @property
    def digest(self) -> str:
        """A fingerprint of the whole assignment so far: shards that split the input alike agree on it."""
        return self._assignment.hexdigest()[:16]


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
