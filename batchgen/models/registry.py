"""Which of our model classes implements a Hugging Face architecture."""

from __future__ import annotations

from batchgen.models.base import CausalLM
from batchgen.models.gpt2 import GPT2LMHeadModel
from batchgen.models.hf_config import HFConfig
from batchgen.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
}
# For configs built from a model_type alone (dummy weights), which name "architectures" leaves unset.
DEFAULT_ARCHITECTURE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
}


def model_class(hf_config: HFConfig) -> type[CausalLM]:
    architectures = getattr(hf_config, "architectures", None) or []
    if not architectures and hf_config.model_type in DEFAULT_ARCHITECTURE:
        architectures = [DEFAULT_ARCHITECTURE[hf_config.model_type]]
    for architecture in architectures:
        if architecture in MODEL_REGISTRY:
            return MODEL_REGISTRY[architecture]
    named = ", ".join(architectures) or f"(none; model_type {hf_config.model_type!r})"
    raise ValueError(f"architecture {named} is not supported; supported: {', '.join(MODEL_REGISTRY)}")
