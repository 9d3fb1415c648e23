"""One input row (a dict, whatever the file format) validated into a `PromptRow`: a prompt (job.task=generate, embed,
classify), or a context and a continuation to score (job.task=score)."""

from __future__ import annotations

from contextlib import suppress
from dataclasses import dataclass
from typing import Any

from batchgen.config import DataConfig
from batchgen.io.errors import RowError
from batchgen.io.overrides import parse_overrides
from batchgen.io.values import as_token_ids, short_repr


@dataclass
class PromptRow:
    index: int  # 0-based position in the input; the output order
    id: str
    prompt: str | None  # the text, chat-template-rendered for messages rows; None for token-id-only rows
    prompt_token_ids: list[int] | None  # None: the engine tokenizes `prompt`
    overrides: dict[str, Any]  # per-row sampling options the row sets, by SamplingParams field name
    error: str | None = None  # set only for malformed rows read with on_error="skip"
    # job.task=score: `prompt` / `prompt_token_ids` hold the context, these the continuation scored after it
    continuation: str | None = None
    continuation_token_ids: list[int] | None = None

    @property
    def text(self) -> str | None:
        """The row's whole text as completions.parquet records it: the prompt, or context + continuation."""
        if self.prompt is not None and self.continuation is not None:
            return self.prompt + self.continuation
        return self.prompt


# job.task=score rows: texts, or token ids
CONTEXT_FIELD, CONTINUATION_FIELD = "context", "continuation"
CONTEXT_IDS_FIELD, CONTINUATION_IDS_FIELD = "context_token_ids", "continuation_token_ids"
SCORE_FIELDS = (CONTEXT_FIELD, CONTINUATION_FIELD, CONTEXT_IDS_FIELD, CONTINUATION_IDS_FIELD)


def read_id(record: dict[str, Any], index: int, id_field: str | None) -> str:
    if id_field is None:
        return str(index)
    value = record.get(id_field)
    if value is None:
        raise RowError(f"missing id field {id_field!r}: set data.id_field=null to number the rows by position, or "
                       "data.id_field=<field> to name the field that holds their ids")
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, str) and value:
        return value
    raise RowError(f"id field {id_field!r} must be a non-empty string or an integer, got {short_repr(value)}")


def _checked_text(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise RowError(f"field {field!r} must be a string, got {type(value).__name__}")
    if not value:
        raise RowError(f"field {field!r} is empty")
    return value


def _checked_messages(value: Any, field: str) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise RowError(f"field {field!r} must be a non-empty list of {{'role', 'content'}} messages")
    for position, message in enumerate(value):
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and message["role"]
            and isinstance(message.get("content"), str)
        ):
            raise RowError(
                f"field {field!r}: message {position} must be a dict with a non-empty string 'role' "
                f"and a string 'content', got {short_repr(message)}"
            )
    return value


def _render_messages(messages: list[dict[str, Any]], tokenizer: Any) -> str:
    if tokenizer is None:
        raise RowError("chat messages need a tokenizer with a chat template, and no tokenizer was given")
    if not getattr(tokenizer, "chat_template", None):
        raise RowError("chat messages need a chat template, and the tokenizer has none")
    from jinja2 import TemplateError  # what renders chat templates: only for messages rows

    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except TemplateError as error:
        raise RowError(f"the chat template failed on these messages: {error}") from None


def _checked_token_ids(value: Any, field: str) -> list[int]:
    token_ids = as_token_ids(value)
    if not token_ids:
        raise RowError(f"field {field!r} must be a non-empty list of non-negative integers")
    return token_ids


def parse_row(record: dict[str, Any], index: int, cfg: DataConfig, tokenizer: Any,
              read_overrides: bool = True) -> PromptRow:
    """Validates one row; raises RowError saying what is wrong. A null field counts as absent. read_overrides:
    False where sampling options mean nothing (embed, classify): the row's are not read."""
    row_id = read_id(record, index, cfg.id_field)
    text = record.get(cfg.prompt_field)
    messages = record.get(cfg.messages_field)
    token_ids = record.get(cfg.token_ids_field)
    if text is not None and messages is not None:
        raise RowError(f"has both {cfg.prompt_field!r} and {cfg.messages_field!r}; give only one")
    if text is None and messages is None and token_ids is None:
        raise RowError(
            f"missing prompt: needs the field {cfg.prompt_field!r}, {cfg.messages_field!r} "
            f"or {cfg.token_ids_field!r}"
        )
    prompt = None
    if text is not None:
        prompt = _checked_text(text, cfg.prompt_field)
    elif messages is not None:
        prompt = _render_messages(_checked_messages(messages, cfg.messages_field), tokenizer)
    prompt_token_ids = None if token_ids is None else _checked_token_ids(token_ids, cfg.token_ids_field)
    return PromptRow(index, row_id, prompt, prompt_token_ids, parse_overrides(record) if read_overrides else {})


def parse_score_row(record: dict[str, Any], index: int, cfg: DataConfig) -> PromptRow:
    """Validates a job.task=score row: `context` and `continuation` texts, or `context_token_ids` and
    `continuation_token_ids`. An empty continuation passes here and becomes an error row (nothing to score); an
    empty context stands for the model's prefix token (lm-eval's)."""
    row_id = read_id(record, index, cfg.id_field)
    texts = [record.get(CONTEXT_FIELD), record.get(CONTINUATION_FIELD)]
    token_ids = [record.get(CONTEXT_IDS_FIELD), record.get(CONTINUATION_IDS_FIELD)]
    has_texts, has_ids = texts != [None, None], token_ids != [None, None]
    if has_texts and has_ids:
        raise RowError(f"has both texts ({CONTEXT_FIELD!r}, {CONTINUATION_FIELD!r}) and token ids "
                       f"({CONTEXT_IDS_FIELD!r}, {CONTINUATION_IDS_FIELD!r}); give one pair")
    if has_texts:
        for field, value in zip((CONTEXT_FIELD, CONTINUATION_FIELD), texts, strict=True):
            if not isinstance(value, str):
                raise RowError(f"field {field!r} must be a string, got {short_repr(value)}")
        return PromptRow(index, row_id, texts[0], None, {}, continuation=texts[1])
    if not has_ids:
        raise RowError(f"missing context: job.task=score needs the fields {CONTEXT_FIELD!r} and "
                       f"{CONTINUATION_FIELD!r}, or {CONTEXT_IDS_FIELD!r} and {CONTINUATION_IDS_FIELD!r}")
    checked = []
    for field, value in zip((CONTEXT_IDS_FIELD, CONTINUATION_IDS_FIELD), token_ids, strict=True):
        ids = as_token_ids(value)
        if ids is None:
            raise RowError(f"field {field!r} must be a list of non-negative integers, got {short_repr(value)}")
        checked.append(ids)
    return PromptRow(index, row_id, None, checked[0], {}, continuation_token_ids=checked[1])


def error_row(record: dict[str, Any] | None, index: int, cfg: DataConfig, error: str) -> PromptRow:
    """The stand-in for a malformed row: its own id when readable, else the index; its text when it is one."""
    row_id = str(index)
    prompt = None
    if record is not None:
        with suppress(RowError):
            row_id = read_id(record, index, cfg.id_field)
        text = record.get(cfg.prompt_field)
        prompt = text if isinstance(text, str) else None
    return PromptRow(index, row_id, prompt, None, {}, error=error)
