"""jsonl_rows: each line's record or problem is what json.loads on the line gives."""

from __future__ import annotations

import codecs
import json
from pathlib import Path

import pytest

from batchgen.io.sources import SourceRow, jsonl_rows

# Lines json.loads reads in other ways than a plain UTF-8 object: other encodings, surrogates, whitespace and
# values around the object, JSON's extensions, numbers of every kind.
LINES = [
    b'{"prompt": "a", "id": 1}',
    b' \t{"prompt": "b"} \r',
    b'{"prompt": "c"} x',
    b'{"prompt": "d"}{"prompt": "e"}',
    b'{"prompt": "f", "prompt": "g"}',
    b'{"n": 1, "f": 1.0, "e": 1e3, "big": 123456789012345678901234567890, "neg": -0}',
    b'{"nan": NaN, "inf": -Infinity}',
    b'{"ids": [1, 2, 3.0, true, null]}',
    codecs.BOM_UTF8 + b'{"prompt": "bom"}',
    '{"prompt": "utf-16"}'.encode("utf-16"),
    '{"prompt": "utf-16-le"}'.encode("utf-16-le"),
    '{"prompt": "utf-32"}'.encode("utf-32"),
    b'{"prompt": "\xed\xa0\x80"}',  # a lone surrogate, which json.loads takes from bytes
    b'{"prompt": "\\ud800 escaped"}',
    b'{"prompt": "caf\xc3\xa9 \xe2\x80\x94"}',
    b'{"prompt": "\xff"}',
    b'{"prompt": "tab\tinside"}',
    b"\x0b{}",
    b'[{"prompt": "in a list"}]',
    b'"text"',
    b"42",
    b"1\x00",
    b"{",
    b'{"a": }',
    b"nul",
    b"\x00\x00\x00{",
    b"{}",
]


def expected_row(line_number: int, line: bytes) -> SourceRow:
    """jsonl_rows's rule, by json.loads."""
    location = f"line {line_number}"
    try:
        value = json.loads(line)
    except json.JSONDecodeError as error:
        return SourceRow(location, None, f"invalid JSON: {error.msg.removesuffix(' at')} at column {error.colno}")
    except UnicodeDecodeError:
        return SourceRow(location, None, "invalid JSON: not UTF-8 text")
    if isinstance(value, dict):
        return SourceRow(location, value)
    return SourceRow(location, None, f"expected a JSON object, got {type(value).__name__}")


def same_values(left: object, right: object) -> bool:
    """Equality that tells 1 from 1.0 and True and takes NaN as equal to itself."""
    if type(left) is not type(right):
        return False
    if isinstance(left, dict):
        return list(left) == list(right) and all(same_values(left[k], right[k]) for k in left)
    if isinstance(left, list):
        return len(left) == len(right) and all(same_values(a, b) for a, b in zip(left, right, strict=True))
    if isinstance(left, float) and left != left:
        return right != right
    return left == right


@pytest.mark.parametrize("line", LINES, ids=repr)
def test_a_line_reads_as_json_loads_reads_it(tmp_path: Path, line: bytes) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"\n" + line + b"\n")
    [row] = list(jsonl_rows(path))
    expected = expected_row(2, line + b"\n")
    assert (row.location, row.problem) == (expected.location, expected.problem)
    assert same_values(row.record, expected.record)
