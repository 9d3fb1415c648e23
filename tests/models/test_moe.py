"""Mixtral, Qwen3-MoE and Qwen2-MoE against transformers on tiny random checkpoints, and their checkpoint format."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, PretrainedConfig

from batchgen.config import ModelConfig
from batchgen.layers.moe import StackedExperts
from batchgen.models.llama import LlamaMLP
from batchgen.models.loader import iter_safetensors, load_hf_config, load_model, safetensors_files
from batchgen.models.moe import MoeMLP
from batchgen.models.registry import model_class
from tests.helpers.common import (
    MOE_ARCHITECTURES,
    assert_logits_close,
    load_ours,
    random_tokens,
    reference_logits,
    save_perturbed,
    tiny_hf_config,
)
from tests.helpers.paged import PagedTestCache


def save_tiny(config: PretrainedConfig, directory: Path) -> Path:
    """A seeded random checkpoint of `config`, every parameter perturbed (as build_tiny_model_dir does)."""
    torch.manual_seed(0)
    return save_perturbed(AutoModelForCausalLM.from_config(config).float(), directory)


def check_steps_match_transformers(directory: Path) -> None:
    """Two sequences through chunked prefill, then decode steps with CUDA-graph-style padding rows."""
    first, second = random_tokens(17, seed=21), random_tokens(9, seed=22)
    expected_first, expected_second = reference_logits(directory, first), reference_logits(directory, second)
    model = load_ours(directory)
    cache = PagedTestCache(model, block_size=4)
    first_logits, second_logits = cache.run(model, [(0, first[:10]), (1, second[:6])])
    assert_logits_close(first_logits, expected_first[:10])
    assert_logits_close(second_logits, expected_second[:6])
    (first_logits,) = cache.run(model, [(0, first[10:14])])
    assert_logits_close(first_logits, expected_first[10:14])
    for position in range(3):
        second_logits, first_logits = cache.run(model, [(1, [second[6 + position]]), (0, [first[14 + position]])],
                                                num_padding_rows=2)
        assert_logits_close(second_logits, expected_second[6 + position:7 + position])
        assert_logits_close(first_logits, expected_first[14 + position:15 + position])


@pytest.mark.parametrize("architecture", MOE_ARCHITECTURES)
def test_prefill_and_decode_logits_match_transformers(architecture: str,
                                                      tiny_model_dir: Callable[..., Path]) -> None:
    check_steps_match_transformers(tiny_model_dir(architecture))


@pytest.mark.parametrize(("changes", "sparse_layers"), [
    ({"decoder_sparse_step": 2}, [False, True]),
    ({"mlp_only_layers": [1], "norm_topk_prob": False}, [True, False]),
], ids=["decoder_sparse_step", "mlp_only_layers"])
@pytest.mark.parametrize("architecture", ["Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"])
def test_qwen_dense_layers_and_unnormalized_routing(architecture: str, changes: dict, sparse_layers: list[bool],
                                                    tmp_path: Path) -> None:
    config = tiny_hf_config(architecture)
    for key, value in changes.items():
        setattr(config, key, value)
    directory = save_tiny(config, tmp_path)
    model = load_ours(directory)
    assert [isinstance(layer.mlp, MoeMLP) for layer in model.model.layers] == sparse_layers
    assert all(isinstance(layer.mlp, LlamaMLP) for layer, sparse in zip(model.model.layers, sparse_layers,
                                                                        strict=True) if not sparse)
    check_steps_match_transformers(directory)


@pytest.mark.parametrize(("architecture", "expert_names"), [
    ("MixtralForCausalLM", ["block_sparse_moe.experts.3.w1", "block_sparse_moe.experts.3.w2",
                            "block_sparse_moe.experts.3.w3"]),
    ("Qwen2MoeForCausalLM", ["mlp.experts.3.down_proj", "mlp.experts.3.gate_proj", "mlp.experts.3.up_proj"]),
])
def test_checkpoints_keep_one_tensor_per_expert_as_on_the_hub(architecture: str, expert_names: list[str],
                                                             tiny_model_dir: Callable[..., Path]) -> None:
    """transformers 5 stacks experts in memory but saves them per expert, as Hub checkpoints are; each lands in its
    slice of our stacked parameters."""
    directory = tiny_model_dir(architecture)
    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        prefix = "model.layers.1."
        assert sorted(n.removeprefix(prefix).removesuffix(".weight") for n in names
                      if n.startswith(prefix) and ".experts.3." in n) == expert_names
        assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in names)
        gate_name, up_name, down_name = (f"{prefix}{n}.weight" for n in sorted(expert_names, key=_projection_order))
        gate, up, down = f.get_tensor(gate_name), f.get_tensor(up_name), f.get_tensor(down_name)
    experts = load_ours(directory).get_submodule("model.layers.1.mlp.experts")
    assert isinstance(experts, StackedExperts)
    half = experts.gate_up_proj.shape[1] // 2
    assert torch.equal(experts.gate_up_proj[3, :half], gate) and torch.equal(experts.gate_up_proj[3, half:], up)
    assert torch.equal(experts.down_proj[3], down)


def _projection_order(name: str) -> int:
    """gate, up, down: Mixtral's w1, w3, w2."""
    for order, suffixes in enumerate((("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))):
        if name.endswith(suffixes):
            return order
    raise ValueError(name)


def test_a_missing_expert_tensor_is_named(tiny_model_dir: Callable[..., Path]) -> None:
    directory = tiny_model_dir("MixtralForCausalLM")
    model = load_ours(directory)
    missing = "model.layers.0.block_sparse_moe.experts.2.w3.weight"
    weights = [(n, t) for n, t in iter_safetensors(safetensors_files(str(directory))) if n != missing]
    with pytest.raises(ValueError, match=rf"missing \['{missing}'\]"):
        model.load_weights(weights)


def test_dummy_weights_from_hf_config_alone() -> None:
    """A model type transformers' config class reads (qwen3_moe): dummy weights from model.hf_config only."""
    hf_config = {"model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
                 "moe_intermediate_size": 16, "num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 64}
    model_config = ModelConfig(load_format="dummy", hf_config=hf_config)
    model = load_model(model_config, load_hf_config(model_config), torch.float32, torch.device("cpu"))
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    experts = model.get_submodule("model.layers.0.mlp.experts")
    assert experts.gate_up_proj.shape == (8, 32, 32) and experts.top_k == 2
    assert experts.gate_up_proj.std() > 0  # filled, not left as torch.empty
    (logits,) = PagedTestCache(model).run(model, [(0, [1, 2, 3])])
    assert logits.shape == (3, 64) and logits.isfinite().all()


def test_qwen3_30b_a3b_conf_is_the_real_shape() -> None:
    """conf/model/qwen3_30b_a3b.yaml (the benchmark's model) reads as Qwen3-30B-A3B's config."""
    from benchmarks.common import load_model_config

    config = load_hf_config(load_model_config("qwen3_30b_a3b"))
    assert (config.num_hidden_layers, config.hidden_size, config.num_experts, config.num_experts_per_tok,
            config.moe_intermediate_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
            config.vocab_size) == (48, 2048, 128, 8, 768, 32, 4, 128, 151936)
    assert config.norm_topk_prob and not config.tie_word_embeddings and config.mlp_only_layers == []


def test_unsupported_activation_is_named(tiny_model_dir: Callable[..., Path]) -> None:
    config = load_hf_config(ModelConfig(path=str(tiny_model_dir("MixtralForCausalLM"))))
    config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="MixtralForCausalLM with hidden_act='gelu' is not supported"):
        model_class(config)(config)
