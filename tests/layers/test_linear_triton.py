"""The Triton small-M linear kernel against F.linear, over many shapes, and the `Linear` layer that uses it.

Runs on CUDA; without a GPU, `TRITON_INTERPRET=1 pytest tests/layers/test_linear_triton.py` runs the same cases, scaled
down, through Triton's CPU interpreter (it needs numpy<2.4; the Qwen3 shapes and CUDA-graph capture run on CUDA only).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.paged import prefill_then_decode_logits

pytest.importorskip("triton", reason="Triton kernels need triton (torch's CPU build has none)")

from batchgen.config import ModelConfig
from batchgen.layers import fused, linear_triton
from batchgen.layers.activation import silu_and_mul
from batchgen.layers.linear import Linear
from batchgen.layers.linear_triton import (
    MAX_M,
    LinearConfig,
    add_rms_norm_linear,
    small_m_linear,
    warp_split_config,
)
from batchgen.layers.norms import gemma_rms_norm, rms_norm
from batchgen.layers.triton_layers import use_triton_layers
from batchgen.models.loader import load_hf_config, load_model
from tests.helpers.graph_replay import capture_graph  # noqa: E402
from tests.helpers.triton_support import DEVICE, ON_GPU, TRITON_MARKS  # noqa: E402

pytestmark = TRITON_MARKS


@pytest.fixture(autouse=True)
def tiny_weights_take_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layers here are tiny, which the engine leaves to cuBLAS: they take the kernel as large ones would."""
    monkeypatch.setattr(linear_triton, "MIN_WEIGHT_BYTES", 0)

f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
# Relative to the output's magnitude: one rounding of the fp32 sum to the output dtype (the interpreter truncates
# to bf16 instead of rounding: up to a whole bf16 ulp, 2**-7).
TOLERANCE = {f32: 1e-5, f16: 1e-3, bf16: 8e-3}
QWEN3_SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024)]  # (N, K): qkv, o, gate_up, ...


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, bias: bool,
            seed: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x (m, k), weight (n, k) scaled like a trained layer's (outputs of order 1), bias (n,) or None."""
    gen = torch.Generator().manual_seed(zlib.crc32(str(seed).encode()))
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)
    weight = (torch.randn(n, k, generator=gen) * k**-0.5).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=gen).to(dtype).to(DEVICE) if bias else None
    return x, weight, b


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear in float64 (never TF32), as float32."""
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double()).float()


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == dtype
    assert actual.shape == expected.shape
    assert actual.device == expected.device
    tol = TOLERANCE[dtype]
    scale = max(float(expected.abs().max()), 1.0) if expected.numel() else 1.0
    torch.testing.assert_close(actual.float(), expected, atol=tol * scale, rtol=tol)


def _check(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, config: LinearConfig | None = None) -> None:
    x, weight, b = _inputs(m, n, k, dtype, bias, (m, n, k, dtype, bias, config))
    assert_close(small_m_linear(x, weight, b, config), _reference(x, weight, b), dtype)


@pytest.mark.parametrize("dtype", [f32, f16, bf16])
@pytest.mark.parametrize("m", range(1, MAX_M + 1))
def test_every_m(m: int, dtype: torch.dtype) -> None:
    """Every row count, on a shape with a partial last block of rows and a K that is no power of two."""
    _check(m, 37 if not ON_GPU else 1000, 100, dtype, bias=m % 2 == 0)


# (N, K): N of 1, a prime, non-multiples and multiples of every BLOCK_N; K of 1, uneven, powers of two, and past
# the default BLOCK_K (4096 bf16, 2048 fp32: several steps with a partial last one).
SHAPES = [(1, 64), (5, 100), (1000, 64), (1024, 1024), (4096, 3072), (1000, 3072), (3, 1), (300, 2048), (9000, 1000),
          (130, 5000)]


def _scaled(n: int, k: int) -> tuple[int, int]:
    """The interpreter runs each program in Python: at most 67 rows (a partial last block) and 2100 features."""
    return (n, k) if ON_GPU else (min(n, 67), min(k, 2100))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [f32, f16, bf16])
@pytest.mark.parametrize(("n", "k"), SHAPES, ids=str)
def test_shapes(n: int, k: int, dtype: torch.dtype, bias: bool) -> None:
    n, k = _scaled(n, k)
    m = 1 + zlib.crc32(str((n, k, dtype, bias)).encode()) % MAX_M  # one M per case keeps the compiles few
    _check(m, n, k, dtype, bias)


@pytest.mark.parametrize(
    "config",
    [LinearConfig(1, 128, 1), LinearConfig(2, 64, 1), LinearConfig(4, 16, 2), LinearConfig(8, 128, 4),
     LinearConfig(16, 32, 8), LinearConfig(32, 512, 4)],
    ids=str,
)
@pytest.mark.parametrize("dtype", [f32, bf16])
def test_config_overrides(config: LinearConfig, dtype: torch.dtype) -> None:
    """What the benchmark sweeps: any power-of-two BLOCK_N and BLOCK_K, several unrolled K chunks with a tail."""
    _check(3, 45, 300, dtype, bias=True, config=config)
    _check(MAX_M, 45, 300, dtype, bias=False, config=config)


def test_strided_operands() -> None:
    """A column slice of a wider activation as x, and a column-major weight (K stride != 1)."""
    x_wide, weight_wide, b = _inputs(5, 67, 300, f32, True, "strided")
    x = x_wide[:, 50:150]  # (5, 100), row stride 300
    weight = weight_wide[:, :100].t().contiguous().t()  # (67, 100), strides (1, 67)
    assert not x.is_contiguous() and weight.stride() == (1, 67)
    assert_close(small_m_linear(x, weight, b), _reference(x, weight, b), f32)


def test_warp_split_config_fills_the_gpu() -> None:
    """On the Qwen3 layers, uncapped: at least 256 programs, two 16-byte weight loads per thread, all of K in one
    step."""
    for n, k in QWEN3_SHAPES:
        config = warp_split_config(n, k, 2, None)
        assert -(-n // config.block_n) >= 256
        assert config.block_n * config.block_k * 2 == 2 * 16 * 32 * config.num_warps
        assert config.block_k >= k and config.num_warps <= 8


def test_zero_rows() -> None:
    x, weight, b = _inputs(1, 5, 16, f32, True, "empty")
    assert small_m_linear(x[:0], weight, b).shape == (0, 5)


@pytest.mark.skipif(not ON_GPU, reason="the Qwen3 shapes are too large for the interpreter")
@pytest.mark.parametrize("m", [1, 2, MAX_M])
@pytest.mark.parametrize(("n", "k"), QWEN3_SHAPES, ids=str)
def test_qwen3_shapes(n: int, k: int, m: int) -> None:
    _check(m, n, k, bf16, bias=False)


@pytest.mark.parametrize("m", [1, MAX_M, MAX_M + 1, 20])
def test_linear_layer_dispatch(m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A switched Linear runs the kernel for 1..MAX_M rows on CUDA only, else F.linear; both match nn.Linear."""
    calls = []

    def spy(*args: object) -> torch.Tensor:
        calls.append(args)
        return small_m_linear(*args)

    monkeypatch.setattr(linear_triton, "small_m_linear", spy)
    layer = Linear(100, 37, device=DEVICE)
    x = torch.randn(m, 100, device=DEVICE)
    with torch.no_grad():
        expected = F.linear(x, layer.weight, layer.bias)
        assert torch.equal(layer(x), expected) and not calls  # off by default
        layer.use_triton()
        assert_close(layer(x), expected, f32)
        assert len(calls) == (1 if ON_GPU and m <= MAX_M else 0)
        assert torch.equal(layer(x[None]), F.linear(x[None], layer.weight, layer.bias))  # 3-D: always F.linear
    assert len(calls) == (1 if ON_GPU and m <= MAX_M else 0)


@pytest.mark.skipif(not ON_GPU, reason="CUDA-graph capture needs a GPU")
@pytest.mark.parametrize(
    ("m", "n", "k", "dtype", "bias"), [(1, 4096, 1024, bf16, False), (MAX_M, 1000, 100, f32, True)]
)
def test_replays_in_cuda_graph(m: int, n: int, k: int, dtype: torch.dtype, bias: bool) -> None:
    """Captured once, the kernel reads whatever x and weight hold at replay time."""
    x, weight, b = _inputs(m, n, k, dtype, bias, "graph")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        small_m_linear(x, weight, b)  # compiles the kernel outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = small_m_linear(x, weight, b)

    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        x.copy_(torch.randn(x.shape, generator=gen).to(dtype))
        weight.mul_(-1)
        graph.replay()
        eager = small_m_linear(x, weight, b)
        assert torch.equal(out, eager)
        assert_close(out, _reference(x, weight, b), dtype)


@pytest.mark.skipif(not ON_GPU, reason="the kernel path runs on CUDA only")
@pytest.mark.parametrize("architecture", ["Qwen3ForCausalLM", "GPT2LMHeadModel"])
def test_model_with_triton_linears(architecture: str, tiny_model_dir: Callable[..., Path]) -> None:
    """A short prefill and decode steps with padding rows (all at most MAX_M rows: every projection and lm_head runs
    the kernel) give the logits of the same model on F.linear."""
    model_config = ModelConfig(path=str(tiny_model_dir(architecture)))
    model = load_model(model_config, load_hf_config(model_config), f32, torch.device(DEVICE))
    tokens = [3, 1, 4, 1, 5, 9, 2, 6]

    expected = prefill_then_decode_logits(model, tokens)
    use_triton_layers(model, gemv=True)
    assert_close(prefill_then_decode_logits(model, tokens), expected, f32)


def _check_silu_and_mul(m: int, n: int, k: int, dtype: torch.dtype, bias: bool,
                        config: LinearConfig | None = None) -> None:
    """Against the unfused ops: SiluAndMul of the gate/up projection (2n weight rows) rounded to the output dtype."""
    x, weight, b = _inputs(m, 2 * n, k, dtype, bias, ("silu", m, n, k, dtype, bias, config))
    expected = silu_and_mul(_reference(x, weight, b).to(dtype)).float()
    _assert_close_activated(small_m_linear(x, weight, b, config, silu_and_mul=True), expected, dtype)


def _assert_close_activated(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype,
                            prologue_atol: float = 0.0) -> None:
    """actual against the unfused ops' expected output, after SiluAndMul. The interpreter truncates where the GPU
    rounds: the projection's two halves, the SiLU and the product each lose up to a bf16 ulp (2**-7 relative), on
    top of what a fused prologue's roundings cost the dot (prologue_atol)."""
    if ON_GPU or dtype == f32:
        assert_close(actual, expected, dtype)
        return
    assert actual.dtype == dtype and actual.shape == expected.shape
    scale = max(float(expected.abs().max()), 1.0)
    torch.testing.assert_close(actual.float(), expected, atol=4 * 2**-7 * scale + prologue_atol,
                               rtol=TOLERANCE[dtype])


def _assert_close_fused(actual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        dtype: torch.dtype) -> None:
    """actual against F.linear(x, weight, bias), x the unfused ops' output."""
    expected = _reference(x, weight, bias)
    if ON_GPU or dtype == f32:
        assert_close(actual, expected, dtype)
        return
    assert actual.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float(), expected, atol=_prologue_atol(x, weight) + tol, rtol=tol)


def _prologue_atol(x: torch.Tensor, weight: torch.Tensor) -> float:
    """The interpreter truncates each bf16 rounding of a fused prologue (up to 3 per element), which biases every
    term of the dot by up to 3 bf16 ulps."""
    return 3 * 2**-7 * float((x.float().abs() @ weight.float().abs().T).max())


def _check_add_rms_norm(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, with_residual: bool,
                        config: LinearConfig | None = None, with_silu: bool = False, gemma_style: bool = False) -> None:
    """Against the unfused ops: F.linear of rms_norm(x + residual) (then SiluAndMul, with_silu: 2n weight rows),
    and the new residual x + residual. gemma_style: Gemma's norm (a zero-centred weight), gemma_rms_norm."""
    seed = ("norm", m, n, k, dtype, bias, with_residual, config, with_silu)
    x, weight, b = _inputs(m, 2 * n if with_silu else n, k, dtype, bias, seed)
    gen = torch.Generator().manual_seed(m * k)
    residual = (torch.randn(m, k, generator=gen) * 4).to(dtype).to(DEVICE) if with_residual else None
    norm_weight = (int(not gemma_style) + torch.randn(k, generator=gen) / 4).to(dtype).to(DEVICE)
    eps = 1e-6
    out, new_residual = add_rms_norm_linear(x, residual, norm_weight, eps, weight, b, config, silu_and_mul=with_silu,
                                            gemma_style=gemma_style)
    summed = x if residual is None else x + residual
    normed = (gemma_rms_norm if gemma_style else rms_norm)(summed, norm_weight, eps)
    if with_silu:
        expected = silu_and_mul(_reference(normed, weight, b).to(dtype)).float()
        _assert_close_activated(out, expected, dtype, _prologue_atol(normed, weight))
    else:
        _assert_close_fused(out, normed, weight, b, dtype)
    if residual is None:
        assert new_residual is x
    elif ON_GPU or dtype == f32:
        assert torch.equal(new_residual, summed)
    else:  # the interpreter truncates the bf16 sum rather than rounding it
        assert_close(new_residual, summed.float(), dtype)


@pytest.mark.parametrize("dtype", [f32, bf16])
@pytest.mark.parametrize("m", range(1, MAX_M + 1))
def test_fused_every_m(m: int, dtype: torch.dtype) -> None:
    """The fused norm, the fused SiLU-and-mul and both at every row count, with a partial last block of rows and a K
    that is no power of two."""
    n = 37 if not ON_GPU else 1000
    _check_silu_and_mul(m, n, 100, dtype, bias=m % 2 == 0)
    _check_add_rms_norm(m, n, 100, dtype, bias=m % 2 == 1, with_residual=m != 3)
    _check_add_rms_norm(m, n, 100, dtype, bias=m % 2 == 0, with_residual=m != 4, with_silu=True)
    _check_add_rms_norm(m, n, 100, dtype, bias=False, with_residual=m != 5, gemma_style=True)


# (N, K): N of 1, a prime and non-multiples of BLOCK_N; K of 1, uneven and powers of two; with a small BLOCK_K, K in
# several unrolled chunks with a partial last one (the norm then sums its squares over all of them first).
FUSED_CASES = [(1, 64, None), (5, 100, None), (67, 1, None), (67, 256, None), (45, 300, LinearConfig(2, 64, 1)),
               (45, 300, LinearConfig(4, 128, 2))]


@pytest.mark.parametrize("dtype", [f32, bf16])
@pytest.mark.parametrize(("n", "k", "config"), FUSED_CASES, ids=str)
def test_fused_shapes(n: int, k: int, config: LinearConfig | None, dtype: torch.dtype) -> None:
    m = 1 + zlib.crc32(str((n, k, dtype)).encode()) % MAX_M
    _check_silu_and_mul(m, n, k, dtype, bias=True, config=config)
    _check_add_rms_norm(m, n, k, dtype, bias=False, with_residual=True, config=config)
    _check_add_rms_norm(m, n, k, dtype, bias=True, with_residual=False, config=config)
    _check_add_rms_norm(m, n, k, dtype, bias=False, with_residual=True, config=config, with_silu=True)
    _check_add_rms_norm(m, n, k, dtype, bias=False, with_residual=True, config=config, gemma_style=True)


@pytest.mark.skipif(not ON_GPU, reason="CUDA-graph capture needs a GPU")
def test_fused_kernels_replay_in_cuda_graph() -> None:
    """Captured once, both fused launches read what their inputs hold at replay time; the new residual too."""
    x, weight, _ = _inputs(2, 4096, 1024, bf16, False, "fused graph")
    residual, norm_weight = torch.randn_like(x), torch.rand(1024, device=DEVICE, dtype=bf16)

    def launches() -> tuple[torch.Tensor, ...]:
        return (*add_rms_norm_linear(x, residual, norm_weight, 1e-6, weight),
                *add_rms_norm_linear(x, residual, norm_weight, 1e-6, weight, silu_and_mul=True))

    graph, captured = capture_graph(launches)
    for _ in range(3):
        for tensor in (x, residual):
            tensor.copy_(torch.randn_like(tensor))
        graph.replay()
        for replayed, eager in zip(captured, launches(), strict=True):
            assert torch.equal(replayed, eager)


def _counting(calls: dict[str, int], kernel: Callable[..., object]) -> Callable[..., object]:
    """kernel, counting its calls by whether they fuse SiLU-and-mul, and Gemma's norm."""
    def spy(*args: object, silu_and_mul: bool = False, gemma_style: bool = False) -> object:
        calls["with SiLU" if silu_and_mul else "Gemma norm" if gemma_style else "norm only"] += 1
        return kernel(*args, silu_and_mul=silu_and_mul, gemma_style=gemma_style)

    return spy


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("architecture", ["Qwen3ForCausalLM", "LlamaForCausalLM", "Gemma2ForCausalLM"])
def test_model_with_fused_linears(architecture: str, fuse: bool, tiny_model_dir: Callable[..., Path],
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """With every Linear on the kernel (prefill and decode steps of at most MAX_M rows), the model's logits match
    F.linear's; with the fusions switched on, the layers' RMSNorms and SiluAndMul run inside the GEMV (per layer and
    step: the qkv projection with its norm, gate/up with its norm and SiLU; Gemma's GeGLU stays outside), switched
    off, never."""
    monkeypatch.setattr(fused, "FUSE_SILU_AND_MUL", fuse)
    monkeypatch.setattr(fused, "FUSE_ADD_RMS_NORM", fuse)
    # The tiny layers' programs hold few weight rows: the 5-row prefill takes the fusion as larger weights' would.
    monkeypatch.setattr(linear_triton, "norm_pass_is_cheap", lambda *args: True)
    calls = {"norm only": 0, "with SiLU": 0, "Gemma norm": 0}
    monkeypatch.setattr(linear_triton, "add_rms_norm_linear", _counting(calls, linear_triton.add_rms_norm_linear))
    model_config = ModelConfig(path=str(tiny_model_dir(architecture)))
    model = load_model(model_config, load_hf_config(model_config), f32, torch.device(DEVICE))
    tokens = [3, 1, 4, 1, 5, 9, 2]

    with torch.no_grad():
        expected = prefill_then_decode_logits(model, tokens)
        for layer in model.modules():
            if isinstance(layer, Linear):
                layer.use_triton(DEVICE)
        assert_close(prefill_then_decode_logits(model, tokens), expected, f32)
    steps = 1 + len(tokens[5:])
    layers = model.config.num_hidden_layers
    fused_calls = layers * steps if fuse else 0
    if architecture.startswith("Gemma"):
        assert calls == {"norm only": 0, "with SiLU": 0, "Gemma norm": 2 * fused_calls}
    else:
        assert calls == {"norm only": fused_calls, "with SiLU": fused_calls, "Gemma norm": 0}
