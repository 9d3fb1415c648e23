"""Which of our model classes implements a Hugging Face architecture."""

from __future__ import annotations

from batchgen.models.base import CausalLM
from batchgen.models.gpt2 import GPT2LMHeadModel
from batchgen.models.hf_config import HFConfig, architecture_of
from batchgen.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from batchgen.models.moe import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

# Keyed by hf_config.ARCHITECTURES' values, which check_checkpoint reads without importing the models (torch).
MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
}


def model_class(hf_config: HFConfig) -> type[CausalLM]:
    return MODEL_REGISTRY[architecture_of(hf_config)]
