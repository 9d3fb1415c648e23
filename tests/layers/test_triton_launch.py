"""Direct launches of compiled Triton kernels (batchgen/layers/triton_launch.py): the same results as Triton's own
launch, a compile of its own for each specialization, none inside compile_ahead's dry run, and Triton's launch for
good once a direct call is refused.

The direct path runs on CUDA only: Triton's CPU interpreter returns no compiled kernel to keep."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="Triton kernels need triton (torch's CPU build has none)")

from batchgen.layers import elementwise_triton, triton_launch  # noqa: E402
from batchgen.layers.norms import add_rms_norm  # noqa: E402
from batchgen.layers.pdl import launch_options  # noqa: E402
from batchgen.worker.compile_ahead import dry_launches  # noqa: E402
from tests.helpers.triton_support import ON_GPU  # noqa: E402

needs_gpu = pytest.mark.skipif(not ON_GPU, reason="direct launches need CUDA")


class CountingKernel:
    """A JIT kernel that counts the launches that go through Triton."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@pytest.fixture
def norm_kernel(monkeypatch):
    """elementwise_triton's add-RMSNorm kernel, its compiled kernels forgotten, counting Triton's launches."""
    direct = elementwise_triton._add_rms_norm
    monkeypatch.setattr(direct, "_compiled", {})
    counting = CountingKernel(direct.kernel)
    monkeypatch.setattr(direct, "kernel", counting)
    return direct, counting


def _inputs(rows: int, dim: int = 1024, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rows * 7 + offset)
    x = torch.randn(rows * dim + offset, generator=gen)[offset:].view(rows, dim).to("cuda", torch.bfloat16)
    if offset:  # the same values, 2 bytes past a 16-byte boundary
        shifted = torch.empty(rows * dim + offset, dtype=torch.bfloat16, device="cuda")
        shifted[offset:].copy_(x.flatten())
        x = shifted[offset:].view(rows, dim)
    residual = torch.randn(rows, dim, generator=gen).to("cuda", torch.bfloat16)
    weight = torch.rand(dim, generator=gen).add(0.5).to("cuda", torch.bfloat16)
    return x, residual, weight


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_a_second_launch_goes_direct_and_computes_what_the_first_did(norm_kernel, rows):
    direct, counting = norm_kernel
    x, residual, weight = _inputs(rows)
    first = elementwise_triton.add_rms_norm(x, residual, weight, 1e-6)
    second = elementwise_triton.add_rms_norm(x, residual, weight, 1e-6)
    assert counting.launches == 1 and len(direct._compiled) == 1
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
    expected, expected_sum = add_rms_norm(x, residual, weight, 1e-6)
    torch.testing.assert_close(second[0], expected, rtol=1.6e-2, atol=1e-2)
    assert torch.equal(second[1], expected_sum)


@pytest.mark.gpu
@needs_gpu
def test_an_unaligned_tensor_or_another_width_launches_through_triton_first(norm_kernel):
    direct, counting = norm_kernel
    results = []
    for rows, dim, offset in ((16, 1024, 0), (16, 1024, 1), (1, 1024, 0), (16, 1024, 1), (8, 1000, 0)):
        x, residual, weight = _inputs(rows, dim, offset)
        out, summed = elementwise_triton.add_rms_norm(x, residual, weight, 1e-6)
        expected, expected_sum = add_rms_norm(x, residual, weight, 1e-6)
        torch.testing.assert_close(out, expected, rtol=1.6e-2, atol=1e-2)
        assert torch.equal(summed, expected_sum)
        results.append(len(direct._compiled))
    # aligned, unaligned, and a width of 1,000 (its own constexpr and a stride not divisible by 16); one row's
    # launch is another grid of the first specialization
    assert results == [1, 2, 2, 2, 3] and counting.launches == 3


def _launch_into(out: torch.Tensor, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> None:
    summed = torch.empty_like(x)
    elementwise_triton._add_rms_norm[(x.shape[0],)](
        x, residual, weight, out, summed, 1e-6, x.stride(0), residual.stride(0), out.stride(0), summed.stride(0),
        DIM=x.shape[1], BLOCK=x.shape[1], HAS_RESIDUAL=True, GEMMA_STYLE=False, num_warps=4,
        **launch_options(x.device),
    )  # fmt: skip


@pytest.mark.gpu
@needs_gpu
def test_nothing_launches_directly_inside_a_dry_run(norm_kernel):
    direct, counting = norm_kernel
    x, residual, weight = _inputs(8)
    out = torch.empty_like(x)
    _launch_into(out, x, residual, weight)
    assert len(direct._compiled) == 1
    untouched = torch.full_like(x, 7.0)
    with dry_launches():
        _launch_into(untouched, x, residual, weight)
    torch.cuda.synchronize()
    assert torch.all(untouched == 7.0)
    assert len(direct._compiled) == 1  # the dry run's stand-in is not kept


class RefusingKernel:
    """A compiled kernel whose launcher takes other arguments than the ones given (another Triton's)."""

    function = packed_metadata = None

    def run(self, *args):
        raise TypeError("function takes exactly 29 arguments (28 given)")


@pytest.mark.gpu
@needs_gpu
def test_a_refused_direct_call_launches_through_triton_from_then_on(norm_kernel, monkeypatch):
    direct, counting = norm_kernel
    monkeypatch.setattr(triton_launch, "_refused", False)
    x, residual, weight = _inputs(4)
    out = torch.empty_like(x)
    _launch_into(out, x, residual, weight)
    ((key, _),) = direct._compiled.items()
    direct._compiled[key] = RefusingKernel()
    refused = torch.empty_like(x)
    _launch_into(refused, x, residual, weight)
    assert triton_launch._refused and counting.launches == 2
    assert torch.equal(refused, out)
    _launch_into(refused, x, residual, weight)
    assert counting.launches == 3


def test_the_key_tells_apart_what_triton_specializes_on():
    key = triton_launch._arg_key
    base = torch.zeros(64, dtype=torch.bfloat16)
    assert key(base) != key(base.float())
    assert key(base) != key(base[1:])  # 2 bytes past the storage's start
    assert key(base) == key(base[8:])  # 16 bytes past it
    assert len({key(1), key(2), key(16), key(2**31), key(2**63), key(-1)}) == 6
    assert key(32) == key(48) and key(3) == key(5)
    assert key(True) != key(1) and key(None) is None
    assert key(0.5) == key(1e-6) != key(1)
