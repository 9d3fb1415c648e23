"""Mixture-of-experts feed-forward: a router scores E experts per token, the top_k of them run, and their outputs are
summed weighted by the router's probabilities.

Routing (`route`) is a softmax over all experts in float32, then the top_k probabilities, renormalized to sum to one
where the checkpoint asks for it (Mixtral always; Qwen2-MoE and Qwen3-MoE when `norm_topk_prob`).

Each layer's experts are stacked into two parameters, gate/up (E, 2 * I, H) with the gate rows first, and down
(E, H, I), which checkpoints fill one expert at a time. On CUDA, `moe_triton` runs routing and experts as one grouped
GEMM per projection (no host sync, so also inside CUDA graphs); elsewhere `experts_reference` runs each expert's tokens
in torch.

Both paths round at the same points: the projections' outputs and silu(gate) * up in the model's dtype, each
expert's output times its float32 routing weight once more, a token's top_k contributions summed in float32 and
rounded. transformers adds the contributions in the model's dtype instead (and Qwen's blocks round the weights to it
first): the same in float32, within a rounding in bf16.

fp8 experts (model.quantization=fp8, or an fp8 checkpoint; layers/fp8_loading.py builds them) hold both weights in
float8_e4m3fn with one float32 scale per (expert, output row), as Fp8Linear does: the kernels upcast each weight tile
as they read it and scale each output's fp32 sum (weight-only fp8: the activations stay in the model's dtype).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import ModuleType
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from batchgen.layers.activation import silu_and_mul
from batchgen.layers.fp8 import FP8_DTYPE, dequantize, quantize_per_channel


class Routing(NamedTuple):
    weights: torch.Tensor  # (T, top_k) float32: each chosen expert's probability, renormalized or not
    expert_ids: torch.Tensor  # (T, top_k) int64: the chosen experts, most probable first


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> Routing:
    """(T, E) router logits -> each token's top_k experts and their weights."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(weights, expert_ids)


def experts_reference(hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                      routing: Routing) -> torch.Tensor:
    """sum_j weight_j * down_e(silu(gate_e(x)) * up_e(x)) over each token's chosen experts e = expert_ids[:, j]:
    (T, H) -> (T, H), computed expert by expert over the (token, j) pairs routed to each (host syncs: CPU only)."""
    num_tokens, top_k = routing.expert_ids.shape
    hidden_size = hidden.shape[1]
    flat_experts = routing.expert_ids.flatten()  # (T * top_k,): pair p is token p // top_k's j = p % top_k
    flat_weights = routing.weights.flatten()
    order = torch.argsort(flat_experts, stable=True)
    counts = torch.bincount(flat_experts, minlength=gate_up.shape[0]).tolist()
    contributions = hidden.new_empty(num_tokens * top_k, hidden_size)
    for expert, pairs in enumerate(order.split(counts)):
        if not len(pairs):
            continue
        activated = silu_and_mul(F.linear(hidden[pairs // top_k], gate_up[expert]))
        out = F.linear(activated, down[expert])
        contributions[pairs] = (out.float() * flat_weights[pairs, None]).to(hidden.dtype)
    return contributions.view(num_tokens, top_k, hidden_size).float().sum(dim=1).to(hidden.dtype)


class StackedExperts(nn.Module):
    """E experts' gate/up and down projections as two stacked parameters (the names transformers 5 uses in memory),
    and the routing of each token to top_k of them.

    Inputs on CUDA take the fused Triton kernels (routing included); `use_kernel_on("cpu")` sends CPU inputs there
    too, for tests under TRITON_INTERPRET=1.

    fp8: the weights are float8_e4m3fn, and `gate_up_proj_scale` (E, 2I) and `down_proj_scale` (E, H) hold each
    row's float32 scale; dtype stays the model's, that of the inputs and outputs.
    """

    WEIGHTS: ClassVar[tuple[str, str]] = ("gate_up_proj", "down_proj")  # each fp8 one's scales: `<name>_scale`

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, top_k: int, renormalize: bool,
                 fp8: bool = False, dtype: torch.dtype | None = None, device: torch.device | None = None) -> None:
        """dtype, device: the model's (default: torch's defaults, which the loader sets while it builds the model)."""
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, {num_experts}] (the number of experts)")
        self.top_k = top_k
        self.renormalize = renormalize
        self.dtype = dtype or torch.get_default_dtype()
        weight_dtype = FP8_DTYPE if fp8 else self.dtype
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=weight_dtype, device=device),
            requires_grad=not fp8)
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size, dtype=weight_dtype, device=device),
            requires_grad=not fp8)
        self.gate_up_proj_scale = self.down_proj_scale = None
        if fp8:
            self.gate_up_proj_scale = nn.Parameter(
                torch.ones(num_experts, 2 * intermediate_size, dtype=torch.float32, device=device), requires_grad=False)
            self.down_proj_scale = nn.Parameter(
                torch.ones(num_experts, hidden_size, dtype=torch.float32, device=device), requires_grad=False)
        self._kernel_device_type = "cuda"
        self._kernels: ModuleType | None = None  # batchgen.layers.moe_triton, imported at the first kernel input

    @property
    def num_experts(self) -> int:
        return self.gate_up_proj.shape[0]

    @property
    def fp8(self) -> bool:
        return self.gate_up_proj.dtype == FP8_DTYPE

    def like(self, fp8: bool) -> StackedExperts:
        """A layer of this one's sizes, routing, model dtype and device, with fp8 weights or not, not yet filled."""
        num_experts, hidden_size, intermediate_size = self.down_proj.shape
        return StackedExperts(num_experts, hidden_size, intermediate_size, self.top_k, self.renormalize, fp8=fp8,
                              dtype=self.dtype, device=self.gate_up_proj.device)

    @torch.no_grad()
    def quantized(self, amax: Mapping[str, torch.Tensor | None] | None = None) -> StackedExperts:
        """This layer with its weights quantized per (expert, output row), an expert at a time (the float32 copy of
        one expert's weight, not of the whole stack, is what quantizing adds to memory). amax: by weight name, the
        (E, rows) absolute maxima of whole rows where this layer holds part of each (quantize_per_channel's)."""
        amax = amax or {}
        layer = self.like(fp8=True)
        for name in self.WEIGHTS:
            rows_amax = amax.get(name)
            for expert, weight in enumerate(getattr(self, name)):
                values, scale = quantize_per_channel(weight, None if rows_amax is None else rows_amax[expert])
                getattr(layer, name)[expert].copy_(values)
                getattr(layer, f"{name}_scale")[expert].copy_(scale)
        return layer

    @torch.no_grad()
    def dequantized(self) -> StackedExperts:
        """This fp8 layer with its weights in the model's dtype."""
        layer = self.like(fp8=False)
        for name in self.WEIGHTS:
            scales = getattr(self, f"{name}_scale")
            for expert, weight in enumerate(getattr(self, name)):
                getattr(layer, name)[expert].copy_(dequantize(weight, scales[expert], self.dtype))
        return layer

    def use_kernel_on(self, device_type: str) -> None:
        self._kernel_device_type = device_type

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """(T, H) hidden states and their (T, E) router logits -> (T, H)."""
        if hidden.device.type == self._kernel_device_type:
            if self._kernels is None:
                from batchgen.layers import moe_triton  # Triton only where the kernels run

                self._kernels = moe_triton
            return self._kernels.sparse_moe(hidden, router_logits, self.gate_up_proj, self.down_proj, self.top_k,
                                            self.renormalize, self.gate_up_proj_scale, self.down_proj_scale)
        routing = route(router_logits, self.top_k, self.renormalize)
        if self.fp8:  # tests only: where the kernels do not run, the loader dequantizes fp8 experts
            return experts_reference(hidden, dequantize(self.gate_up_proj, self.gate_up_proj_scale, hidden.dtype),
                                     dequantize(self.down_proj, self.down_proj_scale, hidden.dtype), routing)
        return experts_reference(hidden, self.gate_up_proj, self.down_proj, routing)
