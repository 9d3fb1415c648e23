"""GPT-2: learned position embeddings, pre-LayerNorm blocks, fused c_attn, lm_head tied to the token embeddings."""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from batchgen.layers.attention import Attention, AttentionMetadata
from batchgen.layers.embedding import InputIdsWithPending, token_ids
from batchgen.layers.parallel_linear import column_parallel_linear, row_parallel_linear, vocab_embedding
from batchgen.layers.tensor_parallel import current
from batchgen.models.base import CausalLM
from batchgen.models.hf_config import HFConfig
from batchgen.models.weights import WeightTarget, load_into

ACTIVATIONS = {
    "gelu_new": partial(F.gelu, approximate="tanh"),
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "gelu_fast": partial(F.gelu, approximate="tanh"),
    "gelu": F.gelu,
}
CONV1D_LAYERS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")  # HF stores these weights as (in, out)


def _is_conv1d_weight(name: str) -> bool:
    return name.endswith(".weight") and any(f".{layer}." in name for layer in CONV1D_LAYERS)


def _check_supported(config: HFConfig) -> None:
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
        if getattr(config, flag, False):
            raise ValueError(f"GPT-2 with {flag}=True is not supported")
    if config.activation_function not in ACTIVATIONS:
        raise ValueError(
            f"GPT-2 activation_function {config.activation_function!r} is not supported; "
            f"supported: {', '.join(ACTIVATIONS)}"
        )


class GPT2Attention(nn.Module):
    def __init__(self, config: HFConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        num_heads = config.num_attention_heads
        head_dim = hidden // num_heads
        scale = head_dim**-0.5 if config.scale_attn_weights else 1.0
        tp = current()
        heads = tp.attention_heads(num_heads, num_heads)  # this tensor-parallel rank's
        q, kv = tp.head_parts(heads, num_heads, num_heads, head_dim)
        self.c_attn = column_parallel_linear(hidden, [q, kv, kv])
        self.c_proj = row_parallel_linear(hidden, hidden)
        self.attn = Attention(heads.num_heads, heads.num_heads, head_dim, scale)

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:  # (T, E) -> (T, E)
        q, k, v = self.c_attn(hidden).chunk(3, dim=-1)  # (T, E) each
        return self.c_proj(self.attn(q, k, v, meta))


class GPT2MLP(nn.Module):
    def __init__(self, config: HFConfig) -> None:
        super().__init__()
        inner = config.n_inner or 4 * config.hidden_size
        self.c_fc = column_parallel_linear(config.hidden_size, [current().even_part(inner)])
        self.c_proj = row_parallel_linear(inner, config.hidden_size)
        self.act = ACTIVATIONS[config.activation_function]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # (T, E) -> (T, E)
        return self.c_proj(self.act(self.c_fc(hidden)))


class GPT2Block(nn.Module):
    def __init__(self, config: HFConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.attn = GPT2Attention(config)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.mlp = GPT2MLP(config)

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = hidden + self.attn(self.ln_1(hidden), meta)
        return hidden + self.mlp(self.ln_2(hidden))


class GPT2Model(nn.Module):
    def __init__(self, config: HFConfig) -> None:
        super().__init__()
        self.wte = vocab_embedding(config.vocab_size, config.hidden_size, nn.Embedding)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList(GPT2Block(config) for _ in range(config.num_hidden_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(self, input_ids: torch.Tensor | InputIdsWithPending, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.wte(token_ids(input_ids)) + self.wpe(positions)  # (T, E)
        for block in self.h:
            hidden = block(hidden, meta)
        return self.ln_f(hidden)


class GPT2LMHeadModel(CausalLM):
    decoder_name = "transformer"

    def __init__(self, config: HFConfig) -> None:
        _check_supported(config)
        decoder = GPT2Model(config)
        super().__init__(config, decoder, decoder.wte)  # GPT-2 always ties them

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Loads Hugging Face-named tensors, with or without the "transformer." prefix (the original checkpoints
        have none), transposing the Conv1D weights."""
        targets = {  # the tied lm_head is listed once, as wte
            name: WeightTarget(param, transpose=_is_conv1d_weight(name)) for name, param in self.named_parameters()
        }

        def rename(name: str) -> str:
            return name if name.startswith(("transformer.", "lm_head.")) else f"transformer.{name}"

        def ignored(name: str) -> bool:
            # attn.bias / attn.masked_bias are the causal-mask buffers older checkpoints saved.
            return name.endswith((".attn.bias", ".attn.masked_bias")) or name == "lm_head.weight"

        load_into(targets, weights, ignored, rename)
