"""Exit codes, and the cleanup of a run directory whose job never started."""

from __future__ import annotations

import shutil
from pathlib import Path

EXIT_OK = 0
EXIT_CRASH = 1  # a bug or an environment failure; Hydra prints the traceback
EXIT_BAD_CONFIG_OR_INPUT = 2  # found by Hydra (an unknown group option, a malformed override) or by batchgen

HYDRA_OWN = ".hydra"


def remove_unstarted_run_dir(run_dir: Path) -> None:
    """Hydra creates the run dir, .hydra/ and a log before batchgen runs; if a failed start left nothing else,
    the directory goes, so failed starts do not litter outputs/ with empty runs."""
    if not run_dir.is_dir():
        return
    if all(entry.name == HYDRA_OWN or (entry.is_file() and entry.suffix == ".log") for entry in run_dir.iterdir()):
        shutil.rmtree(run_dir)
