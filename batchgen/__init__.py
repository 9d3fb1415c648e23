"""batchgen: offline batch generation for Hugging Face causal language models."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from batchgen.outputs import RequestOutput
from batchgen.sampling_params import SamplingParams

if TYPE_CHECKING:
    from batchgen.llm import LLM

__all__ = ["LLM", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    # LLM imports torch: `import batchgen.cli` (--help, config errors) must not pay for it.
    if name == "LLM":
        from batchgen.llm import LLM

        return LLM
    raise AttributeError(f"module 'batchgen' has no attribute {name!r}")
