"""Crash-safe, resumable Parquet outputs: completions.parquet, steps.parquet and summary.json.

Rows are buffered and flushed as complete Parquet part files, so a job killed at any moment (SIGKILL) loses
at most the unflushed buffer and the part being written, and a resumed job rebuilds the final file from the parts of
every attempt.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchgen.io.atomic import (
    TMP_SUFFIX,
    fsync_path,
    tmp_path_for,
    write_atomically,
    write_file_atomically,
)
from batchgen.io.schema import COMPLETIONS_SCHEMA, KERNELS_SCHEMA, STEPS_SCHEMA, with_metadata

PART_PREFIX = "part-"
# A writer keeps the rows of the parts it flushed in memory up to this many bytes (a job's whole output, unless it is
# large), so that closing merges them without reading its own parts back; past it, the rest is read from disk.
KEPT_PART_BYTES = 256 << 20
# Buffered rows become Arrow a piece of this many at a time, as they are written: a part of flush_rows rows built at
# once held the job's thread for tens of milliseconds (a chat job's 4,096 rows), during which the device ran out of
# queued steps; a piece takes about what a decode step leaves the host (benchmarks/RESULTS.md, 2026-11-29, sixth
# session). Smaller pieces cost more calls a row.
CONVERT_ROWS = 512


def import_pandas_in_background() -> threading.Thread:
    """Imports pandas on a thread, where it is installed: pyarrow imports it at its first array made of Python objects
    (to tell pandas' own objects apart), which a job makes as it opens its outputs and starts its engine: an import
    on the job's path. Begun before the input is read, the import runs while Arrow parses the input without the GIL."""

    def import_pandas() -> None:
        with contextlib.suppress(ImportError):
            import pandas  # noqa: F401

    thread = threading.Thread(target=import_pandas, name="batchgen-import-pandas", daemon=True)
    thread.start()
    return thread


class DuplicateRowError(ValueError):
    """The same completion index was written twice."""


def _part_number(part: Path) -> int:
    return int(part.stem.removeprefix(PART_PREFIX))


def records_table(rows: list[tuple[Any, ...]], schema: pa.Schema) -> pa.Table:
    """pa.Table.from_pylist of rows given as tuples of their values in the schema's order, where a value of a nested
    field (a list) may also be a one-row Array of its field's type, or a 1-D numpy array. Built a column at a time: only
    the nested columns are searched for Arrays, and a column without values (another task's) is built as nulls."""
    columns = []
    for field, values in zip(schema, zip(*rows, strict=True), strict=True):
        field_type = field.type  # each access to a Field's attribute builds a new object
        kinds = set(map(type, values)) if pa.types.is_nested(field_type) else set()
        if any(issubclass(kind, pa.Array) for kind in kinds):
            columns.append(pa.chunked_array([value if isinstance(value, pa.Array) else pa.array([value], field_type)
                                             for value in values], type=field_type))
        elif kinds == {np.ndarray} or kinds == {np.ndarray, type(None)}:  # (count(None) would compare each array)
            columns.append(list_of_arrays(values, field_type))
        elif np.ndarray not in kinds and values.count(None) == len(values):
            columns.append(pa.nulls(len(values), field_type))
        else:
            columns.append(pa.array(values, type=field_type))
    return pa.Table.from_arrays(columns, schema=schema)


def list_of_arrays(values: tuple[np.ndarray | None, ...], list_type: pa.ListType) -> pa.ListArray:
    """pa.array(values, list_type) of 1-D numpy arrays (None for a null list) as one concatenation and its offsets,
    several times faster than pyarrow's conversion of each value (benchmarks/RESULTS.md, 2026-11-28, thirteenth
    session). The values are cast safely (an id past the element type raises)."""
    present = [value for value in values if value is not None]
    lengths = np.fromiter((0 if value is None else len(value) for value in values), np.int64, len(values))
    offsets = np.zeros(len(values) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if offsets[-1] > np.iinfo(np.int32).max:  # more ids than a list's int32 offsets hold: pyarrow's conversion
        return pa.array(values, type=list_type)
    flat = np.concatenate(present) if present else np.empty(0, np.int64)
    nulls = pa.array([value is None for value in values]) if len(present) < len(values) else None
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(flat, type=list_type.value_type),
                                    type=list_type, mask=nulls)


def dictionary_columns(schema: pa.Schema) -> list[str]:
    """The Parquet paths of the schema's leaf columns that are not floating point, the ones written with a dictionary:
    ids, texts and labels repeat, while logprobs, timings and embeddings rarely do, and a dictionary of them costs most
    of a scoring file's encoding time for a larger file."""
    def leaves(path: str, field_type: pa.DataType) -> list[tuple[str, pa.DataType]]:
        if pa.types.is_list(field_type):
            return leaves(f"{path}.list.element", field_type.value_type)  # Parquet's nested list naming
        if pa.types.is_struct(field_type):
            return [leaf for child in field_type for leaf in leaves(f"{path}.{child.name}", child.type)]
        return [(path, field_type)]

    return [path for field in schema for path, leaf_type in leaves(field.name, field.type)
            if not pa.types.is_floating(leaf_type)]


def sorted_rows(table: pa.Table, sort_key: str | list[tuple[str, str]]) -> pa.Table:
    """table.sort_by(sort_key), which leaves a table already in that order as it is (rows mostly finish in input
    order) instead of gathering every column again."""
    order = pc.sort_indices(table, sort_keys=[(sort_key, "ascending")] if isinstance(sort_key, str) else sort_key)
    if np.array_equal(order.to_numpy(), np.arange(table.num_rows)):
        return table
    return table.take(order)


class PartedParquetWriter:
    """Buffers records; each flush writes one complete Parquet part file (tmp name, fsync, os.replace into
    <final stem>.parts/part-<n>.parquet). close() merges all parts into the final file atomically (tmp +
    os.replace) sorted by sort_key (None: write order), then removes the parts directory.

    While no earlier attempt left parts, the final file's tmp grows as parts are written, and close() only adds the
    rows still held back and renames it: a large job's close then reads and writes no rows again. The file grows by
    the rows below the key the writer is told every row under has been written (`complete_below`: the job's first
    unfinished row), held back and sorted until then; without that key, by each part whose rows come in the final
    order, until one does not.

    Rows are buffered as Arrow tables of CONVERT_ROWS rows as they come. A part that write() flushes is encoded,
    written and sorted into the final file on the writer's own thread while rows keep coming (Parquet's encoder, Arrow's
    sort and the fsyncs release the GIL), one part at a time; flush() and close() return once every part is on disk,
    and a part that failed to write is written again by the next flush.

    Opening a writer where a previous one left parts or a final file resumes: their rows are kept (a final
    file moves back into a part, so close() always rebuilds from parts) and stale tmp files are removed.
    Not thread-safe; one writer per file at a time.
    """

    def __init__(
        self,
        final_path: Path,
        schema: pa.Schema,
        sort_key: str | list[tuple[str, str]] | None,
        flush_rows: int = 4096,
        flush_seconds: float = 10.0,
    ) -> None:
        self.final_path = final_path
        self.parts_dir = final_path.with_name(final_path.stem + ".parts")
        self.schema = schema
        self.sort_key = sort_key
        self.flush_rows = flush_rows
        self.flush_seconds = flush_seconds
        self._field_names = tuple(schema.names)  # schema.names builds a new list on every access
        self._names = frozenset(self._field_names)
        self._required = [field.name for field in schema if not field.nullable]
        self._required_positions = [position for position, field in enumerate(schema) if not field.nullable]
        self._dictionary_columns = dictionary_columns(schema)
        keys = [] if sort_key is None else [(sort_key, "ascending")] if isinstance(sort_key, str) else sort_key
        self._sort_columns = [name for name, _ in keys]
        self._buffer: list[tuple[Any, ...]] = []  # each row's values in the schema's order, not yet in _converted
        self._converted: list[pa.Table] = []  # the buffered rows before _buffer's, CONVERT_ROWS a table
        self._num_buffered = 0
        # The parts this writer flushed, with their rows, up to KEPT_PART_BYTES: close() merges them from memory
        # rather than reading them back (most of a large job's close).
        self._kept: dict[Path, pa.Table] = {}
        self._kept_bytes = 0
        # (part path, its rows, _complete_below when they were flushed), flushed and not known to be on disk
        self._unwritten: list[tuple[Path, pa.Table, Any]] = []
        self._writing: Future | None = None  # the background write of _unwritten[0]
        self._thread: ThreadPoolExecutor | None = None
        self._last_flush = time.monotonic()
        self._closed = False
        self._recover()
        parts = self._parts()
        self._next_part = _part_number(parts[-1]) + 1 if parts else 0
        # Whether the final file's tmp can still grow into the whole file, from its first row on: its rows so far are
        # the first of the final order, and the held ones come after them. The last grown row's sort key; the rows
        # flushed but held back (sorted); the first sort column's value below which every row has been written.
        self._in_order = not parts and all(order == "ascending" for _, order in keys)
        self._last_key: tuple[Any, ...] | None = None
        self._held: pa.Table | None = None
        self._complete_below: Any = None
        # The tmp, grown on the writer's thread as each part is written; whether no write to it has failed; the parts
        # this writer wrote.
        self._final_rows: pq.ParquetWriter | None = None
        self._growing = True
        self._written_parts: list[Path] = []

    def _recover(self) -> None:
        self.final_path.parent.mkdir(parents=True, exist_ok=True)
        tmp_path_for(self.final_path).unlink(missing_ok=True)
        if self.final_path.exists():
            # close() writes the final file from every part before removing them, so parts that are still
            # there (close() killed after its rename) are already in it.
            if self.parts_dir.exists():
                shutil.rmtree(self.parts_dir)
            self.parts_dir.mkdir()
            self.final_path.replace(self._part_path(0))
            fsync_path(self.parts_dir)
            fsync_path(self.final_path.parent)
            return
        self.parts_dir.mkdir(exist_ok=True)
        for stale in self.parts_dir.glob(f"*{TMP_SUFFIX}"):
            stale.unlink()

    def _part_path(self, number: int) -> Path:
        return self.parts_dir / f"{PART_PREFIX}{number:06d}.parquet"

    def _parts(self) -> list[Path]:
        return sorted(self.parts_dir.glob(f"{PART_PREFIX}*.parquet"), key=_part_number)

    def write(self, record: dict[str, Any]) -> None:
        """Buffers one row (missing nullable fields are null; a value may be a one-row pyarrow Array of its field's
        type, built from arrays by the caller); flushes when flush_rows are buffered or flush_seconds have passed
        since the last flush (checked here, on write)."""
        if not self._names.issuperset(record):
            unknown = record.keys() - self._names
            raise ValueError(
                f"{self.final_path}: unknown fields {sorted(unknown)}; the schema has {self.schema.names}"
            )
        self.write_values(tuple(map(record.get, self._field_names)))

    def write_values(self, values: tuple[Any, ...]) -> None:
        """write() of the record whose values, in the schema's order, these are: a caller that makes one per row
        builds no dict."""
        if self._closed:
            raise RuntimeError(f"{self.final_path}: the writer is closed")
        if len(values) != len(self._field_names):
            raise ValueError(f"{self.final_path}: a row has {len(values)} values; the schema has "
                             f"{len(self._field_names)} fields {list(self._field_names)}")
        for position in self._required_positions:
            if values[position] is None:
                missing = [name for name, value in zip(self._field_names, values, strict=True)
                           if value is None and name in self._required]
                raise ValueError(f"{self.final_path}: record lacks the required fields {missing}")
        self._accept(values)
        self._buffer.append(values)
        self._num_buffered += 1
        if len(self._buffer) >= CONVERT_ROWS:
            self._convert_buffer()
        if self._num_buffered >= self.flush_rows or time.monotonic() - self._last_flush >= self.flush_seconds:
            self._flush(in_background=True)

    def _accept(self, values: tuple[Any, ...]) -> None:
        """Subclasses raise here when a row that fits the schema breaks an invariant of the file."""

    def flush(self) -> None:
        """Writes the buffered rows as one new part file; after it returns they survive a crash."""
        self._flush(in_background=False)

    def _buffered_table(self) -> pa.Table:
        """The buffered rows as one table (of the schema, maybe empty); they stay buffered until _clear_buffered, so
        that a failure before they are in a part or the final file loses none."""
        if self._buffer:
            self._convert_buffer()
        if len(self._converted) > 1:
            self._converted = [pa.concat_tables(self._converted)]
        return self._converted[0] if self._converted else self.schema.empty_table()

    def _convert_buffer(self) -> None:
        """The rows in _buffer become one more Arrow piece of _converted."""
        self._converted.append(records_table(self._buffer, self.schema))
        self._buffer = []

    def _clear_buffered(self) -> None:
        self._buffer, self._converted, self._num_buffered = [], [], 0

    def _flush(self, in_background: bool, buffered: pa.Table | None = None) -> None:
        """Makes the buffered rows (their table, when the caller built it) a part: written before returning, or on the
        writer's thread once the part before it is on disk. A failed write of an earlier part raises here, its rows
        kept to be written again."""
        self.wait_for_parts()
        table = self._buffered_table() if buffered is None else buffered
        if table.num_rows:
            path = self._part_path(self._next_part)
            if self._kept_bytes + table.nbytes <= KEPT_PART_BYTES:
                self._kept[path] = table
                self._kept_bytes += table.nbytes
            self._unwritten.append((path, table, self._complete_below))
            self._next_part += 1
            self._clear_buffered()
        self._last_flush = time.monotonic()
        if in_background and len(self._unwritten) == 1:
            if self._thread is None:
                self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"batchgen-{self.final_path.stem}-parts")
            self._writing = self._thread.submit(self._write_part, *self._unwritten[0])
        else:
            while self._unwritten:
                self._write_part(*self._unwritten[0])
                self._unwritten.pop(0)

    def wait_for_parts(self) -> None:
        """Returns once the part being written in the background is on disk (the buffered rows stay buffered);
        raises its write's error, its rows kept for the next flush."""
        writing, self._writing = self._writing, None
        if writing is not None:
            writing.result()
            self._unwritten.pop(0)

    def complete_below(self, value: Any) -> None:
        """Every row whose first sort column is below `value` has been written: the final file may take them."""
        self._complete_below = value

    def _write_part(self, path: Path, table: pa.Table, complete_below: Any) -> None:
        """Writes a flushed part, then grows the final file by the rows that are now in order: on the writer's thread
        for a flush in the background, so that sorting them (pyarrow's, without the GIL) is not the job's pause.
        complete_below: its value when the part was flushed (rows written since are not in the part)."""
        try:
            write_file_atomically(path, lambda tmp_path: self._write_table(table, tmp_path))
        except BaseException:
            self._drop_final_file()  # a failing disk: the final file is left to a merge, which names the fault
            raise
        self._written_parts.append(path)
        to_grow = self._rows_to_grow(table, complete_below)
        if to_grow is not None:
            self._grow_final_file(to_grow)

    def _rows_to_grow(self, table: pa.Table, complete_below: Any, closing: bool = False) -> pa.Table | None:
        """The flushed rows (with those held back before) that extend the final file now, in its order, given the
        first sort column's value below which every row had been written (`complete_below`); the rest are held back.
        None once the file cannot become the whole file in order (the merge then writes it)."""
        if not self._in_order or not self._sort_columns:
            return table if self._in_order else None
        if complete_below is None and not closing:  # no row known complete: rows that come in order
            grow = table
        else:
            rows = table if self._held is None else pa.concat_tables([self._held, table])
            rows = sorted_rows(rows, self.sort_key) if rows.num_rows else rows
            cut = rows.num_rows if closing else int(np.searchsorted(
                rows.column(self._sort_columns[0]).to_numpy(zero_copy_only=False), complete_below))
            grow, held = rows.slice(0, cut), rows.slice(cut)
            self._held = held if held.num_rows else None
        if grow.num_rows == 0:
            return grow
        columns = [grow.column(name) for name in self._sort_columns]
        first, last = tuple(key[0].as_py() for key in columns), tuple(key[-1].as_py() for key in columns)
        # A null key sorts last, among rows that may not have come yet: those rows are left to the merge.
        self._in_order = (None not in first and None not in last and sorted_rows(grow, self.sort_key) is grow
                          and (self._last_key is None or first > self._last_key))
        self._last_key = last
        return grow if self._in_order else None

    def _grow_final_file(self, table: pa.Table) -> bool:
        """Appends the rows to the final file's tmp; False, with the tmp given up for the merge, where that fails (the
        merge reports a lasting fault of the disk, naming the file)."""
        if not self._growing:
            return False
        try:
            if self._final_rows is None:
                self._final_rows = pq.ParquetWriter(str(tmp_path_for(self.final_path)), self.schema,
                                                    use_dictionary=self._dictionary_columns)
            if table.num_rows:
                self._final_rows.write_table(table)
                fsync_path(tmp_path_for(self.final_path))  # its rows reach the disk now, not all at the close
            return True
        except OSError:
            self._drop_final_file()
            return False

    def _drop_final_file(self) -> None:
        self._growing = False
        if self._final_rows is not None:
            with contextlib.suppress(OSError):
                self._final_rows.close()
            self._final_rows = None
        tmp_path_for(self.final_path).unlink(missing_ok=True)

    def _write_table(self, table: pa.Table, path: Path) -> None:
        # Arrow's own file, not a Python one: a Python file takes the GIL for each of the encoder's writes.
        pq.write_table(table, str(path), use_dictionary=self._dictionary_columns)

    def existing_rows(self, columns: list[str] | None = None) -> pa.Table:
        """The rows in part files, earlier attempts included, in write order; buffered rows are not."""
        self.wait_for_parts()
        schema = self.schema if columns is None else pa.schema([self.schema.field(name) for name in columns])
        tables = []
        for part in self._parts():
            kept = self._kept.get(part)
            if kept is not None:
                tables.append(kept if columns is None else kept.select(columns))
                continue
            with pq.ParquetFile(part) as file:  # no dataset discovery: a job may leave many parts
                table = file.read(columns=columns)
            # An earlier attempt's part carries that attempt's metadata: the rows take this writer's (a forced resume
            # records itself there), without a copy where only the metadata differs.
            tables.append(table.replace_schema_metadata(schema.metadata) if table.schema.equals(schema)
                          else table.cast(schema))
        return pa.concat_tables(tables) if tables else pa.Table.from_batches([], schema=schema)

    def _check_merged(self, table: pa.Table) -> None:
        """Subclasses raise here when the merged rows break an invariant; the parts are left untouched."""

    def _finish_grown_file(self, buffered: pa.Table) -> bool:
        """close() of a writer whose final file could grow: the rows held back and the buffered ones join the tmp,
        which becomes the final file. False, with the tmp removed, where the rows must be merged: some came out of
        order, the parts on disk are not this writer's, or a write to the tmp failed."""
        if self._unwritten or self._parts() != self._written_parts:
            self._in_order = False
        rest = self._rows_to_grow(buffered, self._complete_below, closing=True)
        if rest is None or not self._grow_final_file(rest):
            self._drop_final_file()
            return False
        tmp_path = tmp_path_for(self.final_path)
        try:
            self._final_rows.close()
            fsync_path(tmp_path)
        except OSError:
            self._drop_final_file()
            return False
        self._final_rows = None
        self._clear_buffered()
        os.replace(tmp_path, self.final_path)
        fsync_path(self.final_path.parent)
        return True

    def close(self) -> Path:
        """Flushes, merges every part into the final file atomically, removes the parts; returns its path."""
        if self._closed:
            return self.final_path
        self.wait_for_parts()
        buffered = self._buffered_table()
        if not self._finish_grown_file(buffered):
            self._flush(in_background=False, buffered=buffered)
            table = self.existing_rows().combine_chunks()  # a table of few chunks sorts and writes faster
            if self.sort_key is not None:
                table = sorted_rows(table, self.sort_key)
            self._check_merged(table)
            write_file_atomically(self.final_path, lambda tmp_path: self._write_table(table, tmp_path))
        self._kept, self._kept_bytes = {}, 0
        shutil.rmtree(self.parts_dir)
        if self._thread is not None:
            self._thread.shutdown()
            self._thread = None
        self._closed = True
        return self.final_path


class CompletionWriter(PartedParquetWriter):
    """completions.parquet: one row per (prompt, sample), sorted by index then sample_index; each pair may be written
    only once. A record without sample_index is sample 0."""

    FILE_NAME = "completions.parquet"

    def __init__(
        self, run_dir: Path, metadata: dict[str, Any], flush_rows: int = 4096, flush_seconds: float = 10.0
    ) -> None:
        super().__init__(
            run_dir / self.FILE_NAME,
            with_metadata(COMPLETIONS_SCHEMA, metadata),
            [("index", "ascending"), ("sample_index", "ascending")],
            flush_rows,
            flush_seconds,
        )
        self._index_position = self.schema.get_field_index("index")
        self._sample_index_position = self.schema.get_field_index("sample_index")
        written = self.existing_rows(["index", "sample_index"])
        self._written: set[tuple[int, int]] = set(zip(written.column("index").to_pylist(),
                                                      written.column("sample_index").to_pylist(), strict=True))

    def finished_samples(self) -> dict[int, set[int]]:
        """The sample indices written so far for each row index: by earlier attempts (what a resumed job skips) and
        by this writer."""
        samples: dict[int, set[int]] = {}
        for index, sample_index in self._written:
            samples.setdefault(index, set()).add(sample_index)
        return samples

    def finished_indices(self, num_samples: Callable[[int], int] = lambda index: 1) -> set[int]:
        """Row indices whose samples 0 .. num_samples(index) - 1 are all written."""
        return {index for index, samples in self.finished_samples().items()
                if samples.issuperset(range(num_samples(index)))}

    def write(self, record: dict[str, Any]) -> None:
        record.setdefault("sample_index", 0)
        super().write(record)

    def _accept(self, values: tuple[Any, ...]) -> None:
        key = (values[self._index_position], values[self._sample_index_position])
        if key in self._written:
            raise DuplicateRowError(f"{self.final_path}: index {key[0]} was already written (sample_index {key[1]})")
        self._written.add(key)

    def _check_merged(self, table: pa.Table) -> None:
        """Rows come sorted by (index, sample_index), so a pair written twice is two neighbouring rows."""
        index = table.column("index").to_numpy()
        sample_index = table.column("sample_index").fill_null(0).to_numpy()
        repeated = (index[1:] == index[:-1]) & (sample_index[1:] == sample_index[:-1])
        duplicates = np.unique(index[1:][repeated]).tolist()
        if duplicates:
            raise DuplicateRowError(f"{self.parts_dir}: indices written more than once: {duplicates[:20]}")


class StepWriter(PartedParquetWriter):
    """steps.parquet: one row per engine step, in write order (attempt, then step)."""

    FILE_NAME = "steps.parquet"

    def __init__(
        self, run_dir: Path, metadata: dict[str, Any], flush_rows: int = 4096, flush_seconds: float = 10.0,
        schema: pa.Schema = STEPS_SCHEMA,  # a sharded run's steps add a `shard` column
    ) -> None:
        super().__init__(run_dir / self.FILE_NAME, with_metadata(schema, metadata), None, flush_rows, flush_seconds)

    def next_attempt(self) -> int:
        """0 for a fresh run, else 1 + the latest attempt with steps on disk; call it before writing."""
        attempts = self.existing_rows(["attempt"]).column("attempt")
        return 0 if len(attempts) == 0 else pc.max(attempts).as_py() + 1


def write_kernels(path: Path, rows: list[dict[str, Any]], metadata: dict[str, Any]) -> Path:
    """kernels.parquet (job.profile_steps): one row per kernel of the profiled steps."""
    table = pa.Table.from_pylist(rows, schema=with_metadata(KERNELS_SCHEMA, metadata))
    write_atomically(path, lambda file: pq.write_table(table, file))
    return path


def write_json_atomic(path: Path, obj: Any) -> None:
    """Writes `obj` as indented JSON; readers see the previous file or the whole new one."""
    text = json.dumps(obj, indent=2) + "\n"
    write_atomically(path, lambda file: file.write(text.encode()))
