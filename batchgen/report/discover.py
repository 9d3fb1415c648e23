"""Finding run directories under the paths given to the report."""

from __future__ import annotations

from pathlib import Path

# Files only a batchgen run writes; a directory holding any of them is a run, finished or not.
RUN_MARKERS = ("summary.json", "completions.parquet", "completions.parts", "steps.parquet", "steps.parts")


class ReportInputError(ValueError):
    """A path given to the report is missing or holds no runs; the message names the path."""


def is_run_dir(path: Path) -> bool:
    return any((path / marker).exists() for marker in RUN_MARKERS)


def find_run_dirs(paths: list[Path]) -> list[Path]:
    """Every run directory at or below each path, in path then name order, without duplicates."""
    found: list[Path] = []
    for path in paths:
        if not path.is_dir():
            raise ReportInputError(f"{path}: no such directory (expected a run or multirun directory)")
        runs = [path] if is_run_dir(path) else sorted(
            {p.parent for marker in RUN_MARKERS for p in path.rglob(marker)},
            key=_natural_key)
        if not runs:
            raise ReportInputError(f"{path}: no run directories found (expected summary.json or steps.parquet "
                                   "in it or below it)")
        found += [run for run in runs if run not in found]
    return found


def _natural_key(path: Path) -> list[tuple[int, str]]:
    """Multirun folders 0, 1, ..., 10 in numeric order."""
    return [(int(part), "") if part.isdigit() else (-1, part) for part in path.parts]
