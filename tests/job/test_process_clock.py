"""The process clock: start-up phases from batchgen's entry point to the job's start, taken once per process."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from batchgen.job import process_clock
from batchgen.job.process_clock import StartupClock


def test_phases_run_from_the_entry_point_through_each_mark_to_the_jobs_start():
    clock = StartupClock(entered_at=10.0, interpreter_seconds=0.25, marks=[("imports", 11.0), ("hydra", 11.5)])
    assert clock.phases(job_started_at=12.25) == {"interpreter": 0.25, "imports": 1.0, "hydra": 0.5, "launch": 0.75}
    assert "interpreter" not in StartupClock(10.0, None).phases(10.5)


def test_the_first_job_takes_the_start_up_and_the_next_job_of_the_process_none():
    process_clock.start()
    process_clock.mark("imports")
    phases = process_clock.take_startup(time.perf_counter())
    assert list(phases)[-2:] == ["imports", "launch"] and all(seconds >= 0 for seconds in phases.values())
    process_clock.mark("hydra")  # a multirun's next job passes the marks again
    assert process_clock.take_startup(time.perf_counter()) == {}


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="the process's creation time comes from /proc")
def test_process_age_is_at_least_the_time_since_this_module_was_imported():
    since_import = time.perf_counter() - process_clock.IMPORTED_AT
    age = process_clock.process_age()
    assert age is not None and since_import <= age
