"""A block of JSONL lines read into PromptRows by Arrow's JSON reader, column by column, where that gives exactly the
rows that reading it line by line gives (json on each line, then parse_row on each record): text prompts or token ids,
string or integer ids, sampling options of integers, booleans or strings. Line by line, each row costs several Python
calls (and each token id a check); here the parsing and most checks are one call per column.

A block holding anything else (another kind of value, a null prompt or id, a line that is not one JSON object, a row
that fails its checks) is not read here: the caller reads it line by line, which tells each row's problem as always.
"""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj

from batchgen.config import DataConfig
from batchgen.io.errors import RowError
from batchgen.io.overrides import OVERRIDE_FIELDS, parse_overrides
from batchgen.io.prompt_rows import PromptRow

BLOCK_BYTES = 16 << 20  # lines read by one Arrow call: few calls, a bounded table
PARSE_BLOCK_BYTES = 1 << 20  # what one of Arrow's threads parses of a call's lines
# Arrow types whose Python values are json's own, type included (Arrow reads a number with a fraction or an exponent,
# or an integer beyond int64, as a double, and a string shaped like a date as a timestamp: such columns go line by
# line).
SAME_AS_JSON = (pa.string(), pa.int64(), pa.bool_())
TOKEN_IDS = pa.list_(pa.int64())
_OBJECT_START, _OBJECT_END = ord("{"), ord("}")


def columnar_rows(lines: list[bytes], first_index: int, cfg: DataConfig,
                  read_overrides: bool) -> list[PromptRow] | None:
    """The rows of `lines` (lines of a JSONL file; the first row's index is first_index) as parse_row gives them; None
    where this cannot tell that they are the same."""
    num_rows = 0
    first_line = None
    for line in lines:
        stripped = line.strip()
        if not stripped:
            continue  # not a row, as line by line
        # With as many rows as lines that start and end as an object does, no line holds two objects or part of one.
        if stripped[0] != _OBJECT_START or stripped[-1] != _OBJECT_END:
            return None
        num_rows += 1
        first_line = first_line or stripped
    if first_line is None:
        return []
    if not _without_messages(first_line, cfg):  # the block's rows are likely alike: Arrow would read it in vain
        return None
    data = b"".join(lines)
    try:  # Arrow refuses what json refuses, and more (duplicate keys, lone surrogates): those go line by line
        table = _parsed(data)
        if table.num_rows != num_rows:
            return None
        # A column of nulls only is as absent: json's null is parse_row's absent field.
        columns = {name: table.column(name) for name in table.column_names if table.column(name).type != pa.null()}
        texts, token_ids = columns.get(cfg.prompt_field), columns.get(cfg.token_ids_field)
        if cfg.messages_field in columns or (texts is None and token_ids is None):
            return None
        prompts = [None] * num_rows if texts is None else _texts(texts)
        prompt_token_ids = [None] * num_rows if token_ids is None else _token_ids(token_ids)
        if cfg.id_field is None:
            ids = [str(index) for index in range(first_index, first_index + num_rows)]
        else:
            ids = _ids(columns.get(cfg.id_field))
        overrides = _overrides(columns, num_rows) if read_overrides else [{} for _ in range(num_rows)]
    except (pa.ArrowException, ValueError):  # a ValueError: a string that is not UTF-8
        return None
    if prompts is None or prompt_token_ids is None or ids is None or overrides is None:
        return None
    return [PromptRow(index, row_id, prompt, row_token_ids, row_overrides)
            for index, row_id, prompt, row_token_ids, row_overrides
            in zip(range(first_index, first_index + num_rows), ids, prompts, prompt_token_ids, overrides, strict=True)]


def _parsed(data: bytes) -> pa.Table:
    """The lines as one table, parsed a block at a time on Arrow's threads; as one block where a line is longer than a
    block (Arrow refuses an object across its blocks' boundaries)."""
    try:
        return pj.read_json(io.BytesIO(data), read_options=pj.ReadOptions(block_size=PARSE_BLOCK_BYTES))
    except pa.ArrowInvalid:
        return pj.read_json(io.BytesIO(data), read_options=pj.ReadOptions(block_size=len(data) + 1))


def _without_messages(line: bytes, cfg: DataConfig) -> bool:
    """Whether the line is an object without chat messages (which the chat template renders row by row)."""
    try:
        record = json.loads(line)
    except ValueError:
        return False
    return isinstance(record, dict) and record.get(cfg.messages_field) is None


def _texts(column: pa.ChunkedArray) -> list[str] | None:
    """_checked_text's prompts: non-empty strings."""
    texts = _values(column, pa.string())
    return texts if texts is not None and all(texts) else None


def _token_ids(column: pa.ChunkedArray) -> list[list[int]] | None:
    """_checked_token_ids' lists: non-empty, of integers >= 0."""
    if column.type != TOKEN_IDS or column.null_count:
        return None
    ids = pc.list_flatten(column)
    if ids.null_count or pc.min(pc.list_value_length(column)).as_py() < 1 or pc.min(ids).as_py() < 0:
        return None
    return column.to_pylist()


def _values(column: pa.ChunkedArray | None, arrow_type: pa.DataType) -> list | None:
    """The column's values, when it is of arrow_type and has no nulls."""
    if column is None or column.type != arrow_type or column.null_count:
        return None
    return column.to_pylist()


def _ids(column: pa.ChunkedArray | None) -> list[str] | None:
    """read_id's ids: non-empty strings, or integers as strings."""
    if column is not None and column.type == pa.int64():
        values = _values(column, pa.int64())
        return None if values is None else [str(value) for value in values]
    return _texts(column) if column is not None else None


def _overrides(columns: dict[str, pa.ChunkedArray], num_rows: int) -> list[dict] | None:
    """Each row's parse_overrides (a null is not set), or None where a column is of another type or a row's value is
    invalid."""
    present = [(name, columns[name]) for name in OVERRIDE_FIELDS if name in columns]
    if not present:
        return [{} for _ in range(num_rows)]
    if any(column.type not in SAME_AS_JSON for _, column in present):
        return None
    names = [name for name, _ in present]
    records = [{name: value for name, value in zip(names, values, strict=True) if value is not None}
               for values in zip(*(column.to_pylist() for _, column in present), strict=True)]
    try:
        return [parse_overrides(record) for record in records]
    except RowError:
        return None
