"""fp8 weights on CPU: fp8 checkpoints in both formats and model.quantization=fp8 load dequantized, and their
logits equal transformers' on the same dequantized weights; unsupported quantization configs fail in one line."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from batchgen.config import ConfigError, ModelConfig
from batchgen.layers.fp8 import dequantize, quantize_per_channel
from batchgen.layers.linear import Linear
from batchgen.layers.quantization import UnsupportedQuantization
from batchgen.models.hf_config import check_checkpoint
from batchgen.models.loader import load_hf_config, load_model
from tests.helpers.common import assert_logits_close, random_tokens
from tests.helpers.fp8_checkpoints import FORMATS, PROJECTIONS, transformers_with_weights, write_fp8_checkpoint
from tests.helpers.paged import PagedTestCache

TINY = ["LlamaForCausalLM", "Qwen3ForCausalLM"]  # an lm_head of its own, and one tied to the embeddings


def load_on_cpu(directory: Path, quantization: str | None = None) -> torch.nn.Module:
    model_config = ModelConfig(path=str(directory), quantization=quantization)
    return load_model(model_config, load_hf_config(model_config), torch.float32, torch.device("cpu"))


def prefill_then_decode_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:  # (len(tokens), vocab)
    cache = PagedTestCache(model)
    steps = [cache.run(model, [(0, tokens[:-3])])[0]]
    steps += [cache.run(model, [(0, [t])], num_padding_rows=1)[0] for t in tokens[-3:]]
    return torch.cat(steps)


@torch.no_grad()
def reference_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    return model(torch.tensor([tokens])).logits[0]


@pytest.mark.parametrize("format_name", list(FORMATS))
@pytest.mark.parametrize("architecture", TINY)
def test_fp8_checkpoint_equals_transformers_on_dequantized_weights(
        architecture: str, format_name: str, tiny_model_dir: Callable[..., Path], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    float_dir = tiny_model_dir(architecture)
    dequantized = write_fp8_checkpoint(float_dir, tmp_path, format_name)
    assert len(dequantized) == 2 * len(PROJECTIONS)
    check_checkpoint(ModelConfig(path=str(tmp_path)), None)
    tokens = random_tokens(12, seed=7)
    with caplog.at_level(logging.INFO, logger="batchgen.layers.fp8_loading"):
        ours = load_on_cpu(tmp_path)
    assert [r.getMessage() for r in caplog.records] == [
        "fp8 weights of 8 linear layers dequantized to the model's dtype: cpu does not run fp8 (its kernels need "
        "CUDA compute capability 8.9 or later)"]
    expected = reference_logits(transformers_with_weights(float_dir, dequantized), tokens)
    assert_logits_close(prefill_then_decode_logits(ours, tokens), expected)
    # the quantization is not a no-op: the float checkpoint's logits differ
    assert not torch.allclose(expected, reference_logits(transformers_with_weights(float_dir, {}), tokens),
                              atol=1e-4)


@pytest.mark.parametrize("architecture", [*TINY, "Qwen2ForCausalLM", "GPT2LMHeadModel"])
def test_quantization_fp8_equals_quantize_then_dequantize(architecture: str,
                                                          tiny_model_dir: Callable[..., Path]) -> None:
    """model.quantization=fp8 on CPU: every decoder linear holds dequantize(quantize(weight)) per output channel;
    embeddings, norms, biases and the heads are the checkpoint's."""
    float_dir = tiny_model_dir(architecture)
    plain, quantized = load_on_cpu(float_dir), load_on_cpu(float_dir, quantization="fp8")
    plain_modules = dict(plain.named_modules())
    linears = 0
    for name, module in quantized.named_modules():
        if isinstance(module, Linear) and "." in name:
            weight = plain_modules[name].weight
            assert torch.equal(module.weight, dequantize(*quantize_per_channel(weight), torch.float32)), name
            assert not torch.equal(module.weight, weight)
            linears += 1
    assert linears == len(quantized.get_submodule("model.layers" if architecture != "GPT2LMHeadModel"
                                                  else "transformer.h")) * 4
    quantized_weights = {id(m.weight) for name, m in quantized.named_modules() if isinstance(m, Linear) and "." in name}
    for name, param in quantized.named_parameters():
        if id(param) not in quantized_weights:
            assert torch.equal(param, plain.get_parameter(name)), name


def test_quantization_fp8_logits_equal_transformers_on_dequantized_weights(
        tiny_model_dir: Callable[..., Path]) -> None:
    float_dir = tiny_model_dir("Qwen3ForCausalLM")
    state = transformers_with_weights(float_dir, {}).state_dict()
    dequantized = {name: dequantize(*quantize_per_channel(tensor), torch.float32) for name, tensor in state.items()
                   if name.removesuffix(".weight").rsplit(".", 1)[-1] in PROJECTIONS}
    tokens = random_tokens(10, seed=8)
    expected = reference_logits(transformers_with_weights(float_dir, dequantized), tokens)
    assert_logits_close(prefill_then_decode_logits(load_on_cpu(float_dir, quantization="fp8"), tokens), expected)


def test_dummy_weights_quantize() -> None:
    hf_config = {"model_type": "qwen3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
                 "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}
    models = []
    for quantization in (None, "fp8"):
        model_config = ModelConfig(load_format="dummy", hf_config=hf_config, quantization=quantization)
        models.append(load_model(model_config, load_hf_config(model_config), torch.float32, torch.device("cpu")))
    plain, quantized = (model.model.layers[0].mlp.down_proj.weight for model in models)
    assert torch.equal(quantized, dequantize(*quantize_per_channel(plain), torch.float32))


def _with_quantization_config(directory: Path, tmp_path: Path, quantization_config: dict) -> Path:
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(directory / "model.safetensors")
    return tmp_path


@pytest.mark.parametrize(("quantization_config", "message"), [
    ({"quant_method": "awq", "bits": 4, "group_size": 128},
     "quantization_config quant_method 'awq' is not supported; batchgen runs compressed-tensors FP8 / FP8-dynamic "
     "and quant_method fp8, with per-tensor or per-channel weight scales"),
    ({"quant_method": "gptq", "bits": 4},
     "quantization_config quant_method 'gptq' is not supported"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
     "quantization_config weight_block_size [128, 128] (block-wise fp8 scales) is not supported"),
])
def test_unsupported_quantization_fails_in_one_line(quantization_config: dict, message: str,
                                                    tiny_model_dir: Callable[..., Path], tmp_path: Path) -> None:
    directory = _with_quantization_config(tiny_model_dir("LlamaForCausalLM"), tmp_path, quantization_config)
    with pytest.raises(ConfigError) as checked:
        check_checkpoint(ModelConfig(path=str(directory)), None)
    assert str(checked.value).startswith(f"model.path={directory}: {message}")
    assert "\n" not in str(checked.value)
    with pytest.raises(UnsupportedQuantization, match=re.escape(message)):
        load_on_cpu(directory)


def test_checkpoint_with_an_unquantized_projection_names_it(tiny_model_dir: Callable[..., Path],
                                                            tmp_path: Path) -> None:
    """A checkpoint whose config ignores a decoder projection (left in float) fails naming the tensor, rather than
    loading it without a scale."""
    float_dir = tiny_model_dir("LlamaForCausalLM")
    write_fp8_checkpoint(float_dir, tmp_path, "compressed_tensors_fp8_dynamic")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = load_file(str(float_dir / "model.safetensors"))[name]
    del tensors["model.layers.1.mlp.down_proj.weight_scale"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=f"checkpoint tensor {name} is torch.float32, but the model holds {name} in "
                                         "torch.float8_e4m3fn"):
        load_on_cpu(tmp_path)
