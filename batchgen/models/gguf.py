"""Weights and config from a GGUF file: each tensor dequantized through the `gguf` library, named and laid out as
in the Hugging Face checkpoint our models load (see models/gguf_file.py for the header and the checks)."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch

from batchgen.models.gguf_file import (
    GGUFHeader,
    GGUFTensorInfo,
    gguf_file,
    hf_config_values,
    hf_tensor_name,
    read_header,
)
from batchgen.models.hf_config import HFConfig

# GPT-2's Conv1D weights, which llama.cpp stores transposed as (out, in); our GPT-2 loads them as (in, out).
_BLOCKS_PER_ROW = 1024
_GPT2_TRANSPOSED = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")


def gguf_header(path: str) -> GGUFHeader:
    return read_header(gguf_file(path))


def gguf_hf_config(path: str) -> HFConfig:
    values = hf_config_values(gguf_header(path))
    return HFConfig(values.pop("model_type"), values)


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's q/k row order for Llama: its converter interleaves the two rotary halves of each head
    (rows 0, d/2, 1, d/2 + 1, ...) for its own RoPE kernel; our RoPE (Hugging Face's) rotates the halves apart."""
    rows = weight.shape[0]
    per_head = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return per_head.swapaxes(1, 2).reshape(weight.shape)


def _dequantized(data: np.ndarray, tensor: GGUFTensorInfo) -> np.ndarray:
    """The tensor in float32. gguf's dequantize works through the rows 16 at a time; blocks never straddle rows, so
    the bytes are handed over as rows of up to `_BLOCKS_PER_ROW` blocks: a few hundred numpy calls per tensor
    instead of tens of thousands (seconds saved on a 135M-parameter model)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    quant_type = GGMLQuantizationType(tensor.type_id)
    block_size, type_size = GGML_QUANT_SIZES[quant_type]
    num_blocks = math.prod(tensor.shape) // block_size
    raw = data[tensor.offset:tensor.offset + num_blocks * type_size]
    values = dequantize(raw.reshape(-1, math.gcd(num_blocks, _BLOCKS_PER_ROW) * type_size), quant_type)
    return values.reshape(tensor.shape)


def iter_gguf_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor) pairs, one tensor dequantized at a time; the file is only read."""
    header = gguf_header(path)
    # Copy-on-write, as torch wants writable arrays (nothing is written back to the file); a plain ndarray view, as
    # numpy's memmap subclass costs a Python call for every array derived from it.
    data = np.memmap(header.path, dtype=np.uint8, mode="c", offset=header.data_offset).view(np.ndarray)
    heads = header.get("attention.head_count")
    kv_heads = header.get("attention.head_count_kv", heads)
    for tensor in header.tensors:
        name = hf_tensor_name(header, tensor.name)
        values = _dequantized(data, tensor)
        if header.architecture == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            values = unpermute_rotary_rows(values, heads)
        elif header.architecture == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            values = unpermute_rotary_rows(values, kv_heads)
        elif header.architecture == "gpt2" and name.endswith(_GPT2_TRANSPOSED):
            values = values.T
        yield name, torch.from_numpy(values)
