"""The fp8 Triton kernels against torch: the small-M GEMV on fp8 weights (plain, with the fused residual add +
RMSNorm and SiLU-and-mul), the per-token fp8 quantization, and Fp8Linear's choice between the GEMV, the weight-only
GEMM (tested itself in test_fp8_gemm_triton.py) and _scaled_mm.

Runs on CUDA; without a GPU, `TRITON_INTERPRET=1 pytest tests/layers/test_fp8_triton.py` runs the same cases, scaled
down, through Triton's CPU interpreter (before Triton 3.8 it needs numpy<2.4). The interpreter truncates bf16
roundings where the GPU rounds them: there the fused prologues are checked in float32 only.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="Triton kernels need triton (torch's CPU build has none)")

from batchgen.config import ModelConfig  # noqa: E402
from batchgen.layers import fp8, fp8_gemm_triton, fused, linear_triton  # noqa: E402
from batchgen.layers.activation import silu_and_mul  # noqa: E402
from batchgen.layers.fp8 import FP8_DTYPE, FP8_GEMM_MAX_ROWS, Fp8Linear, dequantize, quantize_per_channel  # noqa: E402
from batchgen.layers.fp8_gemm_triton import fp8_small_m_gemm  # noqa: E402
from batchgen.layers.fp8_loading import quantizable_layers  # noqa: E402
from batchgen.layers.fp8_triton import quantize_rows  # noqa: E402
from batchgen.layers.linear import Linear  # noqa: E402
from batchgen.layers.linear_triton import MAX_M, LinearConfig, add_rms_norm_linear, small_m_linear  # noqa: E402
from batchgen.layers.moe import StackedExperts  # noqa: E402
from batchgen.layers.norms import rms_norm  # noqa: E402
from batchgen.models.loader import load_hf_config, load_model  # noqa: E402
from tests.helpers.graph_replay import capture_graph  # noqa: E402
from tests.helpers.paged import PagedTestCache  # noqa: E402
from tests.helpers.triton_support import DEVICE, ON_GPU, TRITON_MARKS  # noqa: E402

pytestmark = TRITON_MARKS

f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
TOLERANCE = {f32: 1e-5, f16: 1e-3, bf16: 8e-3}  # as test_linear_triton's: one rounding of the fp32 sum
FUSED_DTYPES = [f32, bf16] if ON_GPU else [f32]


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, bias: bool,
            seed: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x (m, k), an fp8 weight (n, k) with its scales (n,) (outputs of order 1, rows of different magnitudes), bias."""
    gen = torch.Generator().manual_seed(zlib.crc32(str(seed).encode()))
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)
    row_magnitudes = torch.linspace(0.1, 2, n)[:, None]
    weight, scale = quantize_per_channel(torch.randn(n, k, generator=gen) * k**-0.5 * row_magnitudes)
    b = torch.randn(n, generator=gen).to(dtype).to(DEVICE) if bias else None
    return x, weight.to(DEVICE), scale.to(DEVICE), b


def _reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear on the dequantized weight in float64, as float32."""
    dequantized = weight.double() * scale.double()[:, None]
    return F.linear(x.double(), dequantized, None if bias is None else bias.double()).float()


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == dtype and actual.shape == expected.shape
    tol = TOLERANCE[dtype]
    scale = max(float(expected.abs().max()), 1.0) if expected.numel() else 1.0
    torch.testing.assert_close(actual.float(), expected, atol=tol * scale, rtol=tol)


def _check(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, config: LinearConfig | None = None) -> None:
    x, weight, scale, b = _inputs(m, n, k, dtype, bias, (m, n, k, dtype, bias, config))
    assert_close(small_m_linear(x, weight, b, config, weight_scale=scale), _reference(x, weight, scale, b), dtype)


@pytest.mark.parametrize("dtype", [f32, f16, bf16])
@pytest.mark.parametrize("m", range(1, MAX_M + 1))
def test_every_m(m: int, dtype: torch.dtype) -> None:
    _check(m, 37 if not ON_GPU else 1000, 100, dtype, bias=m % 2 == 0)


# (N, K): a partial last block of rows, K of 1, uneven, and past the default BLOCK_K of fp8 (8192: several steps).
SHAPES = [(5, 100), (67, 64), (3, 1), (1024, 1024), (300, 2048), (130, 9000), (4096, 1024), (6144, 1024)]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("n", "k"), SHAPES, ids=str)
def test_shapes(n: int, k: int, bias: bool) -> None:
    n, k = (n, k) if ON_GPU else (min(n, 67), min(k, 2100))
    _check(1 + zlib.crc32(str((n, k, bias)).encode()) % MAX_M, n, k, bf16, bias)


@pytest.mark.parametrize("config", [LinearConfig(1, 128, 1), LinearConfig(4, 64, 2), LinearConfig(16, 512, 4)],
                         ids=str)
def test_config_overrides(config: LinearConfig) -> None:
    _check(3, 45, 300, f32, bias=True, config=config)


@pytest.mark.parametrize("dtype", FUSED_DTYPES)
@pytest.mark.parametrize("m", [1, 3, MAX_M])
def test_silu_and_mul(m: int, dtype: torch.dtype) -> None:
    n = 37 if not ON_GPU else 1000
    x, weight, scale, b = _inputs(m, 2 * n, 100, dtype, m == 3, ("silu", m, dtype))
    expected = silu_and_mul(_reference(x, weight, scale, b).to(dtype)).float()
    assert_close(small_m_linear(x, weight, b, silu_and_mul=True, weight_scale=scale), expected, dtype)


@pytest.mark.parametrize("with_silu", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("dtype", FUSED_DTYPES)
@pytest.mark.parametrize("m", [1, 5])
def test_add_rms_norm(m: int, dtype: torch.dtype, with_residual: bool, with_silu: bool) -> None:
    n, k = (37, 100) if not ON_GPU else (1024, 1024)
    x, weight, scale, b = _inputs(m, 2 * n if with_silu else n, k, dtype, not with_silu, ("norm", m, dtype))
    gen = torch.Generator().manual_seed(m * k)
    residual = (torch.randn(m, k, generator=gen) * 4).to(dtype).to(DEVICE) if with_residual else None
    norm_weight = (1 + torch.randn(k, generator=gen) / 4).to(dtype).to(DEVICE)
    out, new_residual = add_rms_norm_linear(x, residual, norm_weight, 1e-6, weight, b, silu_and_mul=with_silu,
                                            weight_scale=scale)
    summed = x if residual is None else x + residual
    projected = _reference(rms_norm(summed, norm_weight, 1e-6), weight, scale, b)
    assert_close(out, silu_and_mul(projected.to(dtype)).float() if with_silu else projected, dtype)
    assert torch.equal(new_residual, summed)


def test_weight_scale_must_be_one_per_row() -> None:
    x, weight, scale, _ = _inputs(2, 16, 32, f32, False, "bad scale")
    with pytest.raises(AssertionError, match="one scale per row"):
        small_m_linear(x, weight, weight_scale=scale[:8])
    with pytest.raises(AssertionError, match="x is torch.float32, weight torch.float8_e4m3fn"):
        small_m_linear(x, weight)


@pytest.mark.parametrize("dtype", [f32, bf16])
@pytest.mark.parametrize(("m", "k"), [(1, 64), (7, 100), (3, 5000)])
def test_quantize_rows(m: int, k: int, dtype: torch.dtype) -> None:
    """Scales as torch computes them; values too, but for a last-bit difference of the division that may round a
    value the other way. The interpreter's fp8 conversion drops the carry of a value rounded up to the next power of
    two (31.7 becomes 16, not 32): there the values are checked to within a factor of two."""
    gen = torch.Generator().manual_seed(m * k)
    x = (torch.randn(m, k, generator=gen) * torch.logspace(-3, 2, m)[:, None]).to(dtype)
    x[0, :] = 0  # a padding row: zeros, not NaN
    x = x.to(DEVICE)
    values, scale = quantize_rows(x)
    expected_values, expected_scale = fp8.quantize_rows_reference(x)
    assert values.dtype == FP8_DTYPE and values.shape == (m, k) and scale.shape == (m, 1)
    torch.testing.assert_close(scale, expected_scale, rtol=1e-6, atol=0)
    assert torch.equal(values[0].float(), torch.zeros(k, device=DEVICE))
    if ON_GPU:  # where they differ, by one fp8 step: 2**-3 of the value
        torch.testing.assert_close(values.float(), expected_values.float(), rtol=2**-3, atol=2**-9)
        assert (values.float() != expected_values.float()).float().mean() <= 1e-3
    else:
        ratio = values.float() / expected_values.float()
        assert ((ratio >= 0.5) & (ratio <= 1) | (expected_values.float() == 0)).all()
    assert quantize_rows(x[:0])[0].shape == (0, k)


@pytest.mark.parametrize("m", [1, 2, FP8_GEMM_MAX_ROWS, FP8_GEMM_MAX_ROWS + 1])
def test_fp8_linear_dispatch(m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """One row takes the GEMV, up to FP8_GEMM_MAX_ROWS the weight-only GEMM (on the device the layer's kernels run
    on), more take _scaled_mm."""
    calls = []

    def spy(kernel: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def counted(*args: object, **kwargs: object) -> torch.Tensor:
            calls.append(kernel.__name__)
            return kernel(*args, **kwargs)
        return counted

    monkeypatch.setattr(linear_triton, "small_m_linear", spy(small_m_linear))
    monkeypatch.setattr(fp8_gemm_triton, "fp8_small_m_gemm", spy(fp8_small_m_gemm))
    layer = Fp8Linear.quantized(Linear(64, 48, device=DEVICE))
    layer.use_triton(DEVICE)
    x = torch.randn(m, 64, device=DEVICE)
    with torch.no_grad():
        out = layer(x)
    expected = _reference(x, layer.weight, layer.weight_scale, layer.bias)
    if m <= FP8_GEMM_MAX_ROWS:  # weight-only: x stays float32
        assert calls == ["small_m_linear" if m == 1 else "fp8_small_m_gemm"]
        assert_close(out, expected, f32)
    else:  # x in fp8 too: about 2**-4 of each product
        assert calls == []
        torch.testing.assert_close(out, expected, rtol=0, atol=0.1 * float(expected.abs().max()))


# q/k norms; qkv bias; Gemma's norm and GeGLU; no norm before the projections (OLMo 2); fp8 experts behind a router
# kept in float
FUSED_NORMS_PER_LAYER = {"Qwen3ForCausalLM": 2, "Qwen2ForCausalLM": 2, "Gemma2ForCausalLM": 2, "Olmo2ForCausalLM": 0,
                         "Qwen3MoeForCausalLM": 1}


@pytest.mark.parametrize("architecture", list(FUSED_NORMS_PER_LAYER))
def test_model_with_fp8_kernels(architecture: str, tiny_model_dir: Callable[..., Path],
                             monkeypatch: pytest.MonkeyPatch) -> None:
    """On fp8 linears (the weight-only GEMM in steps of several rows, the GEMV with its norm and SiLU fusions in steps
    of one) and fp8 experts (the MoE kernels), the model gives the logits of the same model on its dequantized
    weights through F.linear and the experts' kernels on float weights."""
    fused_calls = []

    def spy(*args: object, gemma_style: bool = False, **kwargs: object) -> object:
        fused_calls.append(gemma_style)
        return add_rms_norm_linear(*args, gemma_style=gemma_style, **kwargs)

    monkeypatch.setattr(linear_triton, "add_rms_norm_linear", spy)
    model_config = ModelConfig(path=str(tiny_model_dir(architecture)))
    model = load_model(model_config, load_hf_config(model_config), f32, torch.device(DEVICE))
    tokens = [3, 1, 4, 1, 5, 9, 2]

    def logits() -> torch.Tensor:
        """A prefill step of 5 rows and a decode step of 3 (2 of them padding): the weight-only GEMM; then a decode
        step of one row: the GEMV with its fusions."""
        cache = PagedTestCache(model)
        return torch.cat([cache.run(model, [(0, tokens[:5])])[0],
                          cache.run(model, [(0, tokens[5:6])], num_padding_rows=2)[0],
                          cache.run(model, [(0, tokens[6:])])[0]])

    with torch.no_grad():
        fp8_layers = []
        for parent, name in quantizable_layers(model):
            layer = getattr(parent, name)
            if isinstance(layer, StackedExperts):
                fp8_layer = layer.quantized()
                fp8_layer.use_kernel_on(DEVICE)
                dequantized = fp8_layer.dequantized()
                dequantized.use_kernel_on(DEVICE)
                setattr(parent, name, dequantized)
            else:
                fp8_layer = Fp8Linear.quantized(layer)
                fp8_layer.use_triton(DEVICE)
                layer.weight.copy_(dequantize(fp8_layer.weight, fp8_layer.weight_scale, f32))
            fp8_layers.append((parent, name, fp8_layer))
        expected = logits()
        for parent, name, layer in fp8_layers:
            setattr(parent, name, layer)
        assert_close(logits(), expected, f32)
    gemma = architecture.startswith("Gemma")
    assert fused_calls == [gemma] * FUSED_NORMS_PER_LAYER[architecture] * model.config.num_hidden_layers
    assert fused.FUSE_ADD_RMS_NORM and fused.FUSE_SILU_AND_MUL


@pytest.mark.skipif(not ON_GPU, reason="CUDA-graph capture needs a GPU")
def test_fp8_kernels_replay_in_cuda_graph() -> None:
    """Captured once, the fp8 GEMV (plain and fused) and the row quantization read what their inputs hold at replay."""
    x, weight, scale, _ = _inputs(2, 4096, 1024, bf16, False, "fp8 graph")
    residual, norm_weight = torch.randn_like(x), torch.rand(1024, device=DEVICE, dtype=bf16)

    def launches() -> tuple[torch.Tensor, ...]:
        return (small_m_linear(x, weight, weight_scale=scale),
                *add_rms_norm_linear(x, residual, norm_weight, 1e-6, weight, weight_scale=scale, silu_and_mul=True),
                *quantize_rows(x))

    graph, captured = capture_graph(launches)
    for _ in range(3):
        for tensor in (x, residual):
            tensor.copy_(torch.randn_like(tensor))
        scale.mul_(2)
        graph.replay()
        for replayed, eager in zip(captured, launches(), strict=True):
            assert torch.equal(replayed.float(), eager.float())
