"""How often Python's cyclic garbage collector runs while an engine loop turns, and what it cost.

A job holds every input row, and each step allocates container objects for each running row. With Python's default
thresholds (a young collection every 700 net allocations of containers), a job of many short rows runs the collector
a great many times, and its full collections walk every row the job holds. While an engine loop runs, the young
threshold is raised: collections are rarer, each still short. Reference counting frees every object that is not in a
cycle exactly as before; only cyclic garbage waits longer, and the engine's loop makes little of it. The collections
that still run are counted and timed, for the job's summary.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

# (young, middle, old): a young collection every 50,000 net container allocations, a middle one every 20 young ones,
# a full one considered after 100 middle ones (and, as always, only once the long-lived objects grew by a quarter).
LOOP_THRESHOLDS = (50_000, 20, 100)


@dataclass
class Collections:
    """The collector's passes while a loop ran: how many, and their seconds."""

    count: int = 0
    seconds: float = 0.0
    _started_at: float | None = None

    def observe(self, phase: str, info: dict[str, Any]) -> None:
        """A gc.callbacks callback: a collection's start, then its stop."""
        if phase == "start":
            self._started_at = time.perf_counter()
        elif self._started_at is not None:
            self.count += 1
            self.seconds += time.perf_counter() - self._started_at
            self._started_at = None


@contextmanager
def rare_collections() -> Iterator[Collections]:
    """LOOP_THRESHOLDS inside the block, the caller's thresholds again after it (a multirun's next job, a notebook);
    yields the block's Collections."""
    saved = gc.get_threshold()
    collections = Collections()
    callback = collections.observe
    gc.set_threshold(*LOOP_THRESHOLDS)
    gc.callbacks.append(callback)
    try:
        yield collections
    finally:
        gc.callbacks.remove(callback)
        gc.set_threshold(*saved)
