"""Tiny checkpoints of every architecture, prompts, transformers' reference outputs, batchgen as a subprocess."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    Gemma2Config,
    Gemma3TextConfig,
    GemmaConfig,
    GPT2Config,
    GPTNeoXConfig,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Olmo2Config,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    Starcoder2Config,
)

from batchgen.config import ModelConfig
from batchgen.models.loader import load_hf_config, load_model

ARCHITECTURES = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "GPT2LMHeadModel",
                 "Phi3ForCausalLM", "Olmo2ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
                 "MixtralForCausalLM", "Qwen3MoeForCausalLM", "GPTNeoXForCausalLM", "Starcoder2ForCausalLM"]
MOE_ARCHITECTURES = ["MixtralForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"]
# Architectures without a native implementation: they run on transformers' modules (the generic path).
GENERIC_ARCHITECTURES = ["GPTNeoXForCausalLM", "Starcoder2ForCausalLM", "GraniteForCausalLM"]
NATIVE_ARCHITECTURES = [a for a in ARCHITECTURES if a not in GENERIC_ARCHITECTURES]


LLAMA_LIKE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)


PHI3_SHORT_FACTOR = [1.0, 1.1, 1.3, 1.6, 2.2, 3.0]
PHI3_LONG_FACTOR = [1.5, 2.5, 4.0, 6.5, 10.0, 16.0]


def tiny_hf_config(architecture: str) -> PretrainedConfig:
    """A tiny config per architecture, covering the features each one adds: Llama 3 rope scaling (Llama),
    sliding_window set (Mistral), qkv bias (Qwen2), head_dim != hidden / heads and q/k norms (Qwen3), partial rotary
    and LongRoPE (Phi-3), norms after the sublayers and q/k norms over whole projections (OLMo 2), soft caps and
    query_pre_attn_scalar (Gemma 2), a RoPE per layer type and q/k norms (Gemma 3); mixtures of experts: 4 experts,
    2 a token, renormalized (Mixtral), 8 experts, 2 a token, renormalized, with Qwen3's head_dim and q/k norms
    (Qwen3-MoE), a shared expert and unrenormalized top-2 (Qwen2-MoE); Qwen2, Qwen3, GPT-2, Phi-3 and Gemma tie
    lm_head to the embeddings, the others do not."""
    if architecture == "LlamaForCausalLM":
        config = LlamaConfig(
            **LLAMA_LIKE,
            rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 32},
            tie_word_embeddings=False,
        )
    elif architecture == "MistralForCausalLM":
        config = MistralConfig(**LLAMA_LIKE, head_dim=16, sliding_window=4096, tie_word_embeddings=False)
    elif architecture == "Qwen2ForCausalLM":
        config = Qwen2Config(**LLAMA_LIKE, rope_theta=1000000.0, tie_word_embeddings=True)
    elif architecture == "Qwen3ForCausalLM":
        config = Qwen3Config(**LLAMA_LIKE, head_dim=32, tie_word_embeddings=True)
    elif architecture == "GemmaForCausalLM":
        config = GemmaConfig(**LLAMA_LIKE, head_dim=16)
    elif architecture == "Gemma2ForCausalLM":
        # Soft caps low enough to bend these tiny models' scores and logits; a window past every test sequence (the
        # sliding-window tests shorten it), on layer 0 (Gemma 2 alternates, sliding first).
        config = Gemma2Config(**LLAMA_LIKE, head_dim=16, query_pre_attn_scalar=24, sliding_window=256,
                              attn_logit_softcapping=0.5, final_logit_softcapping=2.0)
    elif architecture == "Gemma3ForCausalLM":
        # One sliding and one global layer, each with its RoPE: the local base, and the global one linearly scaled.
        config = Gemma3TextConfig(
            **LLAMA_LIKE, head_dim=32, query_pre_attn_scalar=20, sliding_window=256,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}},
        )
    elif architecture == "MixtralForCausalLM":
        config = MixtralConfig(**{**LLAMA_LIKE, "intermediate_size": 32}, num_local_experts=4, num_experts_per_tok=2,
                               tie_word_embeddings=False)
    elif architecture == "Qwen3MoeForCausalLM":
        config = Qwen3MoeConfig(**LLAMA_LIKE, head_dim=32, num_experts=8, num_experts_per_tok=2,
                                moe_intermediate_size=32, norm_topk_prob=True, tie_word_embeddings=False)
    elif architecture == "Qwen2MoeForCausalLM":
        config = Qwen2MoeConfig(**LLAMA_LIKE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                shared_expert_intermediate_size=48, norm_topk_prob=False, tie_word_embeddings=False)
    elif architecture == "GPT2LMHeadModel":
        config = GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=256, bos_token_id=255,
                            eos_token_id=255)
    elif architecture == "Phi3ForCausalLM":
        # Phi-4-mini's partial rotary (3/4 of each head: 6 of 8 frequencies) and Phi-3's LongRoPE, whose long factors
        # start at position 64: the engine tests' prompts and generations stay below it, the sliding-window tests'
        # generations cross it (tests/models/test_phi3.py checks both sides against transformers).
        config = Phi3Config(**LLAMA_LIKE, partial_rotary_factor=0.75, original_max_position_embeddings=64,
                            rope_scaling={"type": "longrope", "short_factor": PHI3_SHORT_FACTOR,
                                          "long_factor": PHI3_LONG_FACTOR},
                            pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    elif architecture == "Olmo2ForCausalLM":
        config = Olmo2Config(**LLAMA_LIKE, pad_token_id=0, eos_token_id=2, tie_word_embeddings=False)
    elif architecture == "GPTNeoXForCausalLM":  # partial rotary (a quarter of each head), parallel residual
        config = GPTNeoXConfig(**{k: v for k, v in LLAMA_LIKE.items() if k not in ("num_key_value_heads",
                                                                                     "rms_norm_eps")})
    elif architecture == "Starcoder2ForCausalLM":  # LayerNorm, biases, a GELU MLP, a window where one is set
        config = Starcoder2Config(**{k: v for k, v in LLAMA_LIKE.items() if k != "rms_norm_eps"}, bos_token_id=1,
                                  eos_token_id=2)
    elif architecture == "GraniteForCausalLM":  # multipliers on the embeddings, residuals, attention and logits
        config = GraniteConfig(**LLAMA_LIKE, embedding_multiplier=2.0, residual_multiplier=0.5,
                               attention_multiplier=0.2, logits_scaling=4.0, bos_token_id=1, eos_token_id=2)
    else:
        raise ValueError(f"no tiny config for {architecture}")
    config.architectures = [architecture]
    return config


def with_sliding_window(config: PretrainedConfig, window: int) -> PretrainedConfig:
    """The same tiny config with a small sliding window: on every layer (Mistral, Mixtral), on the layers from
    max_window_layers=1 on (Qwen2: layer 0 full, layer 1 sliding), or on those layer_types already names (Gemma:
    layer 0), as transformers reads these keys."""
    config.sliding_window = window
    if isinstance(config, Qwen2Config):
        config.use_sliding_window = True
        config.max_window_layers = 1
        config.layer_types = ["full_attention" if i < 1 else "sliding_attention"
                              for i in range(config.num_hidden_layers)]
    return config


def build_tiny_model_dir(architecture: str, directory: Path, max_shard_size: str | None = None,
                         sliding_window: int | None = None, overrides: dict | None = None) -> Path:
    """Saves a randomly initialized tiny model (seeded) as a safetensors checkpoint into `directory`; with
    `sliding_window`, the weights are the same as without it. overrides: config values set on the tiny config."""
    torch.manual_seed(0)
    config = tiny_hf_config(architecture)
    if sliding_window is not None:
        config = with_sliding_window(config, sliding_window)
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    return save_perturbed(AutoModelForCausalLM.from_config(config).float(), directory, **kwargs)


def save_perturbed(model: nn.Module, directory: Path, **save_kwargs: Any) -> Path:
    """Saves the model into `directory` after adding seeded-RNG noise to every parameter: transformers initializes
    biases to zero and norms to one, and the noise makes every parameter matter."""
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    model.save_pretrained(directory, **save_kwargs)
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
    return save_perturbed(AutoModelForSequenceClassification.from_config(config).float(), directory)


MAX_TOKENS = 12


def random_prompts(vocab_size: int, count: int = 6, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(rng.randint(1, 30))] for _ in range(count)]


def hf_greedy_on(model_dir, prompts: list[list[int]], max_tokens: int, device: str = "cpu") -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    model.generation_config.eos_token_id = None  # like ignore_eos: run every prompt to max_tokens
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        with torch.no_grad():
            generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                       do_sample=False, pad_token_id=0)
        outputs.append(generated[0, len(prompt):].tolist())
    return outputs


def hf_references(tiny_model_dir, prompts: list[list[int]], max_tokens: int):
    """references(architecture) -> (model dir, prompts, transformers' greedy tokens), each built once."""
    cache = {}

    def get(architecture: str):
        if architecture not in cache:
            model_dir = tiny_model_dir(architecture)
            cache[architecture] = (model_dir, prompts, hf_greedy_on(model_dir, prompts, max_tokens))
        return cache[architecture]

    return get



VOCAB = 256  # the tiny checkpoints' vocab_size


def load_ours(directory: Path) -> nn.Module:
    model_config = ModelConfig(path=str(directory))
    return load_model(model_config, load_hf_config(model_config), torch.float32, torch.device("cpu"))


@torch.no_grad()
def reference_logits(directory: Path, tokens: list[int]) -> torch.Tensor:  # (len(tokens), vocab)
    reference = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").float().eval()
    return reference(torch.tensor([tokens])).logits[0]


def assert_logits_close(ours: torch.Tensor, expected: torch.Tensor) -> None:
    scale = float(expected.abs().max())
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-4 * max(scale, 1.0))


def random_tokens(count: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (count,), generator=torch.Generator().manual_seed(seed)).tolist()



def hf_logprobs(model_dir, sequence: list[int]) -> torch.Tensor:
    """(len(sequence), V): row p is log_softmax of the logits at position p, which score token p + 1."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([sequence])).logits[0].float().log_softmax(-1)


def check_entry(entry: dict, token: int, reference: torch.Tensor, k: int) -> None:
    assert entry["token_id"] == token
    assert abs(entry["logprob"] - reference[token].item()) < 1e-4
    assert entry["rank"] == int((reference > reference[token]).sum()) + 1
    top_logprobs, top_ids = reference.topk(k)
    assert [t["token_id"] for t in entry["top"]] == top_ids.tolist()
    assert torch.allclose(torch.tensor([t["logprob"] for t in entry["top"]]), top_logprobs, atol=1e-4)



REPO = Path(__file__).resolve().parents[2]


TIMING_COLUMNS = ["ttft_ms", "tpot_ms", "latency_ms"]


def batchgen(run_dir: Path, *overrides: str, wait: bool = True) -> subprocess.CompletedProcess | subprocess.Popen:
    command = [sys.executable, "-m", "batchgen", f"hydra.run.dir={run_dir}", "engine.device=cpu",
               "job.progress=false", *overrides]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if not wait:
        return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def comparable(path: Path) -> list[dict]:
    return pq.read_table(path).drop_columns(TIMING_COLUMNS).to_pylist()


def wait_for_parts(run_dir: Path, count: int, process: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    parts = run_dir / "completions.parts"
    while len(list(parts.glob("part-*.parquet"))) < count:
        assert process.poll() is None, process.stdout.read().decode()
        assert time.monotonic() < deadline, "the job wrote no parts in time"
        time.sleep(0.05)



KV_SETUPS = {  # chunked prefill, preemption (recompute over blocks other requests wrote) and padded block tables
    "chunked_prefill": dict(block_size=4, max_num_batched_tokens=7),
    "preemption": dict(block_size=4, num_gpu_blocks_override=14, max_num_seqs=6),
}

