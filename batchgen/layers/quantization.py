"""Which fp8 checkpoints batchgen reads: a config.json's `quantization_config`, checked without torch.

Two formats hold fp8 weights with one scale per tensor or per output channel:
- compressed-tensors (llm-compressor's "FP8" and "FP8-dynamic" schemes): `quant_method: compressed-tensors`, config
  groups whose weights are 8-bit floats with strategy "tensor" or "channel"; tensors `<layer>.weight`
  (float8_e4m3fn) and `<layer>.weight_scale`, with a static scheme also `<layer>.input_scale`.
- `quant_method: fp8` (vLLM's and AutoFP8's format, transformers' FineGrainedFP8Config): `<layer>.weight` and
  `<layer>.weight_scale` (or `weight_scale_inv`, multiplied all the same); a `weight_block_size` means block-wise
  scales (DeepSeek-V3, Qwen3-FP8), which batchgen does not run.
Activations are quantized per token at run time whatever the checkpoint's activation scheme: a static checkpoint's
calibrated input scales are not read (a per-token scale never clips, a calibrated per-tensor one may).
"""

from __future__ import annotations

from typing import Any

WEIGHT_STRATEGIES = ("tensor", "channel")
ACTIVATION_STRATEGIES = ("token", "tensor")
SUPPORTED = "compressed-tensors FP8 / FP8-dynamic and quant_method fp8, with per-tensor or per-channel weight scales"


class UnsupportedQuantization(ValueError):
    """A quantization_config batchgen cannot run; the message is one line naming what is unsupported."""


def _field(config: Any, name: str) -> Any:
    return config.get(name) if isinstance(config, dict) else getattr(config, name, None)


def checkpoint_fp8(config: Any) -> str | None:
    """The quant_method of a model config's fp8 quantization_config (config: an HFConfig, a transformers config or
    config.json's values), compressed-tensors or fp8; None when it has no quantization_config. Raises
    UnsupportedQuantization for any other quantization (AWQ, GPTQ, int8, block-wise fp8, ...)."""
    quantization = _field(config, "quantization_config")
    if quantization is None:
        return None
    if not isinstance(quantization, dict):  # transformers' QuantizationConfigMixin
        quantization = quantization.to_dict()
    method = quantization.get("quant_method")
    if method == "compressed-tensors":
        _check_compressed_tensors(quantization)
        return method
    if method == "fp8":
        _check_fp8(quantization)
        return method
    raise UnsupportedQuantization(f"quantization_config quant_method {method!r} is not supported; batchgen runs "
                                  f"{SUPPORTED}")


def _check_compressed_tensors(quantization: dict[str, Any]) -> None:
    groups = quantization.get("config_groups") or {}
    if not groups:
        raise UnsupportedQuantization("quantization_config (compressed-tensors) has no config_groups")
    for name, group in groups.items():
        where = f"quantization_config config_groups.{name}"
        weights = group.get("weights") or {}
        if weights.get("num_bits") != 8 or weights.get("type") != "float":
            raise UnsupportedQuantization(
                f"{where}: weights of {weights.get('num_bits')}-bit {weights.get('type')} are not supported; batchgen "
                f"runs {SUPPORTED}")
        if weights.get("strategy") not in WEIGHT_STRATEGIES:
            raise UnsupportedQuantization(
                f"{where}: fp8 weight strategy {weights.get('strategy')!r} is not supported; batchgen runs "
                f"{' and '.join(WEIGHT_STRATEGIES)}")
        activations = group.get("input_activations")
        if activations is not None:
            if activations.get("num_bits") != 8 or activations.get("type") != "float":
                raise UnsupportedQuantization(
                    f"{where}: input activations of {activations.get('num_bits')}-bit {activations.get('type')} are "
                    "not supported; batchgen quantizes activations to fp8")
            if activations.get("strategy") not in ACTIVATION_STRATEGIES:
                raise UnsupportedQuantization(
                    f"{where}: input activation strategy {activations.get('strategy')!r} is not supported; batchgen "
                    f"runs {' and '.join(ACTIVATION_STRATEGIES)}")


def _check_fp8(quantization: dict[str, Any]) -> None:
    block = quantization.get("weight_block_size")
    if block is not None:
        raise UnsupportedQuantization(
            f"quantization_config weight_block_size {list(block)} (block-wise fp8 scales) is not supported; batchgen "
            "runs per-tensor and per-channel fp8 weight scales")
    scheme = quantization.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise UnsupportedQuantization(f"quantization_config activation_scheme {scheme!r} is not supported; batchgen "
                                      "runs dynamic and static")
