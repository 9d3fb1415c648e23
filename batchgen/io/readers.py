"""Reads a prompts file into validated `PromptRow`s: lazily, row by row (iter_prompts, which a job and runner=ray's
streaming driver read), or all of them at once (read_prompts)."""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any

from batchgen.config import ERROR_POLICIES, ConfigError, DataConfig
from batchgen.io.errors import InputError, RowError
from batchgen.io.formats import resolve_format
from batchgen.io.jsonl_columns import BLOCK_BYTES, columnar_rows
from batchgen.io.openai_batch import iter_batch_file
from batchgen.io.overrides import OVERRIDE_FIELDS
from batchgen.io.prompt_rows import SCORE_FIELDS, PromptRow, error_row, parse_row, parse_score_row
from batchgen.io.sources import (
    SourceRow,
    arrow_rows,
    hf_disk_rows,
    hf_rows,
    jsonl_blocks,
    jsonl_rows,
    line_rows,
    parquet_rows,
)

__all__ = ["InputError", "PromptRow", "iter_prompts", "read_prompts", "resolve_format"]

FILE_FORMATS = ("jsonl", "parquet", "arrow", "hf")


def _wanted_columns(cfg: DataConfig, task: str) -> set[str]:
    if task == "score":
        columns = set(SCORE_FIELDS)
    else:
        columns = {cfg.prompt_field, cfg.messages_field, cfg.token_ids_field, *OVERRIDE_FIELDS}
    if cfg.id_field is not None:
        columns.add(cfg.id_field)
    return columns


def _check_path(fmt: str, path: Path) -> None:
    if fmt in FILE_FORMATS and not path.is_file():
        raise InputError(f"{path}: format {fmt} reads a file, and this is not one")
    if fmt == "hf_disk" and not path.is_dir():
        raise InputError(
            f"{path}: format hf_disk reads a directory written by save_to_disk, and this is not one"
        )


def _row_source(fmt: str, path: Path, cfg: DataConfig, task: str) -> Iterator[SourceRow]:
    columns = _wanted_columns(cfg, task)
    if fmt == "jsonl":
        return jsonl_rows(path)
    if fmt == "parquet":
        return parquet_rows(path, columns)
    if fmt == "arrow":
        return arrow_rows(path, columns)
    if fmt == "hf_disk":
        return hf_disk_rows(path, cfg.split, columns)
    return hf_rows(path, cfg.split, columns)


def _rows(fmt: str, path: Path, cfg: DataConfig, tokenizer: Any, task: str) -> Iterator[PromptRow]:
    _check_path(fmt, path)
    if fmt == "jsonl" and task != "score":
        yield from _jsonl_rows(path, cfg, tokenizer, task)
        return
    for index, source_row in enumerate(_row_source(fmt, path, cfg, task)):
        yield _prompt_row(source_row, index, cfg, tokenizer, path, task)


def _jsonl_rows(path: Path, cfg: DataConfig, tokenizer: Any, task: str) -> Iterator[PromptRow]:
    """A JSONL file's rows a block of lines at a time: by columns where columnar_rows reads the block, else line by
    line (each row read only when asked for, as the other formats' rows are)."""
    index = 0
    for first_number, lines in jsonl_blocks(path, BLOCK_BYTES):
        rows = columnar_rows(lines, index, cfg, read_overrides=task == "generate")
        if rows is not None:
            yield from rows
            index += len(rows)
            continue
        for source_row in line_rows(enumerate(lines, start=first_number)):
            yield _prompt_row(source_row, index, cfg, tokenizer, path, task)
            index += 1


def _locations(fmt: str, path: Path, indices: tuple[int, ...]) -> list[str]:
    """Where the rows of these indices are, as their messages name them: "line N" in a JSONL file (blank lines are no
    rows), else "row N". Only an error needs them: rows are not given their location as they are read."""
    if fmt != "jsonl":
        return [f"row {index}" for index in indices]
    line_numbers = {}
    with path.open("rb") as file:
        non_blank = (number for number, line in enumerate(file, start=1) if line.strip())
        for index, number in enumerate(islice(non_blank, max(indices) + 1)):
            if index in indices:
                line_numbers[index] = number
    return [f"line {line_numbers[index]}" for index in indices]


def _prompt_row(source_row: SourceRow, index: int, cfg: DataConfig, tokenizer: Any, path: Path,
                task: str) -> PromptRow:
    problem = source_row.problem
    if problem is None:
        try:
            if task == "score":
                return parse_score_row(source_row.record, index, cfg)
            return parse_row(source_row.record, index, cfg, tokenizer, read_overrides=task == "generate")
        except RowError as error:
            problem = str(error)
    message = f"{path}: {source_row.location}: {problem}"
    if cfg.on_error == "fail":
        raise InputError(message)
    return error_row(source_row.record, index, cfg, message)


def read_prompts(cfg: DataConfig, tokenizer: Any = None, model_name: str | None = None,
                 task: str = "generate") -> list[PromptRow]:
    """Every row of `cfg.path` (the first `cfg.limit`), in input order; see iter_prompts."""
    return list(iter_prompts(cfg, tokenizer, model_name, task))


def iter_prompts(cfg: DataConfig, tokenizer: Any = None, model_name: str | None = None,
                 task: str = "generate") -> Iterator[PromptRow]:
    """The rows of `cfg.path` (the first `cfg.limit`), in input order, read as they are asked for; configuration
    and file problems raise at the first row asked for.

    A malformed row raises InputError under on_error="fail"; under "skip" it comes back in place as a
    PromptRow with `error` set. Blank JSONL lines are not rows: they are skipped and get no index. Duplicate
    ids raise InputError under both policies, since outputs are joined by id. `tokenizer` renders chat
    messages. OpenAI Batch files follow OpenAI's rules instead (see openai_batch.py); `model_name` is what their
    body.model must be when data.check_model is set. `task` (job.task): score rows hold a context and a
    continuation; embed and classify rows a prompt whose sampling options are not read.
    """
    if cfg.on_error not in ERROR_POLICIES:
        raise ConfigError(
            f"data.on_error={cfg.on_error!r} is invalid: allowed values are {', '.join(ERROR_POLICIES)}"
        )
    if not cfg.path:
        raise InputError("data.path is empty: set it to a prompts file or dataset directory")
    path = Path(cfg.path)
    if not path.exists():
        raise InputError(f"{path}: no such file or directory")
    fmt = resolve_format(cfg)
    if fmt == "openai_batch":
        if not path.is_file():
            raise InputError(f"{path}: format openai_batch reads a file, and this is not one")
        yield from iter_batch_file(cfg, tokenizer, model_name if cfg.check_model else None, task)
        return
    index_by_id: dict[str, int] = {}
    for row in islice(_rows(fmt, path, cfg, tokenizer, task), cfg.limit):
        first_index = index_by_id.setdefault(row.id, row.index)
        if first_index != row.index:
            first, second = _locations(fmt, path, (first_index, row.index))
            raise InputError(f"{path}: duplicate id {row.id!r} at {first} and {second}")
        yield row
