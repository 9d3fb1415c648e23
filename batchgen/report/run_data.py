"""One run directory as the report sees it: its summary figures, overrides, config, and Parquet tables."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow.parquet as pq
import yaml

from batchgen.job.summary import TIME_COLUMNS
from batchgen.report.summary_fields import SummaryFigures, read_figures

REQUIRED_FILES = ("summary.json", "completions.parquet", "steps.parquet")
COMPLETION_COLUMNS = ["index", "finish_reason", "num_output_tokens", "output_token_ids", "ttft_ms", "tpot_ms",
                      "latency_ms"]
STEP_COLUMNS = ["step", "kind", "num_seqs", "padded_size", "cuda_graph", *TIME_COLUMNS]
NEEDED_COLUMNS = {"completions.parquet": COMPLETION_COLUMNS, "steps.parquet": STEP_COLUMNS}


@dataclass
class Run:
    path: Path
    figures: SummaryFigures | None  # None when summary.json is missing (a killed run)
    overrides: dict[str, str]  # key=value from .hydra/overrides.yaml, "+" and "~" prefixes dropped
    config: dict[str, str]  # the flattened config: summary.json's, else .hydra/config.yaml's
    missing: list[str]  # required files that are absent or lack columns the report reads
    label: str = field(default="")
    params: dict[str, str] = field(default_factory=dict)  # the values of the keys that differ between runs

    @property
    def complete(self) -> bool:
        return not self.missing

    def readable(self, name: str) -> bool:
        return (self.path / name).exists() and not any(m.startswith(name) for m in self.missing)

    def value(self, key: str) -> str | None:
        """A setting as text: the override given, else the config's value."""
        return self.overrides.get(key, self.config.get(key))

    @cached_property
    def steps(self) -> pd.DataFrame:
        return pd.read_parquet(self.path / "steps.parquet")

    @cached_property
    def completions(self) -> pd.DataFrame:
        return pd.read_parquet(self.path / "completions.parquet", columns=COMPLETION_COLUMNS)

    @cached_property
    def kernels(self) -> pd.DataFrame | None:
        path = self.path / "kernels.parquet"
        return pd.read_parquet(path) if path.exists() else None


# A sweep records its values as Hydra parsed them (True); configs flatten to true/false/null.
CANONICAL = {"true": "true", "false": "false", "null": "null", "none": "null"}


def as_text(value: Any) -> str:
    """Config and override values compared as Hydra writes them: true/false, null, numbers, strings."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return str(value)


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    flat: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = as_text(value)
    return flat


def read_overrides(path: Path) -> dict[str, str]:
    if not path.exists():
        return {}
    overrides: dict[str, str] = {}
    for item in yaml.safe_load(path.read_text()) or []:
        key, _, value = str(item).partition("=")
        overrides[key.lstrip("+~")] = CANONICAL.get(value.lower(), value)
    return overrides


def _lacking_columns(path: Path) -> list[str]:
    present = set(pq.read_schema(path).names)
    return [column for column in NEEDED_COLUMNS[path.name] if column not in present]


def load_run(path: Path) -> Run:
    missing = [name for name in REQUIRED_FILES if not (path / name).exists()]
    for name in NEEDED_COLUMNS:
        lacking = _lacking_columns(path / name) if (path / name).exists() else []
        if lacking:
            missing.append(f"{name} (columns {', '.join(lacking)})")
    figures = None
    config: dict[str, Any] = {}
    if (path / "summary.json").exists():
        figures = read_figures(json.loads((path / "summary.json").read_text()))
        config = figures.config
    elif (path / ".hydra" / "config.yaml").exists():
        config = yaml.safe_load((path / ".hydra" / "config.yaml").read_text()) or {}
    return Run(path, figures, read_overrides(path / ".hydra" / "overrides.yaml"), flatten(config), missing)
