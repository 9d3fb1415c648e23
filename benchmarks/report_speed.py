"""report_speed: how long `batchgen.report` takes on a synthetic sweep directory (CPU only, no model).

Writes N run directories shaped like a Shakespeare job's (600 completions of 64 tokens, 700 steps, a kernel
timeline of 6 steps x 300 kernels, .hydra/overrides.yaml with three swept keys), then times the command
`python -m batchgen.report DIR --quiet` (imports included), tables only and with plots: wall seconds and the CPU
seconds the command used (on a shared machine wall time also counts waiting for a core; CPU time does not).

Usage: python -m benchmarks.report_speed [--runs 100] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import REPO, markdown_table
from tests.helpers.report_runs import completion, step, summary, write_run

ROWS, STEPS, KERNEL_STEPS, KERNELS = 600, 700, 6, 300


def write_sweep(root: Path, runs: int) -> None:
    rng = random.Random(0)
    for number in range(runs):
        eager = number % 2 == 0
        padded = None if eager else 64
        steps = [step(i, "prefill" if i % 50 == 0 else "decode", rng.uniform(1, 3), num_seqs=64, padded_size=padded,
                      forward_ms=1.0, sample_ms=0.2, prepare_ms=0.1, schedule_ms=0.05) for i in range(STEPS)]
        completions = [completion(i, [rng.randrange(65) for _ in range(64)], ttft_ms=rng.uniform(5, 50))
                       for i in range(ROWS)]
        kernels = [{"step": 100 + s, "kind": "decode", "cuda_graph": not eager, "name": f"kernel_{k % 40}",
                    "start_us": 10.0 * k, "duration_us": 8.0, "gap_before_us": 2.0}
                   for s in range(KERNEL_STEPS) for k in range(KERNELS)]
        write_run(root / str(number), ["job=shakespeare", f"engine.enforce_eager={str(eager).lower()}",
                                       f"engine.max_num_seqs={2 ** (number // 2 % 8)}", f"engine.seed={number // 16}"],
                  summary(rng.uniform(1000, 5000), rows=ROWS), steps, completions, kernels)


def timed(root: Path, plots: bool) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one report command."""
    command = [sys.executable, "-m", "batchgen.report", str(root), "--quiet", "--out", str(root / "report")]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(command + ([] if plots else ["--no-plots"]), check=True, cwd=REPO, capture_output=True,
                   env={**os.environ, "PYTHONPATH": str(REPO)})
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--dir", type=Path, help="where to write the sweep (default: a temporary directory)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.dir or Path(tmp)
        write_sweep(root, args.runs)
        rows = []
        for plots in (False, True):
            wall_s, cpu_s = timed(root, plots)
            rows.append([args.runs, "tables + plots" if plots else "tables only", wall_s, cpu_s])
    print(f"\n## report_speed: {args.runs} runs of {ROWS} rows, {STEPS} steps, {KERNEL_STEPS * KERNELS} kernels "
          f"({os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f})\n")
    print(markdown_table(["runs", "report", "wall_s", "cpu_s"], rows))


if __name__ == "__main__":
    main()
