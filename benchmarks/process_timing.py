"""Whole-process timings: a command run as a user runs it, in a subprocess, wall clock from spawn to exit."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HEAVY_MODULES = ("torch", "transformers")


@dataclass
class ProcessRun:
    seconds: float
    returncode: int
    output: str  # stdout + stderr
    ended_at: float  # time.time() when it had exited, to compare with the times of the files it wrote


def run_process(args: list[str], env: dict[str, str] | None = None, timeout: float = 600) -> ProcessRun:
    """`python ARGS` from the repository root."""
    start = time.perf_counter()
    result = subprocess.run([sys.executable, *args], cwd=REPO, env={**os.environ, **(env or {})},
                            capture_output=True, text=True, timeout=timeout)
    return ProcessRun(time.perf_counter() - start, result.returncode, result.stdout + result.stderr, time.time())


def median_seconds(args: list[str] | Callable[[int], list[str]], repeats: int, env: dict[str, str] | None = None,
                   expect_success: bool = True) -> tuple[float, list[float]]:
    """Median and all wall times of `repeats` runs (args may depend on the run's number); raises when a run's exit
    status is not the expected one."""
    times = []
    for i in range(repeats):
        run = run_process(args(i) if callable(args) else args, env)
        if (run.returncode == 0) != expect_success:
            raise RuntimeError(f"python {' '.join(args)} exited {run.returncode}:\n{run.output[-2000:]}")
        times.append(run.seconds)
    return statistics.median(times), times


def heavy_imports(args: list[str]) -> list[str]:
    """Which of HEAVY_MODULES the command imports (from `python -X importtime`)."""
    output = run_process(["-X", "importtime", *args]).output
    imported = {line.rsplit("|", 1)[-1].strip() for line in output.splitlines() if line.startswith("import time:")}
    return [name for name in HEAVY_MODULES if name in imported]
