"""How often Python's cyclic garbage collector runs while an engine loop turns.

A job holds every input row, and each step allocates container objects for each running row. With Python's default
thresholds (a young collection every 700 net allocations of containers), a job of many short rows runs the collector
a great many times, and its full collections walk every row the job holds. While an engine loop runs, the young
threshold is raised: collections are rarer, each still short. Reference counting frees every object that is not in a
cycle exactly as before; only cyclic garbage waits longer, and the engine's loop makes little of it.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

# (young, middle, old): a young collection every 50,000 net container allocations, a middle one every 20 young ones,
# a full one considered after 100 middle ones (and, as always, only once the long-lived objects grew by a quarter).
LOOP_THRESHOLDS = (50_000, 20, 100)


@contextmanager
def rare_collections() -> Iterator[None]:
    """LOOP_THRESHOLDS inside the block, the caller's thresholds again after it (a multirun's next job, a notebook)."""
    saved = gc.get_threshold()
    gc.set_threshold(*LOOP_THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*saved)
