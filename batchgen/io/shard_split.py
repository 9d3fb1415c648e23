"""A deterministic split of the input rows into shards (data.num_shards, data.shard_by).

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


class ShardSplit:
    """Assigns the input rows to shards one at a time, in input order (see the module docstring)."""

    def __init__(self, num_shards: int, by: str):
        self.num_shards = num_shards
        self.by = by
        self._loads = [(0, shard) for shard in range(num_shards)]  # a heap of (estimated work so far, shard)
        self._assignment = hashlib.sha256()
        self._unsplit_rows = 0  # one shard: rows whose shard, 0, is not hashed yet (hashed at once by `digest`)

    def shard_of(self, index: int, work: int) -> int:
        """The shard of row `index`, whose estimated work is `work` (unused by the index split)."""
        if self.num_shards == 1:
            self._unsplit_rows += 1
            return 0
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
        assignment = self._assignment.copy()
        assignment.update(bytes(4 * self._unsplit_rows))  # shard 0 as 4 bytes, per row
        return assignment.hexdigest()[:16]
