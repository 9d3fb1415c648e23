"""Which of our model classes implements a Hugging Face architecture."""

from __future__ import annotations

from batchgen.models.gpt2 import GPT2LMHeadModel
from batchgen.models.hf_config import HFConfig
from batchgen.models.llama import (
    LlamaForCausalLM,
    LlamaForEmbedding,
    LlamaForSequenceClassification,
    MistralForCausalLM,
    MistralForEmbedding,
    MistralForSequenceClassification,
    Qwen2ForCausalLM,
    Qwen2ForEmbedding,
    Qwen2ForSequenceClassification,
    Qwen3ForCausalLM,
    Qwen3ForEmbedding,
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
# Bare decoders (transformers' *Model): job.task=embed only.
DECODER_REGISTRY: dict[str, type] = {
    "LlamaModel": LlamaForEmbedding,
    "MistralModel": MistralForEmbedding,
    "Qwen2Model": Qwen2ForEmbedding,
    "Qwen3Model": Qwen3ForEmbedding,
}
# job.task=embed builds the decoder without its head (GPT-2's is tied to its embeddings: it costs nothing).
EMBEDDING_VARIANT: dict[type, type] = {
    LlamaForCausalLM: LlamaForEmbedding, LlamaForSequenceClassification: LlamaForEmbedding,
    MistralForCausalLM: MistralForEmbedding, MistralForSequenceClassification: MistralForEmbedding,
    Qwen2ForCausalLM: Qwen2ForEmbedding, Qwen2ForSequenceClassification: Qwen2ForEmbedding,
    Qwen3ForCausalLM: Qwen3ForEmbedding, Qwen3ForSequenceClassification: Qwen3ForEmbedding,
}
# For configs built from a model_type alone (dummy weights), which name "architectures" leaves unset.
DEFAULT_ARCHITECTURE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
}


def model_class(hf_config: HFConfig, task: str = "generate") -> type:
    """The class that runs hf_config's architecture for job.task `task`."""
    cls = _architecture_class(hf_config)
    return EMBEDDING_VARIANT.get(cls, cls) if task == "embed" else cls


def _architecture_class(hf_config: HFConfig) -> type:
    architectures = getattr(hf_config, "architectures", None) or []
    if not architectures and hf_config.model_type in DEFAULT_ARCHITECTURE:
        architectures = [DEFAULT_ARCHITECTURE[hf_config.model_type]]
    for architecture in architectures:
        if architecture in MODEL_REGISTRY:
            return MODEL_REGISTRY[architecture]
        if architecture in CLASSIFIER_REGISTRY:
            return CLASSIFIER_REGISTRY[architecture]
        if architecture in DECODER_REGISTRY:
            return DECODER_REGISTRY[architecture]
    named = ", ".join(architectures) or f"(none; model_type {hf_config.model_type!r})"
    raise ValueError(f"architecture {named} is not supported; supported: "
                     f"{', '.join([*MODEL_REGISTRY, *CLASSIFIER_REGISTRY, *DECODER_REGISTRY])}")


def check_task(task: str, hf_config: HFConfig) -> None:
    """Raises naming job.task when the checkpoint's architecture cannot do the task: classify needs a
    *ForSequenceClassification checkpoint; generate and score need a causal LM; embed takes any."""
    cls = _architecture_class(hf_config)
    architecture = (getattr(hf_config, "architectures", None) or [hf_config.model_type])[0]
    if task != "embed" and cls in DECODER_REGISTRY.values():
        raise ValueError(f"job.task={task} needs a model with a head; {architecture} is a bare decoder: use "
                         "job.task=embed")
    classifier = cls in CLASSIFIER_REGISTRY.values()
    if task == "classify" and not classifier:
        raise ValueError(f"job.task=classify needs a sequence-classification checkpoint "
                         f"({', '.join(CLASSIFIER_REGISTRY)}); this one is {architecture}")
    if task in ("generate", "score") and classifier:
        raise ValueError(f"job.task={task} needs a causal language model; {architecture} is a classifier: use "
                         "job.task=classify")
