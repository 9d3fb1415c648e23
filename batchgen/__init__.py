"""batchgen: offline batch generation for Hugging Face causal language models."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from batchgen.engine.outputs import RequestOutput
    from batchgen.llm import LLM
    from batchgen.sample.params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
_MODULES = {
    "LLM": "batchgen.llm",
    "RequestOutput": "batchgen.engine.outputs",
    "SamplingParams": "batchgen.sample.params",
}


def __getattr__(name: str) -> Any:
    """Imported on first use, so that `python -m batchgen.report` (Parquet files only) never loads torch."""
    if name in _MODULES:
        return getattr(importlib.import_module(_MODULES[name]), name)
    raise AttributeError(f"module 'batchgen' has no attribute {name!r}")
