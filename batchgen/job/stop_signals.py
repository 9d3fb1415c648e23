"""SIGTERM (timeout, SLURM, Kubernetes) and SIGINT (Ctrl-C): stop the job cleanly, keeping every finished row.

While rows are being written, a signal is only recorded and the job loop stops at its next step, so no part
file is cut in half; before that (reading the input, loading the model) it stops at once. A second signal
always stops at once.
"""

from __future__ import annotations

import shlex
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TypeVar

T = TypeVar("T")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequested(BaseException):
    """Raised by the handler; a BaseException, like KeyboardInterrupt, so no `except Exception` swallows it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class JobStopped(Exception):
    """The job stopped on a signal after flushing every finished row; the CLI reports it and exits 128 + signum."""

    def __init__(self, signum: int, rows_done: int, rows_total: int | None):
        self.signum, self.rows_done, self.rows_total = signum, rows_done, rows_total
        super().__init__(self.describe())

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def describe(self) -> str:
        name = signal.Signals(self.signum).name
        if self.rows_total is None:
            return f"stopped by {name} before the job started"
        return f"stopped by {name} after {self.rows_done} of {self.rows_total} rows"


class StopSignals:
    """Context manager: SIGTERM and SIGINT raise StopRequested, or with `deferred` set only set `received`.
    Installs nothing outside the main thread (Python allows handlers only there)."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.deferred = False
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {signum: signal.signal(signum, self._handle) for signum in STOP_SIGNALS}
        return self

    def __exit__(self, *exc_info: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        repeated = self.received is not None
        self.received = signum
        if repeated or not self.deferred:
            raise StopRequested(signum)


def run_stoppable(run: Callable[[StopSignals], T]) -> T:
    """Calls `run` with SIGTERM and SIGINT handled. A signal while they are not deferred (reading the input,
    loading the model) ends it at once with JobStopped; while rows are written `run` flushes them and raises
    JobStopped itself."""
    with StopSignals() as signals:
        try:
            return run(signals)
        except StopRequested as stop:
            raise JobStopped(stop.signum, 0, None) from None


def resume_command(task_overrides: list[str], run_dir: Path) -> str:
    """The command line that continues `run_dir`: this run's overrides, its run dir and job.resume=true."""
    program = ["python", "-m", "batchgen"] if sys.argv[0].endswith("__main__.py") else [Path(sys.argv[0]).name]
    kept = [o for o in task_overrides if not o.lstrip("+~").startswith("job.resume=")]
    return shlex.join([*program, *kept, f"hydra.run.dir={run_dir}", "job.resume=true"])
