"""Linear layers with fp8 weights: float8_e4m3fn values and one float32 scale per output channel.

`Fp8Linear` computes x @ (weight * weight_scale[:, None]).T + bias in three ways, by the number of rows of x
(`fp8_kernel`, the one place that decides):
- one row (decode at batch 1): the Triton GEMV (layers/linear_triton.py) reads the fp8 weight, half the bytes of
  bf16, and upcasts it in the kernel; x stays in the model's dtype (weight-only quantization). It runs in eager
  steps too, so that eager and graph decode compute the same; it also takes the residual add + RMSNorm and
  SiLU-and-mul fusions (layers/fused.py), as `Linear`'s GEMV does.
- 2 to FP8_GEMM_MAX_ROWS rows (decode batches, short prefill chunks): the Triton weight-only GEMM
  (layers/fp8_gemm_triton.py) upcasts fp8 weight tiles in registers and multiplies them with x, still in the model's
  dtype, on the tensor cores.
- more rows (prefill): x is quantized to fp8 with one scale per row (token), and torch._scaled_mm multiplies on the
  tensor cores, with the row and channel scales applied to its fp32 sums.
All need a GPU of compute capability 8.9 or later (Ada, Hopper): elsewhere `fp8_loading` dequantizes the weights at
load. On CPU, `forward` runs the _scaled_mm path through torch's CPU kernels (for tests).

Per-channel weight scales (rather than vLLM's one scale per tensor) cost nothing at run time and keep a channel of
small weights from being rounded by the scale of the largest: a checkpoint's per-tensor scales become per-channel
ones by repeating each over its rows (q, k and v of a fused qkv_proj keep their own).
"""

from __future__ import annotations

import enum
from types import ModuleType

import torch
from torch import nn
from torch.nn.utils import skip_init

from batchgen.layers.linear import Linear

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
MIN_AMAX = 1e-12  # the scale of an all-zero row or channel (a padding row): anything positive quantizes it to zeros
# torch._scaled_mm needs both dimensions of the weight to be multiples of 16; a layer with other sizes keeps its
# weight in the model's dtype.
SCALED_MM_ALIGNMENT = 16


def fp8_supported(device: torch.device) -> bool:
    """Whether `device` runs fp8 matmuls: a CUDA device of compute capability 8.9 (Ada) or later."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def fits_scaled_mm(out_features: int, in_features: int) -> bool:
    return out_features % SCALED_MM_ALIGNMENT == 0 and in_features % SCALED_MM_ALIGNMENT == 0


def row_amax(weight: torch.Tensor) -> torch.Tensor:
    """(..., N, K) -> (..., N) float32: each row's absolute maximum, without an absolute copy of the weight."""
    return torch.maximum(weight.amax(dim=-1), -weight.amin(dim=-1)).float()


def quantize_per_channel(weight: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., N, K) weight -> fp8 values (..., N, K) and float32 scales (..., N): each row divided by its absolute
    maximum / 448. amax (..., N): the rows' absolute maxima where the weight holds only part of each row (a
    tensor-parallel rank's columns, layers/fp8_loading.py); default: the weight's own."""
    weight = weight.float()
    scale = (row_amax(weight) if amax is None else amax.float()).clamp(min=MIN_AMAX) / FP8_MAX
    return (weight / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8 (..., N, K) weight and its per-row scales (..., N) -> the weight in `dtype`, multiplied in float32."""
    return (weight.float() * scale[..., None]).to(dtype)


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) -> fp8 (M, K) and float32 scales (M, 1), one per row (token): rows divided by their absmax / 448. The
    torch version of fp8_triton.quantize_rows, for CPU."""
    scale = x.float().abs().amax(dim=1, keepdim=True).clamp(min=MIN_AMAX) / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def scaled_mm_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:  # (..., K) -> (..., N) in x's dtype
    """x @ (weight * weight_scale[:, None]).T + bias, x quantized to fp8 per row and multiplied by torch._scaled_mm
    (fp32 accumulation). weight: (N, K) fp8, row-major (its transpose is the column-major operand _scaled_mm wants)."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] == 0:
        return x.new_empty(*x.shape[:-1], weight.shape[0])
    if rows.is_cuda:
        from batchgen.layers.fp8_triton import quantize_rows  # Triton only where CUDA runs

        quantized, row_scale = quantize_rows(rows)
    else:
        quantized, row_scale = quantize_rows_reference(rows)
    if x.dtype == torch.bfloat16:  # the row-wise scaled kernels write bf16 only
        out = torch._scaled_mm(quantized, weight.t(), scale_a=row_scale, scale_b=weight_scale.view(1, -1),
                               out_dtype=torch.bfloat16)
    else:
        unit = torch.ones((), dtype=torch.float32, device=x.device)
        out = torch._scaled_mm(quantized, weight.t(), scale_a=unit, scale_b=unit, out_dtype=torch.float32)
        out = (out * row_scale * weight_scale).to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


def _gemv_kernels() -> ModuleType:
    from batchgen.layers import linear_triton  # Triton only where the kernels run

    return linear_triton


def _gemm_kernels() -> ModuleType:
    from batchgen.layers import fp8_gemm_triton  # Triton only where the kernels run

    return fp8_gemm_triton


class Fp8Kernel(enum.Enum):
    GEMV = "gemv"  # linear_triton.small_m_linear, weight-only, with the norm and SiLU fusions
    SMALL_M_GEMM = "small_m_gemm"  # fp8_gemm_triton.fp8_small_m_gemm, weight-only
    SCALED_MM = "scaled_mm"  # scaled_mm_linear: x quantized per row, torch._scaled_mm


# The row limits of fp8_kernel, read at each call (a benchmark may move them before the engine captures its graphs).
# The GEMV's tiles of several rows measured slower than _scaled_mm on most of Llama-3.1-8B's projections, and many
# times slower past their register budget (bench_linear --dtype fp8, benchmarks/RESULTS.md, 2026-11-27b).
FP8_GEMV_MAX_ROWS = 1
# _scaled_mm read fp8 weights there no faster than cuBLAS reads bf16 (benchmarks/RESULTS.md, 2026-11-27b). With
# its first, unswept tiles the weight-only GEMM beat it at 8 rows and lost at 64 (benchmarks/RESULTS.md,
# 2026-11-27c): it takes the few-row steps until a sweep of its tiles moves this limit.
FP8_GEMM_MAX_ROWS = 8


def fp8_kernel(rows: int) -> Fp8Kernel:
    """Which kernel multiplies `rows` (> 0) rows of x by an fp8 weight on a GPU."""
    if rows <= FP8_GEMV_MAX_ROWS:
        return Fp8Kernel.GEMV
    if rows <= FP8_GEMM_MAX_ROWS:
        return Fp8Kernel.SMALL_M_GEMM
    return Fp8Kernel.SCALED_MM


class Fp8Linear(nn.Module):
    """A linear layer holding `weight` (out, in) in float8_e4m3fn, `weight_scale` (out,) in float32 and `bias` in
    the model's dtype (`dtype`, that of its inputs and outputs)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.dtype = in_features, out_features, dtype
        self.weight = nn.Parameter(torch.zeros(out_features, in_features, dtype=FP8_DTYPE, device=device),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(torch.ones(out_features, dtype=torch.float32, device=device),
                                         requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)
        self._kernel_device_type = "cuda"

    @classmethod
    def empty_like(cls, linear: nn.Linear) -> Fp8Linear:
        """A layer of linear's shape, bias, dtype and device, to load an fp8 checkpoint into."""
        weight = linear.weight
        return cls(linear.in_features, linear.out_features, linear.bias is not None, weight.dtype, weight.device)

    @classmethod
    def quantized(cls, linear: nn.Linear, amax: torch.Tensor | None = None) -> Fp8Linear:
        """linear's weight quantized per output channel; its bias kept. amax: as quantize_per_channel's."""
        layer = cls.empty_like(linear)
        with torch.no_grad():
            weight, scale = quantize_per_channel(linear.weight, amax)
            layer.weight.copy_(weight)
            layer.weight_scale.copy_(scale)
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def empty_unquantized(self) -> Linear:
        """A `Linear` of this layer's shape, bias, dtype and device, not filled."""
        return skip_init(Linear, self.in_features, self.out_features, bias=self.bias is not None,
                         device=self.weight.device, dtype=self.dtype)

    @torch.no_grad()
    def dequantized(self) -> Linear:
        """This layer with its weights dequantized into the model's dtype: an `empty_unquantized` layer, filled."""
        linear = self.empty_unquantized()
        linear.weight.copy_(dequantize(self.weight, self.weight_scale, self.dtype))
        if self.bias is not None:
            linear.bias.copy_(self.bias)
        return linear

    def use_triton(self, device_type: str = "cuda") -> None:
        """The Triton kernels run on CUDA inputs without this call; device_type "cpu" runs them on CPU inputs
        instead (tests, under TRITON_INTERPRET=1)."""
        self._kernel_device_type = device_type

    def kernel_for(self, x: torch.Tensor) -> Fp8Kernel:
        """The kernel that multiplies x: `fp8_kernel`'s for a (rows, features) input on the kernels' device,
        _scaled_mm for anything else."""
        if x.device.type != self._kernel_device_type or x.dim() != 2 or x.shape[0] == 0:
            return Fp8Kernel.SCALED_MM
        return fp8_kernel(x.shape[0])

    def runs_triton(self, x: torch.Tensor, fused_norm: bool = False) -> bool:
        """Whether a (rows, features) input x goes through the Triton GEMV (which the norm and SiLU fusions of
        layers/fused.py need). fused_norm, as Linear.runs_triton's, changes nothing here: fp8_kernel decides by the
        rows alone."""
        return self.kernel_for(x) is Fp8Kernel.GEMV

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        return self.project(x, self.bias)

    def project(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ dequantized weight.T + bias, with the bias given (as Linear.project)."""
        kernel = self.kernel_for(x)
        if kernel is Fp8Kernel.GEMV:
            return _gemv_kernels().small_m_linear(x, self.weight, bias, weight_scale=self.weight_scale)
        if kernel is Fp8Kernel.SMALL_M_GEMM:
            return _gemm_kernels().fp8_small_m_gemm(x, self.weight, self.weight_scale, bias)
        return scaled_mm_linear(x, self.weight, self.weight_scale, bias)

    def add_rms_norm_forward(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                             eps: float, silu_and_mul: bool = False,
                             gemma_style: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Linear.add_rms_norm_forward's fused launch, on the fp8 weight; only where runs_triton(x)."""
        return _gemv_kernels().add_rms_norm_linear(x, residual, norm_weight, eps, self.weight, self.bias,
                                                        silu_and_mul=silu_and_mul, gemma_style=gemma_style,
                                                        weight_scale=self.weight_scale)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"dtype={self.dtype}")
