"""Shared fixtures: tiny random Hugging Face checkpoints of every supported architecture."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

# The tiny test models gain nothing from intra-op threads; on small CPU machines extra threads only add overhead.
torch.set_num_threads(1)

ARCHITECTURES = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "GPT2LMHeadModel"]

_LLAMA_LIKE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)


def tiny_hf_config(architecture: str) -> PretrainedConfig:
    """A tiny config per architecture, covering the features each one adds: Llama 3 rope scaling (Llama),
    sliding_window set (Mistral), qkv bias (Qwen2), head_dim != hidden / heads and q/k norms (Qwen3);
    Qwen2, Qwen3 and GPT-2 tie lm_head to the embeddings, Llama and Mistral do not."""
    if architecture == "LlamaForCausalLM":
        config = LlamaConfig(
            **_LLAMA_LIKE,
            rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 32},
            tie_word_embeddings=False,
        )
    elif architecture == "MistralForCausalLM":
        config = MistralConfig(**_LLAMA_LIKE, head_dim=16, sliding_window=4096, tie_word_embeddings=False)
    elif architecture == "Qwen2ForCausalLM":
        config = Qwen2Config(**_LLAMA_LIKE, rope_theta=1000000.0, tie_word_embeddings=True)
    elif architecture == "Qwen3ForCausalLM":
        config = Qwen3Config(**_LLAMA_LIKE, head_dim=32, tie_word_embeddings=True)
    elif architecture == "GPT2LMHeadModel":
        config = GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=256, bos_token_id=255,
                            eos_token_id=255)
    else:
        raise ValueError(f"no tiny config for {architecture}")
    config.architectures = [architecture]
    return config


def with_sliding_window(config: PretrainedConfig, window: int) -> PretrainedConfig:
    """The same tiny config with a small sliding window: on every layer (Mistral), or on the layers from
    max_window_layers=1 on (Qwen2: layer 0 full, layer 1 sliding), as transformers reads these keys."""
    config.sliding_window = window
    if isinstance(config, Qwen2Config):
        config.use_sliding_window = True
        config.max_window_layers = 1
        config.layer_types = ["full_attention" if i < 1 else "sliding_attention"
                              for i in range(config.num_hidden_layers)]
    return config


def build_tiny_model_dir(architecture: str, directory: Path, max_shard_size: str | None = None,
                         sliding_window: int | None = None) -> Path:
    """Saves a randomly initialized tiny model (seeded) as a safetensors checkpoint into `directory`; with
    `sliding_window`, the weights are the same as without it."""
    torch.manual_seed(0)
    config = tiny_hf_config(architecture)
    if sliding_window is not None:
        config = with_sliding_window(config, sliding_window)
    model = AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        # transformers initializes biases to zero and norms to one; noise makes every parameter matter.
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, **kwargs)
    return directory


def build_tiny_classifier_dir(architecture: str, directory: Path, num_labels: int,
                              pad_token_id: int | None = None) -> Path:
    """A seeded random tiny *ForSequenceClassification checkpoint (architecture: its causal LM's name) with
    num_labels labels (1: a reward model) and, optionally, a pad token that the last-token pooling skips."""
    torch.manual_seed(0)
    config = tiny_hf_config(architecture)
    config.architectures = [architecture.replace("ForCausalLM", "ForSequenceClassification")]
    config.num_labels = num_labels
    config.pad_token_id = pad_token_id
    model = AutoModelForSequenceClassification.from_config(config).float()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """tiny_model_dir(architecture, sharded=False, sliding_window=None) -> checkpoint directory, built once per
    session."""
    built: dict[tuple[str, bool, int | None], Path] = {}

    def get(architecture: str, sharded: bool = False, sliding_window: int | None = None) -> Path:
        key = (architecture, sharded, sliding_window)
        if key not in built:
            suffix = ("-sharded" if sharded else "") + (f"-window{sliding_window}" if sliding_window else "")
            directory = tmp_path_factory.mktemp(f"{architecture}{suffix}")
            built[key] = build_tiny_model_dir(architecture, directory, "20KB" if sharded else None, sliding_window)
        return built[key]

    return get
