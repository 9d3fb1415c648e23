"""Tiny fp8 checkpoints written as llm-compressor (compressed-tensors) and vLLM / AutoFP8 (quant_method fp8) write
them, from a tiny float checkpoint; and transformers' model of the float checkpoint with the fp8 weights put back."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM

from batchgen.layers.fp8 import dequantize, quantize_per_channel

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
# The decoder's linear layers, by the last part of their checkpoint names: Llama's (Qwen's experts and shared expert
# too), Phi-3's fused ones and Mixtral's experts'. Routers (`gate`, `shared_expert_gate`) and heads are not among them.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj",
               "w1", "w2", "w3")
# GPT-2's Conv1D layers, which store their weights (in, out): model.quantization=fp8 quantizes each of its columns.
CONV1D_PROJECTIONS = ("c_attn", "c_proj", "c_fc")


def compressed_tensors_config(weight_strategy: str, activations: dict[str, Any] | None) -> dict[str, Any]:
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": weight_strategy, "dynamic": False,
               "group_size": None, "block_structure": None, "actorder": None, "observer": "minmax"}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": activations, "output_activations": None}},
            "ignore": ["lm_head"], "kv_cache_scheme": None}


STATIC_TENSOR = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False}
DYNAMIC_TOKEN = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}


@dataclass(frozen=True)
class Fp8Format:
    quantization_config: dict[str, Any]
    per_channel: bool  # weight scales per output channel (N, 1), else one per tensor
    scale_name: str  # the weight scale's tensor name suffix
    scalar_scale: bool  # a per-tensor scale of shape () rather than (1,)
    input_scale: bool  # a static activation scale per layer, as calibrated checkpoints carry


FORMATS = {
    # llm-compressor's FP8 scheme: per-tensor weights, static per-tensor activations.
    "compressed_tensors_fp8": Fp8Format(
        compressed_tensors_config("tensor", STATIC_TENSOR), per_channel=False, scale_name="weight_scale",
        scalar_scale=False, input_scale=True),
    # llm-compressor's FP8_DYNAMIC scheme: per-channel weights, dynamic per-token activations.
    "compressed_tensors_fp8_dynamic": Fp8Format(
        compressed_tensors_config("channel", DYNAMIC_TOKEN), per_channel=True, scale_name="weight_scale",
        scalar_scale=False, input_scale=False),
    # AutoFP8 / vLLM: quant_method fp8, per-tensor scalar scales, static activations.
    "fp8_static": Fp8Format(
        {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}, per_channel=False,
        scale_name="weight_scale", scalar_scale=True, input_scale=True),
    # transformers' FineGrainedFP8Config without blocks: weight_scale_inv per tensor, dynamic activations.
    "fp8_dynamic_scale_inv": Fp8Format(
        {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": None}, per_channel=False,
        scale_name="weight_scale_inv", scalar_scale=True, input_scale=False),
}


def quantize(weight: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 values and float32 scales ((N, 1) per channel, () per tensor), as llm-compressor's minmax observer
    computes them."""
    amax = weight.abs().amax(dim=1, keepdim=True) if per_channel else weight.abs().amax()
    scale = (amax / FP8_MAX).float()
    return (weight / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def is_projection(name: str, projections: tuple[str, ...] = PROJECTIONS) -> bool:
    """Whether checkpoint tensor `name` is the weight of a decoder linear layer named in `projections`."""
    return name.endswith(".weight") and name.removesuffix(".weight").rsplit(".", 1)[-1] in projections


def quantization_round_trip(float_dir: Path) -> dict[str, torch.Tensor]:
    """What model.quantization=fp8 makes of float_dir's checkpoint: each decoder linear weight (GPT-2's Conv1D ones
    included) quantized per output channel and dequantized, as float32, by checkpoint name."""
    tensors = load_file(str(float_dir / "model.safetensors"))
    round_trips = {}
    for name, tensor in tensors.items():
        if is_projection(name):
            round_trips[name] = dequantize(*quantize_per_channel(tensor), torch.float32)
        elif is_projection(name, CONV1D_PROJECTIONS):
            round_trips[name] = dequantize(*quantize_per_channel(tensor.t()), torch.float32).t()
    return round_trips


def write_fp8_checkpoint(float_dir: Path, out_dir: Path, format_name: str) -> dict[str, torch.Tensor]:
    """float_dir's checkpoint with every decoder projection quantized to fp8 in format FORMATS[format_name], written
    to out_dir; returns each quantized weight dequantized (float32), by checkpoint name."""
    fmt = FORMATS[format_name]
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(float_dir / "model.safetensors"))
    written: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        layer = name.removesuffix(".weight")
        if not is_projection(name):
            written[name] = tensor
            continue
        weight, scale = quantize(tensor, fmt.per_channel)
        if not fmt.per_channel and not fmt.scalar_scale:
            scale = scale.reshape(1)
        written[name] = weight
        written[f"{layer}.{fmt.scale_name}"] = scale
        if fmt.input_scale:
            written[f"{layer}.input_scale"] = torch.tensor(0.05)
        dequantized[name] = weight.float() * scale
    save_file(written, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((float_dir / "config.json").read_text())
    config["quantization_config"] = fmt.quantization_config
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    shutil.copy(float_dir / "generation_config.json", out_dir / "generation_config.json")
    return dequantized


def write_float_twin(float_dir: Path, out_dir: Path, weights: dict[str, torch.Tensor]) -> Path:
    """float_dir's checkpoint with `weights` (checkpoint names) in place of its tensors, written to out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(float_dir / "model.safetensors"))
    assert set(weights) <= set(tensors)
    save_file({**tensors, **weights}, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "generation_config.json"):
        shutil.copy(float_dir / name, out_dir / name)
    return out_dir


def transformers_with_weights(float_dir: Path, weights: dict[str, torch.Tensor], twin_dir: Path) -> nn.Module:
    """transformers' model (float32, eager attention) of float_dir's checkpoint with `weights` (checkpoint names) in
    place of its tensors: written to twin_dir and loaded from there, so that transformers reads the checkpoint names
    as it does any (each expert's tensors into its stacked parameters)."""
    write_float_twin(float_dir, twin_dir, weights)
    return AutoModelForCausalLM.from_pretrained(twin_dir, attn_implementation="eager").float().eval()
