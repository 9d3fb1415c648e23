"""Which reader a `DataConfig` needs: the explicit format, or one inferred from the path."""

from __future__ import annotations

import json
from pathlib import Path

from batchgen.config import DATA_FORMATS, DataConfig
from batchgen.io.errors import InputError

FORMAT_BY_SUFFIX = {
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".feather": "arrow",
    ".ipc": "arrow",
    # Only the datasets library reads CSV here.
    ".csv": "hf",
}
HF_BUILDER_BY_SUFFIX = {
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".feather": "arrow",
    ".ipc": "arrow",
    ".csv": "csv",
}
# The keys that make a JSONL line an OpenAI Batch request (its url is checked line by line).
OPENAI_BATCH_KEYS = ("custom_id", "body")
# Files that `Dataset.save_to_disk` / `DatasetDict.save_to_disk` write into their directory.
HF_DISK_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


def resolve_format(cfg: DataConfig) -> str:
    """The concrete format to read `cfg.path` with; raises InputError when it cannot be known."""
    if cfg.format not in DATA_FORMATS:
        raise InputError(f"unknown data.format {cfg.format!r}; allowed formats are {', '.join(DATA_FORMATS)}")
    if cfg.format != "auto":
        return cfg.format
    path = Path(cfg.path)
    if path.is_dir():
        if any((path / marker).is_file() for marker in HF_DISK_MARKERS):
            return "hf_disk"
        raise InputError(
            f"{path}: cannot infer the format of a directory without any of {', '.join(HF_DISK_MARKERS)}; "
            f"set data.format to one of {', '.join(DATA_FORMATS[1:])}"
        )
    fmt = FORMAT_BY_SUFFIX.get(path.suffix.lower())
    if fmt is None:
        raise InputError(
            f"{path}: cannot infer the format from the suffix {path.suffix!r} (known: "
            f"{', '.join(FORMAT_BY_SUFFIX)}); set data.format to one of {', '.join(DATA_FORMATS[1:])}"
        )
    if fmt == "jsonl" and path.is_file() and is_openai_batch_file(path):
        return "openai_batch"
    return fmt


def is_openai_batch_file(path: Path) -> bool:
    """Whether the first non-blank line is a JSON object with an OpenAI Batch request's keys."""
    with path.open("rb") as file:
        first = next((line for line in file if line.strip()), b"")
    try:
        record = json.loads(first)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return isinstance(record, dict) and all(key in record for key in OPENAI_BATCH_KEYS)


def hf_builder(path: Path) -> str:
    """The `datasets.load_dataset` builder name for a local data file."""
    builder = HF_BUILDER_BY_SUFFIX.get(path.suffix.lower())
    if builder is None:
        raise InputError(
            f"{path}: format hf cannot read {path.suffix!r} files; "
            f"known suffixes are {', '.join(HF_BUILDER_BY_SUFFIX)}"
        )
    return builder
