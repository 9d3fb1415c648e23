import json
import re
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from batchgen.config import DataConfig
from batchgen.io.readers import InputError, PromptRow, read_prompts, resolve_format

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
ROWS = [
    {"prompt": "the first prompt", "max_tokens": 4},
    {"prompt": "the second prompt"},
    {"prompt": "the third prompt", "temperature": 0},
]


@pytest.fixture(autouse=True)
def hf_cache_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")


@pytest.fixture(scope="module")
def chat_tokenizer() -> PreTrainedTokenizerFast:
    word_level = Tokenizer(models.WordLevel(vocab={"<unk>": 0, "<eos>": 1}, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=word_level, unk_token="<unk>", eos_token="<eos>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def write_jsonl(path: Path, lines: list[Any]) -> Path:
    """Dicts become JSON lines; strings are written verbatim (blank or malformed lines)."""
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def to_columns(rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Unlike `from_pylist`/`from_list`, takes the columns from every row, not just the first."""
    names = dict.fromkeys(name for row in rows for name in row)
    return {name: [row.get(name) for row in rows] for name in names}


def to_table(rows: list[dict[str, Any]]) -> pa.Table:
    return pa.table(to_columns(rows))


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    pq.write_table(to_table(rows), path)
    return path


def write_arrow_file(path: Path, rows: list[dict[str, Any]]) -> Path:
    table = to_table(rows)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return path


def write_arrow_stream(path: Path, rows: list[dict[str, Any]]) -> Path:
    table = to_table(rows)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return path


def write_feather(path: Path, rows: list[dict[str, Any]]) -> Path:
    feather.write_feather(to_table(rows), str(path))
    return path


def write_csv(path: Path, rows: list[dict[str, Any]]) -> Path:
    names = list(rows[0])
    lines = [",".join(names)] + [",".join(str(row.get(name, "")) for name in names) for row in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def save_dataset(path: Path, rows: list[dict[str, Any]]) -> Path:
    datasets.Dataset.from_dict(to_columns(rows)).save_to_disk(str(path))
    return path


def save_dataset_dict(path: Path, rows: list[dict[str, Any]]) -> Path:
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list([{"prompt": "not this split"}]),
            "test": datasets.Dataset.from_dict(to_columns(rows)),
        }
    ).save_to_disk(str(path))
    return path


def read_with(path: Path, tokenizer: Any = None, **options: Any) -> list[PromptRow]:
    return read_prompts(DataConfig(path=str(path), **options), tokenizer)


def expected_rows() -> list[PromptRow]:
    return [
        PromptRow(0, "0", "the first prompt", None, {"max_tokens": 4}),
        PromptRow(1, "1", "the second prompt", None, {}),
        PromptRow(2, "2", "the third prompt", None, {"temperature": 0.0}),
    ]


@pytest.mark.parametrize(
    ("name", "write", "options"),
    [
        ("prompts.jsonl", write_jsonl, {}),
        ("prompts.json", write_jsonl, {}),
        ("prompts.txt", write_jsonl, {"format": "jsonl"}),
        ("prompts.parquet", write_parquet, {}),
        ("prompts.arrow", write_arrow_file, {}),
        ("prompts.ipc", write_arrow_stream, {}),
        ("prompts.feather", write_feather, {}),
        ("prompts.bin", write_arrow_stream, {"format": "arrow"}),
        ("dataset", save_dataset, {}),
        ("dataset", save_dataset, {"format": "hf_disk"}),
        ("dataset_dict", save_dataset_dict, {"split": "test"}),
        ("prompts.jsonl", write_jsonl, {"format": "hf"}),
        ("prompts.parquet", write_parquet, {"format": "hf"}),
        ("prompts.arrow", write_arrow_stream, {"format": "hf"}),
        ("prompts.jsonl", write_jsonl, {"format": "hf", "split": "test"}),
    ],
)
def test_every_format_reads_the_same_rows(
    tmp_path: Path, name: str, write: Any, options: dict[str, Any]
) -> None:
    path = write(tmp_path / name, ROWS)
    assert read_with(path, **options) == expected_rows()


@pytest.mark.parametrize("data_format", ["auto", "hf"])
def test_csv_is_read_through_datasets(tmp_path: Path, data_format: str) -> None:
    path = write_csv(
        tmp_path / "prompts.csv", [{"prompt": "hello there", "uid": "a"}, {"prompt": "bye", "uid": "b"}]
    )
    rows = read_with(path, id_field="uid", format=data_format)
    assert [(row.id, row.prompt) for row in rows] == [("a", "hello there"), ("b", "bye")]


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("p.jsonl", "jsonl"),
        ("p.JSON", "jsonl"),
        ("p.parquet", "parquet"),
        ("p.arrow", "arrow"),
        ("p.feather", "arrow"),
        ("p.ipc", "arrow"),
        ("p.csv", "hf"),
    ],
)
def test_auto_format_follows_the_suffix(name: str, expected: str) -> None:
    assert resolve_format(DataConfig(path=name)) == expected


def test_auto_format_of_saved_datasets(tmp_path: Path) -> None:
    single = save_dataset(tmp_path / "single", ROWS)
    split = save_dataset_dict(tmp_path / "split", ROWS)
    assert resolve_format(DataConfig(path=str(single))) == "hf_disk"
    assert resolve_format(DataConfig(path=str(split))) == "hf_disk"


def test_auto_format_cannot_guess(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"prompts\.txt.*'\.txt'.*data\.format"):
        resolve_format(DataConfig(path=str(tmp_path / "prompts.txt")))
    with pytest.raises(InputError, match="cannot infer the format of a directory"):
        resolve_format(DataConfig(path=str(tmp_path)))


def test_explicit_format_wins_over_the_suffix() -> None:
    assert resolve_format(DataConfig(path="p.parquet", format="jsonl")) == "jsonl"


def test_unknown_format_lists_the_allowed_ones(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", ROWS)
    with pytest.raises(InputError, match="'xml'.*auto, jsonl, parquet, arrow, hf_disk, hf"):
        read_with(path, format="xml")


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "nowhere.jsonl"
    with pytest.raises(InputError, match=f"{path}: no such file"):
        read_with(path)


def test_missing_split_lists_the_splits(tmp_path: Path) -> None:
    path = save_dataset_dict(tmp_path / "dataset_dict", ROWS)
    with pytest.raises(InputError, match="no split 'validation'.*train, test"):
        read_with(path, split="validation")


def test_custom_prompt_and_id_fields(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "p.parquet", [{"text": "a", "uid": 7}, {"text": "b", "uid": 9}])
    rows = read_with(path, prompt_field="text", id_field="uid")
    assert [(row.index, row.id, row.prompt) for row in rows] == [(0, "7", "a"), (1, "9", "b")]


def test_string_ids(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "key": "x-1"}, {"prompt": "b", "key": "x-2"}])
    assert [row.id for row in read_with(path, id_field="key")] == ["x-1", "x-2"]


def test_messages_are_rendered_with_the_chat_template(tmp_path: Path, chat_tokenizer: Any) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    path = write_jsonl(tmp_path / "p.jsonl", [{"messages": messages}, {"prompt": "plain"}])
    rows = read_with(path, tokenizer=chat_tokenizer)
    assert rows[0].prompt == "<system>be brief\n<user>hi\n<assistant>"
    assert rows[0].prompt_token_ids is None
    assert rows[1].prompt == "plain"


def test_messages_from_a_saved_dataset(tmp_path: Path, chat_tokenizer: Any) -> None:
    path = save_dataset(tmp_path / "dataset", [{"chat": [{"role": "user", "content": "hi"}]}])
    rows = read_with(path, tokenizer=chat_tokenizer, messages_field="chat")
    assert rows[0].prompt == "<user>hi\n<assistant>"


def test_messages_without_a_chat_template(tmp_path: Path, chat_tokenizer: Any) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(InputError, match="line 1: chat messages need a tokenizer"):
        read_with(path)
    templateless = chat_tokenizer.__class__(tokenizer_object=chat_tokenizer.backend_tokenizer)
    with pytest.raises(InputError, match="line 1: chat messages need a chat template"):
        read_with(path, tokenizer=templateless)
    [row] = read_with(path, on_error="skip")
    assert "chat messages need a tokenizer" in row.error


def test_token_id_rows(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [{"prompt_token_ids": [5, 0, 7]}, {"prompt": "kept for the output", "prompt_token_ids": [1, 2]}],
    )
    rows = read_with(path)
    assert (rows[0].prompt, rows[0].prompt_token_ids) == (None, [5, 0, 7])
    assert (rows[1].prompt, rows[1].prompt_token_ids) == ("kept for the output", [1, 2])


def test_token_ids_from_parquet_with_a_custom_field(tmp_path: Path) -> None:
    table = pa.table({"ids": pa.array([[3, 4], [5]], pa.list_(pa.int32()))})
    pq.write_table(table, tmp_path / "p.parquet")
    rows = read_with(tmp_path / "p.parquet", token_ids_field="ids")
    assert [row.prompt_token_ids for row in rows] == [[3, 4], [5]]


def test_all_overrides_are_read_and_normalized(tmp_path: Path) -> None:
    overrides = {
        "max_tokens": 8,
        "temperature": 1,
        "top_p": 0.9,
        "top_k": -1,
        "min_p": 0.0,
        "seed": 3,
        "stop": "\n",
        "stop_token_ids": [2],
        "ignore_eos": True,
    }
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "unrelated": 1, **overrides}])
    [row] = read_with(path)
    assert row.overrides == {**overrides, "temperature": 1.0, "min_p": 0.0, "top_p": 0.9, "stop": ["\n"]}


def test_null_overrides_in_columnar_files_are_not_set(tmp_path: Path) -> None:
    path = write_parquet(
        tmp_path / "p.parquet", [{"prompt": "a", "max_tokens": 5}, {"prompt": "b", "max_tokens": None}]
    )
    assert [row.overrides for row in read_with(path)] == [{"max_tokens": 5}, {}]


def test_integral_floats_from_pandas_count_as_integers(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "p.parquet", [{"prompt": "a", "max_tokens": 5.0}, {"prompt": "b"}])
    assert read_with(path)[0].overrides == {"max_tokens": 5}


def test_limit_reads_the_first_rows_only(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "p.jsonl", [{"prompt": "a"}, "", {"prompt": "b"}, "{broken", {"prompt": "c"}]
    )
    assert [row.prompt for row in read_with(path, limit=2)] == ["a", "b"]
    assert [row.prompt for row in read_with(write_parquet(tmp_path / "p.parquet", ROWS), limit=1)] == [
        "the first prompt"
    ]


MALFORMED_LINES = [
    ('{"prompt": "a", ', "invalid JSON"),
    ("[1, 2]", "expected a JSON object, got list"),
    ({"text": "no prompt field"}, "missing prompt"),
    ({"prompt": 5}, "field 'prompt' must be a string, got int"),
    ({"prompt": ""}, "field 'prompt' is empty"),
    ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "has both 'prompt' and 'messages'"),
    ({"messages": [{"role": "user"}]}, "message 0 must be a dict"),
    ({"messages": []}, "non-empty list"),
    ({"prompt_token_ids": [1, -2]}, "non-negative integers"),
    ({"prompt_token_ids": ["a"]}, "non-negative integers"),
    ({"prompt_token_ids": [3, True]}, "non-negative integers"),
    ({"prompt_token_ids": [3, 4.0]}, "non-negative integers"),
    ({"prompt_token_ids": [3, [4]]}, "non-negative integers"),
    ({"prompt_token_ids": []}, "non-empty list of non-negative integers"),
    ({"prompt": "a", "max_tokens": "ten"}, "max_tokens='ten' is invalid: must be a positive integer"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens=0 is invalid"),
    ({"prompt": "a", "max_tokens": True}, "max_tokens=True is invalid"),
    ({"prompt": "a", "temperature": -0.5}, "temperature=-0.5 is invalid: must be a number >= 0"),
    ({"prompt": "a", "top_p": 0}, r"top_p=0 is invalid: must be a number in \(0, 1\]"),
    ({"prompt": "a", "top_p": 1.5}, "top_p=1.5 is invalid"),
    ({"prompt": "a", "top_k": -2}, "top_k=-2 is invalid"),
    ({"prompt": "a", "min_p": 2}, "min_p=2 is invalid"),
    ({"prompt": "a", "seed": "x"}, "seed='x' is invalid"),
    ({"prompt": "a", "stop": 5}, "stop=5 is invalid"),
    ({"prompt": "a", "stop": ["ok", 1]}, r"stop=\['ok', 1\] is invalid"),
    ({"prompt": "a", "stop": [""]}, "stop=.* is invalid"),
    ({"prompt": "a", "stop_token_ids": [-1]}, "stop_token_ids=.* is invalid"),
    ({"prompt": "a", "ignore_eos": "yes"}, "ignore_eos='yes' is invalid: must be a boolean"),
]


@pytest.mark.parametrize(("bad_line", "problem"), MALFORMED_LINES)
def test_malformed_row_fails_naming_file_and_line(tmp_path: Path, bad_line: Any, problem: str) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "fine"}, "", bad_line, {"prompt": "also fine"}])
    with pytest.raises(InputError, match=f"^{re.escape(str(path))}: line 3: .*{problem}"):
        read_with(path)


@pytest.mark.parametrize(("bad_line", "problem"), MALFORMED_LINES)
def test_malformed_row_is_kept_in_place_under_skip(tmp_path: Path, bad_line: Any, problem: str) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "fine"}, "", bad_line, {"prompt": "also fine"}])
    rows = read_with(path, on_error="skip")
    assert [(row.index, row.id) for row in rows] == [(0, "0"), (1, "1"), (2, "2")]
    assert rows[0] == PromptRow(0, "0", "fine", None, {})
    assert rows[2] == PromptRow(2, "2", "also fine", None, {})
    assert rows[1].error.startswith(f"{path}: line 3: ")
    assert rows[1].prompt_token_ids is None and rows[1].overrides == {}


@pytest.mark.parametrize(("text", "problem"), [
    ('{"prompt": "a', "invalid JSON: Unterminated string starting at column 12"),  # a last line without a newline
    ('{"prompt": "a\n', "invalid JSON: Invalid control character at column 14"),
    ('{"prompt": "a\tb"}\n', "invalid JSON: Invalid control character at column 14"),
    ('{"prompt" "a"}\n', "invalid JSON: Expecting ':' delimiter at column 11"),
])
def test_invalid_json_names_the_problem_and_its_column_once(tmp_path: Path, text: str, problem: str) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(text)
    with pytest.raises(InputError) as raised:
        read_with(path)
    assert str(raised.value) == f"{path}: line 1: {problem}"


def test_the_first_bad_row_is_reported(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}, {"prompt": 1}, "{broken"])
    with pytest.raises(InputError, match="line 2:"):
        read_with(path)


def test_skipped_row_keeps_its_id_and_text(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"prompt": "a", "uid": "first"},
            {"prompt": "b", "uid": "second", "top_p": 7},
            {"prompt": "c", "uid": 3},
        ],
    )
    rows = read_with(path, id_field="uid", on_error="skip")
    assert [(row.id, row.prompt, row.error is None) for row in rows] == [
        ("first", "a", True),
        ("second", "b", False),
        ("3", "c", True),
    ]


def test_missing_id_field(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "uid": "x"}, {"prompt": "b"}])
    with pytest.raises(InputError, match="line 2: missing id field 'uid'"):
        read_with(path, id_field="uid")
    rows = read_with(path, id_field="uid", on_error="skip")
    assert [row.id for row in rows] == ["x", "1"]
    assert "missing id field" in rows[1].error


@pytest.mark.parametrize("on_error", ["fail", "skip"])
def test_duplicate_ids_name_both_lines(tmp_path: Path, on_error: str) -> None:
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [{"prompt": "a", "uid": 1}, {"prompt": "b", "uid": 2}, {"prompt": "c", "uid": 1}],
    )
    with pytest.raises(InputError, match=f"{path}: duplicate id '1' at line 1 and line 3"):
        read_with(path, id_field="uid", on_error=on_error)


@pytest.mark.parametrize("on_error", ["fail", "skip"])
def test_duplicate_ids_name_both_rows(tmp_path: Path, on_error: str) -> None:
    path = write_parquet(tmp_path / "p.parquet", [{"prompt": "a", "uid": "k"}, {"prompt": "b", "uid": "k"}])
    with pytest.raises(InputError, match="duplicate id 'k' at row 0 and row 1"):
        read_with(path, id_field="uid", on_error=on_error)


def test_malformed_row_in_a_columnar_file_is_named_by_row(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "p.parquet", [{"prompt": "a"}, {"prompt": ""}, {"prompt": "c"}])
    with pytest.raises(InputError, match=f"^{path}: row 1: field 'prompt' is empty"):
        read_with(path)
    rows = read_with(path, on_error="skip")
    assert [(row.index, row.prompt, row.error is not None) for row in rows] == [
        (0, "a", False),
        (1, "", True),
        (2, "c", False),
    ]


def test_rows_without_any_prompt_column_are_all_reported(tmp_path: Path) -> None:
    path = save_dataset(tmp_path / "dataset", [{"other": 1}, {"other": 2}])
    rows = read_with(path, on_error="skip")
    assert [row.index for row in rows] == [0, 1]
    assert all("missing prompt" in row.error for row in rows)


def test_not_a_parquet_file(tmp_path: Path) -> None:
    path = tmp_path / "p.parquet"
    path.write_text("not parquet")
    with pytest.raises(InputError, match=f"{path}: not a readable Parquet file"):
        read_with(path)
