"""On a GPU with fp8 (compute capability 8.9 or later): fp8 linears and experts stay close to the same model on its
dequantized bf16 weights on every native architecture family, an fp8 checkpoint runs as fp8, and CUDA-graph replay
equals eager decode for every bucket."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from batchgen import LLM
from batchgen.config import ModelConfig
from batchgen.layers import fp8
from batchgen.layers.fp8 import Fp8Linear, dequantize
from batchgen.layers.fp8_loading import quantizable_layers
from batchgen.layers.moe import StackedExperts
from batchgen.models.loader import load_hf_config, load_model
from tests.helpers.common import random_prompts, random_tokens
from tests.helpers.fp8_checkpoints import write_fp8_checkpoint
from tests.helpers.graph_replay import first_decode_logits
from tests.helpers.paged import PagedTestCache

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                       reason="needs a GPU with fp8 (compute capability 8.9 or later)"),
]
CUDA = torch.device("cuda")
CAPTURE_SIZES = [1, 2, 4, 8, 16]


def _load(directory: Path, quantization: str | None = None) -> torch.nn.Module:
    model_config = ModelConfig(path=str(directory), quantization=quantization)
    return load_model(model_config, load_hf_config(model_config), torch.bfloat16, CUDA)


def _logits(model: torch.nn.Module, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 logits of every token: fed in one prefill step (the weight-only GEMM up to FP8_GEMM_MAX_ROWS rows,
    _scaled_mm with fp8 activations past it), and fed one decode step of one row at a time (the weight-only GEMV)."""
    with torch.no_grad():
        prefill = PagedTestCache(model).run(model, [(0, tokens)])[0]
        cache = PagedTestCache(model)
        decode = torch.cat([cache.run(model, [(0, [t])])[0] for t in tokens])
    return prefill.float(), decode.float()


def _is_fp8(layer: torch.nn.Module) -> bool:
    return isinstance(layer, Fp8Linear) or (isinstance(layer, StackedExperts) and layer.fp8)


def _dequantized_twin(model: torch.nn.Module, float_dir: Path) -> torch.nn.Module:
    """The bf16 model of float_dir with each decoder linear and expert stack holding `model`'s fp8 weights,
    dequantized (the rest of an fp8 checkpoint written from float_dir is float_dir's)."""
    twin = _load(float_dir)
    with torch.no_grad():
        for (parent, name), (twin_parent, _) in zip(quantizable_layers(model), quantizable_layers(twin), strict=True):
            layer = getattr(parent, name)
            assert _is_fp8(layer), name
            if isinstance(layer, StackedExperts):
                setattr(twin_parent, name, layer.dequantized())
            else:
                getattr(twin_parent, name).weight.copy_(dequantize(layer.weight, layer.weight_scale, torch.bfloat16))
    return twin


@pytest.mark.parametrize(("architecture", "source"), [
    *[("Qwen3ForCausalLM", source) for source in ("quantization=fp8", "compressed_tensors_fp8", "fp8_static")],
    *[(architecture, "quantization=fp8") for architecture in ("Gemma2ForCausalLM", "Gemma3ForCausalLM",
                                                              "Phi3ForCausalLM", "Olmo2ForCausalLM",
                                                              "MixtralForCausalLM", "Qwen2MoeForCausalLM")],
    ("Phi3ForCausalLM", "compressed_tensors_fp8"), ("Qwen3MoeForCausalLM", "compressed_tensors_fp8_dynamic"),
])
def test_fp8_close_to_dequantized_bf16(architecture: str, source: str, tiny_model_dir: Callable[..., Path],
                                       tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode steps (the weight-only fp8 GEMV and expert kernels) and a prefill step of 19 rows (the weight-only
    GEMM, its row limit moved to 19) match the dequantized bf16 model to within bf16 rounding; a prefill step on
    _scaled_mm (fp8 activations too: FP8_GEMM_MAX_ROWS moved below 19) to within a sixth of the logits' range, with
    at least 80% of the greedy tokens the same: a tiny random model's logits are flat, so one token's fp8 activation
    rounding can flip its argmax (benchmarks/fp8_accuracy.py measures agreement on realistic weights)."""
    float_dir = tiny_model_dir(architecture)
    if source == "quantization=fp8":
        model = _load(float_dir, quantization="fp8")
    else:
        write_fp8_checkpoint(float_dir, tmp_path, source)
        model = _load(tmp_path)
    assert all(_is_fp8(getattr(parent, name)) for parent, name in quantizable_layers(model))
    tokens = random_tokens(19, seed=11)
    monkeypatch.setattr(fp8, "FP8_GEMM_MAX_ROWS", len(tokens))  # the prefill step on the weight-only GEMM
    prefill, decode = _logits(model, tokens)
    expected_prefill, expected_decode = _logits(_dequantized_twin(model, float_dir), tokens)
    scale = float(expected_prefill.abs().max())
    torch.testing.assert_close(decode, expected_decode, rtol=0, atol=0.02 * scale)
    torch.testing.assert_close(prefill, expected_prefill, rtol=0, atol=0.02 * scale)
    monkeypatch.setattr(fp8, "FP8_GEMM_MAX_ROWS", len(tokens) - 1)
    scaled_mm_prefill, _ = _logits(model, tokens)
    torch.testing.assert_close(scaled_mm_prefill, expected_prefill, rtol=0, atol=scale / 6)
    assert (scaled_mm_prefill.argmax(-1) == expected_prefill.argmax(-1)).float().mean() >= 0.8


@pytest.mark.parametrize("architecture", ["Qwen3ForCausalLM", "Gemma3ForCausalLM", "Qwen3MoeForCausalLM"])
def test_graph_replay_equals_eager_for_every_bucket(architecture: str, tiny_model_dir: Callable[..., Path]) -> None:
    """Decode batches of 1 to 16 rows on fp8 weights (the GEMV at one row, the weight-only GEMM above; the expert
    kernels), replayed from their bucket's graph and run eagerly."""
    llm = LLM(str(tiny_model_dir(architecture)), dtype="bfloat16", quantization="fp8", max_num_seqs=16,
              cuda_graph_capture_sizes=CAPTURE_SIZES)
    runner = llm.engine.runner
    assert all(_is_fp8(getattr(parent, name)) for parent, name in quantizable_layers(runner.model))
    assert runner.graphs.sizes == CAPTURE_SIZES
    for num_seqs in range(1, 17):
        graph_logits, eager_logits = first_decode_logits(llm, random_prompts(256, count=num_seqs, seed=num_seqs))
        graph_logits, eager_logits = graph_logits.float(), eager_logits.float()
        scale = float(eager_logits.abs().max())
        torch.testing.assert_close(graph_logits, eager_logits, rtol=0, atol=1e-2 * scale)
    llm.close()

