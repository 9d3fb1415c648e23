"""Copying checkpoint tensors (Hugging Face names) into our parameters, fused ones included."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from batchgen.layers.fp8 import FP8_DTYPE


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
    per-channel scales of its (block of a fused) layer.
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
            if target.rows is not None:
                destination = destination[target.rows]
            source = tensor.t() if target.transpose else tensor
            if (source.dtype == FP8_DTYPE) != (destination.dtype == FP8_DTYPE):
                raise ValueError(f"checkpoint tensor {raw_name} is {source.dtype}, but the model holds {name} in "
                                 f"{destination.dtype} (fp8 models hold the decoder's linear layers and experts in "
                                 "fp8; lm_head, embeddings and MoE routers not)")
            if name.endswith(".weight_scale") and source.numel() == 1:
                source = source.reshape(()).expand(destination.shape)
            if destination.shape != source.shape:
                raise ValueError(
                    f"checkpoint tensor {raw_name} has shape {tuple(tensor.shape)}; "
                    f"expected {tuple(destination.shape)}{' (transposed)' if target.transpose else ''}"
                )
            destination.copy_(source)
            loaded.add(name)
    missing = sorted(set(targets) - loaded)
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the model: missing {missing}, unexpected {sorted(unexpected)}")
