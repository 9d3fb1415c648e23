"""Start-up cost, whole process (median of --repeats runs): import batchgen.cli.main, --help, an invalid config value
rejected, and a one-row Shakespeare job on CPU; which heavy modules each imports."""

from __future__ import annotations

import argparse
import tempfile

from benchmarks.common import add_out_argument, environment, markdown_table, save_json
from benchmarks.process_timing import heavy_imports, median_seconds

ONE_ROW_JOB = ["job=shakespeare", "data.limit=1", "engine.device=cpu", "job.progress=false"]
CASES = {  # name: (python arguments, whether it succeeds, whether to list its heavy imports)
    "import batchgen.cli.main": (["-c", "import batchgen.cli.main"], True, True),
    "--help": (["-m", "batchgen", "--help"], True, True),
    "invalid config value": (["-m", "batchgen", "job=shakespeare", "engine.max_num_seqs=0"], False, True),
    "one-row job (CPU)": (["-m", "batchgen", *ONE_ROW_JOB], True, False),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    add_out_argument(parser)
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (command, succeeds, list_imports) in CASES.items():
            per_run = command
            if name.startswith("one-row"):
                per_run = lambda i, command=command: [*command, f"hydra.run.dir={tmp}/run{i}"]  # noqa: E731
            median, times = median_seconds(per_run, args.repeats, expect_success=succeeds)
            imports = heavy_imports(command) if list_imports else None
            results.append({"case": name, "median_s": median, "times_s": times, "heavy_imports": imports})
    save_json(args.out, "startup", {"environment": environment(), "results": results})
    rows = [[r["case"], r["median_s"], ", ".join(r["heavy_imports"]) if r["heavy_imports"] is not None else "-"]
            for r in results]
    print(markdown_table(["case", f"median s (of {args.repeats})", "imports"], rows))


if __name__ == "__main__":
    main()
