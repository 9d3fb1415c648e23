"""python -m batchgen.report PATH [PATH ...] [--out DIR] [--no-plots]: writes PATH/report/ and prints the tables."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

OUT_NAME = "report"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="batchgen-report", description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", type=Path, help="run directories, multirun directories, or any folder "
                                                            "with run directories below it")
    parser.add_argument("--out", type=Path, help="where to write the report (default: FIRST_PATH/report)")
    parser.add_argument("--no-plots", action="store_true", help="tables only")
    parser.add_argument("--max-run-plots", type=int, default=8, help="runs drawn in the per-run plots")
    parser.add_argument("--quiet", action="store_true", help="do not print the tables")
    args = parser.parse_args(argv)
    try:
        import pandas  # noqa: F401
    except ImportError:
        print('batchgen-report needs pandas: pip install -e ".[report]"', file=sys.stderr)
        return 1
    from batchgen.report.build import build_report, write_report
    from batchgen.report.discover import ReportInputError

    try:
        report = build_report(args.paths)
    except ReportInputError as exc:
        print(f"batchgen-report: {exc}", file=sys.stderr)
        return 2
    out = args.out or args.paths[0] / OUT_NAME
    md_path = write_report(report, out, plots=not args.no_plots, max_runs=args.max_run_plots)
    if not args.quiet:
        print(md_path.read_text())
    print(f"Report: {md_path.parent / 'report.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
