"""The fused mixture-of-experts Triton kernels (float and fp8 expert weights) against the torch routing and expert
reference.

Runs on CUDA; without a GPU, `TRITON_INTERPRET=1 pytest tests/layers/test_moe_triton.py` runs the small cases through
Triton's CPU interpreter (bf16, the Qwen3-30B-A3B shapes and CUDA-graph capture run on CUDA only).
"""

from __future__ import annotations

import zlib
from collections import Counter

import pytest
import torch

pytest.importorskip("triton", reason="Triton kernels need triton (torch's CPU build has none)")

from batchgen.layers import moe_triton  # noqa: E402
from batchgen.layers.fp8 import dequantize, quantize_per_channel  # noqa: E402
from batchgen.layers.moe import StackedExperts, experts_reference, route  # noqa: E402
from tests.helpers.common import load_ours, random_tokens  # noqa: E402
from tests.helpers.paged import PagedTestCache  # noqa: E402
from tests.helpers.triton_support import DEVICE, ON_GPU, TRITON_MARKS  # noqa: E402

pytestmark = TRITON_MARKS
f32, bf16 = torch.float32, torch.bfloat16

# (tokens, experts, top_k, hidden, intermediate, renormalize): a decode row, a padded bucket, a prefill chunk whose
# experts fill several blocks, top_k = E, sizes not multiples of the tiles
CASES = [(1, 8, 2, 64, 32, True), (5, 4, 2, 48, 40, False), (37, 16, 4, 64, 32, True), (3, 4, 4, 32, 16, False),
         (70, 4, 1, 32, 48, True)]
QWEN3_30B_A3B = [(t, 128, 8, 2048, 768, True) for t in (1, 7, 64, 256, 2048)]


def _inputs(case: tuple, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden (T, H), router logits (T, E), gate/up (E, 2I, H), down (E, H, I), scaled like trained weights."""
    num_tokens, num_experts, _, hidden_size, intermediate, _ = case
    gen = torch.Generator().manual_seed(zlib.crc32(str(case).encode()))
    hidden = torch.randn(num_tokens, hidden_size, generator=gen)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    gate_up = torch.randn(num_experts, 2 * intermediate, hidden_size, generator=gen) * hidden_size**-0.5
    down = torch.randn(num_experts, hidden_size, intermediate, generator=gen) * intermediate**-0.5
    return tuple(t.to(dtype).to(DEVICE) for t in (hidden, logits, gate_up, down))


def _check_against_reference(case: tuple, dtype: torch.dtype, fp8: bool) -> None:
    """The kernels against the reference; fp8: on weights quantized per expert and row, against the reference on the
    same weights dequantized."""
    _, _, top_k, _, _, renormalize = case
    hidden, logits, gate_up, down = _inputs(case, dtype)
    scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
    if fp8:
        (gate_up, gate_up_scale), (down, down_scale) = quantize_per_channel(gate_up), quantize_per_channel(down)
        scales = (gate_up_scale, down_scale)
    out = moe_triton.sparse_moe(hidden, logits, gate_up, down, top_k, renormalize, *scales)
    if fp8:
        gate_up, down = dequantize(gate_up, gate_up_scale, dtype), dequantize(down, down_scale, dtype)
    expected = experts_reference(hidden, gate_up, down, route(logits, top_k, renormalize))
    assert out.dtype == dtype and out.shape == expected.shape
    # Both round at the same points; only the fp32 accumulation order differs (bf16: one rounding apart at most; fp8:
    # the reference also rounds each dequantized weight to bf16, where the kernel scales the fp32 sums).
    tolerance = 1e-4 if dtype == f32 else 3e-2 if fp8 else 2e-2
    scale = float(expected.abs().max())
    torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance * scale)


@pytest.mark.parametrize("fp8", [False, True], ids=["float", "fp8"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_sparse_moe_matches_reference_fp32(case: tuple, fp8: bool) -> None:
    _check_against_reference(case, f32, fp8)


@pytest.mark.skipif(not ON_GPU, reason="bf16 dots run on CUDA only")
@pytest.mark.parametrize("fp8", [False, True], ids=["float", "fp8"])
@pytest.mark.parametrize("case", CASES + QWEN3_30B_A3B, ids=str)
def test_sparse_moe_matches_reference_bf16(case: tuple, fp8: bool) -> None:
    _check_against_reference(case, bf16, fp8)


@pytest.mark.parametrize("renormalize", [True, False])
def test_route_kernel_picks_the_reference_experts_and_weights(renormalize: bool) -> None:
    num_tokens, num_experts, top_k = 11, 12, 3  # E not a power of two: padding experts are never chosen
    logits = torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    placement = moe_triton.place_pairs(logits, top_k, renormalize, block_m=16)
    expected = route(logits, top_k, renormalize)
    assert torch.equal(placement.expert_ids.view(num_tokens, top_k).long(), expected.expert_ids)
    torch.testing.assert_close(placement.weights.view(num_tokens, top_k), expected.weights, rtol=1e-6, atol=1e-6)


def test_pairs_fill_each_experts_blocks_in_expert_order() -> None:
    """Every pair sits in exactly one slot, inside its expert's run of blocks; the runs follow in expert order, each
    padded to whole blocks; the grid's bound covers them."""
    num_tokens, num_experts, top_k, block_m = 29, 6, 2, 16
    logits = torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    placement = moe_triton.place_pairs(logits, top_k, True, block_m)
    experts = placement.expert_ids.cpu().tolist()
    counts = Counter(experts)
    assert placement.counts.cpu().tolist() == [counts[e] for e in range(num_experts)]
    slots = placement.slots.cpu().tolist()
    start = 0
    for expert in range(num_experts):
        run = slots[start:start + counts[expert]]
        assert sorted(run) == [p for p, e in enumerate(experts) if e == expert]
        start += -(-counts[expert] // block_m) * block_m
    assert start <= placement.max_blocks * block_m


def test_no_tokens() -> None:
    hidden, logits, gate_up, down = _inputs((1, 4, 2, 32, 16, True), f32)
    out = moe_triton.sparse_moe(hidden[:0], logits[:0], gate_up, down, 2, True)
    assert out.shape == (0, 32)


def test_tiles_grow_with_the_rows_each_expert_gets() -> None:
    decode, prefill = moe_triton.moe_tiles(8, 128, bf16), moe_triton.moe_tiles(8192 * 8, 128, bf16)
    assert decode.block_m == 16 and prefill.block_m == 64


def test_stacked_experts_take_the_kernel_on_their_device(monkeypatch: pytest.MonkeyPatch) -> None:
    experts = StackedExperts(num_experts=4, hidden_size=32, intermediate_size=16, top_k=2, renormalize=True)
    with torch.no_grad():
        experts.gate_up_proj.normal_(std=0.2)
        experts.down_proj.normal_(std=0.2)
    experts = experts.to(DEVICE)
    hidden, logits = torch.randn(5, 32, device=DEVICE), torch.randn(5, 4, device=DEVICE)
    expected = experts_reference(hidden, experts.gate_up_proj, experts.down_proj, route(logits, 2, True))
    calls = []
    original = moe_triton.sparse_moe
    monkeypatch.setattr(moe_triton, "sparse_moe", lambda *args: calls.append(1) or original(*args))
    experts.use_kernel_on(DEVICE)
    torch.testing.assert_close(experts(hidden, logits), expected, rtol=1e-4, atol=1e-4)
    assert calls == [1]


@pytest.mark.parametrize("architecture", ["Qwen3MoeForCausalLM", "MixtralForCausalLM"])
def test_model_logits_with_the_kernel_equal_the_reference(architecture: str, tiny_model_dir) -> None:
    model = load_ours(tiny_model_dir(architecture)).to(DEVICE)
    for module in model.modules():
        if isinstance(module, StackedExperts):
            module.use_kernel_on(DEVICE)
    tokens = random_tokens(9, seed=11)
    (kernel_logits,) = PagedTestCache(model).run(model, [(0, tokens)])
    reference = load_ours(tiny_model_dir(architecture))
    (expected,) = PagedTestCache(reference).run(reference, [(0, tokens)])
    torch.testing.assert_close(kernel_logits.cpu(), expected, rtol=1e-3, atol=1e-3)


@pytest.mark.skipif(not ON_GPU, reason="CUDA-graph capture needs a GPU")
@pytest.mark.parametrize("num_tokens", [1, 8, 64])
def test_cuda_graph_replay_equals_eager(num_tokens: int) -> None:
    """The layer captures (no host sync, fixed shapes), and a replay with new inputs routes them anew."""
    case = (num_tokens, 128, 8, 2048, 768, True)
    hidden, logits, gate_up, down = _inputs(case, bf16)
    static_hidden, static_logits = hidden.clone(), logits.clone()
    moe_triton.sparse_moe(static_hidden, static_logits, gate_up, down, 8, True)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = moe_triton.sparse_moe(static_hidden, static_logits, gate_up, down, 8, True)
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        new_hidden = torch.randn(hidden.shape, generator=gen).to(bf16).to(DEVICE)
        new_logits = torch.randn(logits.shape, generator=gen).to(bf16).to(DEVICE)
        static_hidden.copy_(new_hidden)
        static_logits.copy_(new_logits)
        graph.replay()
        eager = moe_triton.sparse_moe(new_hidden, new_logits, gate_up, down, 8, True)
        assert torch.equal(static_out, eager)

