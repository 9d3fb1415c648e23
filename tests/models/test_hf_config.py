"""Our config.json reader against transformers' config classes: every field the models read, the same value."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoConfig

from batchgen.config import ModelConfig
from batchgen.layers.rotary import rope_parameters
from batchgen.models.hf_config import ARCHITECTURES as ARCHITECTURE_OF_TYPE
from batchgen.models.hf_config import DEFAULTS, HFConfig, hf_config_from_dict
from batchgen.models.llama import head_dim_of, layer_sliding_windows
from batchgen.models.loader import load_hf_config
from tests.helpers.common import NATIVE_ARCHITECTURES

LLAMA_FIELDS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
                "attention_bias", "mlp_bias", "sliding_window", "use_sliding_window", "layer_types",
                "bos_token_id", "eos_token_id", "architectures", "model_type"]
GPT2_FIELDS = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings",
               "n_positions", "n_embd", "n_layer", "n_head", "n_inner", "activation_function", "layer_norm_epsilon",
               "scale_attn_weights", "scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn",
               "add_cross_attention", "tie_word_embeddings", "bos_token_id", "eos_token_id", "architectures"]
MISSING = object()
# The architectures whose config.json batchgen reads itself; transformers reads the others' (Gemma's).
READ_WITHOUT_TRANSFORMERS = [a for a in NATIVE_ARCHITECTURES if a in {ARCHITECTURE_OF_TYPE[t] for t in DEFAULTS}]


def fields_of(config: Any) -> dict[str, Any]:
    """What our models read of a config: the raw fields (absent ones as MISSING) and the values derived from them."""
    names = GPT2_FIELDS if config.model_type == "gpt2" else LLAMA_FIELDS
    values = {name: getattr(config, name, MISSING) for name in names}
    # As resolve_dtype reads it; transformers turns the name into a torch dtype.
    values["dtype"] = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)).removeprefix("torch.")
    if config.model_type != "gpt2":
        values.update(rope=rope_parameters(config), windows=layer_sliding_windows(config),
                      head_dim_of=head_dim_of(config))
    return values


def assert_same_fields(ours: Any, expected: Any) -> None:
    assert isinstance(ours, HFConfig)
    assert fields_of(ours) == fields_of(expected)


@pytest.mark.parametrize("sliding_window", [None, 8])
@pytest.mark.parametrize("architecture", READ_WITHOUT_TRANSFORMERS)
def test_checkpoint_config_reads_as_transformers_does(architecture: str, sliding_window: int | None,
                                                      tiny_model_dir: Callable[..., Path]) -> None:
    if sliding_window is not None and architecture not in ("MistralForCausalLM", "Qwen2ForCausalLM"):
        pytest.skip("no sliding-window variant")
    directory = tiny_model_dir(architecture, sliding_window=sliding_window)
    if AutoConfig.from_pretrained(directory).model_type not in DEFAULTS:
        pytest.skip("transformers reads this model type's config.json")
    assert_same_fields(load_hf_config(ModelConfig(path=str(directory))), AutoConfig.from_pretrained(directory))


CONFIG_DICTS = {
    "llama defaults": {"model_type": "llama"},
    "mistral defaults": {"model_type": "mistral"},
    "qwen2 defaults": {"model_type": "qwen2"},
    "qwen3 defaults": {"model_type": "qwen3"},
    "gpt2 defaults": {"model_type": "gpt2"},
    "llama v4 keys": {"model_type": "llama", "hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 2,
                      "rope_theta": 500000.0, "torch_dtype": "bfloat16", "tie_word_embeddings": True,
                      "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    "mistral without window": {"model_type": "mistral", "sliding_window": None, "head_dim": 64},
    "qwen2 sliding": {"model_type": "qwen2", "num_hidden_layers": 3, "use_sliding_window": True,
                      "sliding_window": 16, "max_window_layers": 1, "rope_theta": 1000000.0},
    "qwen3 yarn": {"model_type": "qwen3", "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                            "original_max_position_embeddings": 32768}},
    "qwen3 window off": {"model_type": "qwen3", "num_hidden_layers": 2, "sliding_window": 16, "dtype": "float16"},
    "gpt2 sized": {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128,
                   "n_inner": 96, "activation_function": "gelu", "architectures": ["GPT2LMHeadModel"]},
}


@pytest.mark.parametrize("name", list(CONFIG_DICTS))
def test_config_dict_reads_as_transformers_does(name: str) -> None:
    values = dict(CONFIG_DICTS[name])
    model_type = values.pop("model_type")
    assert_same_fields(hf_config_from_dict(CONFIG_DICTS[name]), AutoConfig.for_model(model_type, **values))


def test_overrides_apply_after_config_json_as_transformers_update_does(tiny_model_dir: Callable[..., Path]) -> None:
    directory = tiny_model_dir("Qwen3ForCausalLM")
    overrides = {"num_hidden_layers": 1, "rms_norm_eps": 1e-3, "model_type": "ignored"}
    expected = AutoConfig.from_pretrained(directory)
    expected.update({k: v for k, v in overrides.items() if k != "model_type"})
    assert_same_fields(load_hf_config(ModelConfig(path=str(directory), hf_config=overrides)), expected)


def test_gpt2_aliases_follow_their_fields() -> None:
    config = hf_config_from_dict({"model_type": "gpt2", "n_positions": 64})
    config.update({"max_position_embeddings": 32})
    assert config.n_positions == 32 and config.max_position_embeddings == 32
    assert not hasattr(config, "sliding_window")


def test_other_model_types_fall_back_to_transformers(tmp_path: Path) -> None:
    assert hf_config_from_dict({"model_type": "phi3"}) is None
    AutoConfig.for_model("phi3").save_pretrained(tmp_path)
    config = load_hf_config(ModelConfig(path=str(tmp_path)))
    assert not isinstance(config, HFConfig) and config.model_type == "phi3"
    assert load_hf_config(ModelConfig(hf_config={"model_type": "phi3"})).model_type == "phi3"
