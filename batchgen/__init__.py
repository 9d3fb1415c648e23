"""batchgen: offline batch generation for Hugging Face causal language models."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from batchgen.llm import LLM
    from batchgen.outputs import RequestOutput
    from batchgen.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]

# Imported on first use, so that `python -m batchgen --help` does not wait for torch.
_HOMES = {"LLM": "batchgen.llm", "RequestOutput": "batchgen.outputs", "SamplingParams": "batchgen.sampling_params"}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'batchgen' has no attribute {name!r}")
    return getattr(import_module(_HOMES[name]), name)
