"""Gemma decoders: Gemma (1), Gemma 2 and Gemma 3's language model, as transformers 5 computes them.

What they change from Llama:
- embeddings scaled by sqrt(hidden_size), the factor rounded to the model dtype;
- RMSNorm scaling by (1 + weight) in float32, rounded once at the end (norms.GemmaRMSNorm);
- a GeGLU MLP: gelu(gate) * up, gelu_pytorch_tanh (activation.GeluAndMul);
- Gemma 2 and 3: the attention and MLP outputs are normed again before each residual add (post_attention_layernorm,
  post_feedforward_layernorm; pre_feedforward_layernorm is the norm before the MLP), the attention scale is
  query_pre_attn_scalar ** -0.5, and layers alternate between sliding-window and global attention (layer_types);
- Gemma 2: attention scores soft-capped inside the attention kernels (attn_logit_softcapping), final logits
  soft-capped in compute_logits (final_logit_softcapping);
- Gemma 3: per-head q/k RMSNorm before RoPE, and one RoPE per layer type (rope_parameters["sliding_attention"]: the
  local base, rope_local_base_freq; rope_parameters["full_attention"]: the global base and its scaling). Like
  transformers 5, Gemma 3 ignores attn_logit_softcapping (its checkpoints set none).

A Gemma3ForConditionalGeneration checkpoint (text and vision) runs as its language model: the loader reads its
text_config (`language_model_config`) and load_weights takes the language model's tensors, skipping the vision tower.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any, ClassVar

import torch
from torch import nn

from batchgen.layers.activation import GELU_APPROXIMATIONS, GeluAndMul
from batchgen.layers.attention import AttentionMetadata
from batchgen.layers.embedding import InputIdsWithPending
from batchgen.layers.fused import norm_then_linear
from batchgen.layers.norms import GemmaRMSNorm, gemma_rms_norm
from batchgen.layers.parallel_linear import gated_projections, vocab_embedding
from batchgen.layers.rotary import RotaryEmbedding, apply_rotary, rope_parameters
from batchgen.models.base import CausalLM
from batchgen.models.llama import LlamaAttention, head_dim_of, layer_sliding_windows, llama_weight_targets
from batchgen.models.weights import load_into

# Where a Gemma3ForConditionalGeneration checkpoint keeps its language model (transformers 5's names in memory, then
# the Hub's, which it saves), and the parts of it that the text model does not run.
_LANGUAGE_MODEL_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model.",
                            "language_model.lm_head.": "lm_head."}
_VISION_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector.")


@dataclass(frozen=True)
class GemmaSpec:
    """What a Gemma generation's layers compute (GemmaForCausalLM.spec)."""

    approximate_gelu: str  # F.gelu's `approximate` of the MLP's activation
    sandwich_norms: bool  # norms after the attention and the MLP too (Gemma 2, 3)
    attention_softcap: float | None
    qk_norm: bool


def language_model_config(config: Any) -> Any:
    """The config our model reads from a transformers config: Gemma 3's multimodal one's text_config (given the
    checkpoint's dtype when it names none, and its quantization_config), every other config as it is."""
    if getattr(config, "model_type", None) != "gemma3":
        return config
    text_config = config.text_config
    if getattr(text_config, "dtype", None) is None:
        text_config.dtype = getattr(config, "dtype", None)
    if getattr(config, "quantization_config", None) is not None:
        text_config.quantization_config = config.quantization_config
    return text_config


def gemma_norm_and_rotate(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                          norms: tuple[torch.Tensor, torch.Tensor, float] | None, cos: torch.Tensor,
                          sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gemma 3's per-head q/k norms (norms: q weight, k weight, eps; Gemma's (1 + weight) RMSNorm), then RoPE."""
    if norms is not None:
        q_weight, k_weight, eps = norms
        q, k = gemma_rms_norm(q, q_weight, eps), gemma_rms_norm(k, k_weight, eps)
    return apply_rotary(positions, q, k, cos, sin)


class GemmaAttention(LlamaAttention):
    """Llama's attention with Gemma's score scale (query_pre_attn_scalar), soft-capping and (1 + weight) q/k norms."""

    norm_class = GemmaRMSNorm
    norm_and_rotate = staticmethod(gemma_norm_and_rotate)
    gemma_style_norms = True

    def __init__(self, config: Any, rotary: RotaryEmbedding, sliding_window: int | None, softcap: float | None,
                 qk_norm: bool) -> None:
        scale = (getattr(config, "query_pre_attn_scalar", None) or head_dim_of(config)) ** -0.5
        super().__init__(config, rotary, config.attention_bias, qk_norm, sliding_window, scale, softcap)


class GemmaMLP(nn.Module):
    def __init__(self, config: Any, approximate_gelu: str) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj = gated_projections(config.hidden_size, config.intermediate_size,
                                                              False)
        self.act = GeluAndMul(approximate_gelu)

    def forward(self, norm: GemmaRMSNorm, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(down(gelu(gate) * up) of norm(hidden + residual), hidden + residual): (T, hidden) each."""
        gate_up, residual = norm_then_linear(norm, self.gate_up_proj, hidden, residual)
        return self.down_proj(self.act(gate_up)), residual


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: Any, rotary: RotaryEmbedding, sliding_window: int | None, spec: GemmaSpec) -> None:
        super().__init__()
        self.self_attn = GemmaAttention(config, rotary, sliding_window, spec.attention_softcap, spec.qk_norm)
        self.mlp = GemmaMLP(config, spec.approximate_gelu)
        eps = config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.sandwich_norms = spec.sandwich_norms
        if spec.sandwich_norms:
            self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
            self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream before it): as Llama's, the residual add is carried into the
        next norm, and on the Triton path the norm into the projection after it."""
        qkv, residual = norm_then_linear(self.input_layernorm, self.self_attn.qkv_proj, hidden, residual)
        hidden = self.self_attn(positions, qkv, meta)
        if not self.sandwich_norms:  # Gemma (1): post_attention_layernorm is the norm before the MLP, as Llama's
            return self.mlp(self.post_attention_layernorm, hidden, residual)
        hidden, residual = self.mlp(self.pre_feedforward_layernorm, self.post_attention_layernorm(hidden), residual)
        return self.post_feedforward_layernorm(hidden), residual


class GemmaModel(nn.Module):
    def __init__(self, config: Any, spec: GemmaSpec) -> None:
        super().__init__()
        self.embed_tokens = vocab_embedding(config.vocab_size, config.hidden_size)
        # In the model dtype, as transformers multiplies (sqrt(3072) is 55.5 in bf16).
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size**0.5), persistent=False)
        windows = layer_sliding_windows(config)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, rotary, window, spec)
            for rotary, window in zip(layer_rotaries(config), windows, strict=True)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor | InputIdsWithPending, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids) * self.embed_scale, None  # (T, hidden)
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, meta)
        return self.norm(hidden, residual)[0]


def layer_rotaries(config: Any) -> list[RotaryEmbedding]:
    """Each layer's RoPE tables: Gemma 3 names one rope_parameters entry per layer type (a table each, shared by
    the layers of that type); Gemma and Gemma 2 have one for every layer."""
    head_dim, max_positions = head_dim_of(config), config.max_position_embeddings
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and all(kind in params for kind in layer_types):
        tables = {kind: RotaryEmbedding(head_dim, max_positions,
                                        *rope_parameters(SimpleNamespace(rope_parameters=params[kind],
                                                                         max_position_embeddings=max_positions)))
                  for kind in dict.fromkeys(layer_types)}
        return [tables[kind] for kind in layer_types]
    rotary = RotaryEmbedding(head_dim, max_positions, *rope_parameters(config))
    return [rotary] * config.num_hidden_layers


class GemmaForCausalLM(CausalLM):
    """Gemma (1): Llama's layer with Gemma's norms, scaled embeddings and GeGLU."""

    decoder_name = "model"
    activation_key: ClassVar[str] = "hidden_act"  # Gemma 2 and 3 name it hidden_activation
    sandwich_norms: ClassVar[bool] = False

    def __init__(self, config: Any) -> None:
        if getattr(config, "use_bidirectional_attention", None):
            raise ValueError("use_bidirectional_attention=true (an embedding model's attention) is not supported: "
                             "batchgen generates with causal attention")
        decoder = GemmaModel(config, self.spec(config))
        super().__init__(config, decoder, decoder.embed_tokens if config.tie_word_embeddings else None)
        self.final_softcap: float | None = getattr(config, "final_logit_softcapping", None)

    @classmethod
    def spec(cls, config: Any) -> GemmaSpec:
        activation = getattr(config, cls.activation_key)
        if activation not in GELU_APPROXIMATIONS:
            raise ValueError(f"{cls.activation_key}={activation!r} is not supported for {cls.__name__}; supported: "
                             f"{', '.join(GELU_APPROXIMATIONS)}")
        return GemmaSpec(approximate_gelu=GELU_APPROXIMATIONS[activation], sandwich_norms=cls.sandwich_norms,
                         attention_softcap=None, qk_norm=False)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # (N, hidden) -> (N, vocab)
        logits = self.lm_head(hidden)
        if self.final_softcap is None:
            return logits
        return torch.tanh(logits / self.final_softcap) * self.final_softcap

    def checkpoint_name(self, name: str) -> str:
        """The parameter name a checkpoint tensor's name stands for."""
        return name

    def unused(self, name: str) -> bool:
        """Whether the model leaves out a checkpoint tensor (named by checkpoint_name)."""
        return name.endswith("rotary_emb.inv_freq") or (self.config.tie_word_embeddings and name == "lm_head.weight")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Loads Hugging Face-named tensors, packing q/k/v and gate/up into the fused projections."""
        load_into(llama_weight_targets(self), weights, ignored=self.unused, rename=self.checkpoint_name)


class Gemma2ForCausalLM(GemmaForCausalLM):
    activation_key = "hidden_activation"
    sandwich_norms = True

    @classmethod
    def spec(cls, config: Any) -> GemmaSpec:
        return replace(super().spec(config), attention_softcap=config.attn_logit_softcapping)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3's language model, from a Gemma3ForCausalLM checkpoint or a Gemma3ForConditionalGeneration one."""

    @classmethod
    def spec(cls, config: Any) -> GemmaSpec:
        return replace(super().spec(config), attention_softcap=None, qk_norm=True)

    def checkpoint_name(self, name: str) -> str:
        for prefix, replacement in _LANGUAGE_MODEL_PREFIXES.items():
            if name.startswith(prefix):
                return replacement + name.removeprefix(prefix)
        return name

    def unused(self, name: str) -> bool:
        return name.startswith(_VISION_PREFIXES) or super().unused(name)
