"""fp8 weights: quantization, the _scaled_mm path of Fp8Linear (torch's CPU kernels; CUDA with a GPU), loading an fp8
checkpoint's scales into fused layers, and the dequantized fallback."""

from __future__ import annotations

import importlib.util
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchgen.layers import fp8
from batchgen.layers.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    Fp8Kernel,
    Fp8Linear,
    dequantize,
    fits_scaled_mm,
    quantize_per_channel,
    quantize_rows_reference,
    row_amax,
    scaled_mm_linear,
)
from batchgen.layers.fp8_loading import (
    finish_fp8,
    fp8_checkpoint_tensors,
    quantizable_layers,
    quantizable_linears,
    use_fp8_layers,
)
from batchgen.layers.linear import Linear
from batchgen.layers.moe import StackedExperts
from batchgen.layers.parallel_linear import (
    Fp8RowParallelLinear,
    RowParallelLinear,
    column_parallel_linear,
    row_parallel_linear,
)
from batchgen.layers.tensor_parallel import Shard, TensorParallel, building, shard_of
from batchgen.models.weights import WeightTarget, fused_rows, load_into

CPU = torch.device("cpu")
HAS_TRITON = importlib.util.find_spec("triton") is not None


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Rows of very different magnitudes, as trained layers have: a per-tensor scale would round the small ones."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=gen) * torch.logspace(-3, 0, n)[:, None]


def test_per_channel_quantization_rounds_each_row_to_its_own_scale() -> None:
    weight = _weight(40, 64)
    weight[3] = 0  # an all-zero row quantizes to zeros, not NaN
    values, scale = quantize_per_channel(weight)
    assert values.dtype == FP8_DTYPE and values.shape == (40, 64) and scale.shape == (40,)
    assert torch.equal(values.float().abs().amax(dim=1)[scale > 1e-9], torch.full((39,), FP8_MAX))
    restored = dequantize(values, scale, torch.float32)
    assert torch.equal(restored[3], torch.zeros(64))
    # round to nearest with 3 mantissa bits: at most 2**-4 of each value, or half the subnormal step 2**-9 * scale
    assert ((restored - weight).abs() <= weight.abs() * 2**-4 + scale[:, None] * 2**-10).all()


def test_row_quantization_reference() -> None:
    x = torch.randn(5, 48) * torch.tensor([1e-4, 1.0, 30.0, 0.0, 1e3])[:, None]
    values, scale = quantize_rows_reference(x.bfloat16())
    assert values.dtype == FP8_DTYPE and scale.shape == (5, 1) and scale.dtype == torch.float32
    assert torch.equal(values[3].float(), torch.zeros(48))
    restored = values.float() * scale
    xf = x.bfloat16().float()
    assert ((restored - xf).abs() <= xf.abs() * 2**-4 + scale * 2**-10).all()


def _scaled_mm_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         bias: torch.Tensor | None) -> torch.Tensor:
    """The exact product of the fp8 operands with their scales (float64), as float32."""
    values, row_scale = quantize_rows_reference(x)
    out = (values.double() * row_scale.double()) @ (weight.double() * weight_scale.double()[:, None]).T
    return (out if bias is None else out + bias.double()).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_scaled_mm_linear_applies_row_and_channel_scales(dtype: torch.dtype, bias: bool) -> None:
    weight, weight_scale = quantize_per_channel(_weight(48, 64))
    x = (torch.randn(9, 64) * torch.logspace(-2, 1, 9)[:, None]).to(dtype)
    b = torch.randn(48).to(dtype) if bias else None
    out = scaled_mm_linear(x, weight, weight_scale, b)
    assert out.dtype == dtype and out.shape == (9, 48)
    expected = _scaled_mm_reference(x, weight, weight_scale, b)
    rtol = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
    torch.testing.assert_close(out.float(), expected, rtol=rtol, atol=rtol * float(expected.abs().max()))
    assert scaled_mm_linear(x[:0], weight, weight_scale, b).shape == (0, 48)
    assert scaled_mm_linear(x.view(3, 3, 64), weight, weight_scale, b).shape == (3, 3, 48)


@torch.no_grad()
def test_fp8_linear_quantizes_a_linear() -> None:
    linear = Linear(64, 32, bias=True)
    layer = Fp8Linear.quantized(linear)
    values, scale = quantize_per_channel(linear.weight)
    assert torch.equal(layer.weight.view(torch.uint8), values.view(torch.uint8))
    assert torch.equal(layer.weight_scale, scale) and torch.equal(layer.bias, linear.bias)
    assert layer.dtype == torch.float32 and not layer.weight.requires_grad
    x = torch.randn(3, 64)
    assert not layer.runs_triton(x)  # the GEMV runs on CUDA inputs only
    torch.testing.assert_close(layer(x), _scaled_mm_reference(x, values, scale, linear.bias))
    # close to the float layer: about 2**-4 relative error from each operand's rounding
    expected = F.linear(x, linear.weight, linear.bias)
    torch.testing.assert_close(layer(x), expected, rtol=0, atol=0.1 * float(expected.abs().max()))


def test_fp8_linear_takes_the_gemv_for_one_row_the_gemm_up_to_its_limit_and_scaled_mm_past_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    layer = Fp8Linear.quantized(Linear(64, 32, bias=False))
    assert layer.kernel_for(torch.randn(2, 64)) is Fp8Kernel.SCALED_MM  # the kernels run on CUDA inputs only
    layer.use_triton("cpu")
    limit = fp8.FP8_GEMM_MAX_ROWS
    kernels = {rows: layer.kernel_for(torch.randn(rows, 64)) for rows in (1, 2, 3, limit, limit + 1, 4096)}
    assert kernels == {1: Fp8Kernel.GEMV, 2: Fp8Kernel.SMALL_M_GEMM, 3: Fp8Kernel.SMALL_M_GEMM,
                       limit: Fp8Kernel.SMALL_M_GEMM, limit + 1: Fp8Kernel.SCALED_MM, 4096: Fp8Kernel.SCALED_MM}
    assert layer.runs_triton(torch.randn(1, 64))  # the GEMV, which the norm and SiLU fusions need
    assert not any(layer.runs_triton(torch.randn(rows, 64)) for rows in (2, 4, 8, 64))
    assert layer.kernel_for(torch.randn(0, 64)) is Fp8Kernel.SCALED_MM
    assert layer.kernel_for(torch.randn(2, 3, 64)) is Fp8Kernel.SCALED_MM
    monkeypatch.setattr(fp8, "FP8_GEMM_MAX_ROWS", 2 * limit)  # read at each call, as a benchmark moves it
    assert layer.kernel_for(torch.randn(2 * limit, 64)) is Fp8Kernel.SMALL_M_GEMM
    assert layer.kernel_for(torch.randn(2 * limit + 1, 64)) is Fp8Kernel.SCALED_MM


LLAMA3_8B_FP8 = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate_up, down (N, K)


@pytest.mark.skipif(not HAS_TRITON, reason="the launch configuration lives beside the Triton kernel")
@pytest.mark.parametrize("rows", [2, 3, 8, 16, 17, 32, 64, 100, 128])
def test_fp8_gemm_configs_fill_the_gpu_and_fit_its_shared_memory(rows: int) -> None:
    """On Llama-3.1-8B's projections: a row tile covering the rows (up to 64), enough programs for every SM unless
    a split would have too few K steps, and pipeline stages that fit an H100's shared memory, or an Ada GPU's."""
    from batchgen.layers.fp8_gemm_triton import (
        HOPPER,
        MIN_K_STEPS_PER_SPLIT,
        GpuLimits,
        fp8_small_m_config,
        stages_that_fit,
    )

    ada = GpuLimits(sm_count=128, shared_memory_bytes=99 * 1024)
    for limits in (HOPPER, ada):
        for n, k in LLAMA3_8B_FP8:
            config = fp8_small_m_config(rows, n, k, 2, limits)
            assert config.block_m == min(64, max(16, 1 << (rows - 1).bit_length()))
            programs = -(-rows // config.block_m) * -(-n // config.block_n) * config.split_k
            k_steps_per_split = k // config.block_k // config.split_k
            assert programs >= limits.sm_count or k_steps_per_split < 2 * MIN_K_STEPS_PER_SPLIT
            assert k_steps_per_split >= MIN_K_STEPS_PER_SPLIT
            assert 2 <= config.num_stages == stages_that_fit(config.block_m, config.block_n, config.block_k, 2,
                                                             config.weight_first, limits.shared_memory_bytes)
            stage_bytes = config.block_k * (config.block_n + 2 * config.block_m)
            assert config.num_stages * stage_bytes < limits.shared_memory_bytes
    # o_proj and down_proj have 4096 rows, 64 tiles of 64: they split K; gate_up's 448 tiles do not.
    assert fp8_small_m_config(rows, 4096, 14336).split_k > 1
    assert fp8_small_m_config(rows, 28672, 4096).split_k == 1


@pytest.mark.skipif(not HAS_TRITON, reason="the launch configuration lives beside the Triton kernel")
def test_fp8_gemm_config_halves_the_k_step_for_float32_x_and_keeps_small_shapes_in_one_tile() -> None:
    from batchgen.layers.fp8_gemm_triton import fp8_small_m_config

    assert fp8_small_m_config(8, 4096, 4096, 4).block_k == fp8_small_m_config(8, 4096, 4096, 2).block_k // 2
    tiny = fp8_small_m_config(5, 40, 24)
    assert (tiny.block_n, tiny.block_k, tiny.split_k) == (64, 32, 1)


def test_fits_scaled_mm() -> None:
    assert fits_scaled_mm(4096, 1024) and fits_scaled_mm(16, 16)
    assert not fits_scaled_mm(4096, 1000) and not fits_scaled_mm(37, 64)


class TinyDecoder(nn.Module):
    """A fused qkv projection and a plain one inside a decoder, a head beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.qkv_proj = Linear(32, 64, bias=True)  # q: 32 rows, k and v: 16 each
        self.model.o_proj = Linear(32, 32, bias=False)
        self.model.odd_proj = Linear(32, 40, bias=False)  # 40 rows: not a multiple of 16
        self.lm_head = Linear(32, 100, bias=False)


def test_quantizable_linears_leave_the_heads() -> None:
    network = TinyDecoder()
    assert [name for _, name in quantizable_linears(network)] == ["qkv_proj", "o_proj", "odd_proj"]


class TinySparseBlock(nn.Module):
    """A router its block keeps in the model's dtype, and the experts it routes to."""

    unquantized_linears = ("gate",)

    def __init__(self) -> None:
        super().__init__()
        self.gate = Linear(32, 4, bias=False)
        self.experts = StackedExperts(num_experts=4, hidden_size=32, intermediate_size=24, top_k=2, renormalize=True)
        with torch.no_grad():
            self.experts.gate_up_proj.copy_(torch.randn(4, 48, 32) * torch.logspace(-2, 0, 48)[:, None])
            self.experts.down_proj.normal_()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden, self.gate(hidden))


class TinyMoe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.o_proj = Linear(32, 32, bias=False)
        self.model.mlp = TinySparseBlock()
        self.lm_head = Linear(32, 100, bias=False)


def test_quantizable_layers_are_the_linears_then_the_experts_not_the_router() -> None:
    network = TinyMoe()
    assert [name for _, name in quantizable_linears(network)] == ["o_proj"]
    assert [name for _, name in quantizable_layers(network)] == ["o_proj", "experts"]
    use_fp8_layers(network)
    experts = network.model.mlp.experts
    assert experts.fp8 and experts.dtype == torch.float32 and isinstance(network.model.mlp.gate, Linear)
    assert [name for name, _ in experts.named_parameters()] == ["gate_up_proj", "down_proj", "gate_up_proj_scale",
                                                                "down_proj_scale"]
    assert experts.gate_up_proj_scale.shape == (4, 48) and experts.down_proj_scale.shape == (4, 32)


@torch.no_grad()
def test_fp8_experts_hold_each_row_with_its_own_scale() -> None:
    """Quantized a row of an expert at a time; on CPU (no kernels) they compute what their dequantized twin does."""
    block = TinySparseBlock()
    quantized = block.experts.quantized()
    for name in ("gate_up_proj", "down_proj"):
        values, scale = quantize_per_channel(getattr(block.experts, name))
        assert torch.equal(getattr(quantized, name).view(torch.uint8), values.view(torch.uint8))
        assert torch.equal(getattr(quantized, f"{name}_scale"), scale)
    dequantized = quantized.dequantized()
    assert not dequantized.fp8 and dequantized.gate_up_proj_scale is None
    assert torch.equal(dequantized.down_proj, dequantize(*quantize_per_channel(block.experts.down_proj), torch.float32))
    hidden = torch.randn(7, 32)
    logits = block.gate(hidden)
    torch.testing.assert_close(quantized(hidden, logits), dequantized(hidden, logits), rtol=0, atol=0)
    expected = block.experts(hidden, logits)
    torch.testing.assert_close(quantized(hidden, logits), expected, rtol=0, atol=0.1 * float(expected.abs().max()))


def test_finish_fp8_quantizes_experts_and_keeps_the_router(caplog: pytest.LogCaptureFixture) -> None:
    network = TinyMoe()
    router, experts = network.model.mlp.gate.weight.clone(), network.model.mlp.experts
    with caplog.at_level(logging.INFO, logger="batchgen.layers.fp8_loading"):
        finish_fp8(network, CPU)
    assert caplog.messages == ["fp8 weights of 2 layers dequantized to the model's dtype: cpu does not run fp8 (its "
                               "kernels need CUDA compute capability 8.9 or later)"]
    assert torch.equal(network.model.mlp.gate.weight, router)
    for name in ("gate_up_proj", "down_proj"):
        expected = dequantize(*quantize_per_channel(getattr(experts, name)), torch.float32)
        assert torch.equal(getattr(network.model.mlp.experts, name), expected)
    assert not network.model.mlp.experts.fp8


def _fp8_shard(rows: int, per_channel: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    weight = _weight(rows, 32, seed)
    amax = weight.abs().amax(dim=1, keepdim=True) if per_channel else weight.abs().amax()
    scale = amax / FP8_MAX
    return (weight / scale).to(FP8_DTYPE), scale


def test_checkpoint_scales_fill_fused_rows() -> None:
    """q, k and v with per-tensor scales of their own (a scalar, a 1-element vector, per_channel (N, 1)) and the
    scale_inv name: the fused layer holds each shard's values and its scale repeated over the shard's rows."""
    network = TinyDecoder()
    use_fp8_layers(network)
    qkv = network.model.qkv_proj
    assert isinstance(qkv, Fp8Linear) and isinstance(network.lm_head, Linear)
    shards = {"q_proj": _fp8_shard(32, False, 1), "k_proj": _fp8_shard(16, False, 2),
              "v_proj": _fp8_shard(16, True, 3)}
    bias = torch.randn(64)
    checkpoint = [
        ("model.q_proj.weight", shards["q_proj"][0]), ("model.q_proj.weight_scale", shards["q_proj"][1]),
        ("model.q_proj.input_scale", torch.tensor(0.1)),
        ("model.k_proj.weight", shards["k_proj"][0]), ("model.k_proj.weight_scale_inv", shards["k_proj"][1][None]),
        ("model.v_proj.weight", shards["v_proj"][0]), ("model.v_proj.weight_scale", shards["v_proj"][1]),
        ("model.qkv_proj.bias", bias),
    ]
    targets = {"model.qkv_proj.bias": WeightTarget(qkv.bias)}
    for shard, block in zip(shards, fused_rows([32, 16, 16]), strict=True):
        targets[f"model.{shard}.weight"] = WeightTarget(qkv.weight, block)
        targets[f"model.{shard}.weight_scale"] = WeightTarget(qkv.weight_scale, block)
    load_into(targets, fp8_checkpoint_tensors(checkpoint))
    expected = torch.cat([values.float() * scale for values, scale in shards.values()])
    torch.testing.assert_close(dequantize(qkv.weight, qkv.weight_scale, torch.float32), expected, rtol=0, atol=0)
    assert torch.equal(qkv.weight_scale[:32], shards["q_proj"][1].expand(32))
    assert torch.equal(qkv.bias, bias)


def test_float_tensor_into_fp8_layer_is_refused() -> None:
    layer = Fp8Linear(32, 16, bias=False, dtype=torch.float32)
    with pytest.raises(ValueError, match="checkpoint tensor w is torch.float32, but the model holds w in "
                                         "torch.float8_e4m3fn"):
        load_into({"w": WeightTarget(layer.weight)}, [("w", torch.randn(16, 32))])
    with pytest.raises(ValueError, match="checkpoint tensor h is torch.float8_e4m3fn, but the model holds h in "
                                         "torch.float32"):
        load_into({"h": WeightTarget(Linear(32, 16).weight)}, [("h", torch.randn(16, 32).to(FP8_DTYPE))])


def test_block_wise_scales_are_refused() -> None:
    tensors = [("model.q_proj.weight_scale_inv", torch.ones(2, 4))]
    with pytest.raises(ValueError, match=r"model.q_proj.weight_scale has shape \(2, 4\): block-wise fp8 weight"):
        list(fp8_checkpoint_tensors(tensors))


def test_finish_fp8_dequantizes_on_cpu(caplog: pytest.LogCaptureFixture) -> None:
    network = TinyDecoder()
    float_weights = {name: module.weight.clone() for name, module in network.named_modules()
                     if isinstance(module, Linear)}
    head = network.lm_head
    with caplog.at_level(logging.INFO, logger="batchgen.layers.fp8_loading"):
        finish_fp8(network, CPU)
    assert caplog.messages == ["fp8 weights of 3 layers dequantized to the model's dtype: cpu does not run fp8 (its "
                               "kernels need CUDA compute capability 8.9 or later)"]
    assert network.lm_head is head
    for name, module in network.named_modules():
        if isinstance(module, Linear) and name != "lm_head":
            expected = dequantize(*quantize_per_channel(float_weights[name]), torch.float32)
            assert torch.equal(module.weight, expected), name
    assert not any(isinstance(module, Fp8Linear) for module in network.modules())


class PeerRank:
    """Rank 0's collectives of two ranks, whose peer's all-gather inputs are given, in the order it sends them."""

    def __init__(self, peer_inputs: list[torch.Tensor]) -> None:
        self.peer_inputs = peer_inputs

    def all_reduce(self, tensor: torch.Tensor) -> None:
        raise AssertionError("loading reduces nothing")

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.cat([tensor, self.peer_inputs.pop(0)])


class TinyRank(nn.Module):
    """Rank 0 of two of a decoder's qkv (column-parallel), o_proj (row-parallel) and experts (each expert's
    intermediate columns split), filled with its slices of the given whole weights."""

    def __init__(self, tp: TensorParallel, qkv: torch.Tensor, o_proj: torch.Tensor, down: torch.Tensor) -> None:
        super().__init__()
        self.model = nn.Module()
        with building(tp), torch.no_grad():
            self.model.qkv_proj = column_parallel_linear(32, [tp.even_part(32), tp.even_part(16), tp.even_part(16)])
            self.model.o_proj = row_parallel_linear(64, 32)
            self.model.experts = StackedExperts(num_experts=4, hidden_size=32, intermediate_size=24, top_k=2,
                                                renormalize=True)
            tp.mark(self.model.experts.down_proj, 1, tp.even_part(48))
            self.model.qkv_proj.weight.copy_(torch.cat([qkv[:16], qkv[32:40], qkv[48:56]]))
            self.model.o_proj.weight.copy_(o_proj[:, :32])
            self.model.experts.down_proj.copy_(down[..., :24])


@torch.no_grad()
def test_a_row_parallel_rank_quantizes_its_columns_by_the_whole_rows_maxima() -> None:
    """model.quantization=fp8 with tensor parallelism: a rank's fp8 weights are its slices of the one-rank fp8
    weights. Column-parallel rows are whole on the rank; a row-parallel rank (o_proj, an expert's down projection)
    holds half of each row, and scales it by the maximum of the whole row, which it gathers from its peer."""
    qkv, o_proj, down = _weight(64, 32, seed=1), _weight(32, 64, seed=2), torch.randn(4, 32, 48)
    tp = TensorParallel(0, 2, PeerRank([row_amax(o_proj[:, 32:]), row_amax(down[..., 24:])]))
    network = TinyRank(tp, qkv, o_proj, down)
    layouts = {name: shard_of(param) for name, param in network.named_parameters()}
    finish_fp8(network, CPU, tp)

    def one_rank(weight: torch.Tensor) -> torch.Tensor:
        return dequantize(*quantize_per_channel(weight), torch.float32)

    assert isinstance(network.model.o_proj, RowParallelLinear)  # its forward still sums over the ranks
    assert torch.equal(network.model.o_proj.weight, one_rank(o_proj)[:, :32])
    assert not torch.equal(network.model.o_proj.weight, one_rank(o_proj[:, :32]))  # the peer's maxima mattered
    assert torch.equal(network.model.experts.down_proj, one_rank(down)[..., :24])
    assert torch.equal(network.model.qkv_proj.weight, one_rank(torch.cat([qkv[:16], qkv[32:40], qkv[48:56]])))
    assert {name: shard_of(param) for name, param in network.named_parameters()} == layouts


def test_fp8_layers_keep_their_split_and_split_the_scales_of_split_rows() -> None:
    """An fp8 checkpoint's layers on a tensor-parallel rank: a column-parallel layer's scales split as its rows (q, k
    and v each), a row-parallel layer's whole; a row-parallel layer stays row-parallel."""
    tp = TensorParallel(0, 2)
    network = TinyRank(tp, torch.zeros(64, 32), torch.zeros(32, 64), torch.zeros(4, 32, 48))
    use_fp8_layers(network)
    qkv, o_proj, experts = network.model.qkv_proj, network.model.o_proj, network.model.experts
    assert type(qkv) is Fp8Linear and isinstance(o_proj, Fp8RowParallelLinear) and experts.fp8
    assert shard_of(qkv.weight_scale) == shard_of(qkv.weight) == Shard(0, (tp.even_part(32), tp.even_part(16),
                                                                           tp.even_part(16)))
    assert shard_of(o_proj.weight) == Shard(1, (tp.even_part(64),)) and shard_of(o_proj.weight_scale) is None
    assert shard_of(experts.down_proj) == Shard(1, (tp.even_part(48),)) and shard_of(experts.down_proj_scale) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_finish_fp8_on_cuda_keeps_fp8_where_scaled_mm_fits(caplog: pytest.LogCaptureFixture) -> None:
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a GPU with fp8 (compute capability 8.9 or later)")
    network = TinyDecoder().cuda().bfloat16()
    with caplog.at_level(logging.INFO, logger="batchgen.layers.fp8_loading"):
        finish_fp8(network, torch.device("cuda"))
    assert isinstance(network.model.qkv_proj, Fp8Linear) and isinstance(network.model.o_proj, Fp8Linear)
    assert isinstance(network.model.odd_proj, Linear) and network.model.odd_proj.weight.dtype == torch.bfloat16
    assert caplog.messages == ["fp8 weights of 1 linear layers dequantized to the model's dtype: torch._scaled_mm "
                               "needs both sizes of a weight to be multiples of 16"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_scaled_mm_linear_on_cuda(dtype: torch.dtype) -> None:
    """Prefill-sized inputs on the Qwen3-0.6B gate/up shape: the Triton row quantization and torch._scaled_mm against
    the exact product of the same fp8 operands."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a GPU with fp8 (compute capability 8.9 or later)")
    from batchgen.layers.fp8_triton import quantize_rows

    weight, weight_scale = (t.cuda() for t in quantize_per_channel(_weight(6144, 1024)))
    x = torch.randn(300, 1024, device="cuda").to(dtype)
    bias = torch.randn(6144, device="cuda").to(dtype)
    out = scaled_mm_linear(x, weight, weight_scale, bias)
    values, row_scale = quantize_rows(x)
    reference_values, reference_scale = quantize_rows_reference(x)
    torch.testing.assert_close(row_scale, reference_scale, rtol=1e-6, atol=0)
    # one fp8 rounding may go the other way where the division differs in its last bit
    assert (values.float() != reference_values.float()).float().mean() < 1e-3
    expected = ((values.double() * row_scale.double()) @ (weight.double() * weight_scale.double()[:, None]).T
                + bias.double()).float()
    # float32 output is no closer than float16's: Hopper's fp8 tensor cores accumulate below float32 precision
    tol = {torch.float32: 2**-10, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol * float(expected.abs().max()))
