"""Exit codes, what the environment's faults look like to the user, the cleanup of a run directory whose job never
started, and the end of a process without the interpreter's teardown (and of its last job without freeing memory)."""

from __future__ import annotations

import atexit
import errno
import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

from batchgen.io.atomic import LOCK_FILE, DirectoryInUse, DirectoryLock

EXIT_OK = 0
EXIT_CRASH = 1  # a bug or an unforeseen failure; Hydra prints the traceback
# Found by Hydra (an unknown group option, a malformed override) or by batchgen (a bad value or checkpoint, a run
# directory another job holds)
EXIT_BAD_CONFIG_OR_INPUT = 2
EXIT_ENVIRONMENT = 3  # the machine refused a file: read-only, a full disk or quota, a file-size limit, a permission

HYDRA_OWN = ".hydra"
# Errors of the machine rather than of batchgen: the same command works once they are fixed.
ENVIRONMENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM})


def is_environment_fault(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in ENVIRONMENT_ERRNOS


def describe_os_error(exc: OSError) -> str:
    """One line saying what failed and where: "No space left on device (ENOSPC): <path>"."""
    name = errno.errorcode.get(exc.errno, str(exc.errno)) if exc.errno is not None else "no errno"
    where = f": {exc.filename}" if exc.filename is not None else ""
    return f"{exc.strerror or exc} ({name}){where}"


def _unstarted(run_dir: Path) -> bool:
    return all(entry.name in (HYDRA_OWN, LOCK_FILE) or (entry.is_file() and entry.suffix == ".log")
               for entry in run_dir.iterdir())


def remove_unstarted_run_dir(run_dir: Path) -> None:
    """Hydra creates the run dir, .hydra/ and a log before batchgen runs; if a failed start left nothing else,
    the directory goes, so failed starts do not litter outputs/ with empty runs. Not while another job holds its
    lock: that job has started and may not have written anything yet. Best effort: a directory that cannot be
    locked (a full disk) stays."""
    if not run_dir.is_dir() or not _unstarted(run_dir):
        return
    lock = DirectoryLock(run_dir)
    try:
        lock.acquire()
    except (DirectoryInUse, OSError):
        return
    try:
        if _unstarted(run_dir):
            shutil.rmtree(run_dir)
    finally:
        lock.release()


def end_process(status: int = EXIT_OK) -> NoReturn:
    """Ends the process once its files are final: the exit handlers (the log's flush among them) run, then the process
    exits with `status` without the interpreter's teardown. The teardown only frees objects (every module's,
    libtorch's, the CUDA context), which on a GPU machine costs a short job a noticeable share of its time
    (benchmarks/RESULTS.md); after a tensor-parallel follower died it also destroys NCCL's communicator while the
    collective aborted for the dead rank may still run, and the C++ runtime aborts the process (status -6, not 1)."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


_job_ends_process = False


@contextmanager
def job_ends_process() -> Iterator[None]:
    """Within it, the job that runs is its process's last (the command line's single run; not a multirun, whose jobs
    share the process): the job's engine leaves its memory to the process's end instead of freeing it for a next
    engine (LLMEngine.close)."""
    global _job_ends_process
    _job_ends_process = True
    try:
        yield
    finally:
        _job_ends_process = False


def process_ends_with_job() -> bool:
    return _job_ends_process
