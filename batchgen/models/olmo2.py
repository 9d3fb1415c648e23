"""OLMo 2 (Olmo2ForCausalLM): RMSNorm on the outputs of attention and of the MLP, before each joins the residual
stream, and none before them; q and k RMS-normalized over the whole projection (all heads at once), not per head.

Neither fits the fused paths of the Llama family, so none is taken: the norm before qkv_proj and gate_up_proj that
layers/fused.py folds into the projection does not exist here, and the fused q/k-norm + RoPE + K/V-store kernel
normalizes each head alone. The projections still take the Triton GEMV and SiLU-and-mul on CUDA (same math).
The norms round as transformers' Olmo2RMSNorm does (weight multiplied in float32, one rounding at the end), and
RoPE rotates in float32 (its cos/sin tables are never cast to the model dtype).
"""

from __future__ import annotations

import torch
from torch import nn

from batchgen.layers.activation import SiluAndMul
from batchgen.layers.attention import Attention, AttentionMetadata
from batchgen.layers.compiled import compiled
from batchgen.layers.embedding import InputIdsWithPending
from batchgen.layers.parallel_linear import (
    column_parallel_linear,
    gated_projections,
    row_parallel_linear,
    vocab_embedding,
)
from batchgen.layers.rotary import RotaryEmbedding, apply_rotary, rotary_embedding
from batchgen.layers.tensor_parallel import current
from batchgen.models.base import CausalLM
from batchgen.models.hf_config import HFConfig
from batchgen.models.llama import LlamaForCausalLM, attention_heads, head_dim_of


def olmo2_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   mean_square: torch.Tensor | None = None) -> torch.Tensor:  # (..., dim) -> (..., dim)
    """mean_square (..., 1) float32: of the whole projection, where x is a tensor-parallel rank's part of it."""
    x_float = x.float()
    if mean_square is None:
        mean_square = x_float.pow(2).mean(dim=-1, keepdim=True)
    normed = x_float * torch.rsqrt(mean_square + eps)
    return (weight * normed).to(x.dtype)


class Olmo2RMSNorm(nn.Module):
    """RMSNorm rounded once, after the weight; no Triton kernel (the one in elementwise_triton rounds before it)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self._norm = olmo2_rms_norm

    def use_compiled(self) -> None:
        self._norm = compiled(olmo2_rms_norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm(x, self.weight, self.eps)


def norm_whole_and_rotate(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                          k_weight: torch.Tensor, eps: float, head_dim: int, cos: torch.Tensor, sin: torch.Tensor,
                          mean_squares: tuple[torch.Tensor, torch.Tensor] | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """q (T, H * D) and k (T, KVH * D) RMS-normalized over all their heads, then rotated in float32: (T, H, D) and
    (T, KVH, D). One function, so that torch.compile fuses it into one kernel. mean_squares: of the whole q and k,
    (T, 1) each, where q and k are a tensor-parallel rank's heads."""
    num_tokens = q.shape[0]
    q_mean_square, k_mean_square = mean_squares or (None, None)
    q = olmo2_rms_norm(q, q_weight, eps, q_mean_square).view(num_tokens, -1, head_dim)
    k = olmo2_rms_norm(k, k_weight, eps, k_mean_square).view(num_tokens, -1, head_dim)
    q_rotated, k_rotated = apply_rotary(positions, q.float(), k.float(), cos, sin)
    return q_rotated.to(q.dtype), k_rotated.to(k.dtype)


class Olmo2Attention(nn.Module):
    def __init__(self, config: HFConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.tp = current()
        self.num_heads, self.num_kv_heads, parts = attention_heads(config)
        self.head_dim = head_dim_of(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = getattr(config, "attention_bias", False)
        self.qkv_proj = column_parallel_linear(config.hidden_size, parts, bias=bias)
        self.o_proj = row_parallel_linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = Olmo2RMSNorm(self.q_size, config.rms_norm_eps)
        self.k_norm = Olmo2RMSNorm(self.kv_size, config.rms_norm_eps)
        q_part, kv_part, _ = parts
        self.tp.mark(self.q_norm.weight, 0, q_part)
        self.tp.mark(self.k_norm.weight, 0, kv_part)
        self.whole_sizes = (q_part.full, kv_part.full)
        self.kv_replicas = self.tp.size * kv_part.size // kv_part.full  # ranks holding each KV head
        self.rotary = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)
        self._norm_and_rotate = norm_whole_and_rotate

    def use_compiled(self) -> None:
        self._norm_and_rotate = compiled(norm_whole_and_rotate)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        mean_squares = self._whole_mean_squares(q, k) if self.tp.size > 1 else None
        q, k = self._norm_and_rotate(positions, q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                                     self.head_dim, self.rotary.cos, self.rotary.sin, mean_squares)
        return self.o_proj(self.attn(q, k, v, meta))  # (T, hidden)

    def _whole_mean_squares(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The mean squares of the whole q and k projections, (T, 1) each, from every rank's heads by one all-reduce
        (a KV head that several ranks hold counts once)."""
        sums = torch.stack([q.float().pow(2).sum(-1), k.float().pow(2).sum(-1) / self.kv_replicas], dim=-1)
        means = self.tp.all_reduce(sums) / torch.tensor(self.whole_sizes, dtype=torch.float32, device=sums.device)
        return means[:, :1], means[:, 1:]


class Olmo2MLP(nn.Module):
    def __init__(self, config: HFConfig) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj = gated_projections(config.hidden_size, config.intermediate_size)
        self.act = SiluAndMul()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(hidden)))


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, config: HFConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = Olmo2Attention(config, rotary)
        self.mlp = Olmo2MLP(config)
        self.post_attention_layernorm = Olmo2RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = Olmo2RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = hidden + self.post_attention_layernorm(self.self_attn(positions, hidden, meta))
        return hidden + self.post_feedforward_layernorm(self.mlp(hidden))


class Olmo2Model(nn.Module):
    def __init__(self, config: HFConfig) -> None:
        super().__init__()
        self.embed_tokens = vocab_embedding(config.vocab_size, config.hidden_size)
        rotary = rotary_embedding(config, head_dim_of(config))  # one table shared by all layers
        self.layers = nn.ModuleList(Olmo2DecoderLayer(config, rotary) for _ in range(config.num_hidden_layers))
        self.norm = Olmo2RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor | InputIdsWithPending, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # (T, hidden)
        for layer in self.layers:
            hidden = layer(positions, hidden, meta)
        return self.norm(hidden)


class Olmo2ForCausalLM(CausalLM):
    decoder_name = "model"

    def __init__(self, config: HFConfig) -> None:
        decoder = Olmo2Model(config)
        super().__init__(config, decoder, decoder.embed_tokens if config.tie_word_embeddings else None)

    # The checkpoint names are Llama's: q/k/v and gate/up packed into the fused projections alike.
    weight_targets = LlamaForCausalLM.weight_targets
    load_weights = LlamaForCausalLM.load_weights
