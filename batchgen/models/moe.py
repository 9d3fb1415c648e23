"""Mixture-of-experts decoders: Mixtral, Qwen3-MoE and Qwen2-MoE.

Llama's attention and decoder layer (models/llama.py) with a sparse feed-forward block on the layers that have one:
a router (`gate`) picks each token's top_k experts (layers/moe.py). Qwen3-MoE adds Qwen3's q/k norms; Qwen2-MoE adds
a shared expert that every token runs, weighted by sigmoid(shared_expert_gate(x)). Qwen's `decoder_sparse_step` and
`mlp_only_layers` leave some layers a dense MLP.

Checkpoints store each expert's projections apart (as on the Hub, and as transformers' save_pretrained writes them):
`<layer>.block_sparse_moe.experts.<e>.w1/w3/w2` (Mixtral: gate, up, down) or
`<layer>.mlp.experts.<e>.gate_proj/up_proj/down_proj` (Qwen). They load into the layer's stacked parameters, and an
fp8 checkpoint's `<projection>.weight_scale` of each expert into the stacked scales of fp8 experts
(layers/fp8_loading.py). The routers stay in the model's dtype under fp8.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from batchgen.layers.activation import SiluAndMul
from batchgen.layers.linear import Linear
from batchgen.layers.moe import StackedExperts
from batchgen.layers.norms import RMSNorm
from batchgen.layers.parallel_linear import gated_projections
from batchgen.layers.tensor_parallel import current
from batchgen.models.hf_config import HFConfig
from batchgen.models.llama import LlamaForCausalLM, LlamaMLP
from batchgen.models.weights import WeightTarget


class SharedExpert(nn.Module):
    """Qwen2-MoE's always-on expert: down(silu(gate(x)) * up(x)) with gate and up fused. With tensor parallelism its
    output is this rank's partial sum, which MoeMLP's one all-reduce adds up with the experts'."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj = gated_projections(hidden_size, intermediate_size, reduce=False)
        self.act = SiluAndMul()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # (T, H) -> (T, H)
        return self.down_proj(self.act(self.gate_up_proj(hidden)))


class MoeMLP(nn.Module):
    """A decoder layer's sparse feed-forward block, called as LlamaMLP is. With tensor parallelism each rank holds
    its 1/size of every expert's intermediate dimension (and of the shared expert's); the router is replicated, and
    one all-reduce sums the ranks' partial outputs."""

    # Routers stay in the model's dtype under fp8 (layers/fp8_loading.py), as fp8 checkpoints leave them: a rounded
    # router logit may pick another expert, and the routers are a sliver of the weights.
    unquantized_linears: ClassVar[tuple[str, ...]] = ("gate", "shared_expert_gate")

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, renormalize: bool,
                 shared_expert_size: int | None = None) -> None:
        """renormalize: the top_k weights are divided by their sum; shared_expert_size: the intermediate size of
        Qwen2-MoE's shared expert, None for none."""
        super().__init__()
        self.tp = current()
        self.gate = Linear(hidden_size, num_experts, bias=False)  # the router
        part = self.tp.even_part(intermediate_size)
        self.experts = StackedExperts(num_experts, hidden_size, part.size, top_k, renormalize)
        self.tp.mark(self.experts.gate_up_proj, 0, part, part)  # of each expert: its gate rows, then its up rows
        self.tp.mark(self.experts.down_proj, 1, part)
        self.shared_expert = None if shared_expert_size is None else SharedExpert(hidden_size, shared_expert_size)
        self.shared_expert_gate = None if shared_expert_size is None else Linear(hidden_size, 1, bias=False)

    def forward(self, norm: RMSNorm, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the experts' output for norm(hidden + residual), hidden + residual): (T, hidden) each."""
        normed, residual = (norm(hidden), hidden) if residual is None else norm(hidden, residual)
        out = self.experts(normed, self.gate(normed))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(normed)) * self.shared_expert(normed)
        return self.tp.all_reduce(out), residual


class MoeForCausalLM(LlamaForCausalLM):
    """What the MoE architectures share: the check of the activation and the per-expert checkpoint names."""

    moe_checkpoint_name: ClassVar[str] = "mlp"  # the sparse block's name in checkpoints
    expert_checkpoint_names: ClassVar[tuple[str, str, str]] = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, config: HFConfig) -> None:
        if config.hidden_act != "silu":
            raise ValueError(f"{type(self).__name__} with hidden_act={config.hidden_act!r} is not supported; "
                             "supported: silu")
        super().__init__(config)

    def weight_targets(self) -> dict[str, WeightTarget]:
        """Llama's, with each stacked expert parameter filled by its experts' checkpoint tensors (fp8 experts: their
        weight scales too, `<expert>.<projection>.weight_scale`)."""
        targets = super().weight_targets()
        gate_name, up_name, down_name = self.expert_checkpoint_names
        for name, experts in self.named_modules():
            if not isinstance(experts, StackedExperts):
                continue
            block = name.removesuffix(".experts")  # model.layers.<i>.mlp
            checkpoint_block = f"{block.removesuffix('.mlp')}.{self.moe_checkpoint_name}"
            targets[f"{checkpoint_block}.gate.weight"] = targets.pop(f"{block}.gate.weight")
            half = experts.gate_up_proj.shape[1] // 2
            stacks = {"weight": (experts.gate_up_proj, experts.down_proj)}
            if experts.fp8:
                stacks["weight_scale"] = (experts.gate_up_proj_scale, experts.down_proj_scale)
            for tensor_name, (gate_up, down) in stacks.items():
                suffix = tensor_name.removeprefix("weight")  # the stacked parameters' names: "" or "_scale"
                del targets[f"{name}.gate_up_proj{suffix}"], targets[f"{name}.down_proj{suffix}"]
                for expert in range(experts.num_experts):
                    prefix = f"{checkpoint_block}.experts.{expert}"
                    targets[f"{prefix}.{gate_name}.{tensor_name}"] = WeightTarget(gate_up, slice(0, half),
                                                                                  expert=expert)
                    targets[f"{prefix}.{up_name}.{tensor_name}"] = WeightTarget(gate_up, slice(half, 2 * half),
                                                                                expert=expert)
                    targets[f"{prefix}.{down_name}.{tensor_name}"] = WeightTarget(down, expert=expert)
        return targets


class MixtralForCausalLM(MoeForCausalLM):
    moe_checkpoint_name = "block_sparse_moe"
    expert_checkpoint_names = ("w1", "w3", "w2")

    @classmethod
    def layer_mlp(cls, config: HFConfig, layer_index: int) -> nn.Module:
        return MoeMLP(config.hidden_size, config.num_local_experts, config.num_experts_per_tok,
                      config.intermediate_size, renormalize=True)


def is_sparse_layer(config: HFConfig, layer_index: int) -> bool:
    """Whether a Qwen MoE layer has experts (else a dense MLP of intermediate_size), as transformers decides."""
    mlp_only_layers = getattr(config, "mlp_only_layers", None) or []
    return (layer_index not in mlp_only_layers and config.num_experts > 0
            and (layer_index + 1) % config.decoder_sparse_step == 0)


def qwen_moe_mlp(config: HFConfig, layer_index: int, shared_expert_size: int | None) -> nn.Module:
    if not is_sparse_layer(config, layer_index):
        return LlamaMLP(config)
    return MoeMLP(config.hidden_size, config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                  config.norm_topk_prob, shared_expert_size)


class Qwen3MoeForCausalLM(MoeForCausalLM):
    qk_norm = True

    @classmethod
    def layer_mlp(cls, config: HFConfig, layer_index: int) -> nn.Module:
        return qwen_moe_mlp(config, layer_index, shared_expert_size=None)


class Qwen2MoeForCausalLM(MoeForCausalLM):
    @classmethod
    def layer_mlp(cls, config: HFConfig, layer_index: int) -> nn.Module:
        return qwen_moe_mlp(config, layer_index, config.shared_expert_intermediate_size)
