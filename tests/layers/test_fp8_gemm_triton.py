"""The weight-only fp8 GEMM (layers/fp8_gemm_triton.py) against a matmul on the dequantized weight: row counts that
fill a tile partly, N and K that are no multiples of the tiles, per-channel and per-tensor scales, with and without
split-K, both operand orders, strided operands.

Runs on CUDA; without a GPU, `TRITON_INTERPRET=1 pytest tests/layers/test_fp8_gemm_triton.py` runs the small cases
through Triton's CPU interpreter, in float16 and float32 (its bf16 tl.dot multiplies the raw uint16 storage: bf16
runs on CUDA only, as do Llama-3.1-8B's shapes, determinism and CUDA-graph capture).
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="Triton kernels need triton (torch's CPU build has none)")

from batchgen.layers.fp8 import FP8_DTYPE, FP8_MAX, quantize_per_channel  # noqa: E402
from batchgen.layers.fp8_gemm_triton import (  # noqa: E402
    SmallMGemmConfig,
    block_m_for,
    fp8_small_m_config,
    fp8_small_m_gemm,
)
from tests.helpers.graph_replay import capture_graph  # noqa: E402
from tests.helpers.triton_support import DEVICE, ON_GPU, TRITON_MARKS  # noqa: E402

pytestmark = TRITON_MARKS

f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
# Relative to the output's magnitude: one rounding of the fp32 sum to the output dtype (as test_fp8_triton's).
TOLERANCE = {f32: 1e-5, f16: 1e-3, bf16: 8e-3}
DTYPES = [f32, f16, bf16] if ON_GPU else [f32, f16]
LLAMA3_8B = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096),
             "down_proj": (4096, 14336)}


def _quantize_per_tensor(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 values and one float32 scale, (1,), for the whole weight: its absolute maximum / 448."""
    scale = weight.abs().max().reshape(1) / FP8_MAX
    return (weight / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, per_channel: bool, bias: bool,
            seed: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x (m, k), an fp8 weight (n, k) with its scales ((n,) or (1,)) whose rows differ in magnitude, bias (n,)."""
    gen = torch.Generator().manual_seed(zlib.crc32(str(seed).encode()))
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)
    weight = torch.randn(n, k, generator=gen) * k**-0.5 * torch.linspace(0.1, 2, n)[:, None]
    values, scale = quantize_per_channel(weight) if per_channel else _quantize_per_tensor(weight)
    b = torch.randn(n, generator=gen).to(dtype).to(DEVICE) if bias else None
    return x, values.to(DEVICE), scale.to(DEVICE), b


def _reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear on the dequantized weight in float64, as float32."""
    dequantized = weight.double() * scale.double().reshape(-1, 1)
    return F.linear(x.double(), dequantized, None if bias is None else bias.double()).float()


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == dtype and actual.shape == expected.shape and actual.device == expected.device
    tol = TOLERANCE[dtype]
    scale = max(float(expected.abs().max()), 1.0) if expected.numel() else 1.0
    torch.testing.assert_close(actual.float(), expected, atol=tol * scale, rtol=tol)


def _config(m: int, split_k: int, weight_first: bool = True) -> SmallMGemmConfig:
    """Small tiles, so that the small shapes here span several of them: 32 channels, 32 features a step."""
    return SmallMGemmConfig(block_m_for(m), 32, 32, split_k, num_warps=4, num_stages=2, weight_first=weight_first)


def _check(m: int, n: int, k: int, dtype: torch.dtype, per_channel: bool, bias: bool,
           config: SmallMGemmConfig | None) -> None:
    x, weight, scale, b = _inputs(m, n, k, dtype, per_channel, bias, (m, n, k, dtype, per_channel, bias, config))
    assert_close(fp8_small_m_gemm(x, weight, scale, b, config), _reference(x, weight, scale, b), dtype)


@pytest.mark.parametrize("split_k", [1, 3], ids=["no-split", "split-3"])
@pytest.mark.parametrize("per_channel", [True, False], ids=["per-channel", "per-tensor"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [2, 3, 17, 64])
def test_matches_dequantized_reference(m: int, dtype: torch.dtype, per_channel: bool, split_k: int) -> None:
    """N = 70: two whole tiles of 32 channels and a partial one; K = 200: six whole steps of 32 and a partial one,
    split in three ranges of three steps, the last of one partial step."""
    _check(m, 70, 200, dtype, per_channel, bias=m % 2 == 1, config=_config(m, split_k))


@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_x_second(dtype: torch.dtype, split_k: int) -> None:
    """weight_first=False: x is the dot's first operand, the upcast weight its second."""
    _check(17, 70, 200, dtype, per_channel=True, bias=True, config=_config(17, split_k, weight_first=False))


@pytest.mark.parametrize(("n", "k"), [(64, 128), (16, 16), (5, 3), (1, 64), (48, 1000)], ids=str)
def test_shapes(n: int, k: int) -> None:
    """Whole tiles and steps (no load mask), N and K below one tile, one channel, and a K of 32 steps split
    three ways."""
    _check(5, n, k, f16, per_channel=True, bias=True, config=_config(5, split_k=3))


@pytest.mark.parametrize("m", [2, 64, 100])
def test_default_config(m: int) -> None:
    """fp8_small_m_config's launch: 100 rows take two tiles of 64; K = 4096 in 16 steps takes split-K."""
    config = fp8_small_m_config(m, 96, 4096, x_element_size=2)
    assert config.split_k > 1
    _check(m, 96, 4096, f16, per_channel=True, bias=False, config=None)


def test_strided_operands() -> None:
    """A column slice of a wider activation as x, and a column-major weight (K stride != 1)."""
    x_wide, weight_wide, scale, b = _inputs(5, 70, 300, f32, True, True, "strided")
    x = x_wide[:, 50:250]  # (5, 200), row stride 300
    weight = weight_wide[:, :200].t().contiguous().t()  # (70, 200), strides (1, 70)
    assert not x.is_contiguous() and weight.stride() == (1, 70)
    for split_k in (1, 3):
        assert_close(fp8_small_m_gemm(x, weight, scale, b, _config(5, split_k)), _reference(x, weight, scale, b), f32)


def test_zero_rows() -> None:
    x, weight, scale, b = _inputs(1, 5, 16, f32, True, True, "empty")
    assert fp8_small_m_gemm(x[:0], weight, scale, b).shape == (0, 5)


def test_refuses_other_scales_and_weights() -> None:
    x, weight, scale, _ = _inputs(2, 16, 32, f32, True, False, "refused")
    with pytest.raises(AssertionError, match=r"one scale per row or one in all: scales \(8,\)"):
        fp8_small_m_gemm(x, weight, scale[:8])
    with pytest.raises(AssertionError, match="float8_e4m3fn weight and float32 scales: torch.float32"):
        fp8_small_m_gemm(x, weight.float(), scale)
    with pytest.raises(AssertionError, match="x is torch.int32"):
        fp8_small_m_gemm(x.int(), weight, scale)


@pytest.mark.skipif(not ON_GPU, reason="Llama-3.1-8B's shapes are too large for the interpreter")
@pytest.mark.parametrize("m", [2, 16, 64, 128])
@pytest.mark.parametrize("layer", list(LLAMA3_8B))
def test_llama3_8b_shapes(layer: str, m: int) -> None:
    """The default launch (split-K on o_proj, down_proj and qkv_proj) on the real projections, bf16."""
    n, k = LLAMA3_8B[layer]
    _check(m, n, k, bf16, per_channel=True, bias=False, config=None)


@pytest.mark.skipif(not ON_GPU, reason="the order in which programs finish varies on a GPU only")
def test_split_k_is_deterministic() -> None:
    """Split-K sums its slices in a fixed order: the same inputs give the same bits every time."""
    x, weight, scale, _ = _inputs(16, 4096, 14336, bf16, True, False, "deterministic")
    config = fp8_small_m_config(16, 4096, 14336)
    assert config.split_k > 1
    first = fp8_small_m_gemm(x, weight, scale)
    assert all(torch.equal(fp8_small_m_gemm(x, weight, scale), first) for _ in range(20))


@pytest.mark.skipif(not ON_GPU, reason="CUDA-graph capture needs a GPU")
def test_replays_in_cuda_graph() -> None:
    """Captured once, split and unsplit launches read what x and the scales hold at replay."""
    x, weight, scale, b = _inputs(8, 4096, 4096, bf16, True, True, "graph")

    def launches() -> tuple[torch.Tensor, ...]:
        return (fp8_small_m_gemm(x, weight, scale, b), fp8_small_m_gemm(x, weight, scale, b, _config(8, 1)))

    graph, captured = capture_graph(launches)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        scale.mul_(2)
        graph.replay()
        for replayed, eager in zip(captured, launches(), strict=True):
            assert torch.equal(replayed, eager)
