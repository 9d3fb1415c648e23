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

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


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
        if not (name.endswith(".weight") and layer.rsplit(".", 1)[-1] in PROJECTIONS):
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


@torch.no_grad()
def transformers_with_weights(float_dir: Path, weights: dict[str, torch.Tensor]) -> nn.Module:
    """transformers' model of float_dir (float32, eager attention) with `weights` (checkpoint names) put in place of
    its own."""
    model = AutoModelForCausalLM.from_pretrained(float_dir, attn_implementation="eager").float().eval()
    parameters = dict(model.named_parameters())
    for name, weight in weights.items():
        parameters[name].copy_(weight)
    return model
