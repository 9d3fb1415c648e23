"""The Triton RMSNorm (+ residual add; Llama's and Gemma's) and SiluAndMul kernels against the torch ops they replace,
and the layers' switch to them.

Runs on CUDA; without a GPU,
`TRITON_INTERPRET=1 pytest tests/layers/test_elementwise_triton.py` runs the kernels through
Triton's CPU interpreter (bf16 runs on CUDA only).
"""

from __future__ import annotations

import zlib

import pytest
import torch

pytest.importorskip("triton", reason="Triton kernels need triton (torch's CPU build has none)")

from batchgen.layers import elementwise_triton  # noqa: E402
from batchgen.layers.activation import SiluAndMul, silu_and_mul  # noqa: E402
from batchgen.layers.norms import (  # noqa: E402
    GemmaRMSNorm,
    RMSNorm,
    add_gemma_rms_norm,
    add_rms_norm,
    gemma_rms_norm,
    rms_norm,
)
from batchgen.layers.triton_layers import use_triton_layers  # noqa: E402
from tests.helpers.triton_support import DEVICE, ON_GPU, TRITON_MARKS  # noqa: E402

pytestmark = TRITON_MARKS
f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
# Both round at the same points; only the order of the fp32 sum of squares differs: at most one unit in the last place.
TOLERANCE = {f32: (1e-5, 1e-5), bf16: (1.6e-2, 1e-2), f16: (2e-3, 1e-3)}

# (rows, features, dtype): one row (decode at batch 1), a padded bucket, a prefill; widths not powers of two
CASES = [(1, 1024, bf16), (3, 64, f32), (8, 1000, f16), (17, 128, f32), (40, 4096, bf16), (5, 3072, f16)]


def _random(shape: tuple[int, ...], dtype: torch.dtype, case: tuple, salt: str, scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(f"{case}{salt}".encode()))
    return (scale * torch.randn(shape, generator=gen)).to(dtype).to(DEVICE)


def _skip_bf16_on_cpu(dtype: torch.dtype) -> None:
    if DEVICE == "cpu" and dtype == bf16:
        pytest.skip("bf16 runs on CUDA only")


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_add_rms_norm_matches_reference(case: tuple, with_residual: bool) -> None:
    rows, dim, dtype = case
    _skip_bf16_on_cpu(dtype)
    x = _random((rows, dim), dtype, case, "x")
    weight = _random((dim,), dtype, case, "w", scale=1.0).abs().add(0.5)
    residual = _random((rows, dim), dtype, case, "r") if with_residual else None
    out, summed = elementwise_triton.add_rms_norm(x, residual, weight, 1e-6)
    if residual is None:
        expected, expected_summed = rms_norm(x, weight, 1e-6), x
    else:
        expected, expected_summed = add_rms_norm(x, residual, weight, 1e-6)
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(out, expected, rtol=rtol, atol=atol)
    assert torch.equal(summed, expected_summed)  # one rounded add: exact


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_gemma_add_rms_norm_matches_reference(case: tuple, with_residual: bool) -> None:
    """Gemma's norm: (1 + weight) in fp32, rounded once; the output in x's dtype."""
    rows, dim, dtype = case
    _skip_bf16_on_cpu(dtype)
    x = _random((rows, dim), dtype, case, "gemma x")
    weight = _random((dim,), dtype, case, "gemma w", scale=0.5)  # zero-centred
    residual = _random((rows, dim), dtype, case, "gemma r") if with_residual else None
    out, summed = elementwise_triton.add_rms_norm(x, residual, weight, 1e-6, gemma_style=True)
    if residual is None:
        expected, expected_summed = gemma_rms_norm(x, weight, 1e-6), x
    else:
        expected, expected_summed = add_gemma_rms_norm(x, residual, weight, 1e-6)
    rtol, atol = TOLERANCE[dtype]
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected, rtol=rtol, atol=atol)
    assert torch.equal(summed, expected_summed)
    assert not torch.allclose(out.float(), elementwise_triton.add_rms_norm(x, residual, weight, 1e-6)[0].float())


@pytest.mark.parametrize("case", CASES, ids=str)
def test_silu_and_mul_matches_reference(case: tuple) -> None:
    rows, dim, dtype = case
    _skip_bf16_on_cpu(dtype)
    gate_up = _random((rows, 2 * dim), dtype, case, "gate_up")
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(elementwise_triton.silu_and_mul(gate_up), silu_and_mul(gate_up), rtol=rtol, atol=atol)


def test_kernels_take_no_rows_and_leading_dims() -> None:
    weight = torch.ones(64, device=DEVICE)
    out, summed = elementwise_triton.add_rms_norm(torch.empty(0, 64, device=DEVICE), None, weight, 1e-6)
    assert out.shape == (0, 64) and summed.shape == (0, 64)
    assert elementwise_triton.silu_and_mul(torch.empty(0, 32, device=DEVICE)).shape == (0, 16)
    x = _random((2, 3, 64), f32, "3d", "x")
    torch.testing.assert_close(elementwise_triton.add_rms_norm(x, None, weight, 1e-6)[0], rms_norm(x, weight, 1e-6))


def test_layers_switch_to_the_kernels_on_their_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """After use_triton(DEVICE) the layers' outputs come from the kernels (a counting wrapper sees every call), the
    same values as before."""
    calls = []
    for name in ("add_rms_norm", "silu_and_mul"):
        original = getattr(elementwise_triton, name)
        monkeypatch.setattr(elementwise_triton, name,
                            lambda *args, _f=original, _n=name, **kwargs: calls.append(_n) or _f(*args, **kwargs))
    norm, gemma_norm, act = RMSNorm(64, 1e-6).to(DEVICE), GemmaRMSNorm(64, 1e-6).to(DEVICE), SiluAndMul()
    with torch.no_grad():
        gemma_norm.weight.copy_(_random((64,), f32, "layers", "gemma w", scale=0.5))
    x, residual, gate_up = (_random((5, 64), f32, "layers", salt) for salt in ("x", "r", "gu"))
    expected = (norm(x), norm(x, residual), gemma_norm(x), gemma_norm(x, residual), act(gate_up))
    for layer in (norm, gemma_norm, act):
        layer.use_triton(DEVICE)
    actual = (norm(x), norm(x, residual), gemma_norm(x), gemma_norm(x, residual), act(gate_up))
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert calls == ["add_rms_norm"] * 4 + ["silu_and_mul"]


@pytest.mark.skipif(ON_GPU, reason="checks the CPU fallback")
def test_cuda_switched_layers_fall_back_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("add_rms_norm", "silu_and_mul"):
        monkeypatch.setattr(elementwise_triton, name, lambda *args: pytest.fail("the kernel ran on CPU"))
    norm, act = RMSNorm(16, 1e-6), SiluAndMul()
    norm.use_triton()
    act.use_triton()
    x = torch.randn(2, 16)
    assert torch.equal(norm(x), rms_norm(x, norm.weight, 1e-6)) and torch.equal(act(x), silu_and_mul(x))


def test_use_triton_layers_leaves_compiled_elementwise_layers_alone() -> None:
    model = torch.nn.ModuleList([RMSNorm(16, 1e-6), SiluAndMul()])
    use_triton_layers(model, gemv=False, elementwise=False)
    assert all(layer._kernels is None for layer in model)
    use_triton_layers(model, gemv=False)
    assert all(layer._kernels is elementwise_triton for layer in model)
