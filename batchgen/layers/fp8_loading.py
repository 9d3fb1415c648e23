"""fp8 weights at load time: which layers hold them, an fp8 checkpoint's tensors, quantizing and dequantizing.

The decoder's linear layers (attention and MLP projections) and its mixture-of-experts layers' stacked experts
(layers/moe.py) hold fp8 weights; embeddings, norms, the heads (lm_head, a classifier's score) and the linear layers a
module lists in its `unquantized_linears` (the MoE routers) keep the model's dtype, as in the fp8 checkpoints of
llm-compressor and vLLM, whose configs ignore lm_head and the routers. The heads are the network's direct children;
the decoder's linears sit deeper.

The loader calls, in order: `use_fp8_layers` (before an fp8 checkpoint's tensors load: each quantized layer an empty
fp8 layer, `Fp8Linear` or fp8 `StackedExperts`, that `fp8_checkpoint_tensors` fills), then `finish_fp8` (after the
weights load: quantizes what is still in the model's dtype, for model.quantization=fp8, and dequantizes again where
the device cannot run fp8).

With tensor parallelism each swapped layer keeps its predecessor's split (a row-parallel projection stays
row-parallel, `Fp8RowParallelLinear`), and a weight's per-row scales are split as its rows: a column-parallel rank
holds the scales of its rows (of each of q, k and v; gate and up), a row-parallel rank holds part of every row and
so every scale. Quantizing at load scales each row by the maximum of the whole row, gathered from the ranks: a
rank's fp8 weights are then the one-rank fp8 weights' slice, and so are their dequantized values.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from typing import Any

import torch
from torch import nn

from batchgen.layers.fp8 import Fp8Linear, fits_scaled_mm, fp8_supported, row_amax
from batchgen.layers.linear import Linear
from batchgen.layers.moe import StackedExperts
from batchgen.layers.parallel_linear import Fp8RowParallelLinear, RowParallelLinear
from batchgen.layers.tensor_parallel import SINGLE, TensorParallel, set_shard, shard_of

log = logging.getLogger(__name__)

SCALE_SUFFIX = ".weight_scale"
# quant_method fp8 names the weight scale weight_scale_inv (it multiplies the weight all the same).
SCALE_ALIASES = (".weight_scale_inv",)
# Calibrated activation and KV-cache scales: activations are quantized per token at run time (their scales are
# computed, never read), and the fp8 KV cache (engine.kv_cache_dtype=fp8) runs with scale 1.
UNUSED_SCALES = (".input_scale", ".output_scale", ".k_scale", ".v_scale")


def quantizable_linears(network: nn.Module) -> list[tuple[nn.Module, str]]:
    """(parent, attribute) of every linear layer of the decoder that holds fp8 weights in an fp8 model: the `Linear`s
    and `Fp8Linear`s below the network's direct children, but for those their parent names in
    `unquantized_linears`."""
    found = []
    for parent_name, parent in network.named_modules():
        if not parent_name:  # the network itself: its linear children are heads
            continue
        kept = getattr(parent, "unquantized_linears", ())
        for name, child in parent.named_children():
            if isinstance(child, (Linear, Fp8Linear)) and name not in kept:
                found.append((parent, name))
    return found


def quantizable_layers(network: nn.Module) -> list[tuple[nn.Module, str]]:
    """(parent, attribute) of every layer that holds fp8 weights in an fp8 model: quantizable_linears', then every
    `StackedExperts`."""
    experts = [(parent, name) for parent in network.modules() for name, child in parent.named_children()
               if isinstance(child, StackedExperts)]
    return quantizable_linears(network) + experts


def _replace(network: nn.Module, convert: Callable[[nn.Module], nn.Module | None]) -> int:
    """Replaces each quantizable layer for which convert returns a layer, one at a time (the old weight is freed
    before the next layer is built); the number replaced."""
    replaced = 0
    for parent, name in quantizable_layers(network):
        layer = convert(getattr(parent, name))
        if layer is not None:
            setattr(parent, name, layer)
            replaced += 1
    return replaced


def _fp8_class(linear: Linear) -> type[Fp8Linear]:
    return Fp8RowParallelLinear if isinstance(linear, RowParallelLinear) else Fp8Linear


def _empty_fp8(layer: nn.Module) -> nn.Module | None:
    if isinstance(layer, Linear):
        return _with_split_of(layer, _fp8_class(layer).empty_like(layer))
    if isinstance(layer, StackedExperts) and not layer.fp8:
        return _with_split_of(layer, layer.like(fp8=True))
    return None


def _quantized(layer: nn.Module, tp: TensorParallel) -> nn.Module | None:
    if isinstance(layer, Linear):
        return _with_split_of(layer, _fp8_class(layer).quantized(layer, _whole_row_amax(layer.weight, tp)))
    if isinstance(layer, StackedExperts) and not layer.fp8:
        amax = {name: _whole_row_amax(getattr(layer, name), tp) for name in StackedExperts.WEIGHTS}
        return _with_split_of(layer, layer.quantized(amax))
    return None


def _whole_row_amax(weight: torch.Tensor, tp: TensorParallel) -> torch.Tensor | None:
    """The absolute maximum of each row of a weight this rank holds only some columns of (split along its inputs:
    a row-parallel projection, an expert's down projection), over the whole row: the ranks' maxima, gathered. Each
    rank then quantizes its columns with the scales one rank would use, and the fp8 shards are the one-rank fp8
    weight cut in pieces. None where the rank holds whole rows (its weight's own maxima are the rows')."""
    layout = shard_of(weight)
    if layout is None or layout.dim == 0:
        return None
    return tp.max_over_ranks(row_amax(weight))


def _with_split_of(source: nn.Module, layer: nn.Module) -> nn.Module:
    """`layer` (source swapped for its fp8 form, or back) with source's tensor-parallel split (models/weights.py
    loads each rank's slices by it): each parameter's, and for a weight split by its rows (column-parallel), its
    per-row scales (`<weight>_scale`) split the same way. A weight split by its columns (row-parallel) has its scales
    whole on every rank."""
    params = dict(layer.named_parameters(recurse=False))
    for name, param in source.named_parameters(recurse=False):
        layout = shard_of(param)
        if layout is None or name not in params:
            continue
        set_shard(params[name], layout)
        scale = params.get(f"{name}_scale")
        if scale is not None and layout.dim == 0:
            set_shard(scale, layout)
    return layer


def use_fp8_layers(network: nn.Module) -> None:
    """Every quantizable layer becomes an empty fp8 layer of its shape, for an fp8 checkpoint to load into."""
    _replace(network, _empty_fp8)


def fp8_checkpoint_tensors(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """An fp8 checkpoint's (name, tensor) pairs as the model's parameters take them: weight scales named
    `<layer>.weight_scale`, float32, 1-D (a per-tensor scale of one element, which load_into repeats over the rows
    of its layer; per-channel scales (N, 1) as (N,)); activation and KV-cache scales dropped (UNUSED_SCALES).
    Tensors may be safetensors slices (a tensor-parallel rank's, which read only what load_into indexes): weights
    pass as they come, scales are read whole (a float a row at most) and load_into cuts a rank's rows from them."""
    for name, tensor in weights:
        if name.endswith(UNUSED_SCALES):
            continue
        for alias in SCALE_ALIASES:
            if name.endswith(alias):
                name = name.removesuffix(alias) + SCALE_SUFFIX
        if name.endswith(SCALE_SUFFIX):
            tensor = tensor[...]  # a safetensors slice: read whole
            if tensor.dim() == 2 and tensor.shape[1] != 1:
                raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}: block-wise fp8 weight "
                                 "scales are not supported; batchgen runs per-tensor and per-channel ones")
            tensor = tensor.float().reshape(-1)
        yield name, tensor


def finish_fp8(network: nn.Module, device: torch.device, tp: TensorParallel = SINGLE) -> None:
    """After the weights load: quantizes every quantizable layer still in the model's dtype to fp8 (per output
    channel; a tensor-parallel rank `tp` scales its part of each row by the whole row's maximum). Where `device` has
    no fp8 matmuls (CPU, GPUs before Ada), every fp8 layer gets its dequantized weights in the model's dtype back, and
    a line says so; on an fp8 GPU, so do linear layers whose shape torch._scaled_mm cannot take (sizes not multiples
    of 16; the expert kernels take any)."""
    with torch.no_grad():
        _replace(network, partial(_quantized, tp=tp))
        if not fp8_supported(device):
            count = _replace(network, _dequantized)
            log.info("fp8 weights of %d layers dequantized to the model's dtype: %s does not run fp8 (its kernels "
                     "need CUDA compute capability 8.9 or later)", count, _device_name(device))
            return
        count = _replace(network, lambda layer: _dequantized(layer) if isinstance(layer, Fp8Linear)
                         and not fits_scaled_mm(layer.out_features, layer.in_features) else None)
    if count:
        log.info("fp8 weights of %d linear layers dequantized to the model's dtype: torch._scaled_mm needs both "
                 "sizes of a weight to be multiples of 16", count)


def _dequantized(layer: nn.Module) -> nn.Module | None:
    if (isinstance(layer, StackedExperts) and layer.fp8) or isinstance(layer, Fp8Linear):
        return _with_split_of(layer, layer.dequantized())
    return None


def _device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor})"
