"""Copying checkpoint tensors (Hugging Face names) into our parameters, fused ones included; a tensor-parallel
rank's parameters take only their slices (`Shard`, layers/tensor_parallel.py) of the tensors."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from batchgen.layers.fp8 import FP8_DTYPE
from batchgen.layers.tensor_parallel import Shard, shard_of

# A checkpoint tensor, or a safetensors slice (safe_open(...).get_slice) that reads from the file only what is indexed.
CheckpointTensor = Any


@dataclass(frozen=True)
class WeightTarget:
    """Where one checkpoint tensor goes: a parameter, or a block of rows of a fused parameter."""

    param: nn.Parameter
    rows: slice | None = None  # the rows of a fused parameter (q/k/v, gate/up) this tensor fills
    transpose: bool = False  # GPT-2's Conv1D stores (in, out); nn.Linear wants (out, in)
    expert: int | None = None  # the expert of a stacked (experts, ...) parameter this tensor fills, before `rows`


def fused_rows(sizes: list[int]) -> list[slice]:
    """Consecutive row blocks of the given sizes: [0, s0), [s0, s0 + s1), ..."""
    slices, start = [], 0
    for size in sizes:
        slices.append(slice(start, start + size))
        start += size
    return slices


def load_into(
    targets: dict[str, WeightTarget],
    weights: Iterable[tuple[str, torch.Tensor]],
    ignored: Callable[[str], bool] = lambda name: False,
    rename: Callable[[str], str] = lambda name: name,
) -> None:
    """Copies each (name, tensor) into its target; raises listing names missing from or unexpected in `weights`.

    `rename` maps a checkpoint name to the name `targets` uses; `ignored` (given the renamed name) drops buffers and
    tensors the model does not need, such as rotary inv_freq or a tied lm_head.

    fp8 weights (float8_e4m3fn) load only into fp8 parameters and the other way round: a cast would drop their scale.
    A per-tensor fp8 weight scale (one element, `layers/fp8_loading.fp8_checkpoint_tensors`) fills every row of the
    per-channel scales of its (block of a fused) layer, of a tensor-parallel rank's rows of it too.
    """
    loaded: set[str] = set()
    unexpected: list[str] = []
    with torch.no_grad():
        for raw_name, tensor in weights:
            name = rename(raw_name)
            if ignored(name):
                continue
            target = targets.get(name)
            if target is None:
                unexpected.append(raw_name)
                continue
            destination = target.param if target.expert is None else target.param[target.expert]
            layout = shard_of(target.param)
            if layout is None:
                if target.rows is not None:
                    destination = destination[target.rows]
                _copy(destination, tensor[...], target.transpose, raw_name, name)
            else:
                _copy_shard(destination, target, layout, tensor, raw_name, name)
            loaded.add(name)
    missing = sorted(set(targets) - loaded)
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the model: missing {missing}, unexpected {sorted(unexpected)}")


def _copy(destination: torch.Tensor, source: torch.Tensor, transpose: bool, raw_name: str, name: str) -> None:
    """name: the parameter's (the renamed checkpoint name); raw_name: the checkpoint's, for errors."""
    source = source.t() if transpose else source
    if (source.dtype == FP8_DTYPE) != (destination.dtype == FP8_DTYPE):
        raise ValueError(f"checkpoint tensor {raw_name} is {source.dtype}, but the model holds {name} in "
                         f"{destination.dtype} (fp8 models hold the decoder's linear layers and experts in "
                         "fp8; lm_head, embeddings and MoE routers not)")
    if _is_per_tensor_scale(name, tuple(source.shape)):
        source = source.reshape(()).expand(destination.shape)
    if destination.shape != source.shape:
        shape = tuple(source.t().shape if transpose else source.shape)
        raise ValueError(f"checkpoint tensor {raw_name} has shape {shape}; "
                         f"expected {tuple(destination.shape)}{' (transposed)' if transpose else ''}")
    destination.copy_(source)


def _shape(tensor: CheckpointTensor) -> tuple[int, ...]:
    return tuple(tensor.get_shape()) if hasattr(tensor, "get_shape") else tuple(tensor.shape)


def _copy_shard(destination: torch.Tensor, target: WeightTarget, layout: Shard, tensor: CheckpointTensor,
                raw_name: str, name: str) -> None:
    """Reads this rank's ranges of `tensor` into `destination` (the parameter, or one expert of a stacked one):
    one part of a fused parameter where the target names its rows (a checkpoint's q_proj into qkv_proj), else every
    part from a tensor that holds them all fused (Phi-3's qkv_proj) or the one part of an unfused parameter."""
    local = layout.local_slices()
    if target.rows is not None:
        index = local.index(target.rows)
        pieces = [(layout.parts[index], local[index], 0)]
    else:
        offsets = [sum(part.full for part in layout.parts[:i]) for i in range(len(layout.parts))]
        pieces = list(zip(layout.parts, local, offsets, strict=True))
    full = list(destination.shape)
    full[layout.dim] = sum(part.full for part, _, _ in pieces)
    dim = layout.dim
    if target.transpose:  # GPT-2's Conv1D stores (in, out)
        full.reverse()
        dim = 1 - dim
    per_tensor_scale = _is_per_tensor_scale(name, _shape(tensor))
    if _shape(tensor) != tuple(full) and not per_tensor_scale:
        raise ValueError(f"checkpoint tensor {raw_name} has shape {_shape(tensor)}; expected {tuple(full)}")
    for part, rows, offset in pieces:
        index = [slice(None)] * len(full)
        index[dim] = slice(offset + part.start, offset + part.stop)
        source = tensor[...] if per_tensor_scale else tensor[tuple(index)]  # _copy repeats a per-tensor scale
        _copy(destination.narrow(layout.dim, rows.start, part.size), source, target.transpose, raw_name, name)


def _is_per_tensor_scale(name: str, shape: tuple[int, ...]) -> bool:
    """Whether a checkpoint tensor is an fp8 weight scale of one element, for every row of its (part of a) layer."""
    return name.endswith(".weight_scale") and math.prod(shape) == 1
