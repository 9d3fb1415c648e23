"""`pytest -m gpu` in several concurrent processes on the one GPU, to spend less device time: the kernel tests are
bound by Triton compiling on the host, which one process does on one core.

The test files are dealt to `--jobs` groups by their number of GPU tests (largest first, each to the smallest group);
each group is one pytest process. The tests marked `whole_gpu` (an engine whose KV cache takes most of the GPU's memory
by design) run after the groups, in one process of their own: beside them the others' allocations ran out of memory.
Prints every group's summary line; exits non-zero when any group fails.

Usage: python -m benchmarks.pytest_gpu [--jobs 3] [--out DIR] [pytest args...]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections import Counter
from pathlib import Path

from benchmarks.common import REPO, add_out_argument

PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
CONCURRENT = "gpu and not whole_gpu"  # the tests the groups run side by side
ALONE = "gpu and whole_gpu"  # the tests run after them, in one process


def gpu_test_counts(marks: str) -> Counter[str]:
    """The number of tests of each file that `-m marks` selects."""
    listing = subprocess.run([*PYTEST, "-m", marks, "--collect-only"], cwd=REPO, capture_output=True, text=True)
    if listing.returncode not in (0, 5):  # 5: nothing selected
        raise SystemExit(f"pytest --collect-only failed:\n{listing.stdout}{listing.stderr}")
    return Counter(line.split("::", 1)[0] for line in listing.stdout.splitlines() if "::" in line)


def deal(counts: Counter[str], jobs: int) -> list[list[str]]:
    """Files in at most `jobs` groups of about equal test counts."""
    groups: list[tuple[int, list[str]]] = [(0, []) for _ in range(jobs)]
    for path, count in counts.most_common():
        size, files = min(groups, key=lambda group: group[0])
        groups.remove((size, files))
        groups.append((size + count, [*files, path]))
    return [files for _, files in groups if files]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=3)
    add_out_argument(parser)
    args, pytest_args = parser.parse_known_args()
    args.out.mkdir(parents=True, exist_ok=True)
    groups = deal(gpu_test_counts(CONCURRENT), args.jobs)
    logs = [args.out / f"pytest_gpu_{i}.log" for i in range(len(groups))]
    processes = [subprocess.Popen([*PYTEST, "-m", CONCURRENT, *pytest_args, *files], cwd=REPO, stdout=log.open("w"),
                                  stderr=subprocess.STDOUT) for files, log in zip(groups, logs, strict=True)]
    codes = [process.wait() for process in processes]
    alone = sorted(gpu_test_counts(ALONE))
    if alone:
        groups.append(alone)
        logs.append(args.out / "pytest_gpu_alone.log")
        codes.append(subprocess.run([*PYTEST, "-m", ALONE, *pytest_args, *alone], cwd=REPO, stdout=logs[-1].open("w"),
                                    stderr=subprocess.STDOUT).returncode)
    for files, log, code in zip(groups, logs, codes, strict=True):
        lines = Path(log).read_text().strip().splitlines()
        print(f"group of {len(files)} files, exit {code}: {lines[-1] if lines else '(no output)'}")
        for line in lines:
            if line.startswith(("FAILED", "ERROR")):
                print(line)
    sys.exit(max(codes))


if __name__ == "__main__":
    main()
