"""batchgen: offline batch generation for Hugging Face causal language models."""

from batchgen.llm import LLM
from batchgen.outputs import RequestOutput
from batchgen.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
