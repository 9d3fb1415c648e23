"""Which of our model classes implements a Hugging Face architecture."""

from __future__ import annotations

from batchgen.models.gpt2 import GPT2LMHeadModel
from batchgen.models.hf_config import HFConfig
from batchgen.models.llama import (
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    MistralForCausalLM,
    MistralForSequenceClassification,
    Qwen2ForCausalLM,
    Qwen2ForSequenceClassification,
    Qwen3ForCausalLM,
    Qwen3ForSequenceClassification,
)

MODEL_REGISTRY: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
}
# Classifiers and reward models (job.task=classify): the decoder with a `score` head in place of the LM head.
CLASSIFIER_REGISTRY: dict[str, type] = {
    "LlamaForSequenceClassification": LlamaForSequenceClassification,
    "MistralForSequenceClassification": MistralForSequenceClassification,
    "Qwen2ForSequenceClassification": Qwen2ForSequenceClassification,
    "Qwen3ForSequenceClassification": Qwen3ForSequenceClassification,
}
# For configs built from a model_type alone (dummy weights), which name "architectures" leaves unset.
DEFAULT_ARCHITECTURE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
}


def model_class(hf_config: HFConfig) -> type:
    architectures = getattr(hf_config, "architectures", None) or []
    if not architectures and hf_config.model_type in DEFAULT_ARCHITECTURE:
        architectures = [DEFAULT_ARCHITECTURE[hf_config.model_type]]
    for architecture in architectures:
        if architecture in MODEL_REGISTRY:
            return MODEL_REGISTRY[architecture]
        if architecture in CLASSIFIER_REGISTRY:
            return CLASSIFIER_REGISTRY[architecture]
    named = ", ".join(architectures) or f"(none; model_type {hf_config.model_type!r})"
    raise ValueError(f"architecture {named} is not supported; supported: "
                     f"{', '.join([*MODEL_REGISTRY, *CLASSIFIER_REGISTRY])}")


def check_task(task: str, hf_config: HFConfig) -> None:
    """Raises naming job.task when the checkpoint's architecture cannot do the task: classify needs a
    *ForSequenceClassification checkpoint; generate and score need a causal LM; embed takes either."""
    classifier = model_class(hf_config) in CLASSIFIER_REGISTRY.values()
    architecture = (getattr(hf_config, "architectures", None) or [hf_config.model_type])[0]
    if task == "classify" and not classifier:
        raise ValueError(f"job.task=classify needs a sequence-classification checkpoint "
                         f"({', '.join(CLASSIFIER_REGISTRY)}); this one is {architecture}")
    if task in ("generate", "score") and classifier:
        raise ValueError(f"job.task={task} needs a causal language model; {architecture} is a classifier: use "
                         "job.task=classify")
