"""Which of our model classes implements a Hugging Face architecture."""

from __future__ import annotations

from batchgen.models.base import CausalLM
from batchgen.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM, GemmaForCausalLM
from batchgen.models.gpt2 import GPT2LMHeadModel
from batchgen.models.hf_config import HFConfig, architecture_of, model_implementation
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
from batchgen.models.moe import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from batchgen.models.olmo2 import Olmo2ForCausalLM
from batchgen.models.phi3 import Phi3ForCausalLM

# Keyed by hf_config's architecture names (ARCHITECTURES' values, CLASSIFIERS, DECODERS), which check_checkpoint
# reads without importing the models (torch).
MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "GemmaForCausalLM": GemmaForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForCausalLM,  # its language model: the loader reads its text_config
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
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


def model_class(hf_config: HFConfig, task: str = "generate") -> type:
    """The class that runs hf_config's architecture for job.task `task`."""
    cls = _architecture_class(hf_config)
    return EMBEDDING_VARIANT.get(cls, cls) if task == "embed" else cls


def _architecture_class(hf_config: HFConfig) -> type:
    architecture = architecture_of(hf_config)
    return MODEL_REGISTRY.get(architecture) or CLASSIFIER_REGISTRY.get(architecture) or DECODER_REGISTRY[architecture]


def check_task(task: str, hf_config: HFConfig, impl: str) -> None:
    """Raises naming job.task when the checkpoint's architecture cannot do the task: classify needs a
    *ForSequenceClassification checkpoint; generate and score need a causal LM; embed takes any native one.
    impl: model.impl; transformers' modules (the generic path) run causal LMs only."""
    if model_implementation(hf_config, impl) == "transformers":
        if task not in ("generate", "score"):
            raise ValueError(f"job.task={task} runs on batchgen's native modules only; transformers' modules "
                             "(model.impl) run causal language models (job.task=generate or score)")
        return
    architecture = architecture_of(hf_config)
    if task != "embed" and architecture in DECODER_REGISTRY:
        raise ValueError(f"job.task={task} needs a model with a head; {architecture} is a bare decoder: use "
                         "job.task=embed")
    classifier = architecture in CLASSIFIER_REGISTRY
    if task == "classify" and not classifier:
        raise ValueError(f"job.task=classify needs a sequence-classification checkpoint "
                         f"({', '.join(CLASSIFIER_REGISTRY)}); this one is {architecture}")
    if task in ("generate", "score") and classifier:
        raise ValueError(f"job.task={task} needs a causal language model; {architecture} is a classifier: use "
                         "job.task=classify")
