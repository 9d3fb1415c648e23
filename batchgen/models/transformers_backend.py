"""The generic path: any causal LM transformers builds runs through its own modules, with batchgen's paged KV cache
and attention plugged in through transformers' attention interface.

batchgen registers an attention function (ATTENTION_IMPLEMENTATION) with transformers' AttentionInterface and builds
the model with it as `attn_implementation`. No attention mask function is registered under that name, so
transformers' mask creation returns None at once (masking_utils skips implementations it has no mask function for):
a step's flattened tokens go through the model as one batch of T tokens with their positions as `position_ids`,
and each attention call writes its K/V into the layer's paged cache and attends through layers/attention.py's ops
with the step's AttentionMetadata, which travels to the attention function as a keyword argument.

At build time one probe forward of two tokens records every attention call (module, heads, head_dim, scaling,
sliding window): each attending module gets an Attention layer of those sizes, which the model runner finds and
binds to the KV cache like a native model's. The same probe refuses, one line each, what the paged cache cannot
hold or the ops do not compute (layers that keep state of their own, soft-capping, attention sinks, ...), and checks
that compute_logits gives the logits the model's own forward gives.

The modules run eagerly: CUDA graphs are off for this path (docs/models.md says what that costs).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from transformers import AttentionInterface, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from batchgen.config import ModelConfig
from batchgen.layers.attention import Attention, AttentionMetadata
from batchgen.layers.embedding import InputIdsWithPending, token_ids

log = logging.getLogger(__name__)

ATTENTION_IMPLEMENTATION = "batchgen_paged"
METADATA_KWARG = "batchgen_attention_metadata"  # the step's AttentionMetadata, or the probe's list of calls
# Attention arguments that change what attention computes, which the paged ops do not implement.
UNSUPPORTED_ARGUMENTS = ("softcap", "s_aux", "sinks", "position_bias")
PROBE_TOKENS = 2


@dataclass(frozen=True)
class AttentionCall:
    """One call of the attention function, as the probe forward saw it."""

    module: nn.Module
    num_heads: int
    num_kv_heads: int
    head_dim: int
    value_head_dim: int
    scale: float
    sliding_window: int | None
    unsupported: tuple[str, ...]  # UNSUPPORTED_ARGUMENTS it was given (not None); "is_causal=False" if bidirectional


def paged_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention function signature over batchgen's paged KV cache: query (1, H, T, D), key and value
    (1, KVH, T, D) -> ((1, T, H, D), no attention weights). attention_mask is always None (no mask is built)."""
    step = kwargs.get(METADATA_KWARG)
    batch, num_heads, num_tokens, head_dim = query.shape
    if isinstance(step, list):  # the probe: record the call, attend to nothing
        unsupported = tuple(name for name in UNSUPPORTED_ARGUMENTS if kwargs.get(name) is not None)
        if kwargs.get("is_causal", getattr(module, "is_causal", True)) is False:  # an encoder's attention
            unsupported += ("is_causal=False",)
        step.append(AttentionCall(module, num_heads, key.shape[1], head_dim, value.shape[-1],
                                  head_dim**-0.5 if scaling is None else scaling, kwargs.get("sliding_window"),
                                  unsupported))
        return query.new_zeros(batch, num_tokens, num_heads, value.shape[-1]), None
    if not isinstance(step, AttentionMetadata):
        raise RuntimeError(f"{type(module).__name__} called batchgen's paged attention without the step's metadata")
    q = query[0].transpose(0, 1).contiguous()  # (T, H, D)
    k = key[0].transpose(0, 1).contiguous()  # (T, KVH, D)
    v = value[0].transpose(0, 1).contiguous()  # (T, KVH, D)
    out = module.paged_attention(q, k, v, step)  # (T, H * D)
    return out.view(1, num_tokens, num_heads, head_dim), None


AttentionInterface.register(ATTENTION_IMPLEMENTATION, paged_attention)


class TransformersCausalLM(nn.Module):
    """A transformers causal LM behind batchgen's model interface: forward over a step's flattened tokens, the
    lm_head (and the logit scaling its forward applies) over chosen rows."""

    impl: ClassVar[str] = "transformers"
    # Arbitrary modules may synchronize with the host or keep Python-side state that a replayed graph would not see.
    cuda_graphs: ClassVar[bool] = False

    def __init__(self, network: PreTrainedModel) -> None:
        """network: built with attn_implementation=ATTENTION_IMPLEMENTATION, its weights in place, on its device."""
        super().__init__()
        self.network = network
        self.config = network.config
        self.architecture = type(network).__name__
        if network.base_model is network or network.get_output_embeddings() is None:
            raise ValueError(f"architecture {self.architecture} has no decoder and lm_head apart, which batchgen's "
                             "generic path runs separately")
        scale = getattr(self.config, "logit_scale", None) or 1.0  # Cohere multiplies the logits
        self.logit_scale = scale / (getattr(self.config, "logits_scaling", None) or 1.0)  # Granite divides them
        self.logit_softcap: float | None = getattr(self.config, "final_logit_softcapping", None)
        calls = self._probe()
        for call in calls:
            # Each attending module carries its own layer: transformers hands the attention function the module.
            call.module.paged_attention = Attention(call.num_heads, call.num_kv_heads, call.head_dim, call.scale,
                                                    call.sliding_window)

    @property
    def lm_head(self) -> nn.Module:
        return self.network.get_output_embeddings()

    def forward(self, input_ids: torch.Tensor | InputIdsWithPending, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:  # (T,) int64 ids and positions -> (T, hidden)
        output = self.network.base_model(input_ids=token_ids(input_ids)[None], position_ids=positions[None],
                                         use_cache=False, **{METADATA_KWARG: meta})
        return output.last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # (N, hidden) -> (N, vocab)
        logits = self.lm_head(hidden)
        if self.logit_scale != 1.0:
            logits = logits * self.logit_scale
        if self.logit_softcap is not None:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits

    @torch.no_grad()
    def _probe(self) -> list[AttentionCall]:
        """The attention calls of one forward, checked to be what the paged cache and ops can run; and
        compute_logits checked against the model's own logits on the same (zero-attention) forward."""
        device = next(self.network.parameters()).device
        ids = torch.zeros(1, PROBE_TOKENS, dtype=torch.int64, device=device)
        positions = torch.arange(PROBE_TOKENS, device=device)[None]
        calls: list[AttentionCall] = []
        logits = self.network(input_ids=ids, position_ids=positions, use_cache=False, **{METADATA_KWARG: calls}).logits
        self._check_calls(calls)
        hidden = self.network.base_model(input_ids=ids, position_ids=positions, use_cache=False,
                                         **{METADATA_KWARG: []}).last_hidden_state
        ours = self.compute_logits(hidden[0]).float()
        expected = logits[0].float()
        if not torch.allclose(ours, expected, rtol=1e-3, atol=1e-3 * max(float(expected.abs().max()), 1.0)):
            raise ValueError(f"architecture {self.architecture} computes its logits in a way batchgen's generic path "
                             "does not reproduce (its forward does more than the lm_head and the logit scaling)")
        return calls

    def _check_calls(self, calls: list[AttentionCall]) -> None:
        name = self.architecture
        if not calls:
            raise ValueError(f"architecture {name} does not attend through transformers' attention interface, which "
                             "batchgen's generic path plugs its KV cache into")
        if len({id(call.module) for call in calls}) < len(calls):
            raise ValueError(f"architecture {name} runs one attention module in several layers; batchgen's KV cache "
                             "holds one layer per module")
        num_layers = getattr(self.config.get_text_config(), "num_hidden_layers", None)
        if num_layers is not None and len(calls) != num_layers:
            raise ValueError(f"architecture {name}: {len(calls)} of its {num_layers} layers attend through "
                             "transformers' attention interface; the others keep state batchgen's KV cache cannot "
                             "hold")
        if unsupported := sorted({arg for call in calls for arg in call.unsupported}):
            raise ValueError(f"architecture {name}'s attention uses {', '.join(unsupported)}, which batchgen's paged "
                             "attention does not compute")
        shapes = {(call.num_kv_heads, call.head_dim, call.value_head_dim) for call in calls}
        if len(shapes) > 1 or any(head_dim != value_dim for _, head_dim, value_dim in shapes):
            raise ValueError(f"architecture {name} has (kv heads, key dim, value dim) {sorted(shapes)} across its "
                             "layers; batchgen's KV cache holds one shape, alike for keys and values")
        window = getattr(self.config, "sliding_window", None)
        layer_types = set(getattr(self.config, "layer_types", None) or ())
        if layer_types - {"full_attention", "sliding_attention"}:
            raise ValueError(f"architecture {name} has layers of types {sorted(layer_types)}; batchgen's generic path "
                             "runs full_attention and sliding_attention layers")
        declares_window = window is not None and (not layer_types or "sliding_attention" in layer_types)
        if declares_window and all(call.sliding_window is None for call in calls):
            raise ValueError(f"architecture {name} declares sliding_window={window} but does not pass it to the "
                             "attention function, which batchgen's paged attention needs to apply it")


def build_transformers_model(model: ModelConfig, hf_config: PretrainedConfig, dtype: torch.dtype,
                             device: torch.device) -> TransformersCausalLM:
    """transformers' causal LM for hf_config with batchgen's attention, on `device` in `dtype`: random weights
    (transformers' own initialization, seeded) for model.load_format=dummy, else the checkpoint's safetensors weights
    read by transformers itself, so that its conversions of checkpoint names and layouts apply as they do there.
    Never runs code from the model directory; never reads pickles."""
    cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)]
    if not cls._supports_attention_backend:  # transformers' flag for models that attend through the interface
        raise ValueError(f"architecture {cls.__name__} does not attend through transformers' attention interface, "
                         "which batchgen's generic path plugs its KV cache into")
    options = dict(config=hf_config, dtype=dtype, attn_implementation=ATTENTION_IMPLEMENTATION, trust_remote_code=False)
    if model.load_format == "dummy":
        torch.manual_seed(0)
        with torch.device(device):
            network = AutoModelForCausalLM.from_config(**options)
    else:
        # Without the accelerate package, from_pretrained loads onto the CPU only: one host copy, then the device.
        network = AutoModelForCausalLM.from_pretrained(model.path, use_safetensors=True, **options).to(device)
    network.eval()
    network.requires_grad_(False)
    return TransformersCausalLM(network)
