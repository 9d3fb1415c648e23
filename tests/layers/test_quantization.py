"""Which quantization_configs batchgen runs (fp8 with per-tensor or per-channel weight scales), and the one-line
error for every other."""

from __future__ import annotations

import pytest

from batchgen.layers.quantization import UnsupportedQuantization, checkpoint_fp8
from tests.helpers.fp8_checkpoints import DYNAMIC_TOKEN, FORMATS, STATIC_TENSOR, compressed_tensors_config


@pytest.mark.parametrize("format_name", list(FORMATS))
def test_fp8_formats_are_recognized(format_name: str) -> None:
    config = {"model_type": "llama", "quantization_config": FORMATS[format_name].quantization_config}
    assert checkpoint_fp8(config) == config["quantization_config"]["quant_method"]


def test_weight_only_fp8_and_no_quantization() -> None:
    assert checkpoint_fp8({"quantization_config": compressed_tensors_config("channel", None)}) == "compressed-tensors"
    assert checkpoint_fp8({"quant_method": "fp8"}) is None  # a stray key outside quantization_config
    assert checkpoint_fp8({"model_type": "llama"}) is None


def _weights(**changes: object) -> dict:
    config = compressed_tensors_config("channel", DYNAMIC_TOKEN)
    config["config_groups"]["group_0"]["weights"].update(changes)
    return {"quantization_config": config}


def _activations(**changes: object) -> dict:
    config = compressed_tensors_config("tensor", dict(STATIC_TENSOR, **changes))
    return {"quantization_config": config}


@pytest.mark.parametrize(("config", "message"), [
    ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "quantization_config quant_method 'awq' is not "
     "supported; batchgen runs compressed-tensors FP8 / FP8-dynamic and quant_method fp8, with per-tensor or "
     "per-channel weight scales"),
    ({"quantization_config": {"quant_method": "bitsandbytes", "load_in_8bit": True}},
     "quantization_config quant_method 'bitsandbytes' is not supported"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
     "quantization_config weight_block_size [128, 128] (block-wise fp8 scales) is not supported; batchgen runs "
     "per-tensor and per-channel fp8 weight scales"),
    ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "sometimes"}},
     "quantization_config activation_scheme 'sometimes' is not supported"),
    (_weights(num_bits=4, type="int", strategy="group", group_size=128),
     "quantization_config config_groups.group_0: weights of 4-bit int are not supported"),
    (_weights(num_bits=8, type="int"), "quantization_config config_groups.group_0: weights of 8-bit int are not "
     "supported"),
    (_weights(strategy="block", block_structure=[128, 128]),
     "quantization_config config_groups.group_0: fp8 weight strategy 'block' is not supported; batchgen runs tensor "
     "and channel"),
    (_activations(num_bits=8, type="int"), "quantization_config config_groups.group_0: input activations of 8-bit "
     "int are not supported"),
    (_activations(strategy="group"), "quantization_config config_groups.group_0: input activation strategy 'group' "
     "is not supported"),
    ({"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {}}},
     "quantization_config (compressed-tensors) has no config_groups"),
])
def test_unsupported_configs_fail_in_one_line(config: dict, message: str) -> None:
    with pytest.raises(UnsupportedQuantization) as raised:
        checkpoint_fp8(config)
    assert str(raised.value).startswith(message)
    assert "\n" not in str(raised.value)


def test_transformers_quantization_config_object() -> None:
    """transformers' config classes hold quantization_config as a dict; its quantizer objects read through
    to_dict()."""
    transformers = pytest.importorskip("transformers")
    quantization = transformers.FineGrainedFP8Config(weight_block_size=None)
    assert checkpoint_fp8({"quantization_config": quantization}) == "fp8"
    with pytest.raises(UnsupportedQuantization, match="weight_block_size"):
        checkpoint_fp8({"quantization_config": transformers.FineGrainedFP8Config()})
