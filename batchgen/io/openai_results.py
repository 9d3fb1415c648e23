"""results.jsonl: OpenAI Batch output lines (the shape of OpenAI's and `vllm run-batch`'s) built from the final
completions.parquet, so it is the same after a resume or a shard merge.

One line per input line, in input order. A row with several samples (n > 1: rows sharing an index, told apart
by sample_index) is one line whose choices are the samples. An error row is a line with `error` set. A choice's
`logprobs` is null unless the request asked for them (chat: logprobs=true with top_logprobs=k; completions:
logprobs=k), and then in OpenAI's shape for its endpoint, built from the row's logprobs column. An
/v1/embeddings line (job.task=embed) is answered with OpenAI's embeddings list.
"""

from __future__ import annotations

import json
import time
import uuid
from itertools import accumulate, groupby
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.config import Config, ConfigError
from batchgen.io.atomic import write_atomically
from batchgen.io.formats import resolve_format
from batchgen.io.openai_batch import BatchLine, model_name, read_batch_lines
from batchgen.io.openai_fields import CHAT_URL, EMBEDDINGS_URL, URLS_BY_TASK
from batchgen.io.writers import CompletionWriter

RESULTS_FILE = "results.jsonl"
ERROR_CODE = "invalid_request"
ERROR_STATUS = 400
COLUMNS = ("index", "sample_index", "completion", "num_prompt_tokens", "num_output_tokens", "finish_reason", "error",
           "logprobs", "embedding")
# What OpenAI (and vLLM) answer for a token the distribution rules out, whose -inf is not JSON.
LOWEST_LOGPROB = -9999.0


def _random_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def _token(entry: dict[str, Any]) -> str:
    """A token's text; without a tokenizer, its id (vLLM's spelling)."""
    return entry["text"] if entry["text"] is not None else f"token_id:{entry['token_id']}"


def _logprob(entry: dict[str, Any]) -> float:
    return max(entry["logprob"], LOWEST_LOGPROB)


def _chat_token(entry: dict[str, Any]) -> dict[str, Any]:
    text = entry["text"]
    return {"token": _token(entry), "logprob": _logprob(entry), "bytes": None if text is None else list(text.encode())}


def chat_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """A chat choice's logprobs: each output token with its UTF-8 bytes and the top_logprobs most likely tokens."""
    return {"content": [{**_chat_token(entry), "top_logprobs": [_chat_token(top) for top in entry["top"]]}
                        for entry in entries]}


def completion_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """A completion choice's logprobs: the output tokens, their logprobs, the `logprobs` most likely tokens of each
    position by text, with the sampled token always among them, and each token's character offset in the text."""
    tokens = [_token(entry) for entry in entries]
    return {
        "tokens": tokens,
        "token_logprobs": [_logprob(entry) for entry in entries],
        "top_logprobs": [{**{_token(top): _logprob(top) for top in entry["top"]}, _token(entry): _logprob(entry)}
                         for entry in entries],
        "text_offset": list(accumulate((len(token) for token in tokens[:-1]), initial=0)),
    }


def _choice(row: dict[str, Any], url: str | None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": row.get("sample_index") or 0}
    entries = row.get("logprobs")
    if url == CHAT_URL:
        choice["message"] = {"role": "assistant", "content": row["completion"]}
        logprobs = None if entries is None else chat_logprobs(entries)
    else:
        choice["text"] = row["completion"]
        logprobs = None if entries is None else completion_logprobs(entries)
    return {**choice, "logprobs": logprobs, "finish_reason": row["finish_reason"]}


def embedding_body(row: dict[str, Any], model: str) -> dict[str, Any]:
    """OpenAI's embeddings response for one input."""
    prompt_tokens = row["num_prompt_tokens"] or 0
    return {"object": "list", "data": [{"object": "embedding", "embedding": row["embedding"], "index": 0}],
            "model": model, "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def response_body(samples: list[dict[str, Any]], url: str | None, model: str, created: int) -> dict[str, Any]:
    """A chat.completion or text_completion object for one request's completions rows (one per sample), or an
    embeddings list."""
    if url == EMBEDDINGS_URL:
        return embedding_body(samples[0], model)
    chat = url == CHAT_URL
    prompt_tokens = samples[0]["num_prompt_tokens"] or 0
    completion_tokens = sum(sample["num_output_tokens"] or 0 for sample in samples)
    return {
        "id": _random_id("chatcmpl-" if chat else "cmpl-"),
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [_choice(sample, url) for sample in samples],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }


def result_line(samples: list[dict[str, Any]], line: BatchLine, model: str, created: int) -> dict[str, Any]:
    """One output line: a 200 response, or (any sample an error) a 400 with `error` {code, message}."""
    failed = next((sample for sample in samples if sample["finish_reason"] == "error"), None)
    response = {"status_code": ERROR_STATUS if failed else 200, "request_id": _random_id("req_"),
                "body": None if failed else response_body(samples, line.url, model, created)}
    error = None if failed is None else {"code": ERROR_CODE, "message": failed["error"]}
    return {"id": _random_id("batch_req_"), "custom_id": line.custom_id, "response": response, "error": error}


def _samples_by_index(table: pa.Table) -> list[tuple[int, list[dict[str, Any]]]]:
    rows = table.to_pylist()
    rows.sort(key=lambda row: (row["index"], row.get("sample_index") or 0))
    return [(index, list(group)) for index, group in groupby(rows, key=lambda row: row["index"])]


def write_results(completions_path: Path, lines: list[BatchLine], model: str) -> Path:
    """Writes results.jsonl beside `completions_path` atomically; `lines`: the input lines by row index."""
    names = pq.read_schema(completions_path).names
    table = pq.read_table(completions_path, columns=[name for name in COLUMNS if name in names])
    created = int(time.time())
    out = []
    for index, samples in _samples_by_index(table):
        if index >= len(lines):
            raise ValueError(f"{completions_path}: row index {index} has no input line (the input has {len(lines)})")
        out.append(json.dumps(result_line(samples, lines[index], model, created)) + "\n")
    path = completions_path.with_name(RESULTS_FILE)
    write_atomically(path, lambda file: file.write("".join(out).encode()))
    return path


def openai_results_wanted(config: Config) -> bool:
    """Whether the job writes results.jsonl (job.output_format); raises ConfigError when it cannot."""
    openai_input = resolve_format(config.data) == "openai_batch"
    if config.job.output_format == "openai_batch" and not openai_input:
        raise ConfigError("job.output_format=openai_batch needs an OpenAI Batch input file (data.format="
                          "openai_batch, or a .jsonl file of such lines with data.format=auto)")
    if openai_input and config.job.task not in URLS_BY_TASK:
        raise ConfigError(f"job.task={config.job.task} does not read OpenAI Batch files ({config.data.path}); they "
                          f"run with job.task={' or '.join(URLS_BY_TASK)}")
    return config.job.output_format == "openai_batch" or (config.job.output_format == "auto" and openai_input)


def write_openai_results(config: Config, run_dir: Path) -> Path:
    """results.jsonl from the run's final completions.parquet (a shard merge calls it after merging)."""
    return write_results(Path(run_dir) / CompletionWriter.FILE_NAME, read_batch_lines(config.data),
                         model_name(config.model))
