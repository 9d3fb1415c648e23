"""Llama-family decoders: Llama (2, 3, 3.1 rope scaling), Mistral, Qwen2 (qkv bias), Qwen3 (per-head q/k RMSNorm).

Tokens of all sequences in a step are flattened into one (T,) batch; attention goes through the paged KV cache.
Sliding-window attention (Mistral; Qwen2's opt-in `use_sliding_window`, on the layers its `layer_types` name) is
passed to each layer's Attention; the KV cache keeps every position, so no block is freed outside the window.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from typing import ClassVar

import torch
from torch import nn

from batchgen.layers.activation import SiluAndMul
from batchgen.layers.attention import Attention, AttentionMetadata
from batchgen.layers.compiled import compiled
from batchgen.layers.embedding import InputIdsWithPending
from batchgen.layers.fused import norm_then_gate_up, norm_then_linear
from batchgen.layers.linear import Linear
from batchgen.layers.norms import RMSNorm, rms_norm
from batchgen.layers.parallel_linear import (
    column_parallel_linear,
    gated_projections,
    row_parallel_linear,
    vocab_embedding,
)
from batchgen.layers.rotary import RotaryEmbedding, apply_rotary, rotary_embedding
from batchgen.layers.tensor_parallel import ShardPart, current
from batchgen.models.base import CausalLM
from batchgen.models.hf_config import HFConfig
from batchgen.models.weights import WeightTarget, fused_rows, load_into


def head_dim_of(config: HFConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def attention_heads(config: HFConfig) -> tuple[int, int, list[ShardPart]]:
    """The q and KV heads of the tensor-parallel rank being built, and its parts of the fused q/k/v rows."""
    tp = current()
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    heads = tp.attention_heads(num_heads, num_kv_heads)
    q, kv = tp.head_parts(heads, num_heads, num_kv_heads, head_dim_of(config))
    return heads.num_heads, heads.num_kv_heads, [q, kv, kv]


def norm_and_rotate(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                    norms: tuple[torch.Tensor, torch.Tensor, float] | None, cos: torch.Tensor,
                    sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's per-head q/k RMSNorm (norms: q weight, k weight, eps), then RoPE: one function, so that on CUDA
    torch.compile fuses them into one kernel."""
    if norms is not None:
        q_weight, k_weight, eps = norms
        q, k = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
    return apply_rotary(positions, q, k, cos, sin)


class LlamaAttention(nn.Module):
    # How the q/k norms compute (Gemma 3's attention overrides these three): the module, its torch function, and the
    # fused Triton kernel's variant of it.
    norm_class: ClassVar[type[nn.Module]] = RMSNorm
    norm_and_rotate: ClassVar[Callable] = staticmethod(norm_and_rotate)
    gemma_style_norms: ClassVar[bool] = False

    def __init__(self, config: HFConfig, rotary: RotaryEmbedding, qkv_bias: bool, qk_norm: bool,
                 sliding_window: int | None = None, scale: float | None = None,
                 softcap: float | None = None) -> None:
        """scale: the attention scores' (default head_dim ** -0.5); softcap: scores become
        softcap * tanh(score / softcap)."""
        super().__init__()
        # This tensor-parallel rank's heads (all of them with one rank).
        self.num_heads, self.num_kv_heads, parts = attention_heads(config)
        self.head_dim = head_dim_of(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = column_parallel_linear(config.hidden_size, parts, bias=qkv_bias)
        self.o_proj = row_parallel_linear(config.num_attention_heads * self.head_dim, config.hidden_size,
                                          bias=getattr(config, "attention_bias", False))
        if qk_norm:
            self.q_norm = self.norm_class(self.head_dim, config.rms_norm_eps)
            self.k_norm = self.norm_class(self.head_dim, config.rms_norm_eps)
        self.qk_norm = qk_norm
        self.rotary = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, scale or self.head_dim**-0.5,
                              sliding_window, softcap)
        self._norm_and_rotate = self.norm_and_rotate
        self._rotate_and_store = None  # the fused Triton op, once use_triton() is called

    def use_compiled(self) -> None:
        self._norm_and_rotate = compiled(self.norm_and_rotate)

    def use_triton(self) -> None:
        """q/k norm, RoPE and the K/V cache store as one Triton kernel, for CUDA inputs."""
        from batchgen.layers.rotary_triton import rotate_and_store

        self._rotate_and_store = rotate_and_store

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """qkv (T, (H + 2 * KVH) * D) -> (T, hidden): the decoder layer runs qkv_proj, fused with the norm before it."""
        num_tokens = qkv.shape[0]
        norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else None
        if self._rotate_and_store is not None and qkv.is_cuda:
            q = self._rotate_and_store(qkv, positions, self.rotary.cos, self.rotary.sin, norms, self.attn.k_cache,
                                       self.attn.v_cache, meta.slot_mapping, self.num_heads, self.num_kv_heads,
                                       gemma_style=self.gemma_style_norms)
            return self.o_proj(self.attn.attend(q, meta))  # (T, hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # (T, H, D)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # (T, KVH, D)
        q, k = self._norm_and_rotate(positions, q, k, norms, self.rotary.cos, self.rotary.sin)
        return self.o_proj(self.attn(q, k, v, meta))  # (T, hidden)


class LlamaMLP(nn.Module):
    def __init__(self, config: HFConfig) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj = gated_projections(config.hidden_size, config.intermediate_size,
                                                              getattr(config, "mlp_bias", False))
        self.act = SiluAndMul()

    def forward(self, norm: RMSNorm, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(down(silu(gate) * up) of norm(hidden + residual), hidden + residual): (T, hidden) each."""
        activated, residual = norm_then_gate_up(norm, self.gate_up_proj, self.act, hidden, residual)
        return self.down_proj(activated), residual


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: HFConfig, rotary: RotaryEmbedding, qkv_bias: bool, qk_norm: bool,
                 sliding_window: int | None = None, mlp: nn.Module | None = None) -> None:
        """mlp: the feed-forward block, called as LlamaMLP is (default: a LlamaMLP)."""
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary, qkv_bias, qk_norm, sliding_window)
        self.mlp = LlamaMLP(config) if mlp is None else mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is carried separately so each add fuses into the norm that follows it (and, on the
        Triton path, the norm into the projection after it)."""
        qkv, residual = norm_then_linear(self.input_layernorm, self.self_attn.qkv_proj, hidden, residual)
        hidden = self.self_attn(positions, qkv, meta)
        return self.mlp(self.post_attention_layernorm, hidden, residual)


class LlamaModel(nn.Module):
    def __init__(self, config: HFConfig, qkv_bias: bool, qk_norm: bool,
                 layer_mlp: Callable[[int], nn.Module] | None = None) -> None:
        """layer_mlp(layer index): that layer's feed-forward block (default: a LlamaMLP each)."""
        super().__init__()
        self.embed_tokens = vocab_embedding(config.vocab_size, config.hidden_size)
        # One cos/sin table shared by all layers: at 128k positions it is tens of MB.
        rotary = rotary_embedding(config, head_dim_of(config))
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, rotary, qkv_bias, qk_norm, window, layer_mlp(i) if layer_mlp else None)
            for i, window in enumerate(layer_sliding_windows(config))
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor | InputIdsWithPending, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None  # (T, hidden)
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, meta)
        return self.norm(hidden, residual)[0]


def layer_sliding_windows(config: HFConfig) -> list[int | None]:
    """Each layer's sliding window (None: full attention), as transformers decides it.

    Configs with `layer_types` (Qwen2/Qwen3: "sliding_attention" on layers >= max_window_layers when
    use_sliding_window is set, else none) name each layer's kind; others (Mistral) slide on every layer when
    `sliding_window` is set.
    """
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False:
        window = None
    num_layers = config.num_hidden_layers
    layer_types = getattr(config, "layer_types", None)
    if window is None:
        return [None] * num_layers
    if layer_types is None:
        return [window] * num_layers
    return [window if kind == "sliding_attention" else None for kind in layer_types]


class LlamaForCausalLM(CausalLM):
    decoder_name = "model"
    qkv_bias_always = False  # Qwen2 has q/k/v biases whatever config.attention_bias says
    qk_norm = False  # Qwen3 RMS-normalizes each head of q and k before RoPE

    def __init__(self, config: HFConfig) -> None:
        # qkv_bias: Qwen2-MoE's name for it
        qkv_bias = (self.qkv_bias_always or getattr(config, "attention_bias", False)
                    or getattr(config, "qkv_bias", False))
        decoder = LlamaModel(config, qkv_bias, self.qk_norm, partial(self.layer_mlp, config))
        super().__init__(config, decoder, decoder.embed_tokens if config.tie_word_embeddings else None)

    @classmethod
    def layer_mlp(cls, config: HFConfig, layer_index: int) -> nn.Module:
        """The feed-forward block of layer `layer_index`: forward(norm, hidden, residual) ->
        (output, hidden + residual), as LlamaMLP's."""
        return LlamaMLP(config)

    def weight_targets(self) -> dict[str, WeightTarget]:
        return llama_weight_targets(self)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_llama_weights(self.weight_targets(), weights, tied_lm_head=self.config.tie_word_embeddings)


def llama_weight_targets(network: nn.Module) -> dict[str, WeightTarget]:
    """Where each Hugging Face-named checkpoint tensor goes, q/k/v and gate/up packed into the fused projections."""
    targets: dict[str, WeightTarget] = {}
    for name, param in network.named_parameters():  # a tied lm_head is listed once, as embed_tokens
        if ".qkv_proj." in name:
            attn = network.model.layers[0].self_attn
            rows = fused_rows([attn.q_size, attn.kv_size, attn.kv_size])
            for shard, shard_rows in zip(("q_proj", "k_proj", "v_proj"), rows, strict=True):
                targets[name.replace("qkv_proj", shard)] = WeightTarget(param, shard_rows)
        elif ".gate_up_proj." in name:
            half = param.shape[0] // 2
            for shard, shard_rows in zip(("gate_proj", "up_proj"), fused_rows([half, half]), strict=True):
                targets[name.replace("gate_up_proj", shard)] = WeightTarget(param, shard_rows)
        else:
            targets[name] = WeightTarget(param)
    return targets


def load_llama_weights(targets: dict[str, WeightTarget], weights: Iterable[tuple[str, torch.Tensor]],
                       tied_lm_head: bool, skipped_heads: tuple[str, ...] = ()) -> None:
    """Loads Hugging Face-named tensors into their targets. skipped_heads: the checkpoint's head tensors the network
    has no use for."""

    def ignored(name: str) -> bool:
        return (name.endswith("rotary_emb.inv_freq") or (tied_lm_head and name == "lm_head.weight")
                or name in skipped_heads)

    def rename(name: str) -> str:
        """A bare decoder's checkpoint (sentence-transformers' Qwen3-Embedding, say) names its tensors without the
        "model." prefix."""
        return name if name.startswith(("model.", "lm_head.", "score.")) else f"model.{name}"

    load_into(targets, weights, ignored, rename)


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias_always = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True


def num_labels(config: HFConfig) -> int:
    """A classification checkpoint's label count: its id2label's size (transformers' num_labels), 2 without one."""
    id2label = getattr(config, "id2label", None)
    return len(id2label) if id2label else 2


class LlamaForEmbedding(nn.Module):
    """The decoder alone, for job.task=embed, whose final hidden states are pooled: from a causal LM's or a
    classifier's checkpoint (its head is not loaded) or a bare decoder's."""

    impl: ClassVar[str] = "native"  # as CausalLM's
    cuda_graphs: ClassVar[bool] = True
    qkv_bias_always = False
    qk_norm = False

    def __init__(self, config: HFConfig) -> None:
        super().__init__()
        self.config = config
        qkv_bias = self.qkv_bias_always or getattr(config, "attention_bias", False)
        self.model = LlamaModel(config, qkv_bias, self.qk_norm)

    def forward(self, input_ids: torch.Tensor | InputIdsWithPending, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:  # (T, hidden)
        return self.model(input_ids, positions, meta)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_llama_weights(llama_weight_targets(self), weights, tied_lm_head=False,
                           skipped_heads=("lm_head.weight", "score.weight"))


class MistralForEmbedding(LlamaForEmbedding):
    pass


class Qwen2ForEmbedding(LlamaForEmbedding):
    qkv_bias_always = True


class Qwen3ForEmbedding(LlamaForEmbedding):
    qk_norm = True


class LlamaForSequenceClassification(LlamaForEmbedding):
    """The decoder with transformers' `score` head (hidden -> num_labels, no bias) in place of the LM head: a
    classifier, or a reward model with one label. job.task=classify scores the last non-pad token's hidden state."""

    def __init__(self, config: HFConfig) -> None:
        super().__init__(config)
        self.score = Linear(config.hidden_size, num_labels(config), bias=False)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # (N, hidden) -> (N, num_labels)
        return self.score(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_llama_weights(llama_weight_targets(self), weights, tied_lm_head=False)


class MistralForSequenceClassification(LlamaForSequenceClassification):
    pass


class Qwen2ForSequenceClassification(LlamaForSequenceClassification):
    qkv_bias_always = True


class Qwen3ForSequenceClassification(LlamaForSequenceClassification):
    qk_norm = True
