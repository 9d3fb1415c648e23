"""A row's logprob entries (schema.LOGPROB_ENTRY) built as Arrow arrays from NumPy arrays: a scoring row has one entry
per prompt token, thousands of them, and one Python dict per entry costs more than the step that computed it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from batchgen.io.schema import LOGPROB_ENTRY

TOP_ENTRY = LOGPROB_ENTRY.field("top").type.value_type


@dataclass(frozen=True)
class LogprobArrays:
    """One row's entries: `num_missing` null entries (tokens without a logprob, first), then one per scored token."""

    num_missing: int
    token_ids: np.ndarray  # (P,)
    texts: pa.StringArray | None  # (P,); None: no tokenizer, every text null
    logprobs: np.ndarray  # (P,)
    ranks: np.ndarray  # (P,)
    top_ids: np.ndarray  # (P, k), most likely first
    top_texts: pa.StringArray | None  # (P * k,), a position's k after each other
    top_logprobs: np.ndarray  # (P, k)

    def to_arrow(self) -> pa.ListArray:
        """A one-row list<LOGPROB_ENTRY> array: what pa.array([entries]) makes of the row's entries as dicts."""
        missing, (scored, k) = self.num_missing, self.top_ids.shape
        offsets = np.concatenate([np.zeros(missing, dtype=np.int32), np.arange(scored + 1, dtype=np.int32) * k])
        top = pa.StructArray.from_arrays(
            [_ints(self.top_ids.reshape(-1)), _strings(self.top_texts, scored * k),
             _floats(self.top_logprobs.reshape(-1))], fields=list(TOP_ENTRY))
        entries = pa.StructArray.from_arrays(
            [_ints(self.token_ids, missing), _strings(self.texts, scored, missing), _floats(self.logprobs, missing),
             _ints(self.ranks, missing), pa.ListArray.from_arrays(pa.array(offsets), top)],
            fields=list(LOGPROB_ENTRY), mask=pa.array(np.arange(missing + scored) < missing))
        return pa.ListArray.from_arrays(pa.array([0, missing + scored], type=pa.int32()), entries)


def _padded(values: np.ndarray, dtype: type, missing: int) -> np.ndarray:
    """values after `missing` zeros (the values of the null entries, never read)."""
    return np.concatenate([np.zeros(missing, dtype=dtype), values.astype(dtype, copy=False)])


def _ints(values: np.ndarray, missing: int = 0) -> pa.Array:
    return pa.array(_padded(values, np.int32, missing))


def _floats(values: np.ndarray, missing: int = 0) -> pa.Array:
    return pa.array(_padded(values, np.float32, missing))


def _strings(texts: pa.StringArray | None, count: int, missing: int = 0) -> pa.Array:
    if texts is None:
        return pa.nulls(missing + count, pa.string())
    return pa.concat_arrays([pa.nulls(missing, pa.string()), texts]) if missing else texts
