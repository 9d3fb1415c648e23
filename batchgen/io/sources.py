"""Row sources: one small generator per file format, each yielding the rows of a file as dicts, in order."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.io.errors import InputError
from batchgen.io.formats import hf_builder

ARROW_BATCH_ROWS = 1024
JSON_WHITESPACE = " \t\n\r"  # what json skips around a value
_scan_json_value = json.JSONDecoder().scan_once  # json.loads's own parser, without its wrapping


@dataclass
class SourceRow:
    location: str  # "line N" (JSONL, 1-based) or "row N" (0-based) for error messages
    record: dict[str, Any] | None  # None when the raw row could not be decoded
    problem: str | None = None  # why it could not be decoded


def jsonl_rows(path: Path, parse_only_with: tuple[bytes, ...] = ()) -> Iterator[SourceRow]:
    """One row per non-blank line; blank lines are not rows and are skipped, but count in line numbers.
    parse_only_with: when given, a line holding none of these byte strings is not parsed and comes as an empty
    record (a reader of one field passes the spellings its name can have, to skip rows that lack it)."""
    with path.open("rb") as file:
        yield from line_rows(enumerate(file, start=1), parse_only_with)


def jsonl_blocks(path: Path, block_bytes: int) -> Iterator[tuple[int, list[bytes]]]:
    """The file's lines in blocks of about block_bytes (whole lines), each with its first line's 1-based number."""
    with path.open("rb") as file:
        first_number = 1
        while lines := file.readlines(block_bytes):
            yield first_number, lines
            first_number += len(lines)


def line_rows(numbered_lines: Iterable[tuple[int, bytes]], parse_only_with: tuple[bytes, ...] = ()
              ) -> Iterator[SourceRow]:
    """jsonl_rows over lines given with their numbers."""
    for line_number, line in numbered_lines:
        if not line.strip():
            continue
        location = f"line {line_number}"
        if parse_only_with and not any(text in line for text in parse_only_with):
            yield SourceRow(location, {})
            continue
        try:
            value = _json_value(line)
        except json.JSONDecodeError as error:
            # Some of json's messages end in "at", meant to be followed by the position.
            problem = error.msg.removesuffix(" at")
            yield SourceRow(location, None, f"invalid JSON: {problem} at column {error.colno}")
            continue
        except UnicodeDecodeError:
            yield SourceRow(location, None, "invalid JSON: not UTF-8 text")
            continue
        if isinstance(value, dict):
            yield SourceRow(location, value)
        else:
            yield SourceRow(location, None, f"expected a JSON object, got {type(value).__name__}")


def _json_value(line: bytes) -> Any:
    """json.loads(line). A line of UTF-8 text holding one JSON value (almost every line) is parsed by json's own
    parser without json.loads's per-call work (finding the encoding, regular expressions); any other line goes through
    json.loads, which decodes the other encodings (a BOM, UTF-16, surrogates) and raises its own errors."""
    try:
        text = line.decode()
        value, end = _scan_json_value(text, len(text) - len(text.lstrip(JSON_WHITESPACE)))
    except (UnicodeDecodeError, StopIteration, json.JSONDecodeError):
        return json.loads(line)
    if text[end:].lstrip(JSON_WHITESPACE):  # "Extra data"
        return json.loads(line)
    return value


def _batch_rows(batches: Iterable[pa.RecordBatch]) -> Iterator[SourceRow]:
    index = 0
    for batch in batches:
        for record in batch.to_pylist():
            yield SourceRow(f"row {index}", record)
            index += 1


def _present(names: list[str], columns: set[str]) -> list[str]:
    return [name for name in names if name in columns]


def parquet_rows(path: Path, columns: set[str]) -> Iterator[SourceRow]:
    """Reads only `columns` (those the file has), batch by batch, so a `limit` stops early."""
    try:
        parquet_file = pq.ParquetFile(path)
    except pa.ArrowInvalid as error:
        raise InputError(f"{path}: not a readable Parquet file: {error}") from None
    with parquet_file:
        present = _present(parquet_file.schema_arrow.names, columns)
        yield from _batch_rows(parquet_file.iter_batches(batch_size=ARROW_BATCH_ROWS, columns=present))


def _ipc_batches(source: pa.NativeFile, path: Path) -> Iterator[pa.RecordBatch]:
    try:
        file_reader = pa.ipc.open_file(source)
    except pa.ArrowInvalid:
        # Not the random-access file format; try the stream format, which `Dataset.save_to_disk` writes.
        source.seek(0)
        try:
            return iter(pa.ipc.open_stream(source))
        except pa.ArrowInvalid as error:
            raise InputError(f"{path}: not an Arrow IPC file or stream: {error}") from None
    return (file_reader.get_batch(i) for i in range(file_reader.num_record_batches))


def arrow_rows(path: Path, columns: set[str]) -> Iterator[SourceRow]:
    with pa.memory_map(str(path)) as source:
        batches = _ipc_batches(source, path)
        yield from _batch_rows(batch.select(_present(batch.schema.names, columns)) for batch in batches)


def _dataset_rows(dataset: Any, columns: set[str]) -> Iterator[SourceRow]:
    present = _present(dataset.column_names, columns)
    # A dataset with no selected columns iterates as empty; keep them all so every row is still reported.
    selected = dataset.select_columns(present) if present else dataset
    for index, record in enumerate(selected):
        yield SourceRow(f"row {index}", record)


def hf_disk_rows(path: Path, split: str, columns: set[str]) -> Iterator[SourceRow]:
    # Imported here: importing datasets takes over a second, and most jobs read JSONL or Parquet.
    from datasets import DatasetDict, load_from_disk

    try:
        dataset = load_from_disk(str(path))
    except FileNotFoundError as error:
        raise InputError(f"{path}: not a directory written by save_to_disk: {error}") from None
    if isinstance(dataset, DatasetDict):
        if split not in dataset:
            raise InputError(f"{path}: no split {split!r} (data.split); the splits are {', '.join(dataset)}")
        dataset = dataset[split]
    yield from _dataset_rows(dataset, columns)


def hf_rows(path: Path, split: str, columns: set[str]) -> Iterator[SourceRow]:
    """`datasets.load_dataset` on a local file; the file as a whole must decode (no per-line skipping)."""
    from datasets import load_dataset
    from datasets.exceptions import DatasetGenerationError

    try:
        dataset = load_dataset(hf_builder(path), data_files={split: str(path)}, split=split)
    except DatasetGenerationError as error:
        raise InputError(f"{path}: datasets could not load it: {error.__cause__ or error}") from None
    yield from _dataset_rows(dataset, columns)
