"""Exit codes, and the cleanup of a run directory whose job never started."""

from __future__ import annotations

import shutil
from pathlib import Path

from batchgen.io.atomic import LOCK_FILE, DirectoryInUse, DirectoryLock

EXIT_OK = 0
EXIT_CRASH = 1  # a bug or an environment failure; Hydra prints the traceback
# Found by Hydra (an unknown group option, a malformed override) or by batchgen (a bad value or checkpoint, a run
# directory another job holds)
EXIT_BAD_CONFIG_OR_INPUT = 2

HYDRA_OWN = ".hydra"


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
