"""Where a process's time went before its job started, so that summary.json accounts for the whole process.

batchgen's entry point (batchgen/__main__.py) imports this module before anything else of its own and starts the
clock; the command line marks the end of each start-up phase; the job takes the phases once, when it starts reading
its input. A job run without the entry point (the Python API, tests) or the next job of a multirun has none.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

IMPORTED_AT = time.perf_counter()  # batchgen's entry point: before Hydra, torch or the config are imported
INTERPRETER = "interpreter"  # the phase before the entry point: process creation, the interpreter's start, site
LAST_PHASE = "launch"  # the last mark to the job's start: picking the runner, the GPU check, the runner's own start


def process_age() -> float | None:
    """Seconds since this process was created, from /proc/self/stat (Linux, 10 ms resolution); None where there is
    no /proc."""
    if not hasattr(time, "CLOCK_BOOTTIME"):
        return None
    try:
        stat = Path("/proc/self/stat").read_text()
    except OSError:
        return None
    # starttime is field 22, in clock ticks after boot; field 2 (the command name) may hold spaces and parentheses.
    start_ticks = int(stat.rpartition(")")[2].split()[19])
    return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")


@dataclass
class StartupClock:
    entered_at: float  # perf_counter at the entry point
    interpreter_seconds: float | None  # process creation to the entry point; None where unknown
    marks: list[tuple[str, float]] = field(default_factory=list)  # (the phase that ended, perf_counter)

    def phases(self, job_started_at: float) -> dict[str, float]:
        """Each phase's seconds, in order, up to the job's start (the last one is LAST_PHASE)."""
        phases = {} if self.interpreter_seconds is None else {INTERPRETER: self.interpreter_seconds}
        since = self.entered_at
        for phase, at in [*self.marks, (LAST_PHASE, job_started_at)]:
            phases[phase] = at - since
            since = at
        return phases


_clock: StartupClock | None = None


def start() -> None:
    """Starts counting from this module's import (the entry point's first import)."""
    global _clock
    age = process_age()
    # /proc's start time is rounded down to a clock tick: never after the import, so this is never negative.
    interpreter = None if age is None else age - (time.perf_counter() - IMPORTED_AT)
    _clock = StartupClock(IMPORTED_AT, interpreter)


def mark(phase: str) -> None:
    """Ends a start-up phase, named for what happened since the previous mark (or the entry point)."""
    if _clock is not None:
        _clock.marks.append((phase, time.perf_counter()))


def take_startup(job_started_at: float) -> dict[str, float]:
    """The start-up phases up to job_started_at (a perf_counter); empty when the clock was not started, or a job of
    this process has already taken them."""
    global _clock
    clock, _clock = _clock, None
    return {} if clock is None else clock.phases(job_started_at)
