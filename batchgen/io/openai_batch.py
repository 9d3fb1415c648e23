"""OpenAI Batch input files (also `vllm run-batch`'s): one request a line, read into `PromptRow`s.

A line is {"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions", "body"}, or, in a
job.task=embed job, "url": "/v1/embeddings" with body.input one text or token-id list. As in OpenAI's Batch API, a
bad line does not stop the batch: it becomes an error row (whatever data.on_error says), answered in place by an
error line in results.jsonl, and every other line is still run.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from itertools import islice
from pathlib import Path
from typing import Any

from batchgen.config import DataConfig, ModelConfig
from batchgen.io.errors import RowError
from batchgen.io.openai_fields import (
    CHAT_URL,
    EMBEDDINGS_URL,
    PROMPT_FIELD_BY_URL,
    URLS_BY_TASK,
    body_overrides,
    check_embedding_body,
)
from batchgen.io.prompt_rows import PromptRow, parse_row
from batchgen.io.sources import SourceRow, jsonl_rows
from batchgen.io.values import short_repr

BATCH_ID_FIELD = "custom_id"


@dataclass(frozen=True)
class BatchLine:
    """What results.jsonl needs of an input line besides its completions row."""

    custom_id: str | None
    url: str | None


def model_name(model: ModelConfig) -> str:
    """The name responses carry and data.check_model compares: model.served_model_name, else the checkpoint's
    directory name."""
    if model.served_model_name:
        return model.served_model_name
    path = model.path or model.tokenizer
    return Path(path).name if path else "dummy"


def _custom_id(record: dict[str, Any] | None) -> str | None:
    value = None if record is None else record.get(BATCH_ID_FIELD)
    return value if isinstance(value, str) and value else None


def _prompt_record(body: dict[str, Any], url: str) -> dict[str, Any]:
    """The body's prompt as a plain batchgen row: messages (text parts joined), a text, or token ids."""
    if url == CHAT_URL:
        messages = body.get("messages")
        if isinstance(messages, list):
            messages = [_text_message(message, position) for position, message in enumerate(messages)]
        return {"messages": messages}
    field = PROMPT_FIELD_BY_URL[url]
    prompt = body.get(field)
    if isinstance(prompt, list) and prompt and all(isinstance(token, int) for token in prompt):
        return {"prompt_token_ids": prompt}
    if prompt is not None and not isinstance(prompt, str):
        raise RowError(f"body.{field} must be a string or a list of token ids (one {field} a line)")
    return {"prompt": prompt}


def _text_message(message: Any, position: int) -> Any:
    """A message whose content is a list of {"type": "text"} parts, as one string; others as they are."""
    if not isinstance(message, dict) or not isinstance(message.get("content"), list):
        return message
    parts = message["content"]
    if not all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
               for part in parts):
        raise RowError(f"body.messages[{position}].content: only text parts are supported")
    return {**message, "content": "".join(part["text"] for part in parts)}


def parse_batch_line(record: dict[str, Any], index: int, cfg: DataConfig, tokenizer: Any,
                     expected_model: str | None, task: str = "generate") -> PromptRow:
    """One OpenAI Batch line as a PromptRow; raises RowError naming the field that is wrong. task (job.task):
    generate reads chat and completions lines, embed reads embeddings lines."""
    if _custom_id(record) is None:
        raise RowError(f"{BATCH_ID_FIELD} must be a non-empty string, got {short_repr(record.get(BATCH_ID_FIELD))}")
    if record.get("method", "POST") != "POST":
        raise RowError(f"method={short_repr(record.get('method'))} is not supported: only POST")
    url = record.get("url")
    urls = URLS_BY_TASK[task]
    if url not in urls:
        raise RowError(f"url={short_repr(url)} is not supported with job.task={task}: use {' or '.join(urls)}")
    body = record.get("body")
    if not isinstance(body, dict):
        raise RowError(f"body must be a JSON object, got {short_repr(body)}")
    if expected_model is not None and body.get("model") != expected_model:
        raise RowError(f"body.model={short_repr(body.get('model'))} is not the loaded model {expected_model!r}")
    if url == EMBEDDINGS_URL:
        check_embedding_body(body)
        overrides = {}
    else:
        overrides = body_overrides(body, url)
    plain = {BATCH_ID_FIELD: record[BATCH_ID_FIELD], **_prompt_record(body, url)}
    plain_cfg = replace(cfg, id_field=BATCH_ID_FIELD, prompt_field="prompt", messages_field="messages",
                        token_ids_field="prompt_token_ids")
    try:
        row = parse_row(plain, index, plain_cfg, tokenizer)
    except RowError as error:
        raise RowError(f"body: {error}") from None
    return replace(row, overrides=overrides)


def _batch_source(cfg: DataConfig) -> Iterator[SourceRow]:
    return islice(jsonl_rows(Path(cfg.path)), cfg.limit)


def iter_batch_file(cfg: DataConfig, tokenizer: Any = None, expected_model: str | None = None,
                    task: str = "generate") -> Iterator[PromptRow]:
    """Every line of an OpenAI Batch file as a row, in order, read a line at a time; bad lines and repeated
    custom_ids (the later ones) come back as error rows. `expected_model`: the name body.model must equal
    (data.check_model); `task`: job.task, which decides the lines' url."""
    line_by_id: dict[str, str] = {}  # custom_ids only, to name a repeated one's first line
    for index, source_row in enumerate(_batch_source(cfg)):
        problem = source_row.problem
        row = None
        if problem is None:
            try:
                row = parse_batch_line(source_row.record, index, cfg, tokenizer, expected_model, task)
            except RowError as error:
                problem = str(error)
        custom_id = _custom_id(source_row.record)
        if problem is None and custom_id in line_by_id:
            problem = f"duplicate custom_id {custom_id!r}: first used at {line_by_id[custom_id]}"
        if custom_id is not None:
            line_by_id.setdefault(custom_id, source_row.location)
        if problem is not None:
            row = PromptRow(index, custom_id or str(index), None, None, {},
                            error=f"{cfg.path}: {source_row.location}: {problem}")
        yield row


def read_batch_lines(cfg: DataConfig) -> list[BatchLine]:
    """custom_id and url of every line, by row index, without validating or tokenizing anything."""
    lines = []
    for source_row in _batch_source(cfg):
        url = None if source_row.record is None else source_row.record.get("url")
        lines.append(BatchLine(_custom_id(source_row.record), url if url in PROMPT_FIELD_BY_URL else None))
    return lines
