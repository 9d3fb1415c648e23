"""The body of an OpenAI Batch request line: its sampling fields as batchgen per-row overrides."""

from __future__ import annotations

from typing import Any

from batchgen.io.errors import RowError
from batchgen.io.overrides import OVERRIDE_RULES, parse_overrides
from batchgen.io.values import as_integer, short_repr

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
EMBEDDINGS_URL = "/v1/embeddings"
PROMPT_FIELD_BY_URL = {CHAT_URL: "messages", COMPLETIONS_URL: "prompt", EMBEDDINGS_URL: "input"}
URLS_BY_TASK = {"generate": (CHAT_URL, COMPLETIONS_URL), "embed": (EMBEDDINGS_URL,)}  # the tasks that read them
# /v1/embeddings fields accepted without effect (the model is checked only with data.check_model)
EMBEDDING_IGNORED_FIELDS = ("model", "user")

# OpenAI (and vLLM extra) body fields -> the batchgen per-row override they set. Names batchgen does not know
# (yet) pass through unchecked; sample.params.row_params then rejects them, naming them, at run time.
OVERRIDE_BY_FIELD = {
    "max_tokens": "max_tokens",
    "max_completion_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "n": "n",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "min_tokens": "min_tokens",
    "logit_bias": "logit_bias",
    "logprobs": "logprobs",  # completions: an integer; chat: a boolean, with top_logprobs giving the count
    "prompt_logprobs": "prompt_logprobs",
    "bad_words": "bad_words",
    "allowed_token_ids": "allowed_token_ids",
    "truncate_prompt_tokens": "truncate_prompt_tokens",
    "guided_json": "guided_json",
    "guided_regex": "guided_regex",
    "guided_choice": "guided_choice",
    "guided_grammar": "guided_grammar",
    "response_format": "guided_json",  # {"type": "json_schema" | "json_object" | "text"}
}
# Values that ask for nothing (OpenAI's defaults): dropped, so a line that spells them out runs before batchgen
# knows the field.
NEUTRAL_VALUES = {"n": 1, "presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1, "min_tokens": 0}
# Accepted and without effect: the model is checked only with data.check_model; the rest are bookkeeping.
IGNORED_FIELDS = ("model", "user", "metadata", "store", "stream", "top_logprobs")


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    """Chat asks with logprobs=true and top_logprobs=k; batchgen's logprobs is the count (0: the sampled token)."""
    wanted = body.get("logprobs")
    if wanted is None or wanted is False:
        return None
    if wanted is not True:
        raise RowError(f"body.logprobs={short_repr(wanted)} is invalid: must be a boolean for {CHAT_URL}")
    top = body.get("top_logprobs")
    count = 0 if top is None else as_integer(top)
    if count is None or count < 0:
        raise RowError(f"body.top_logprobs={short_repr(top)} is invalid: must be a non-negative integer")
    return count


def _response_format_schema(value: Any) -> Any:
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise RowError(f"body.response_format={short_repr(value)} is invalid: needs a type of text, json_object "
                       "or json_schema")
    if value["type"] == "text":
        return None
    if value["type"] == "json_object":
        return {"type": "object"}
    json_schema = value.get("json_schema")
    schema = json_schema.get("schema") if isinstance(json_schema, dict) else None
    if not isinstance(schema, dict):
        raise RowError("body.response_format.json_schema.schema must be a JSON schema object")
    return schema


def body_overrides(body: dict[str, Any], url: str) -> dict[str, Any]:
    """The overrides the body's fields set, by batchgen name; raises RowError naming a field that is wrong."""
    overrides: dict[str, Any] = {}
    for field, value in body.items():
        if field in IGNORED_FIELDS or field == PROMPT_FIELD_BY_URL[url]:
            continue
        if field == "max_tokens" and body.get("max_completion_tokens") is not None:
            continue  # as in vLLM, the newer name wins
        name = OVERRIDE_BY_FIELD.get(field)
        if name is None:
            raise RowError(f"body.{field} is not supported by batchgen for {url}")
        if field == "logprobs" and url == CHAT_URL:
            value = _chat_logprobs(body)
        elif field == "response_format":
            value = _response_format_schema(value)
        if value is None or (field in NEUTRAL_VALUES and not isinstance(value, bool)
                             and value == NEUTRAL_VALUES[field]):
            continue
        if name not in OVERRIDE_RULES:
            overrides[name] = value
            continue
        try:
            overrides.update(parse_overrides({name: value}))
        except RowError as error:
            raise RowError(f"body.{field}: {error}") from None
    if body.get("stream") not in (None, False):
        raise RowError("body.stream must be false or absent in a batch")
    return overrides


def check_embedding_body(body: dict[str, Any]) -> None:
    """Raises RowError naming an /v1/embeddings body field batchgen does not do (embeddings come as floats, at
    the model's size)."""
    for field, value in body.items():
        if field in EMBEDDING_IGNORED_FIELDS or field == PROMPT_FIELD_BY_URL[EMBEDDINGS_URL]:
            continue
        if field == "encoding_format":
            if value not in (None, "float"):
                raise RowError(f"body.encoding_format={short_repr(value)} is not supported: only float")
            continue
        raise RowError(f"body.{field} is not supported by batchgen for {EMBEDDINGS_URL}")
