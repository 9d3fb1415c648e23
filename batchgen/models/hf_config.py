"""A Hugging Face config.json read without transformers, for the model types our models implement.

Importing transformers' config classes costs seconds of start-up (they pull in most of transformers); the models
read only a few dozen fields. `HFConfig` holds every key of config.json as an attribute, with transformers' defaults
(v5) for the fields our models read when the file leaves them out, its derived values (head_dim, num_key_value_heads,
Qwen's layer_types) and GPT-2's aliases (hidden_size for n_embd, ...). tests/models/test_hf_config.py checks every field
against transformers' own config classes. Other model types return None: the loader falls back to transformers.

check_checkpoint checks a checkpoint directory from its files alone (config.json, the safetensors files present),
so that a directory the loader would fail on is a configuration error before the job writes anything.
model_implementation decides which modules run a config (model.impl): ours where we implement its architecture,
else transformers' own causal LM, which it learns from transformers' model mapping without importing transformers.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
from importlib.metadata import version
from pathlib import Path
from typing import Any

from batchgen.config import ConfigError, ModelConfig
from batchgen.layers.quantization import UnsupportedQuantization, checkpoint_fp8
from batchgen.models.gguf_file import is_gguf_path
from batchgen.models.tp_shapes import check_tensor_parallel

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")
# The architecture (config.json's "architectures") our model class of each model type implements; registry.py maps
# each to its class. A config built from a model_type alone (dummy weights) names no architecture: its type's is used.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "phi3": "Phi3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
}
# The other heads of these model types that job.task=classify and job.task=embed run: sequence classifiers (and
# reward models) and bare decoders (transformers' *Model).
_CLASS_PREFIXES = ("Llama", "Mistral", "Qwen2", "Qwen3")
CLASSIFIERS = tuple(f"{prefix}ForSequenceClassification" for prefix in _CLASS_PREFIXES)
DECODERS = tuple(f"{prefix}Model" for prefix in _CLASS_PREFIXES)

_LLAMA_LIKE = {
    "num_key_value_heads": None, "head_dim": None, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "rope_parameters": None,
}
_QWEN = {
    **_LLAMA_LIKE, "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 32768,
    "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28, "layer_types": None,
    "bos_token_id": None, "eos_token_id": None,
}
# Each model type's config class defaults, for the fields batchgen reads (transformers' configuration_<type>.py).
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        **_LLAMA_LIKE, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2,
        "attention_bias": False, "mlp_bias": False,
    },
    "mistral": {
        **_LLAMA_LIKE, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 4096 * 32,
        "sliding_window": 4096, "bos_token_id": 1, "eos_token_id": 2,
    },
    "qwen2": {key: value for key, value in _QWEN.items() if key != "head_dim"},
    "qwen3": {**_QWEN, "head_dim": 128, "attention_bias": False},
    "gpt2": {
        "vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None,
        "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "scale_attn_weights": True,
        "bos_token_id": 50256, "eos_token_id": 50256, "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False, "add_cross_attention": False, "tie_word_embeddings": True,
    },
}
ALIASES = {  # model type: {the name our models read: the name config.json uses}
    "gpt2": {"hidden_size": "n_embd", "max_position_embeddings": "n_positions", "num_attention_heads": "n_head",
             "num_hidden_layers": "n_layer"},
}


class HFConfig:
    """config.json's values as attributes, as transformers' PretrainedConfig exposes them."""

    def __init__(self, model_type: str, values: dict[str, Any]) -> None:
        object.__setattr__(self, "_aliases", ALIASES.get(model_type, {}))
        self.model_type = model_type
        self.architectures = None
        self.dtype = None
        self.update(DEFAULTS[model_type])
        self.update(values)
        self._derive()

    def _derive(self) -> None:
        """What transformers' config classes compute in __post_init__."""
        if self.model_type == "gpt2":
            return
        if self.model_type in ("llama", "mistral") and self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.model_type in ("qwen2", "qwen3"):
            if not self.use_sliding_window:
                self.sliding_window = None
            if self.layer_types is None:
                self.layer_types = [
                    "sliding_attention" if self.sliding_window is not None and i >= self.max_window_layers
                    else "full_attention" for i in range(self.num_hidden_layers)
                ]

    def update(self, values: dict[str, Any]) -> None:
        for key, value in values.items():
            setattr(self, key, value)

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, self._aliases.get(name, name), value)

    def __getattr__(self, name: str) -> Any:  # only called for names not set: the aliases
        aliases = object.__getattribute__(self, "_aliases")
        if name in aliases:
            return getattr(self, aliases[name])
        raise AttributeError(f"{type(self).__name__} of model_type {self.model_type!r} has no {name!r}")

    def __repr__(self) -> str:
        fields = {key: value for key, value in vars(self).items() if not key.startswith("_")}
        return f"HFConfig({fields})"


def hf_config_from_dict(values: dict[str, Any]) -> HFConfig | None:
    """The config of values (config.json's keys, model_type among them); None for a model type we do not read."""
    model_type = values.get("model_type")
    if model_type not in DEFAULTS:
        return None
    return HFConfig(model_type, {key: value for key, value in values.items() if key != "model_type"})


def read_hf_config(directory: str) -> HFConfig | None:
    """directory's config.json; None when there is none or transformers must read it."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        return None
    return hf_config_from_dict(json.loads(path.read_text(encoding="utf-8")))


def _field(config: Any, name: str) -> Any:
    return config.get(name) if isinstance(config, dict) else getattr(config, name, None)


def architecture_of(config: Any) -> str:
    """The architecture of ours that implements `config` (an HFConfig, a transformers config or config.json's
    values): the first of its "architectures" we implement, else its model type's when it names none."""
    named = _field(config, "architectures") or []
    model_type = _field(config, "model_type")
    if not named and model_type in ARCHITECTURES:
        return ARCHITECTURES[model_type]
    supported = (*ARCHITECTURES.values(), *CLASSIFIERS, *DECODERS)
    for architecture in named:
        if architecture in supported:
            return architecture
    listed = ", ".join(named) or f"(none; model_type {model_type!r})"
    raise ValueError(f"architecture {listed} is not supported; supported: {', '.join(supported)}")


def check_quantization(config: Any, model: ModelConfig) -> None:
    """The quantization of `config` (an HFConfig, a transformers config or config.json's values) and
    model.quantization, checked against the modules that run it. Native modules: a quantization_config must be an
    fp8 one batchgen reads (layers/quantization.py). transformers' modules (the generic path) take neither
    model.quantization nor an fp8 checkpoint, as batchgen's fp8 layers are native ones; other quantization_configs
    stay transformers' to load. Raises ValueError, one line."""
    if model_implementation(config, model.impl) == "native":
        checkpoint_fp8(config)
        return
    if model.quantization is not None:
        what = f"model.quantization={model.quantization}"
    else:
        try:
            method = checkpoint_fp8(config)
        except UnsupportedQuantization:
            return
        if method is None:
            return
        what = f"an fp8 checkpoint (quantization_config quant_method {method})"
    named = _field(config, "architectures") or [_field(config, "model_type")]
    raise ValueError(f"{what} runs on batchgen's native modules only, and {named[0]} runs on transformers' "
                     f"(model.impl={model.impl}); the native ones: {', '.join(ARCHITECTURES.values())}")


def _rope_scaling(config: Any) -> dict[str, Any]:
    """The RoPE entry of a config (v5 `rope_parameters`, v4 `rope_scaling`); empty when there is none."""
    params = _field(config, "rope_parameters")
    if not (isinstance(params, dict) and "rope_theta" in params):
        params = _field(config, "rope_scaling")
    return params if isinstance(params, dict) else {}


@functools.cache
def causal_lm_classes() -> dict[str, str]:
    """{model type: the class transformers' AutoModelForCausalLM builds for it}. Read from the mapping's source, a
    literal: importing it imports torch and most of transformers (seconds), parsing it takes a tenth of that."""
    source = Path(importlib.util.find_spec("transformers").submodule_search_locations[0], "models", "auto",
                  "modeling_auto.py")
    for node in ast.parse(source.read_text(encoding="utf-8")).body:
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and node.value.args
                and any(getattr(t, "id", None) == "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES" for t in node.targets)):
            return dict(ast.literal_eval(node.value.args[0]))
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # written otherwise

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def model_implementation(config: Any, impl: str) -> str:
    """The modules that run `config` (an HFConfig, a transformers config or config.json's values) under
    model.impl=`impl` (auto | native | transformers): "native" (ours) or "transformers" (transformers' own causal LM
    with our paged attention). Raises ValueError, one line naming the architecture and each path tried."""
    if impl != "transformers":
        try:
            architecture_of(config)
            return "native"
        except ValueError as error:
            if impl == "native":
                raise ValueError(f"{error} (model.impl=native; model.impl=auto also tries transformers' "
                                 "implementation)") from None
    named = _field(config, "architectures") or []
    model_type = _field(config, "model_type")
    causal = causal_lm_classes().get(model_type)
    decoder = causal is not None and causal.endswith("ForCausalLM")  # not an encoder's or a multimodal model's head
    if decoder and (not named or causal in named):
        return "transformers"
    listed = ", ".join(named) or f"(none; model_type {model_type!r})"
    if causal is None:
        why = f"have no causal LM for model_type {model_type!r} in transformers {version('transformers')}"
    elif not decoder:
        why = f"build {causal} for model_type {model_type!r}, not a *ForCausalLM decoder"
    else:
        why = f"build {causal} for model_type {model_type!r}, which config.json's architectures do not name"
    if _field(config, "auto_map"):
        why += "; the checkpoint's own code (auto_map) is never run"
    if impl == "auto":
        raise ValueError(f"architecture {listed} is not supported by either path (model.impl=auto): batchgen's native "
                         f"modules run {', '.join(ARCHITECTURES.values())}; transformers' modules {why}")
    raise ValueError(f"architecture {listed} is not supported (model.impl=transformers): transformers' modules {why}")


def max_positions(config: Any) -> int | None:
    """The most positions the model supports; None if it names none.

    max_position_embeddings (GPT-2's n_positions), stretched where the RoPE scaling is what extends the context past
    it, as vLLM reads these configs: `dynamic` by its factor, `yarn` to factor times its original length (Qwen's
    configs add yarn to max_position_embeddings = the original length). `llama3` and `longrope` configs already name
    the extended length.
    """
    limit = _field(config, "max_position_embeddings") or _field(config, "n_positions")
    scaling = _rope_scaling(config)
    rope_type = scaling.get("rope_type", scaling.get("type"))
    factor = scaling.get("factor")
    if limit is None or not factor:
        return limit
    if rope_type == "dynamic":
        return max(limit, int(limit * factor))
    if rope_type == "yarn":
        original = scaling.get("original_max_position_embeddings") or limit
        return max(limit, int(original * factor))
    return limit


def _read_json(path: Path, where: str) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: {path.name} is not valid JSON ({exc})") from None


def _check_weights(directory: Path, where: str) -> None:
    """The safetensors files load_model reads are all there (those model.safetensors.index.json names, or
    model.safetensors) and whole (`check_safetensors`)."""
    index = directory / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = _read_json(index, where).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ConfigError(f"{where}: {SAFETENSORS_INDEX} has no weight_map")
        names = sorted(set(weight_map.values()))
        missing = [name for name in names if not (directory / name).is_file()]
        if missing:
            raise ConfigError(f"{where}: {SAFETENSORS_INDEX} names weight files that are missing: {', '.join(missing)}")
    elif (directory / SAFETENSORS_FILE).is_file():
        names = [SAFETENSORS_FILE]
    else:
        if any((directory / name).is_file() for name in PICKLE_WEIGHTS):
            raise ConfigError(f"{where}: holds only PyTorch pickles (pytorch_model.bin), which batchgen never loads "
                              "(unpickling runs code): convert them to safetensors")
        raise ConfigError(f"{where}: no {SAFETENSORS_FILE} or {SAFETENSORS_INDEX} (batchgen reads safetensors "
                          "weights; model.load_format=dummy runs random weights from config.json)")
    for name in names:
        check_safetensors(directory / name, where)


_LFS_POINTER = b"version https://git-lfs"  # how a Git LFS pointer file starts
_MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit on its JSON header


def check_safetensors(path: Path, where: str) -> None:
    """The file is a safetensors file exactly as long as its header says: not a Git LFS pointer left by a clone without
    git-lfs, not cut short by an interrupted download. Reads the header alone (8 bytes of length, then JSON)."""
    size = path.stat().st_size
    with path.open("rb") as file:
        start = file.read(len(_LFS_POINTER))
        if start == _LFS_POINTER:
            raise ConfigError(f"{where}: {path.name} is a Git LFS pointer ({size} bytes), not the weights: fetch them "
                              "(git lfs pull in the clone, or huggingface-cli download)")
        header_bytes = int.from_bytes(start[:8], "little")
        header = None
        if len(start) >= 8 and header_bytes <= min(size - 8, _MAX_HEADER_BYTES):
            file.seek(8)
            header = _json_map(file.read(header_bytes))
    if header is None:
        raise ConfigError(f"{where}: {path.name} is not a safetensors file, or is cut short ({size} bytes): download "
                          "it again")
    expected = 8 + header_bytes + _data_bytes(header)
    if size < expected:
        raise ConfigError(f"{where}: {path.name} is incomplete, {size} of its {expected} bytes (an interrupted "
                          "download?): download it again")
    if size > expected:  # safetensors refuses bytes its tensors do not cover
        raise ConfigError(f"{where}: {path.name} has {size - expected} bytes past its tensors' data, which safetensors "
                          "refuses: download it again")


def _data_bytes(header: dict[str, Any]) -> int:
    """How many bytes of tensor data follow the header: the last end among its tensors' [begin, end] data_offsets
    (entries without a pair of integers there count for none)."""
    ends = [0]
    for name, entry in header.items():
        offsets = entry.get("data_offsets") if name != "__metadata__" and isinstance(entry, dict) else None
        if isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(offset, int) for offset in offsets):
            ends.append(offsets[1])
    return max(ends)


def _json_map(data: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return value if isinstance(value, dict) else None


def check_checkpoint(model: ModelConfig, max_model_len: int | None, tensor_parallel_size: int = 1) -> None:
    """What loading the model needs, checked from its files alone (no weights read, no torch): config.json, the
    safetensors files, an architecture batchgen runs (model.impl), a quantization_config it runs
    (layers/quantization.py), engine.max_model_len within the model's positions, and a model that
    engine.tensor_parallel_size splits.
    Raises ConfigError naming the directory or key; model and max_model_len are validated values (config.py)."""
    if model.path is not None and is_gguf_path(model.path):
        try:  # a GGUF file holds its own config, checked by config.validate_model
            check_tensor_parallel({}, tensor_parallel_size, "native", gguf=True)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return
    overrides = dict(model.hf_config or {})
    if model.path is None:
        where = "model.hf_config"
        if "model_type" not in overrides:
            raise ConfigError("model.hf_config needs a model_type (e.g. llama) when model.path is not set")
        values = overrides
    else:
        directory = Path(model.path)
        where = f"model.path={model.path}"
        if not (directory / CONFIG_FILE).is_file():
            raise ConfigError(f"{where}: no {CONFIG_FILE}; set model.path to a Hugging Face checkpoint directory")
        overrides.pop("model_type", None)  # as load_hf_config applies them: config.json fixes the model type
        values = {**_read_json(directory / CONFIG_FILE, where), **overrides}
        if model.load_format != "dummy":
            _check_weights(directory, where)
    try:
        implementation = model_implementation(values, model.impl)
        check_quantization(values, model)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    try:
        check_tensor_parallel(hf_config_from_dict(values) or values, tensor_parallel_size, implementation, gguf=False)
    except ValueError as exc:
        raise ConfigError(f"{exc} ({where})") from None
    limit = max_positions(hf_config_from_dict(values) or values)
    if max_model_len is not None and limit is not None and max_model_len > limit:
        raise ConfigError(f"engine.max_model_len={max_model_len} is invalid: the model in {model.path or where} "
                          f"supports at most {limit} positions")
