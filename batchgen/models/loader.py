"""From a ModelConfig to a ready model: the Hugging Face config, the dtype, the module and its weights."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from batchgen.config import ModelConfig
from batchgen.layers.fp8_loading import finish_fp8, fp8_checkpoint_tensors, use_fp8_layers
from batchgen.layers.norms import GemmaRMSNorm, RMSNorm
from batchgen.layers.quantization import checkpoint_fp8
from batchgen.layers.tensor_parallel import SINGLE, TensorParallel, building
from batchgen.models.base import CausalLM
from batchgen.models.gemma import language_model_config
from batchgen.models.gguf import gguf_hf_config, iter_gguf_weights
from batchgen.models.gguf_file import is_gguf_path
from batchgen.models.hf_config import (
    SAFETENSORS_FILE,
    SAFETENSORS_INDEX,
    architecture_of,
    check_quantization,
    check_safetensors,
    hf_config_from_dict,
    model_implementation,
    read_hf_config,
)
from batchgen.models.olmo2 import Olmo2RMSNorm
from batchgen.models.registry import model_class

if TYPE_CHECKING:
    from batchgen.models.transformers_backend import TransformersCausalLM

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_hf_config(model: ModelConfig) -> Any:
    """config.json from model.path with model.hf_config applied on top, or a config built from model.hf_config alone.

    An HFConfig for the model types batchgen implements (read without importing transformers), else transformers'
    config: always with model.impl=transformers, whose modules read transformers' config classes.
    """
    overrides = dict(model.hf_config or {})
    if is_gguf_path(model.path):
        config = gguf_hf_config(model.path)
        config.update(overrides)
        return config
    ours = model.impl != "transformers"
    if model.path is not None:
        config = read_hf_config(model.path) if ours else None
        if config is None:
            from transformers import AutoConfig

            config = language_model_config(AutoConfig.from_pretrained(model.path, trust_remote_code=False))
        overrides.pop("model_type", None)  # the config class is fixed by config.json
        config.update(overrides)  # after the derived values, as transformers' PretrainedConfig.update does
        return config
    if "model_type" not in overrides:
        raise ValueError("model.hf_config needs a model_type (e.g. llama) when model.path is not set")
    config = hf_config_from_dict(overrides) if ours else None
    if config is None:
        from transformers import AutoConfig

        model_type = overrides.pop("model_type")
        config = language_model_config(AutoConfig.for_model(model_type, **overrides))
    return config


def resolve_dtype(name: str, hf_config: Any, device: torch.device) -> torch.dtype:
    """"auto" is the checkpoint's dtype on CUDA (float32 if it names none) and float32 on CPU."""
    if name != "auto":
        return DTYPES[name]
    if device.type != "cuda":
        return torch.float32
    checkpoint_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if checkpoint_dtype is None:
        return torch.float32
    return getattr(torch, checkpoint_dtype) if isinstance(checkpoint_dtype, str) else checkpoint_dtype


def safetensors_files(directory: str) -> list[Path]:
    """The checkpoint's safetensors files: the shards a model.safetensors.index.json names, or model.safetensors."""
    root = Path(directory)
    if (root / SAFETENSORS_INDEX).is_file():
        weight_map = json.loads((root / SAFETENSORS_INDEX).read_text())["weight_map"]
        return [root / name for name in sorted(set(weight_map.values()))]
    if (root / SAFETENSORS_FILE).is_file():
        return [root / SAFETENSORS_FILE]
    raise FileNotFoundError(f"no {SAFETENSORS_FILE} or {SAFETENSORS_INDEX} in {directory}")


def iter_safetensors(files: list[Path], lazy: bool = False) -> Iterator[tuple[str, Any]]:
    """(name, tensor) pairs read one tensor at a time, so a checkpoint never sits in host memory whole; lazy: a
    safetensors slice in place of each tensor, which reads only what is indexed (a tensor-parallel rank's part)."""
    for file in files:
        try:
            shard = safe_open(str(file), framework="pt", device="cpu")
        except SafetensorError as exc:  # its message names no file: say which, and why where the header tells
            check_safetensors(file, f"model.path={file.parent}")
            raise ValueError(f"model.path={file.parent}: {file.name} cannot be read ({exc})") from None
        with shard:
            for name in shard.keys():
                yield name, shard.get_slice(name) if lazy else shard.get_tensor(name)


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def init_dummy_weights(model: nn.Module) -> None:
    """Reproducible random weights: normal(0, 0.02), with norm weights the identity scale (one; zero for Gemma's
    norms, which scale by 1 + weight) and norm biases zero."""
    torch.manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            is_norm = isinstance(module, (nn.LayerNorm, RMSNorm, Olmo2RMSNorm))
            for name, param in module.named_parameters(recurse=False):
                if not is_norm:
                    param.normal_(mean=0.0, std=0.02)
                elif name == "weight":
                    param.fill_(0.0 if isinstance(module, GemmaRMSNorm) else 1.0)
                else:
                    param.zero_()


def load_model(model: ModelConfig, hf_config: Any, dtype: torch.dtype, device: torch.device,
               task: str = "generate", tp: TensorParallel = SINGLE) -> CausalLM | TransformersCausalLM:
    """Builds the model for hf_config's architecture and job.task `task` on `device` in `dtype` and fills its
    weights: batchgen's own modules, or transformers' (model.impl; hf_config.model_implementation decides). The
    decoder's linear and expert layers hold fp8 weights when the checkpoint does (its quantization_config) or
    model.quantization=fp8 asks (dummy weights of an fp8 config too), dequantized again where `device` has none.
    tp: the tensor-parallel rank whose shard of the native modules to build and load, fp8 weights and scales
    included (model.quantization=fp8 gathers each row-parallel row's maximum from the other ranks: every rank loads
    at once)."""
    check_quantization(hf_config, model)
    if model_implementation(hf_config, model.impl) == "transformers":  # registry.check_task vetted the task
        from batchgen.models.transformers_backend import build_transformers_model  # imports transformers' modeling

        network = build_transformers_model(model, hf_config, dtype, device)
        log.info("Model: %s runs on transformers' modules with batchgen's paged KV cache and attention "
                 "(model.impl=%s%s)", network.architecture, model.impl,
                 ": no native implementation" if model.impl == "auto" else "")
        return network
    cls = model_class(hf_config, task)
    log.info("Model: %s runs on batchgen's native modules (model.impl=%s)", architecture_of(hf_config), model.impl)
    gguf = is_gguf_path(model.path)
    fp8_checkpoint = checkpoint_fp8(hf_config)
    files = [] if model.load_format == "dummy" or gguf else safetensors_files(model.path)
    with _default_dtype(dtype), torch.device(device), building(tp):
        network = cls(hf_config)
    if model.load_format == "dummy":
        init_dummy_weights(network)
    elif gguf:
        network.load_weights(iter_gguf_weights(model.path))
    elif fp8_checkpoint is not None:
        use_fp8_layers(network)
        network.load_weights(fp8_checkpoint_tensors(iter_safetensors(files, lazy=tp.size > 1)))
    else:
        network.load_weights(iter_safetensors(files, lazy=tp.size > 1))
    if fp8_checkpoint is not None or model.quantization == "fp8":
        finish_fp8(network, device, tp)
    network.eval()
    network.requires_grad_(False)
    return network
