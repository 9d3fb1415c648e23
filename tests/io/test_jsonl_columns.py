"""JSONL rows read by columns (columnar_rows) are the rows reading line by line gives, for every kind of line: a block
that columnar_rows cannot vouch for goes line by line."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest

from batchgen.config import DataConfig
from batchgen.io import jsonl_columns, readers
from batchgen.io.jsonl_columns import columnar_rows
from batchgen.io.readers import InputError, read_prompts
from batchgen.io.sources import jsonl_blocks
from tests.io.test_sources import LINES, same_values

PLAIN = [b'{"id": "a", "prompt": "one"}', b'{"id": "b", "prompt": "two", "max_tokens": 3}']
# Lines of prompt rows whose values Arrow and json may read apart, or which parse_row refuses.
ROW_LINES = [
    b'{"id": 7, "prompt": "an integer id"}',
    b'{"id": "", "prompt": "an empty id"}',
    b'{"id": true, "prompt": "a boolean id"}',
    b'{"id": 1.0, "prompt": "a float id"}',
    b'{"id": 123456789012345678901234567890, "prompt": "a big id"}',
    b'{"id": null, "prompt": "a null id"}',
    b'{"prompt": "no id"}',
    b'{"id": "e", "prompt": ""}',
    b'{"id": "f", "prompt": null}',
    b'{"id": "g", "prompt": 5}',
    b'{"id": "h", "prompt": "2024-01-01 12:00:00"}',
    b'{"id": "i", "prompt": "x", "messages": null, "prompt_token_ids": null}',
    b'{"id": "j", "prompt": "x", "messages": [{"role": "user", "content": "y"}]}',
    b'{"id": "k", "prompt_token_ids": [1, 2]}',
    b'{"id": "k", "prompt_token_ids": [0], "prompt": "both"}',
    b'{"id": "k", "prompt_token_ids": []}',
    b'{"id": "k", "prompt_token_ids": [3, -1]}',
    b'{"id": "k", "prompt_token_ids": [1, 2.0]}',
    b'{"id": "k", "prompt_token_ids": [1, true]}',
    b'{"id": "k", "prompt_token_ids": [1, null]}',
    b'{"id": "k", "prompt_token_ids": [1, 1180591620717411303424]}',
    b'{"id": "k", "prompt_token_ids": "1 2"}',
    b'{"id": "k", "prompt_token_ids": [[1]]}',
    b'{"id": "l", "prompt": "x", "max_tokens": 0}',
    b'{"id": "m", "prompt": "x", "max_tokens": 4.0}',
    b'{"id": "n", "prompt": "x", "temperature": 1}',
    b'{"id": "o", "prompt": "x", "temperature": 0.5}',
    b'{"id": "p", "prompt": "x", "ignore_eos": true, "stop": "END", "seed": null}',
    b'{"id": "q", "prompt": "x", "stop": ["a", "b"]}',
    b'{"id": "r", "prompt": "x", "logit_bias": {"3": 1}}',
    b'{"id": "s", "prompt": "x", "meta": {"deep": [1, "mixed"]}}',
    b'{"id": "t", "prompt": "x", "prompt": "twice"}',
    b'{"id": "t", "prompt": "x", "\\u0070rompt": "escaped twice"}',
    b'{"id": "t", "\\u0070rompt": "an escaped key"}',
    b'{"id": "u", "prompt": "\\ud800 lone"}',
    b'{"id": "v", "prompt": "x"} {"id": "w", "prompt": "y"}',
    b'{"id": "x", "prompt": "x"}\r{"id": "y", "prompt": "y"}',
    b'{"id": "z", "prompt": "caf\xc3\xa9 \\u00e9 \\n"}',
    b'{"id": "a", "prompt": "a duplicate id"}',
]


def read(path: Path, line_by_line: bool, monkeypatch: pytest.MonkeyPatch, task: str = "generate",
         **options) -> list[dict] | str:
    """The rows as dicts, or the InputError's message."""
    with monkeypatch.context() as patch:
        if line_by_line:
            patch.setattr(readers, "columnar_rows", lambda *args, **kwargs: None)
        try:
            return [asdict(row) for row in read_prompts(DataConfig(path=str(path), **options), task=task)]
        except InputError as error:
            return str(error)


@pytest.mark.parametrize("line", [*LINES, *ROW_LINES], ids=repr)
@pytest.mark.parametrize("options", [{"id_field": "id", "on_error": "skip"}, {"on_error": "skip"},
                                     {"id_field": "id"}], ids=["skip", "no_id", "fail"])
@pytest.mark.parametrize("task", ["generate", "embed"])
@pytest.mark.parametrize("among_plain_rows", [True, False], ids=["among_plain_rows", "alone"])
def test_every_line_reads_as_line_by_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, line: bytes,
                                          options: dict, task: str, among_plain_rows: bool) -> None:
    path = tmp_path / "rows.jsonl"
    around = PLAIN if among_plain_rows else [b"", b""]
    path.write_bytes(b"\n".join([around[0], b"", b"  \t", line, around[1], b""]) + b"\n")
    expected = read(path, True, monkeypatch, task, **options)
    assert same_values(read(path, False, monkeypatch, task, **options), expected)


def test_plain_prompt_rows_are_read_by_columns(tmp_path: Path) -> None:
    lines = [*PLAIN, b"", b'{"id": "c", "prompt": "three", "stop": "x", "ignore_eos": false, "seed": null}']
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    [(_, lines)] = jsonl_blocks(path, 1 << 20)
    rows = columnar_rows(lines, 5, DataConfig(path=str(path), id_field="id"), read_overrides=True)
    assert rows is not None
    assert [(row.index, row.id, row.prompt, row.overrides) for row in rows] == [
        (5, "a", "one", {}), (6, "b", "two", {"max_tokens": 3}),
        (7, "c", "three", {"stop": ["x"], "ignore_eos": False})]


def test_integer_ids_are_read_by_columns(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"id": 9, "prompt": "one"}\n{"id": -2, "prompt": "two"}\n')
    [(_, lines)] = jsonl_blocks(path, 1 << 20)
    rows = columnar_rows(lines, 0, DataConfig(path=str(path), id_field="id"), read_overrides=True)
    assert [row.id for row in rows or ()] == ["9", "-2"]


def test_token_id_rows_are_read_by_columns(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"prompt_token_ids": [1, 2], "max_tokens": 4}\n{"prompt_token_ids": [0], "max_tokens": null}\n')
    [(_, lines)] = jsonl_blocks(path, 1 << 20)
    rows = columnar_rows(lines, 0, DataConfig(path=str(path)), read_overrides=True)
    assert [(row.id, row.prompt, row.prompt_token_ids, row.overrides) for row in rows or ()] == [
        ("0", None, [1, 2], {"max_tokens": 4}), ("1", None, [0], {})]


def test_lines_parsed_in_many_arrow_blocks_read_by_columns_as_line_by_line(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jsonl_columns, "PARSE_BLOCK_BYTES", 256)
    lines = [b'{"id": "r%d", "prompt_token_ids": [%d, 2]%s}' % (n, n, b', "max_tokens": 3' if n >= 30 else b"")
             for n in range(60)]  # a field that only later blocks hold
    lines[40] = b'{"id": "long", "prompt_token_ids": [%s]}' % b", ".join([b"7"] * 200)  # longer than a block
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    [(_, block)] = jsonl_blocks(path, 1 << 20)
    rows = columnar_rows(block, 0, DataConfig(path=str(path), id_field="id"), read_overrides=True)
    assert rows is not None and len(rows) == 60 and rows[40].prompt_token_ids == [7] * 200
    assert same_values([asdict(row) for row in rows], read(path, True, monkeypatch, id_field="id"))


def test_a_block_of_chat_messages_goes_line_by_line(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"messages": [{"role": "user", "content": "hi"}]}\n')
    [(_, lines)] = jsonl_blocks(path, 1 << 20)
    assert columnar_rows(lines, 0, DataConfig(path=str(path)), read_overrides=True) is None


def test_blocks_hold_whole_lines_and_their_numbers(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"".join(b'{"prompt": "%d"}\n' % n for n in range(100)))
    blocks = list(jsonl_blocks(path, 64))
    assert len(blocks) > 1 and all(sum(map(len, lines[:-1])) <= 64 for _, lines in blocks)
    assert [first + offset for first, lines in blocks for offset in range(len(lines))] == list(range(1, 101))
    assert b"".join(line for _, lines in blocks for line in lines) == path.read_bytes()


@pytest.mark.parametrize("on_error", ["fail", "skip"])
def test_duplicate_ids_name_their_lines_across_blocks_and_blank_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     on_error: str) -> None:
    monkeypatch.setattr(readers, "BLOCK_BYTES", 64)
    lines = [b'{"id": "r%d", "prompt": "p"}' % n for n in range(40)]
    lines[30] = b'{"id": "r3", "prompt": "again"}'
    lines.insert(10, b"")
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(InputError, match=f"^{path}: duplicate id 'r3' at line 4 and line 32$"):
        read_prompts(DataConfig(path=str(path), id_field="id", on_error=on_error))


def test_a_bad_row_fails_at_its_line_after_the_rows_before_it(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"\n".join([*PLAIN, b'{"id": "c", "prompt": ""}']) + b"\n")
    rows = readers.iter_prompts(DataConfig(path=str(path), id_field="id"))
    assert [next(rows).id, next(rows).id] == ["a", "b"]
    with pytest.raises(InputError, match="line 3: field 'prompt' is empty"):
        next(rows)
