"""python -m batchgen.merge DIR: merges the shards under DIR into DIR/completions.parquet, steps and summary."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from batchgen.runners.merge import MergeError, merge_shards


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m batchgen.merge", description=__doc__.split(": ", 1)[1])
    parser.add_argument("dir", type=Path, help="a run (or multirun sweep) directory holding shard-<i>-of-<K>/")
    args = parser.parse_args(argv)
    try:
        summary = merge_shards(args.dir)
    except MergeError as exc:
        print(f"batchgen.merge: {exc}", file=sys.stderr)
        return 1
    print(f"Merged {summary['num_shards']} shards, {summary['rows']} rows -> {args.dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
