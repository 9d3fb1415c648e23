"""A deterministic split of the input rows into shards (data.num_shards, data.shard_by).

The split depends only on the input and the configuration, never on how fast a shard goes, so every shard (and
every resume of it) computes the same assignment on its own. It is made one row at a time, in input order, so a
shard keeps only its own rows while it reads:
- data.shard_by=work (the default): each row goes to the shard with the least estimated work so far (its prompt
  tokens plus n * max_tokens: what the row can cost), ties to the lowest shard. Greedy list scheduling leaves the
  shards' estimates at most the largest row's work apart, so data-parallel ranks finish together.
- data.shard_by=index: row `index` goes to shard `index % num_shards`; a row's shard follows from its index alone.
Rows keep their global index, so ids, seeds and resume do not depend on the split; the merge sorts by index.

A split can also be given, as the shard of every input row in order (`given`): the data-parallel parent weighs the
input once (runners/parent_split.py) and its ranks, instead of each tokenizing every row, take its assignment, which
is the one they would have computed.
"""

from __future__ import annotations

import hashlib
import heapq
from array import array
from collections.abc import Sequence

# The typecode of an assignment: a shard per row, as given to a split and as `assignment` records it.
ASSIGNMENT_TYPECODE = "i"


class SplitMismatch(ValueError):
    """A given split and the input do not have the same rows."""


class ShardSplit:
    """Assigns the input rows to shards one at a time, in input order (see the module docstring)."""

    def __init__(self, num_shards: int, by: str, given: Sequence[int] | None = None, record: bool = False):
        """given: the shard of each input row in order, computed elsewhere by this same split; record: keep the
        shards handed out in `assignment`."""
        self.num_shards = num_shards
        self.by = by
        self.given = given
        self.assignment = array(ASSIGNMENT_TYPECODE) if record else None
        self._loads = [(0, shard) for shard in range(num_shards)]  # a heap of (estimated work so far, shard)
        self._assignment = hashlib.sha256()
        self._rows = 0
        self._unsplit_rows = 0  # one shard: rows whose shard, 0, is not hashed yet (hashed at once by `digest`)

    @property
    def weighs(self) -> bool:
        """Whether shard_of needs each row's estimated work: a split by work over several shards, not given."""
        return self.num_shards > 1 and self.by == "work" and self.given is None

    def shard_of(self, index: int, work: int) -> int:
        """The shard of row `index`, whose estimated work is `work` (unused by the index split and a given one)."""
        if self.num_shards == 1:
            self._unsplit_rows += 1
            return 0
        if self.given is not None:
            if self._rows >= len(self.given):
                raise SplitMismatch(f"the given split covers {len(self.given)} rows, and the input has more")
            shard = self.given[self._rows]
        elif self.by == "index":
            shard = index % self.num_shards
        else:
            load, shard = self._loads[0]
            heapq.heapreplace(self._loads, (load + work, shard))
        self._rows += 1
        self._assignment.update(shard.to_bytes(4, "little"))
        if self.assignment is not None:
            self.assignment.append(shard)
        return shard

    def check_complete(self) -> None:
        """Raises SplitMismatch where a given split covers rows that the input did not have."""
        if self.given is not None and self._rows != len(self.given):
            raise SplitMismatch(f"the given split covers {len(self.given)} rows, and the input has {self._rows}")

    @property
    def digest(self) -> str:
        """A fingerprint of the whole assignment so far: shards that split the input alike agree on it."""
        assignment = self._assignment.copy()
        assignment.update(bytes(4 * self._unsplit_rows))  # shard 0 as 4 bytes, per row
        return assignment.hexdigest()[:16]
