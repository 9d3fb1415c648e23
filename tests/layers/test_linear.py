"""`Linear` as a drop-in nn.Linear in every model: same parameters, tied lm_head kept, plain F.linear on CPU.

The Triton kernel itself is tested in test_linear_triton.py.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchgen.config import ModelConfig
from batchgen.layers.linear import Linear
from batchgen.layers.triton_layers import use_triton_layers
from batchgen.models.loader import load_hf_config, load_model
from tests.helpers.common import MOE_ARCHITECTURES, NATIVE_ARCHITECTURES
from tests.helpers.paged import PagedTestCache

HAS_TRITON = importlib.util.find_spec("triton") is not None
H100_THREAD_CAP = 132 * 2048 // 4  # linear_triton.launch_thread_cap on an H100 or H200: 132 SMs of 2,048 threads


def test_linear_is_a_drop_in_nn_linear() -> None:
    torch.manual_seed(0)
    plain = nn.Linear(16, 8)
    ours = Linear(16, 8)
    ours.load_state_dict(plain.state_dict())
    assert [name for name, _ in ours.named_parameters()] == ["weight", "bias"]
    assert isinstance(ours, nn.Linear) and Linear(16, 8, bias=False).bias is None
    x = torch.randn(3, 5, 16)
    assert torch.equal(ours(x), plain(x))


@pytest.mark.skipif(not HAS_TRITON, reason="the launch configuration lives beside the Triton kernel")
def test_warp_split_config_under_a_thread_cap() -> None:
    """Capped at a quarter of an H200 (132 SMs x 2048 threads): programs take the fewest doublings of their rows
    that bring the launch under the cap; the lm_head, which no MAX_BLOCK_N brings under it, takes twice the rows."""
    from batchgen.layers.linear_triton import MAX_BLOCK_N, warp_split_config

    cap = 132 * 2048 // 4
    for n, k in [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024)]:  # Qwen3-0.6B, lm_head last
        uncapped, capped = warp_split_config(n, k, 2, None), warp_split_config(n, k, 2, cap)
        assert (capped.block_k, capped.num_warps) == (uncapped.block_k, uncapped.num_warps)
        threads = {block_n: -(-n // block_n) * 32 * capped.num_warps  # the launch's threads, by rows per program
                   for block_n in (max(1, capped.block_n // 2), capped.block_n, MAX_BLOCK_N)}
        if threads[MAX_BLOCK_N] > cap:
            assert capped.block_n == 2 * uncapped.block_n
        else:
            assert threads[capped.block_n] <= cap
            assert capped.block_n == uncapped.block_n or threads[max(1, capped.block_n // 2)] > cap
    assert warp_split_config(4096, 1024, 2, cap).block_n == 8  # qkv: 512 programs of 128 threads
    assert warp_split_config(151936, 1024, 2, cap).block_n == 4


@pytest.mark.skipif(not HAS_TRITON, reason="the launch configuration lives beside the Triton kernel")
def test_one_row_tiles_take_two_warp_programs_under_the_cap() -> None:
    """Qwen3-0.6B's projections: two warps a program, 16 weight loads of 16 bytes a thread, all of K in one step.
    A launch that would pass the cap so (the lm_head, an 8B model's qkv) keeps the warp-split programs."""
    from batchgen.layers.linear_triton import default_config, warp_split_config

    cap = 132 * 2048 // 4
    for n, k in [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]:
        config = default_config(n, k, 2, max_threads=cap)
        assert config.num_warps == 2 and config.block_k >= k
        assert config.block_n * config.block_k * 2 == 16 * 16 * 32 * 2
        assert -(-n // config.block_n) * 64 <= cap
    for n, k in [(151936, 1024), (6144, 4096)]:
        assert default_config(n, k, 2, max_threads=cap) == warp_split_config(n, k, 2, cap)


@pytest.mark.skipif(not HAS_TRITON, reason="the launch configuration lives beside the Triton kernel")
def test_tiles_of_several_rows_take_the_warp_split_programs_with_half_the_warps() -> None:
    from batchgen.layers.linear_triton import default_config, warp_split_config

    cap = 132 * 2048 // 4
    for n, k in [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (1024, 128)]:
        split = warp_split_config(n, k, 2, cap)
        for rows in (2, 4, 8):
            config = default_config(n, k, 2, max_threads=cap, rows=rows)
            assert (config.block_n, config.block_k) == (split.block_n, split.block_k)
            assert config.num_warps == max(1, split.num_warps // 2)
    assert default_config(1024, 128, 2, rows=4).num_warps == 1  # a program of one warp keeps it


@pytest.mark.skipif(not HAS_TRITON, reason="use_triton imports the Triton kernel")
def test_switched_linear_falls_back_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from batchgen.layers import linear_triton

    monkeypatch.setattr(linear_triton, "small_m_linear", lambda *args: pytest.fail("the kernel ran on CPU"))
    layer = Linear(16, 8)
    layer.use_triton()
    x = torch.randn(1, 16)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


@pytest.mark.parametrize("architecture", NATIVE_ARCHITECTURES)
def test_models_build_their_projections_from_linear(
    architecture: str, tiny_model_dir: Callable[..., Path]
) -> None:
    """Every projection and lm_head is a `Linear`; a tied lm_head still shares the embedding after loading, and the
    switch to the Triton path (a no-op on CPU) leaves the logits unchanged."""
    model_config = ModelConfig(path=str(tiny_model_dir(architecture)))
    model = load_model(model_config, load_hf_config(model_config), torch.float32, torch.device("cpu"))
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(isinstance(m, Linear) for m in linears)
    # qkv, o, gate/up and down a layer, or with experts (stacked parameters) the router instead of gate/up and down
    per_layer = 3 if architecture in MOE_ARCHITECTURES else 4
    assert len(linears) == per_layer * model.config.num_hidden_layers + 1
    embedding = model.get_submodule("transformer.wte" if architecture == "GPT2LMHeadModel" else "model.embed_tokens")
    assert (model.lm_head.weight is embedding.weight) == model.config.tie_word_embeddings
    tokens = [3, 1, 4, 1, 5]
    (expected,) = PagedTestCache(model).run(model, [(0, tokens)])
    if HAS_TRITON:
        use_triton_layers(model, gemv=True)
        assert all(layer._kernels is not None for layer in linears)
        (logits,) = PagedTestCache(model).run(model, [(0, tokens)])
        assert torch.equal(logits, expected)


@pytest.mark.skipif(not HAS_TRITON, reason="the dispatch rule lives beside the Triton kernel")
def test_gemv_takes_single_rows_and_small_launches_only() -> None:
    from batchgen.layers.linear_triton import MAX_M, beats_cublas

    bf16 = 2
    assert beats_cublas(1, 151936, 1024, bf16) and not beats_cublas(2, 151936, 1024, bf16)  # lm_head: a single row
    assert beats_cublas(MAX_M, 1024, 1024, bf16) and not beats_cublas(MAX_M + 1, 1024, 1024, bf16)
    # Qwen3-0.6B's qkv (4096 rows) and gate/up (6144) projections: up to M = 4 (a tile of 4 rows for M = 3 too).
    for n in (4096, 6144):
        assert all(beats_cublas(m, n, 1024, bf16, H100_THREAD_CAP) for m in (2, 3, 4))
        assert not beats_cublas(MAX_M, n, 1024, bf16, H100_THREAD_CAP)
    # The main job's 128-wide GPT-2: every weight is tiny, cuBLAS reads it as fast and nothing compiles.
    assert not beats_cublas(1, 512, 128, 4) and not beats_cublas(1, 66, 128, 4)


@pytest.mark.skipif(not HAS_TRITON, reason="the dispatch rule lives beside the Triton kernel")
def test_gemv_leaves_tiles_that_would_spill_to_cublas() -> None:
    from batchgen.layers.linear_triton import MAX_TILE_PER_THREAD, beats_cublas, block_m, default_config, tile_fits

    bf16 = 2
    # Llama-3.1-8B's o_proj (4096 x 4096) at M = 4 on an H100: 16-row programs hold 2,048 products a thread.
    config = default_config(4096, 4096, bf16, H100_THREAD_CAP, block_m(4))
    assert 4 * config.block_n * config.block_k > MAX_TILE_PER_THREAD * 32 * config.num_warps
    assert not beats_cublas(4, 4096, 4096, bf16, H100_THREAD_CAP)
    assert beats_cublas(1, 4096, 4096, bf16, H100_THREAD_CAP)  # a single row keeps the kernel
    assert beats_cublas(4, 6144, 4096, bf16, H100_THREAD_CAP)  # its qkv's programs are 2 rows: it fits
    # Its qkv split over two tensor-parallel ranks (3072 x 4096) at M = 8.
    assert not beats_cublas(8, 3072, 4096, bf16, H100_THREAD_CAP)
    # fp8 weights (one byte): down_proj (4096 x 14336) at M = 8 does not fit, at M = 1 the rule does not apply.
    assert not tile_fits(8, 4096, 14336, 1, H100_THREAD_CAP)


@pytest.mark.skipif(not HAS_TRITON, reason="the dispatch rule lives beside the Triton kernel")
def test_several_row_launches_fuse_the_norm_only_where_programs_hold_twice_the_rows_of_x() -> None:
    """Each program normalizes the tile's rows itself: Llama-3.1-8B's qkv (2 weight rows a program) leaves the norm to
    its own kernel and the projection to cuBLAS from 2 rows on, Qwen3-0.6B's (8 a program) fuses it up to 4 rows."""
    from batchgen.layers.linear_triton import beats_cublas, block_m, default_config

    bf16 = 2
    for m in (2, 3, 4):
        assert beats_cublas(m, 6144, 4096, bf16, H100_THREAD_CAP)  # the plain projection keeps the kernel
        assert not beats_cublas(m, 6144, 4096, bf16, H100_THREAD_CAP, fused_norm=True)
        for n in (4096, 6144):  # Qwen3-0.6B's qkv and gate/up
            assert beats_cublas(m, n, 1024, bf16, H100_THREAD_CAP, fused_norm=True)
            assert default_config(n, 1024, bf16, H100_THREAD_CAP, block_m(m), fused_norm=True).block_n >= 2 * block_m(m)
    assert beats_cublas(1, 6144, 4096, bf16, H100_THREAD_CAP, fused_norm=True)  # one row: its own launches


@pytest.mark.skipif(not HAS_TRITON, reason="the launch configuration lives beside the Triton kernel")
def test_one_row_launches_with_the_norm_fused_take_eight_rows_and_all_of_k_on_large_weights() -> None:
    """Every program normalizes x itself: on a weight of LARGE_WEIGHT_BYTES or more, 8 weight rows a program, K in one
    step up to 4,096 features, a warp per 1,024 of them, for fp8 and 16-bit weights alike and past the cap
    (Llama-3.1-8B's qkv and gate/up; a down_proj's width takes two steps). Smaller weights (Qwen3-0.6B's) launch as
    without the norm, and so do tiles of four rows or more (two rows of a large weight launch differently without the
    norm: the test below)."""
    from batchgen.layers.linear_triton import LARGE_WEIGHT_BYTES, LinearConfig, default_config

    for element_size in (1, 2):
        for n, k in [(6144, 4096), (28672, 4096), (4096, 14336)]:
            assert n * k * element_size >= LARGE_WEIGHT_BYTES
            assert default_config(n, k, element_size, H100_THREAD_CAP, fused_norm=True) == LinearConfig(8, 4096, 4)
        for n, k in [(4096, 1024), (6144, 1024), (64, 300)]:
            assert n * k * element_size < LARGE_WEIGHT_BYTES
            assert default_config(n, k, element_size, H100_THREAD_CAP, fused_norm=True) == (
                default_config(n, k, element_size, H100_THREAD_CAP))
        assert default_config(28672, 4096, element_size, H100_THREAD_CAP, rows=4, fused_norm=True) == (
            default_config(28672, 4096, element_size, H100_THREAD_CAP, rows=4))


@pytest.mark.skipif(not HAS_TRITON, reason="the launch configuration lives beside the Triton kernel")
def test_plain_one_row_launches_of_large_weights_take_one_warp_programs() -> None:
    """fp8: 2 rows, 2 KB steps, one warp on a large weight, 4 rows and two warps on a smaller one. 16-bit: where
    two-warp programs pass the cap on a large weight (Llama-3.1-8B's o_proj and down_proj), one-warp programs of the
    same rows and half the K step, if they fit."""
    from batchgen.layers.linear_triton import LinearConfig, default_config, two_warp_config

    for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]:
        assert default_config(n, k, 1, H100_THREAD_CAP) == LinearConfig(2, 2048, 1)
    for n, k in [(1024, 3072), (4096, 1024)]:  # Qwen3-0.6B's down_proj and qkv_proj
        assert default_config(n, k, 1, H100_THREAD_CAP) == LinearConfig(4, min(2048, k), 2)
    for n, k in [(4096, 4096), (4096, 14336)]:
        two_warps = two_warp_config(n, k, 2)
        assert -(-n // two_warps.block_n) * 64 > H100_THREAD_CAP
        config = default_config(n, k, 2, H100_THREAD_CAP)
        assert config == LinearConfig(two_warps.block_n, two_warps.block_k // 2, 1) == LinearConfig(2, 2048, 1)
        assert -(-n // config.block_n) * 32 <= H100_THREAD_CAP


@pytest.mark.skipif(not HAS_TRITON, reason="the launch configuration lives beside the Triton kernel")
def test_two_rows_of_a_large_plain_weight_take_the_one_row_launch() -> None:
    """Llama-3.1-8B's bf16 o_proj and down_proj: at 2 rows the one-row programs, which fit and beat cuBLAS; at 4 rows
    the warp-split tile, which does not fit, so cuBLAS; a small weight or a fused norm keeps the warp-split tile at 2
    rows. (fp8 weights take the GEMV at one row only: layers/fp8.py.)"""
    from batchgen.layers.linear_triton import LARGE_WEIGHT_BYTES, beats_cublas, default_config, warp_split_config

    bf16 = 2
    for n, k in [(4096, 4096), (4096, 14336)]:
        assert n * k * bf16 >= LARGE_WEIGHT_BYTES
        assert default_config(n, k, bf16, H100_THREAD_CAP, rows=2) == default_config(n, k, bf16, H100_THREAD_CAP)
        assert beats_cublas(2, n, k, bf16, H100_THREAD_CAP)
        split = warp_split_config(n, k, bf16, H100_THREAD_CAP)
        assert default_config(n, k, bf16, H100_THREAD_CAP, rows=4) == split._replace(num_warps=split.num_warps // 2)
        assert not beats_cublas(4, n, k, bf16, H100_THREAD_CAP)
    split = warp_split_config(1024, 3072, bf16, H100_THREAD_CAP)  # Qwen3-0.6B's down_proj: 6 MiB
    assert default_config(1024, 3072, bf16, H100_THREAD_CAP, rows=2) == split._replace(num_warps=split.num_warps // 2)
    split = warp_split_config(6144, 4096, bf16, H100_THREAD_CAP)  # Llama-3.1-8B's qkv_proj, the norm fused in
    assert default_config(6144, 4096, bf16, H100_THREAD_CAP, rows=2, fused_norm=True) == split._replace(
        num_warps=split.num_warps // 2)


@pytest.mark.skipif(not HAS_TRITON, reason="the row tile lives beside the Triton kernel")
def test_gemv_row_tiles_are_the_powers_of_two_up_to_max_m() -> None:
    from batchgen.layers.linear_triton import MAX_M, block_m

    tiles = [block_m(m) for m in range(1, MAX_M + 1)]
    assert tiles == [1, 2, 4, 4, 8, 8, 8, 8]  # at most four compiles per weight shape, each at most twice the rows
