"""Mixture-of-experts routing against transformers' routers, and the torch expert reference against a token-by-token
loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import MixtralConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from batchgen.layers.moe import Routing, StackedExperts, experts_reference, route


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("renormalize", [True, False])
def test_route_matches_transformers_routers(renormalize: bool) -> None:
    """Mixtral always renormalizes the top_k probabilities; Qwen3-MoE only with norm_topk_prob."""
    hidden = torch.randn(9, 16, generator=_generator(0))
    if renormalize:
        router = MixtralTopKRouter(MixtralConfig(hidden_size=16, num_local_experts=8, num_experts_per_tok=3))
    else:
        router = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=3,
                                                   norm_topk_prob=False))
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, 16, generator=_generator(1)))
        logits, expected_weights, expected_ids = router(hidden)
    routing = route(logits, top_k=3, renormalize=renormalize)
    assert torch.equal(routing.expert_ids, expected_ids)
    torch.testing.assert_close(routing.weights, expected_weights.float(), rtol=0, atol=0)
    assert torch.allclose(routing.weights.sum(-1), torch.ones(9)) == renormalize


def _naive_experts(hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                   routing: Routing) -> torch.Tensor:
    """Token by token, expert by expert, as the formula reads."""
    rows = []
    for token, (weights, experts) in enumerate(zip(routing.weights, routing.expert_ids, strict=True)):
        total = torch.zeros(hidden.shape[1])
        for weight, expert in zip(weights.tolist(), experts.tolist(), strict=True):
            gate, up = F.linear(hidden[token], gate_up[expert]).chunk(2)
            total += weight * F.linear(F.silu(gate) * up, down[expert])
        rows.append(total)
    return torch.stack(rows) if rows else hidden.new_empty(0, hidden.shape[1])


@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k"), [(0, 4, 2), (1, 4, 1), (7, 4, 2), (33, 16, 4),
                                                                   (5, 8, 8)])
def test_experts_reference_matches_a_token_by_token_loop(num_tokens: int, num_experts: int, top_k: int) -> None:
    gen = _generator(num_tokens * 100 + num_experts)
    hidden_size, intermediate = 24, 20
    hidden = torch.randn(num_tokens, hidden_size, generator=gen)
    gate_up = torch.randn(num_experts, 2 * intermediate, hidden_size, generator=gen) * hidden_size**-0.5
    down = torch.randn(num_experts, hidden_size, intermediate, generator=gen) * intermediate**-0.5
    routing = route(torch.randn(num_tokens, num_experts, generator=gen), top_k, renormalize=True)
    out = experts_reference(hidden, gate_up, down, routing)
    assert out.shape == (num_tokens, hidden_size)
    torch.testing.assert_close(out, _naive_experts(hidden, gate_up, down, routing), rtol=1e-5, atol=1e-5)


def test_experts_reference_rounds_each_contribution_to_the_model_dtype() -> None:
    """bf16: each expert's output times its float32 weight is rounded to bf16 once, then the top_k of a token summed
    in float32 and rounded: the order transformers' experts round in (up to the order of the sum)."""
    gen = _generator(5)
    hidden = torch.randn(6, 32, generator=gen).bfloat16()
    gate_up = (torch.randn(4, 32, 32, generator=gen) * 0.2).bfloat16()
    down = (torch.randn(4, 32, 16, generator=gen) * 0.25).bfloat16()
    routing = route(torch.randn(6, 4, generator=gen), 2, renormalize=False)
    out = experts_reference(hidden, gate_up, down, routing)
    assert out.dtype == torch.bfloat16
    expected = torch.zeros(6, 32)
    for token in range(6):
        for weight, expert in zip(routing.weights[token], routing.expert_ids[token], strict=True):
            gate, up = F.linear(hidden[token], gate_up[expert]).chunk(2)
            projected = F.linear(F.silu(gate) * up, down[expert])
            expected[token] += (projected.float() * weight).bfloat16().float()
    assert torch.equal(out, expected.bfloat16())


def test_stacked_experts_shapes_and_top_k_bound() -> None:
    experts = StackedExperts(num_experts=6, hidden_size=8, intermediate_size=5, top_k=2, renormalize=True)
    assert experts.gate_up_proj.shape == (6, 10, 8) and experts.down_proj.shape == (6, 8, 5)
    assert experts.num_experts == 6
    with pytest.raises(ValueError, match=r"num_experts_per_tok=7 must be in \[1, 6\]"):
        StackedExperts(num_experts=6, hidden_size=8, intermediate_size=5, top_k=7, renormalize=True)
