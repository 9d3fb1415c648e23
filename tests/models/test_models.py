"""Our models against transformers' on tiny random checkpoints, through the paged KV cache; and model loading."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from batchgen.config import ModelConfig
from batchgen.layers.norms import RMSNorm
from batchgen.models.loader import iter_safetensors, load_hf_config, load_model, resolve_dtype, safetensors_files
from batchgen.models.registry import model_class
from tests.helpers.common import ARCHITECTURES, VOCAB, assert_logits_close, load_ours, random_tokens, reference_logits
from tests.helpers.paged import PagedTestCache


@pytest.fixture(params=ARCHITECTURES)
def checkpoint(request: pytest.FixtureRequest, tiny_model_dir: Callable[..., Path]) -> Path:
    return tiny_model_dir(request.param)


def test_prefill_matches_transformers(checkpoint: Path) -> None:
    tokens = random_tokens(11, seed=1)
    model = load_ours(checkpoint)
    (logits,) = PagedTestCache(model).run(model, [(0, tokens)])
    assert_logits_close(logits, reference_logits(checkpoint, tokens))


def test_chunked_prefill_then_decode_matches_transformers(checkpoint: Path) -> None:
    tokens = random_tokens(20, seed=2)
    expected = reference_logits(checkpoint, tokens)
    model = load_ours(checkpoint)
    cache = PagedTestCache(model, block_size=4)
    steps = [tokens[:7], tokens[7:13]] + [[t] for t in tokens[13:]]
    start = 0
    for step in steps:
        # Decode steps carry two padding rows, as a CUDA-graph batch padded to its capture size does.
        (logits,) = cache.run(model, [(0, step)], num_padding_rows=2 if len(step) == 1 else 0)
        assert_logits_close(logits, expected[start : start + len(step)])
        start += len(step)


def test_batch_of_two_sequences_matches_transformers(checkpoint: Path) -> None:
    short, long = random_tokens(5, seed=3), random_tokens(13, seed=4)
    extra_short, extra_long = random_tokens(1, seed=5), random_tokens(1, seed=6)
    model = load_ours(checkpoint)
    cache = PagedTestCache(model, block_size=8)
    short_logits, long_logits = cache.run(model, [(0, short), (1, long)])
    long_next, short_next = cache.run(model, [(1, extra_long), (0, extra_short)])  # a decode step, rows swapped
    expected_short = reference_logits(checkpoint, short + extra_short)
    expected_long = reference_logits(checkpoint, long + extra_long)
    assert_logits_close(short_logits, expected_short[:-1])
    assert_logits_close(long_logits, expected_long[:-1])
    assert_logits_close(short_next, expected_short[-1:])
    assert_logits_close(long_next, expected_long[-1:])


def test_sharded_checkpoint_loads(tiny_model_dir: Callable[..., Path]) -> None:
    sharded = tiny_model_dir("LlamaForCausalLM", sharded=True)
    assert len(safetensors_files(str(sharded))) > 1
    ours_sharded = load_ours(sharded).state_dict()
    ours_single = load_ours(tiny_model_dir("LlamaForCausalLM")).state_dict()
    assert ours_sharded.keys() == ours_single.keys()
    for name, tensor in ours_single.items():
        torch.testing.assert_close(ours_sharded[name], tensor, rtol=0, atol=0)


def test_dummy_weights_from_hf_config_alone() -> None:
    hf_config = {"model_type": "qwen3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
                 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                 "max_position_embeddings": 64}
    model_config = ModelConfig(load_format="dummy", hf_config=hf_config)
    config = load_hf_config(model_config)
    first = load_model(model_config, config, torch.float32, torch.device("cpu"))
    second = load_model(model_config, config, torch.float32, torch.device("cpu"))
    assert type(first).__name__ == "Qwen3ForCausalLM"
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"{name} differs between two dummy builds")
    norms = [m for m in first.modules() if isinstance(m, RMSNorm)]
    assert norms and all(bool(m.weight.eq(1).all()) for m in norms)
    assert not any(p.requires_grad for p in first.parameters()) and not first.training
    (logits,) = PagedTestCache(first).run(first, [(0, [1, 2, 3])])
    assert logits.shape == (3, 64) and logits.isfinite().all()


def test_hf_config_overrides_apply_on_top_of_checkpoint(tiny_model_dir: Callable[..., Path]) -> None:
    config = load_hf_config(ModelConfig(path=str(tiny_model_dir("GPT2LMHeadModel")), hf_config={"n_positions": 64}))
    assert config.max_position_embeddings == 64 and config.vocab_size == VOCAB


def test_unsupported_architecture_lists_supported(tiny_model_dir: Callable[..., Path]) -> None:
    config = load_hf_config(ModelConfig(path=str(tiny_model_dir("LlamaForCausalLM"))))
    config.architectures = ["FalconForCausalLM"]
    with pytest.raises(ValueError, match="FalconForCausalLM is not supported; supported: LlamaForCausalLM"):
        model_class(config)


def test_missing_and_unexpected_tensors_are_named(tiny_model_dir: Callable[..., Path]) -> None:
    directory = tiny_model_dir("Qwen2ForCausalLM")
    model = load_ours(directory)
    files = safetensors_files(str(directory))
    weights = [(n, t) for n, t in iter_safetensors(files) if n != "model.layers.1.self_attn.k_proj.bias"]
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.self_attn.k_proj.bias'\]"):
        model.load_weights(weights)
    with pytest.raises(ValueError, match=r"unexpected \['model.extra.weight'\]"):
        model.load_weights([*iter_safetensors(files), ("model.extra.weight", torch.ones(1))])


def test_a_weight_file_cut_short_is_named_where_the_model_loads(tiny_model_dir: Callable[..., Path],
                                                                tmp_path: Path) -> None:
    """The Python API loads without the command line's checkpoint check: safetensors' own error names no file, so
    the loader's does, and why."""
    directory = tiny_model_dir("LlamaForCausalLM")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_bytes((directory / "config.json").read_bytes())
    weights = (directory / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(weights[:-100])
    with pytest.raises(ValueError, match=f"model.path={broken}: model.safetensors is incomplete, "
                                         f"{len(weights) - 100} of its {len(weights)} bytes"):
        load_ours(broken)
    (broken / "model.safetensors").write_bytes(weights + bytes(16))
    with pytest.raises(ValueError, match="model.safetensors has 16 bytes past its tensors' data"):
        load_ours(broken)
    header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": ["0", "4"]}}).encode()  # no numbers
    (broken / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(4))
    with pytest.raises(ValueError, match="model.safetensors has 4 bytes past its tensors' data"):
        load_ours(broken)
    # What the header check passes and safetensors refuses still names the file.
    header = json.dumps({"w": {"dtype": "NO_SUCH_TYPE", "shape": [1], "data_offsets": [0, 4]}}).encode()
    (broken / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(4))
    with pytest.raises(ValueError, match=f"model.path={broken}: model.safetensors cannot be read \\("):
        load_ours(broken)


def test_gpt2_loads_checkpoints_without_transformer_prefix(tiny_model_dir: Callable[..., Path]) -> None:
    directory = tiny_model_dir("GPT2LMHeadModel")
    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        original_style = [(n.removeprefix("transformer."), f.get_tensor(n)) for n in f.keys()]
    model = load_ours(directory)
    model.load_weights(original_style)
    tokens = random_tokens(6, seed=7)
    (logits,) = PagedTestCache(model).run(model, [(0, tokens)])
    assert_logits_close(logits, reference_logits(directory, tokens))


def test_gpt2_rejects_unsupported_attention_variants(tiny_model_dir: Callable[..., Path]) -> None:
    config = load_hf_config(ModelConfig(path=str(tiny_model_dir("GPT2LMHeadModel"))))
    config.scale_attn_by_inverse_layer_idx = True
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx"):
        model_class(config)(config)


def test_missing_weights_file_names_the_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        safetensors_files(str(tmp_path))


def test_resolve_dtype(tiny_model_dir: Callable[..., Path]) -> None:
    config = load_hf_config(ModelConfig(path=str(tiny_model_dir("LlamaForCausalLM"))))
    config.dtype = torch.bfloat16
    assert resolve_dtype("auto", config, torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", config, torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float16", config, torch.device("cpu")) == torch.float16
