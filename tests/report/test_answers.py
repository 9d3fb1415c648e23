"""Exact match against an input's answer key: the normalisation and containment rule, and where it shows."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.io.sources import jsonl_rows
from batchgen.report.answers import ExactMatch, exact_match, matches, read_answer_key
from batchgen.report.run_data import Run
from batchgen.report.tables_runs import runs_table


@pytest.mark.parametrize(("completion", "answers", "expected"), [
    ("The capital of France is Paris.", ["Paris"], True),
    ("  THE CAPITAL IS\n  new   delhi!", ["New Delhi"], True),
    ('"Hola."', ["hola"], True),
    ("12 + 7 = 19.", ["19"], True),
    ("It has three letters", ["3", "three"], True),
    ("The answer is 190.", ["19"], False),
    ("100 / 4 = 2.25", ["25"], False),
    ("The Parisian skyline", ["Paris"], False),
    ("anything", [""], False),
])
def test_a_completion_matches_an_answer_it_contains_as_a_whole_phrase(completion, answers, expected):
    assert matches(completion, answers) is expected


def write_run(directory: Path, rows: list[dict], completions: list[str]) -> tuple[Path, dict]:
    """A run directory's completions, and the data config of its input rows."""
    directory.mkdir(parents=True, exist_ok=True)
    prompts = directory / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    run_dir = directory / "run"
    run_dir.mkdir()
    pq.write_table(pa.table({"index": list(range(len(completions))), "completion": completions}),
                   run_dir / "completions.parquet")
    return run_dir, {"path": str(prompts), "format": "auto"}


def test_rows_without_an_answer_are_not_judged(tmp_path):
    run_dir, data = write_run(tmp_path, [{"prompt": "a", "answer": "Paris"}, {"prompt": "b"},
                                         {"prompt": "c", "answer": ["4", "four"]}, {"prompt": "d", "answer": "x"}],
                              ["It is Paris.", "whatever", "Four.", "no"])
    result = exact_match(run_dir, data)
    assert result == ExactMatch(matched=2, judged=3)
    assert result.line() == "exact match 2/3 (67%) against the input's 'answer' field"


def test_the_answer_key_is_read_from_the_rows_that_name_the_field_however_it_is_spelled(tmp_path):
    """Rows without the field are skipped unparsed, yet still count in the row numbers; a name spelled with \\u
    escapes is still found."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a", "answer": "Paris"}\n'
                       '{"prompt_token_ids": [1, 2, 3]}\n'
                       '\n'  # a blank line is not a row
                       'not JSON, and no answer\n'
                       '{"prompt": "d", "\\u0061nswer": "four"}\n')
    assert read_answer_key({"path": str(prompts), "format": "jsonl"}) == {0: ["Paris"], 3: ["four"]}
    rows = list(jsonl_rows(prompts, parse_only_with=(b'"answer"',)))
    assert [row.location for row in rows] == ["line 1", "line 2", "line 4", "line 5"]
    assert [row.record for row in rows[1:]] == [{}, {}, {}] and rows[0].record["answer"] == "Paris"
    escaped_only, plain = tmp_path / "escaped_only.jsonl", tmp_path / "plain.jsonl"
    escaped_only.write_text('{"prompt": "a"}\n{"\\u0061nswer": "x"}\n')
    plain.write_text('{"prompt": "a"}\n{"prompt": "the answer"}\n')
    assert read_answer_key({"path": str(escaped_only), "format": "jsonl"}) == {1: ["x"]}
    assert read_answer_key({"path": str(plain), "format": "jsonl"}) is None


def test_the_runs_table_has_exact_match_only_for_inputs_with_an_answer_key(tmp_path):
    keyed, keyed_data = write_run(tmp_path / "keyed", [{"prompt": "a", "answer": "yes"}], ["Yes."])
    plain, plain_data = write_run(tmp_path / "plain", [{"prompt": "a"}], ["Yes."])

    def run(path: Path, data: dict) -> Run:
        return Run(path, None, {}, {"data.path": data["path"], "data.format": data["format"]}, [])

    assert "exact_match" not in runs_table([run(plain, plain_data)], []).columns
    table = runs_table([run(keyed, keyed_data), run(plain, plain_data)], [])
    assert table["exact_match"].tolist()[0] == 1.0 and table["exact_match"].isna().tolist()[1]
