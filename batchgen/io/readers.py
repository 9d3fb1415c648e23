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
from batchgen.io.openai_batch import iter_batch_file
from batchgen.io.overrides import OVERRIDE_FIELDS
from batchgen.io.prompt_rows import SCORE_FIELDS, PromptRow, error_row, parse_row, parse_score_row
from batchgen.io.sources import SourceRow, arrow_rows, hf_disk_rows, hf_rows, jsonl_rows, parquet_rows

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


def _row_source(fmt: str, path: Path, cfg: DataConfig, task: str) -> Iterator[SourceRow]:
    if fmt in FILE_FORMATS and not path.is_file():
        raise InputError(f"{path}: format {fmt} reads a file, and this is not one")
    if fmt == "hf_disk" and not path.is_dir():
        raise InputError(
            f"{path}: format hf_disk reads a directory written by save_to_disk, and this is not one"
        )
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
    source = _row_source(fmt, path, cfg, task)
    location_by_id: dict[str, str] = {}
    for index, source_row in enumerate(islice(source, cfg.limit)):
        row = _prompt_row(source_row, index, cfg, tokenizer, path, task)
        first_location = location_by_id.setdefault(row.id, source_row.location)
        if first_location != source_row.location:
            raise InputError(f"{path}: duplicate id {row.id!r} at {first_location} and {source_row.location}")
        yield row
