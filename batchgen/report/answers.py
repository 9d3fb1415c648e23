"""Exact match against an answer key: for a job whose input rows carry an `answer` field (a string, or a list of
accepted strings), how many completions give that answer.

The rule: both texts are normalised (Unicode NFKC, case folded, runs of whitespace made one space, surrounding
quotes and trailing punctuation . , ; : ! ? dropped); a completion matches when its normalised text contains a
normalised answer as a whole phrase, not inside a longer word or number ("19" matches "12 + 7 = 19." but not
"190" or "2.19"). Containment, not equality, since chat models answer in sentences ("The capital of France is Paris.").
Rows without an answer are left out; error rows count as misses.
"""

from __future__ import annotations

import mmap
import re
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from batchgen.io.formats import FORMAT_BY_SUFFIX
from batchgen.io.sources import SourceRow, arrow_rows, jsonl_rows, parquet_rows

ANSWER_FIELD = "answer"
# A JSONL row can name the field only as written or with \u escapes: a file, or a row, with neither has no answer, so
# that reading the key after a job costs a scan of its input, not a second parse of every row.
ANSWER_FIELD_SPELLINGS = (f'"{ANSWER_FIELD}"'.encode(), b"\\u")
_READERS = {"jsonl": jsonl_rows, "parquet": parquet_rows, "arrow": arrow_rows}
_TRAILING = ".,;:!?"
_QUOTES = "\"'`“”‘’"


@dataclass(frozen=True)
class ExactMatch:
    matched: int
    judged: int  # completions whose input row has an answer

    @property
    def share(self) -> float:
        return self.matched / self.judged if self.judged else 0.0

    def line(self) -> str:
        return (f"exact match {self.matched}/{self.judged} ({100 * self.share:.0f}%) against the input's "
                f"{ANSWER_FIELD!r} field")


def normalise(text: str) -> str:
    text = " ".join(unicodedata.normalize("NFKC", text).casefold().split())
    return text.strip(_QUOTES).rstrip(_TRAILING).strip(_QUOTES)


def matches(completion: str, answers: list[str]) -> bool:
    said = normalise(completion)
    return any(re.search(rf"(?<!\w)(?<!\d\.){re.escape(answer)}(?!\w)(?!\.\d)", said)
               for answer in map(normalise, answers) if answer)


def _accepted(value: Any) -> list[str] | None:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(item, str) for item in value):
        return value
    return None


def read_answer_key(data: dict[str, Any]) -> dict[int, list[str]] | None:
    """{input row index: accepted answers} from the job's input (its data.path and data.format, as the run's
    config records them); None when the input is gone, is not a JSONL, Parquet or Arrow file, or has no answers."""
    path = Path(str(data.get("path") or ""))
    fmt = data.get("format") or "auto"
    if fmt == "auto":
        fmt = FORMAT_BY_SUFFIX.get(path.suffix.lower(), "")
    if fmt not in _READERS or not path.is_file():
        return None
    if fmt == "jsonl" and not _mentions(path, ANSWER_FIELD_SPELLINGS):
        return None
    rows: Iterator[SourceRow] = (jsonl_rows(path, ANSWER_FIELD_SPELLINGS) if fmt == "jsonl"
                                 else _READERS[fmt](path, {ANSWER_FIELD}))
    key: dict[int, list[str]] = {}
    for index, source_row in enumerate(rows):  # indexed as the job indexes its rows
        answers = _accepted((source_row.record or {}).get(ANSWER_FIELD))
        if answers is not None:
            key[index] = answers
    return key or None


def _mentions(path: Path, texts: tuple[bytes, ...]) -> bool:
    """Whether the file holds any of `texts`, found without reading it into memory."""
    if path.stat().st_size == 0:  # mmap refuses an empty file
        return False
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as view:
        return any(view.find(text) != -1 for text in texts)


def exact_match(run_dir: Path, data: dict[str, Any]) -> ExactMatch | None:
    """The run's exact match against its input's answer key; None when the input has none."""
    key = read_answer_key(data)
    completions_path = run_dir / "completions.parquet"
    if key is None or not completions_path.is_file():
        return None
    completions = pq.read_table(completions_path, columns=["index", "completion"]).to_pylist()
    judged = [row for row in completions if row["index"] in key]
    matched = sum(matches(row["completion"] or "", key[row["index"]]) for row in judged)
    return ExactMatch(matched, len(judged))
