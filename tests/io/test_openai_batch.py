"""OpenAI Batch files: request lines in (fields mapped onto row overrides, bad lines kept as errors) and
results.jsonl out (OpenAI's output shape, one line per input line, samples grouped into choices)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from batchgen.config import ConfigError, DataConfig, JobConfig, ModelConfig, validate_job
from batchgen.io import openai_batch
from batchgen.io.openai_batch import BatchLine, model_name, read_batch_lines
from batchgen.io.openai_results import write_results
from batchgen.io.readers import iter_prompts, read_prompts, resolve_format
from tests.helpers.common import REPO, batchgen

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def request(custom_id: str, url: str, **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def write_lines(path: Path, lines: list[Any]) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


@pytest.fixture(scope="module")
def chat_tokenizer() -> PreTrainedTokenizerFast:
    word_level = Tokenizer(models.WordLevel(vocab={"<unk>": 0, "<eos>": 1}, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=word_level, unk_token="<unk>", eos_token="<eos>")
    tokenizer.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
    return tokenizer


def test_auto_format_detects_openai_batch_lines(tmp_path: Path) -> None:
    batch = write_lines(tmp_path / "batch.jsonl", ["", request("a", COMPLETIONS, prompt="x")])
    plain = write_lines(tmp_path / "plain.jsonl", [{"prompt": "x", "body": "not a request"}])
    assert resolve_format(DataConfig(path=str(batch))) == "openai_batch"
    assert resolve_format(DataConfig(path=str(plain))) == "jsonl"


def test_request_fields_map_onto_row_overrides(tmp_path: Path, chat_tokenizer: Any) -> None:
    path = write_lines(tmp_path / "batch.jsonl", [
        request("chat-1", CHAT, model="m", messages=[{"role": "system", "content": "be brief"},
                                                     {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                max_tokens=99, max_completion_tokens=7, temperature=0.5, top_p=0.9, stop="\n", seed=3, n=1, user="u"),
        request("text-1", COMPLETIONS, model="m", prompt="once upon", max_tokens=4, top_k=5, min_p=0.1,
                stop=["a", "b"], ignore_eos=True, stop_token_ids=[1], presence_penalty=0, stream=False),
        request("ids-1", COMPLETIONS, prompt=[5, 6, 7]),
    ])
    chat, text, ids = read_prompts(DataConfig(path=str(path)), chat_tokenizer)
    assert (chat.index, chat.id, chat.prompt, chat.error) == (0, "chat-1", "<system>be brief\n<user>hi\n<assistant>",
                                                              None)
    assert chat.overrides == {"max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "stop": ["\n"], "seed": 3}
    assert (text.id, text.prompt) == ("text-1", "once upon")
    assert text.overrides == {"max_tokens": 4, "top_k": 5, "min_p": 0.1, "stop": ["a", "b"], "ignore_eos": True,
                              "stop_token_ids": [1]}
    assert (ids.prompt, ids.prompt_token_ids, ids.overrides) == (None, [5, 6, 7], {})


def test_fields_batchgen_may_not_know_pass_through_by_their_batchgen_name(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "batch.jsonl", [
        request("a", COMPLETIONS, prompt="hi", logprobs=1, frequency_penalty=0.5, n=1, repetition_penalty=1),
    ])
    [row] = read_batch_rows(path)
    # OpenAI's neutral values (n=1, repetition_penalty=1) ask for nothing and are dropped.
    assert row.overrides == {"logprobs": 1, "frequency_penalty": 0.5}


def read_batch_rows(path: Path, tokenizer: Any = None, **options: Any) -> list[Any]:
    return read_prompts(DataConfig(path=str(path), format="openai_batch", **options), tokenizer)


def test_response_format_maps_to_guided_json(tmp_path: Path, chat_tokenizer: Any) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    path = write_lines(tmp_path / "batch.jsonl", [
        request("schema", CHAT, messages=[{"role": "user", "content": "hi"}], n=3, logprobs=True, top_logprobs=2,
                response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}),
        request("object", CHAT, messages=[{"role": "user", "content": "hi"}],
                response_format={"type": "json_object"}),
        request("text", CHAT, messages=[{"role": "user", "content": "hi"}], response_format={"type": "text"}),
    ])
    with_schema, any_object, text = read_batch_rows(path, chat_tokenizer)
    assert with_schema.overrides == {"n": 3, "logprobs": 2, "guided_json": schema}
    assert any_object.overrides == {"guided_json": {"type": "object"}}
    assert text.overrides == {}


BAD_LINES = [
    ('{"custom_id": "broken", "body": ', "invalid JSON"),
    (request("", COMPLETIONS, prompt="x"), "custom_id must be a non-empty string"),
    ({"method": "POST", "url": COMPLETIONS, "body": {"prompt": "x"}}, "custom_id must be"),
    ({**request("get", COMPLETIONS, prompt="x"), "method": "GET"}, "method='GET' is not supported"),
    (request("embed", "/v1/embeddings", input="x"), "url='/v1/embeddings' is not supported"),
    ({"custom_id": "nobody", "method": "POST", "url": COMPLETIONS}, "body must be a JSON object"),
    (request("tools", CHAT, messages=[{"role": "user", "content": "x"}], tools=[]), "body.tools is not supported"),
    (request("temp", COMPLETIONS, prompt="x", temperature=-1), "body.temperature: temperature=-1 is invalid"),
    (request("max", CHAT, messages=[], max_completion_tokens=0), "body.max_completion_tokens: max_tokens=0"),
    (request("noprompt", COMPLETIONS, max_tokens=3), "body: missing prompt"),
    (request("prompts", COMPLETIONS, prompt=["a", "b"]), "body.prompt must be a string or a list of token ids"),
    (request("image", CHAT, messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
     r"body.messages\[0\].content: only text parts"),
    (request("schema", CHAT, messages=[{"role": "user", "content": "x"}],
             response_format={"type": "json_schema", "json_schema": "x"}), "json_schema.schema must be a JSON schema"),
    (request("mixed", COMPLETIONS, messages=[{"role": "user", "content": "x"}]),
     "body.messages is not supported by batchgen for /v1/completions"),
    (request("stream", COMPLETIONS, prompt="x", stream=True), "body.stream must be false"),
    (request("good", COMPLETIONS, prompt="again"), "duplicate custom_id 'good': first used at line 1"),
]


def test_bad_lines_become_error_rows_in_place(tmp_path: Path) -> None:
    lines = [request("good", COMPLETIONS, prompt="first")] + [line for line, _ in BAD_LINES]
    lines.append(request("last", COMPLETIONS, prompt="last"))
    path = write_lines(tmp_path / "batch.jsonl", lines)
    # Unlike other formats, a bad line never stops an OpenAI Batch file, whatever data.on_error says.
    rows = read_batch_rows(path, on_error="fail")
    assert [row.index for row in rows] == list(range(len(lines)))
    assert (rows[0].error, rows[-1].error, rows[-1].id) == (None, None, "last")
    for row, (_, problem) in zip(rows[1:-1], BAD_LINES, strict=True):
        assert row.error is not None and re.search(problem, row.error), (problem, row.error)
        assert row.error.startswith(f"{path}: line {row.index + 1}: ")
    assert rows[4].id == "get" and rows[2].id == "2"  # its own custom_id when it has one, else the index


def test_check_model_compares_body_model_with_the_loaded_model(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "batch.jsonl", [request("a", COMPLETIONS, model="model", prompt="x"),
                                                  request("b", COMPLETIONS, model="gpt-4o", prompt="x")])
    cfg = DataConfig(path=str(path), check_model=True)
    assert [row.error for row in read_prompts(DataConfig(path=str(path)), None, "model")] == [None, None]
    checked = read_prompts(cfg, None, model_name(ModelConfig(path="/models/model")))
    assert checked[0].error is None and "body.model='gpt-4o' is not the loaded model 'model'" in checked[1].error
    assert model_name(ModelConfig(path="/models/model", served_model_name="served")) == "served"


def completions_table(rows: list[dict[str, Any]]) -> pa.Table:
    defaults = {"completion": None, "num_prompt_tokens": None, "num_output_tokens": None, "error": None}
    return pa.Table.from_pylist([{**defaults, **row} for row in rows])


def test_results_group_samples_into_choices_in_input_order(tmp_path: Path) -> None:
    table = completions_table([
        {"index": 1, "sample_index": 1, "completion": "b1", "num_prompt_tokens": 4, "num_output_tokens": 2,
         "finish_reason": "length"},
        {"index": 2, "sample_index": 0, "finish_reason": "error", "error": "line 3: bad"},
        {"index": 0, "sample_index": 0, "completion": "a0", "num_prompt_tokens": 3, "num_output_tokens": 5,
         "finish_reason": "stop"},
        {"index": 1, "sample_index": 0, "completion": "b0", "num_prompt_tokens": 4, "num_output_tokens": 1,
         "finish_reason": "stop"},
    ])
    pq.write_table(table, tmp_path / "completions.parquet")
    lines = [BatchLine("a", COMPLETIONS), BatchLine("b", CHAT), BatchLine(None, None)]
    path = write_results(tmp_path / "completions.parquet", lines, "shakespeare")
    assert path == tmp_path / "results.jsonl" and not (tmp_path / "results.jsonl.tmp").exists()
    first, second, third = [json.loads(line) for line in path.read_text().splitlines()]

    assert [first["custom_id"], second["custom_id"], third["custom_id"]] == ["a", "b", None]
    assert first["id"].startswith("batch_req_") and first["error"] is None
    assert first["response"]["status_code"] == 200 and first["response"]["request_id"].startswith("req_")
    body = first["response"]["body"]
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-") and body["model"] == "shakespeare"
    assert body["choices"] == [{"index": 0, "text": "a0", "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}

    chat = second["response"]["body"]
    assert chat["object"] == "chat.completion" and chat["id"].startswith("chatcmpl-")
    assert chat["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": "b0"}, "logprobs": None, "finish_reason": "stop"},
        {"index": 1, "message": {"role": "assistant", "content": "b1"}, "logprobs": None, "finish_reason": "length"},
    ]
    assert chat["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}

    assert third["response"] == {"status_code": 400, "request_id": third["response"]["request_id"], "body": None}
    assert third["error"] == {"code": "invalid_request", "message": "line 3: bad"}


def logprob_entry(token_id: int, text: str | None, logprob: float, top: list[tuple[int, str | None, float]]) -> dict:
    """A completions.parquet logprobs entry: the sampled token and the k most likely, most likely first."""
    return {"token_id": token_id, "text": text, "logprob": logprob, "rank": 1 + sum(lp > logprob for _, _, lp in top),
            "top": [{"token_id": t, "text": tt, "logprob": lp} for t, tt, lp in top]}


LOGPROBS = [logprob_entry(7, "Hé", -0.5, [(7, "Hé", -0.5), (8, " x", -1.5)]),
            logprob_entry(9, "llo", -2.0, [(8, " x", -0.25), (10, "!", float("-inf"))])]


def test_results_answer_logprobs_in_openai_shapes(tmp_path: Path) -> None:
    table = completions_table([
        {"index": i, "sample_index": 0, "completion": "Héllo", "num_prompt_tokens": 2, "num_output_tokens": 2,
         "finish_reason": "length", "logprobs": LOGPROBS} for i in range(2)
    ] + [{"index": 2, "sample_index": 0, "completion": "ab", "num_prompt_tokens": 2, "num_output_tokens": 2,
          "finish_reason": "length", "logprobs": None}])
    pq.write_table(table, tmp_path / "completions.parquet")
    lines = [BatchLine("chat", CHAT), BatchLine("text", COMPLETIONS), BatchLine("plain", COMPLETIONS)]
    path = write_results(tmp_path / "completions.parquet", lines, "m")
    chat, text, plain = [json.loads(line) for line in path.read_text().splitlines()]

    # An impossible token's -inf is OpenAI's -9999.0: results.jsonl stays strict JSON.
    assert chat["response"]["body"]["choices"][0]["logprobs"] == {"content": [
        {"token": "Hé", "logprob": -0.5, "bytes": [72, 195, 169], "top_logprobs": [
            {"token": "Hé", "logprob": -0.5, "bytes": [72, 195, 169]},
            {"token": " x", "logprob": -1.5, "bytes": [32, 120]}]},
        {"token": "llo", "logprob": -2.0, "bytes": [108, 108, 111], "top_logprobs": [
            {"token": " x", "logprob": -0.25, "bytes": [32, 120]},
            {"token": "!", "logprob": -9999.0, "bytes": [33]}]},
    ]}
    # The sampled token is always among top_logprobs (up to logprobs + 1 of them); text_offset counts characters.
    assert text["response"]["body"]["choices"][0]["logprobs"] == {
        "tokens": ["Hé", "llo"], "token_logprobs": [-0.5, -2.0],
        "top_logprobs": [{"Hé": -0.5, " x": -1.5}, {" x": -0.25, "!": -9999.0, "llo": -2.0}], "text_offset": [0, 2]}
    assert plain["response"]["body"]["choices"][0]["logprobs"] is None


def test_logprobs_of_tokens_without_text_name_their_ids(tmp_path: Path) -> None:
    """A model without a tokenizer (token-id prompts) has no token texts."""
    entries = [logprob_entry(5, None, -1.0, [(6, None, -0.5)])]
    pq.write_table(completions_table([{"index": i, "completion": None, "num_prompt_tokens": 1, "num_output_tokens": 1,
                                       "finish_reason": "length", "logprobs": entries} for i in range(2)]),
                   tmp_path / "completions.parquet")
    path = write_results(tmp_path / "completions.parquet", [BatchLine("c", CHAT), BatchLine("t", COMPLETIONS)], "m")
    chat, text = [json.loads(line)["response"]["body"]["choices"][0]["logprobs"] for line in
                  path.read_text().splitlines()]
    assert chat == {"content": [{"token": "token_id:5", "logprob": -1.0, "bytes": None, "top_logprobs": [
        {"token": "token_id:6", "logprob": -0.5, "bytes": None}]}]}
    assert text == {"tokens": ["token_id:5"], "token_logprobs": [-1.0],
                    "top_logprobs": [{"token_id:6": -0.5, "token_id:5": -1.0}], "text_offset": [0]}


def test_results_without_a_sample_index_column(tmp_path: Path) -> None:
    table = completions_table([{"index": i, "completion": str(i), "num_prompt_tokens": 1, "num_output_tokens": 1,
                                "finish_reason": "length"} for i in (1, 0)])
    pq.write_table(table, tmp_path / "completions.parquet")
    path = write_results(tmp_path / "completions.parquet", [BatchLine("x", COMPLETIONS), BatchLine("y", CHAT)], "m")
    results = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == ["x", "y"]
    assert [r["response"]["body"]["choices"][0]["index"] for r in results] == [0, 0]


def test_read_batch_lines_keeps_custom_id_and_url_by_index(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "batch.jsonl", [request("a", CHAT), "", "not json", request("b", "/v1/other")])
    assert read_batch_lines(DataConfig(path=str(path))) == [BatchLine("a", CHAT), BatchLine(None, None),
                                                            BatchLine("b", None)]


def results_of(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines()]


def test_shakespeare_job_answers_every_line(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "batch.jsonl", [
        request("text-1", COMPLETIONS, model="model", prompt="ROMEO:\n", max_tokens=5, temperature=0),
        request("chat-1", CHAT, model="model", messages=[{"role": "user", "content": "ROMEO:"}]),
        request("text-2", COMPLETIONS, model="model", prompt="JULIET:\n", max_tokens=3, foo=1),
        "{broken",
        request("text-3", COMPLETIONS, model="model", prompt="KING:\n", max_tokens=4, stop=["\n\n"]),
    ])
    result = batchgen(tmp_path / "run", "job=shakespeare", f"data.path={path}", "sampling.max_tokens=6")
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = tmp_path / "run"
    assert pq.read_table(run_dir / "completions.parquet").column("index").to_pylist() == list(range(5))
    lines = results_of(run_dir)
    assert [line["custom_id"] for line in lines] == ["text-1", "chat-1", "text-2", None, "text-3"]
    assert [line["error"] is None for line in lines] == [True, False, False, False, True]
    assert "chat messages need a chat template" in lines[1]["error"]["message"]
    assert "body.foo is not supported" in lines[2]["error"]["message"]
    assert "line 4: invalid JSON" in lines[3]["error"]["message"]
    body = lines[0]["response"]["body"]
    assert body["model"] == "model" and body["usage"]["completion_tokens"] == 5
    assert body["usage"]["prompt_tokens"] == len("ROMEO:\n")  # one character per token
    assert len(body["choices"][0]["text"]) == 5 and body["choices"][0]["finish_reason"] == "length"

    # A resumed run writes results.jsonl again from the final completions.parquet.
    (run_dir / "results.jsonl").unlink()
    result = batchgen(run_dir, "job=shakespeare", f"data.path={path}", "sampling.max_tokens=6", "job.resume=true")
    assert result.returncode == 0, result.stdout + result.stderr
    resumed = results_of(run_dir)
    assert [line["custom_id"] for line in resumed] == ["text-1", "chat-1", "text-2", None, "text-3"]
    assert resumed[0]["response"]["body"]["choices"] == body["choices"]


def test_a_data_parallel_run_leaves_one_results_file_in_input_order(tmp_path: Path) -> None:
    lines: list[Any] = [request(f"text-{i}", COMPLETIONS, model="model", prompt=f"ROMEO {i}:\n", max_tokens=2 + i % 5)
                        for i in range(7)]
    lines.insert(3, "{broken")
    path = write_lines(tmp_path / "batch.jsonl", lines)
    overrides = ["job=shakespeare", f"data.path={path}", "sampling.temperature=0"]
    single = batchgen(tmp_path / "single", *overrides)
    assert single.returncode == 0, single.stdout + single.stderr
    parallel = batchgen(tmp_path / "parallel", *overrides, "engine.data_parallel_size=2")
    assert parallel.returncode == 0, parallel.stdout + parallel.stderr
    merged = results_of(tmp_path / "parallel")
    assert [line["custom_id"] for line in merged] == [f"text-{i}" for i in range(3)] + [None] + [
        f"text-{i}" for i in range(3, 7)]
    assert "line 4: invalid JSON" in merged[3]["error"]["message"]
    assert [line["response"]["body"] and line["response"]["body"]["choices"] for line in merged] == [
        line["response"]["body"] and line["response"]["body"]["choices"] for line in results_of(tmp_path / "single")]


def test_batch_files_are_read_a_line_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parsed = []

    def counting_parse(record: dict[str, Any], *args: Any) -> Any:
        parsed.append(record["custom_id"])
        return parse_batch_line(record, *args)

    parse_batch_line = openai_batch.parse_batch_line
    monkeypatch.setattr(openai_batch, "parse_batch_line", counting_parse)
    path = write_lines(tmp_path / "batch.jsonl", [request(f"r{i}", COMPLETIONS, prompt=[1, 2]) for i in range(5)])
    rows = iter_prompts(DataConfig(path=str(path)))
    assert next(rows).id == "r0" and parsed == ["r0"]
    assert [row.id for row in rows] == ["r1", "r2", "r3", "r4"]


def test_output_format_openai_batch_needs_openai_batch_input(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "plain.jsonl", [{"prompt": "ROMEO:"}])
    result = batchgen(tmp_path / "run", "job=shakespeare", f"data.path={path}", "data.id_field=null",
                      "job.output_format=openai_batch")
    assert result.returncode == 2 and "job.output_format=openai_batch needs" in result.stdout + result.stderr


def test_chat_and_completion_lines_agree_on_a_model_with_a_chat_template(tmp_path: Path) -> None:
    model_dir = shutil.copytree(REPO / "jobs/shakespeare/model", tmp_path / "bard")
    tokenizer_config = model_dir / "tokenizer_config.json"
    # A template of characters the Shakespeare tokenizer knows: the user's text and a newline.
    template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    tokenizer_config.write_text(json.dumps({**json.loads(tokenizer_config.read_text()), "chat_template": template}))
    path = write_lines(tmp_path / "batch.jsonl", [
        request("chat", CHAT, model="bard", messages=[{"role": "user", "content": "ROMEO:"}], max_completion_tokens=8),
        request("text", COMPLETIONS, model="bard", prompt="ROMEO:\n", max_tokens=8),
        request("other", COMPLETIONS, model="gpt-4o", prompt="ROMEO:\n", max_tokens=8),
    ])
    result = batchgen(tmp_path / "run", "job=shakespeare", f"model.path={model_dir}", f"data.path={path}",
                      "sampling.temperature=0", "data.check_model=true")
    assert result.returncode == 0, result.stdout + result.stderr
    chat, text, other = results_of(tmp_path / "run")
    assert chat["error"] is None and text["error"] is None
    chat_text = chat["response"]["body"]["choices"][0]["message"]["content"]
    assert len(chat_text) == 8 and chat_text == text["response"]["body"]["choices"][0]["text"]
    assert chat["response"]["body"]["usage"] == text["response"]["body"]["usage"]
    assert "body.model='gpt-4o' is not the loaded model 'bard'" in other["error"]["message"]


def test_logprobs_asked_for_in_a_body_come_back_in_results(tmp_path: Path) -> None:
    model_dir = shutil.copytree(REPO / "jobs/shakespeare/model", tmp_path / "bard")
    tokenizer_config = model_dir / "tokenizer_config.json"
    template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    tokenizer_config.write_text(json.dumps({**json.loads(tokenizer_config.read_text()), "chat_template": template}))
    path = write_lines(tmp_path / "batch.jsonl", [
        request("chat", CHAT, messages=[{"role": "user", "content": "ROMEO:"}], max_tokens=6, logprobs=True,
                top_logprobs=2),
        request("text", COMPLETIONS, prompt="ROMEO:\n", max_tokens=6, logprobs=3),
        request("bare", COMPLETIONS, prompt="ROMEO:\n", max_tokens=6),
    ])
    result = batchgen(tmp_path / "run", "job=shakespeare", f"model.path={model_dir}", f"data.path={path}")
    assert result.returncode == 0, result.stdout + result.stderr
    chat, text, bare = [line["response"]["body"]["choices"][0] for line in results_of(tmp_path / "run")]
    stored = pq.read_table(tmp_path / "run" / "completions.parquet").column("logprobs").to_pylist()

    content = chat["logprobs"]["content"]
    assert "".join(token["token"] for token in content) == chat["message"]["content"]
    assert [token["logprob"] for token in content] == [entry["logprob"] for entry in stored[0]]
    assert all(len(token["top_logprobs"]) == 2 and bytes(token["bytes"]).decode() == token["token"]
               for token in content)

    logprobs = text["logprobs"]
    assert "".join(logprobs["tokens"]) == text["text"] and len(logprobs["tokens"]) == 6
    assert logprobs["token_logprobs"] == [entry["logprob"] for entry in stored[1]]
    assert logprobs["text_offset"] == list(range(6))  # one character per token
    assert all(3 <= len(top) <= 4 and top[token] == logprob for top, token, logprob in
               zip(logprobs["top_logprobs"], logprobs["tokens"], logprobs["token_logprobs"], strict=True))
    assert bare["logprobs"] is None and stored[2] is None


def test_output_format_is_validated() -> None:
    with pytest.raises(ConfigError, match="job.output_format='csv' is invalid"):
        validate_job(JobConfig(output_format="csv"))
