"""The merge of the shards' results.jsonl (OpenAI Batch input): one file, one line per input line, in input order.

Each shard wrote its results.jsonl from its final completions, one line per row index in index order; the merge
interleaves the shards' lines by index, a line at a time, so it needs neither the input file nor memory for the
whole output.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import pyarrow.parquet as pq

from batchgen.io.atomic import write_atomically
from batchgen.io.openai_results import RESULTS_FILE
from batchgen.io.writers import CompletionWriter
from batchgen.runners.errors import MergeError


def _indexed_lines(shard_dir: Path) -> Iterator[tuple[int, bytes]]:
    """(row index, results line) for each line of the shard's results.jsonl."""
    index_column = pq.read_table(shard_dir / CompletionWriter.FILE_NAME, columns=["index"]).column("index")
    indices = sorted(set(index_column.to_pylist()))
    with (shard_dir / RESULTS_FILE).open("rb") as lines:
        try:
            yield from zip(indices, lines, strict=True)
        except ValueError:
            raise MergeError(f"{shard_dir / RESULTS_FILE}: its lines are not one per row of its "
                             f"{CompletionWriter.FILE_NAME} ({len(indices)} rows)") from None


def merge_results(root: Path, shards: dict[int, Path]) -> Path | None:
    """Writes root/results.jsonl from the shards' (None when no shard wrote one)."""
    without = [index for index, path in shards.items() if not (path / RESULTS_FILE).exists()]
    if len(without) == len(shards):
        return None
    if without:
        raise MergeError(f"{root}: shards {without} have no {RESULTS_FILE} and the others do: were they run with "
                         "different job.output_format?")

    def write(file: BinaryIO) -> None:
        for _, line in heapq.merge(*(_indexed_lines(path) for path in shards.values())):
            file.write(line)

    path = root / RESULTS_FILE
    write_atomically(path, write)
    return path
