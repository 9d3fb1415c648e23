"""fp8 weights on CPU: fp8 checkpoints in both formats and model.quantization=fp8 load dequantized on every native
architecture, and their greedy tokens and logits equal transformers' on the same dequantized weights; unsupported
quantization configs, and fp8 on transformers' modules (model.impl), fail in one line."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from batchgen import LLM, SamplingParams
from batchgen.config import ConfigError, ModelConfig
from batchgen.layers.fp8 import dequantize, quantize_per_channel
from batchgen.layers.fp8_loading import quantizable_layers
from batchgen.layers.linear import Linear
from batchgen.layers.moe import StackedExperts
from batchgen.layers.quantization import UnsupportedQuantization
from batchgen.models.hf_config import check_checkpoint
from batchgen.models.loader import load_hf_config, load_model
from tests.helpers.common import (
    GENERIC_ARCHITECTURES,
    MAX_TOKENS,
    MOE_ARCHITECTURES,
    NATIVE_ARCHITECTURES,
    assert_logits_close,
    hf_greedy_on,
    random_prompts,
    random_tokens,
)
from tests.helpers.fp8_checkpoints import (
    FORMATS,
    quantization_round_trip,
    transformers_with_weights,
    write_float_twin,
    write_fp8_checkpoint,
)
from tests.helpers.paged import PagedTestCache

TINY = ["LlamaForCausalLM", "Qwen3ForCausalLM"]  # an lm_head of its own, and one tied to the embeddings
# Every native architecture family: Gemma (1) and Qwen2-MoE on top of the ones the engine tests run.
FAMILIES = sorted({*NATIVE_ARCHITECTURES, *MOE_ARCHITECTURES, "GemmaForCausalLM"})
# fp8 checkpoints beyond TINY's: Phi-3's checkpoint projections already fused (one per-tensor scale over q, k and v),
# Gemma 3, OLMo 2, and experts with scales of their own (Mixtral's w1/w2/w3, Qwen2-MoE's, with a shared expert).
CHECKPOINT_CASES = [(architecture, format_name) for architecture in TINY for format_name in FORMATS] + [
    (architecture, format_name)
    for architecture in ("Phi3ForCausalLM", "Gemma3ForCausalLM", "Olmo2ForCausalLM", "MixtralForCausalLM",
                         "Qwen2MoeForCausalLM")
    for format_name in ("compressed_tensors_fp8", "compressed_tensors_fp8_dynamic")
]


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


@pytest.mark.parametrize(("architecture", "format_name"), CHECKPOINT_CASES)
def test_fp8_checkpoint_equals_transformers_on_dequantized_weights(
        architecture: str, format_name: str, tiny_model_dir: Callable[..., Path], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    float_dir = tiny_model_dir(architecture)
    fp8_dir = tmp_path / "fp8"
    dequantized = write_fp8_checkpoint(float_dir, fp8_dir, format_name)
    check_checkpoint(ModelConfig(path=str(fp8_dir)), None)
    tokens = random_tokens(12, seed=7)
    with caplog.at_level(logging.INFO, logger="batchgen.layers.fp8_loading"):
        ours = load_on_cpu(fp8_dir)
    assert [r.getMessage() for r in caplog.records if r.name == "batchgen.layers.fp8_loading"] == [
        f"fp8 weights of {len(quantizable_layers(ours))} layers dequantized to the model's dtype: cpu does not run "
        "fp8 (its kernels need CUDA compute capability 8.9 or later)"]
    expected = reference_logits(transformers_with_weights(float_dir, dequantized, tmp_path / "twin"), tokens)
    assert_logits_close(prefill_then_decode_logits(ours, tokens), expected)
    # the quantization is not a no-op: the float checkpoint's logits differ
    assert not torch.allclose(expected, reference_logits(transformers_with_weights(float_dir, {}, tmp_path / "float"),
                                                         tokens), atol=1e-4)


@pytest.mark.parametrize("architecture", FAMILIES)
def test_quantization_fp8_equals_quantize_then_dequantize(architecture: str,
                                                          tiny_model_dir: Callable[..., Path]) -> None:
    """model.quantization=fp8 on CPU: every decoder linear and expert stack holds dequantize(quantize(weight)) per
    output channel; embeddings, norms, biases, MoE routers and the heads are the checkpoint's."""
    float_dir = tiny_model_dir(architecture)
    plain, quantized = load_on_cpu(float_dir), load_on_cpu(float_dir, quantization="fp8")
    names = {id(param): name for name, param in quantized.named_parameters()}
    layers = quantizable_layers(quantized)
    round_trips = set()
    for parent, name in layers:
        layer = getattr(parent, name)
        assert isinstance(layer, Linear) or (isinstance(layer, StackedExperts) and not layer.fp8), name
        for param_name, param in layer.named_parameters():
            if param_name == "bias":
                continue
            weight = plain.get_parameter(names[id(param)])
            assert torch.equal(param, dequantize(*quantize_per_channel(weight), torch.float32)), names[id(param)]
            assert not torch.equal(param, weight), names[id(param)]
            round_trips.add(names[id(param)])
    # per decoder layer: attention's qkv and output projections, then the MLP's two, or the experts (one stack) and
    # Qwen2-MoE's shared expert (two)
    per_layer = {"MixtralForCausalLM": 3, "Qwen3MoeForCausalLM": 3, "Qwen2MoeForCausalLM": 5}.get(architecture, 4)
    assert len(layers) == per_layer * quantized.config.num_hidden_layers
    for name, param in quantized.named_parameters():
        if name not in round_trips:
            assert torch.equal(param, plain.get_parameter(name)), name


@pytest.mark.parametrize("architecture", FAMILIES)
def test_quantization_fp8_equals_transformers_on_dequantized_weights(
        architecture: str, tiny_model_dir: Callable[..., Path], tmp_path: Path) -> None:
    """Each native architecture with model.quantization=fp8 on CPU: greedy tokens of the engine and logits of the
    model equal transformers' on the checkpoint whose linear layers (and experts) hold the same dequantized weights."""
    float_dir = tiny_model_dir(architecture)
    twin_dir = write_float_twin(float_dir, tmp_path, quantization_round_trip(float_dir))
    prompts = random_prompts(256, count=3, seed=5)
    llm = LLM(str(float_dir), device="cpu", dtype="float32", quantization="fp8")
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                           use_tqdm=False)
    llm.close()
    assert [o.token_ids for o in outputs] == hf_greedy_on(twin_dir, prompts, MAX_TOKENS)
    tokens = random_tokens(10, seed=8)
    expected = reference_logits(transformers_with_weights(twin_dir, {}, tmp_path / "reference"), tokens)
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


@pytest.mark.parametrize(("architecture", "impl", "fp8_checkpoint"), [
    ("GPTNeoXForCausalLM", "auto", False), ("LlamaForCausalLM", "transformers", False),
    ("GPTNeoXForCausalLM", "auto", True)])
def test_fp8_on_transformers_modules_fails_in_one_line(architecture: str, impl: str, fp8_checkpoint: bool,
                                                       tiny_model_dir: Callable[..., Path], tmp_path: Path) -> None:
    """fp8 layers are native ones: model.quantization=fp8, or an fp8 checkpoint, on the generic path is refused
    before the load, naming the setting or the checkpoint."""
    assert architecture in GENERIC_ARCHITECTURES or impl == "transformers"
    directory = tiny_model_dir(architecture)
    if fp8_checkpoint:
        fp8_config = FORMATS["compressed_tensors_fp8"].quantization_config
        directory = _with_quantization_config(directory, tmp_path, fp8_config)
    model_config = ModelConfig(path=str(directory), impl=impl, quantization=None if fp8_checkpoint else "fp8")
    what = ("an fp8 checkpoint (quantization_config quant_method compressed-tensors)" if fp8_checkpoint
            else "model.quantization=fp8")
    message = (f"{what} runs on batchgen's native modules only, and {architecture} runs on transformers' "
               f"(model.impl={impl}); the native ones: LlamaForCausalLM, ")
    with pytest.raises(ConfigError) as checked:
        check_checkpoint(model_config, None)
    assert str(checked.value).startswith(f"model.path={directory}: {message}") and "\n" not in str(checked.value)
    with pytest.raises(ValueError, match=re.escape(message)):
        load_model(model_config, load_hf_config(model_config), torch.float32, torch.device("cpu"))


def test_other_quantization_stays_transformers_on_the_generic_path(tiny_model_dir: Callable[..., Path],
                                                                    tmp_path: Path) -> None:
    """A quantization_config that is not fp8 is transformers' to load on its own modules, as before fp8 came; native
    modules refuse it (test_unsupported_quantization_fails_in_one_line)."""
    directory = _with_quantization_config(tiny_model_dir("LlamaForCausalLM"), tmp_path,
                                          {"quant_method": "awq", "bits": 4, "group_size": 128})
    check_checkpoint(ModelConfig(path=str(directory), impl="transformers"), None)


def test_checkpoint_with_a_quantized_router_names_it(tiny_model_dir: Callable[..., Path], tmp_path: Path) -> None:
    """Routers stay in the model's dtype: a checkpoint that quantized one fails naming its tensor."""
    write_fp8_checkpoint(tiny_model_dir("MixtralForCausalLM"), tmp_path, "compressed_tensors_fp8_dynamic")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.0.block_sparse_moe.gate.weight"
    tensors[name], tensors[name + "_scale"] = quantize_per_channel(tensors[name])
    save_file(tensors, str(tmp_path / "model.safetensors"))
    message = (f"checkpoint tensor {name} is torch.float8_e4m3fn, but the model holds {name} in torch.float32 (fp8 "
               "models hold the decoder's linear layers and experts in fp8; lm_head, embeddings and MoE routers not)")
    with pytest.raises(ValueError, match=re.escape(message)):
        load_on_cpu(tmp_path)
