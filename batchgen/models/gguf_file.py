"""GGUF files (llama.cpp's single-file checkpoints) read without torch: the header, the Hugging Face config it
implies, and the checks that turn a file batchgen cannot run into a one-line error before anything loads.

A GGUF file is a metadata table (architecture, sizes, the tokenizer's vocabulary and merges, the chat template), a
tensor table (name, shape, type, offset) and the tensor data. `gguf.GGUFReader` builds numpy views for every string
of the vocabulary (tens of seconds for a 49k-token one), so the header is walked here with `struct` instead (a tenth
of a second); the data stays on disk until the loader (models/gguf.py) dequantizes it through the `gguf` library.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

GGUF_SUFFIX = ".gguf"
MAGIC = b"GGUF"
VERSIONS = (2, 3)  # version 1 counted with 32-bit integers; llama.cpp has written v3 since 2023
DEFAULT_ALIGNMENT = 32
INSTALL_HINT = "pip install 'batchgen[gguf]'"

# Metadata value types: the fixed-size ones as struct formats; 8 is a string, 9 an array.
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                   12: "<d"}
_FLOAT32, _STRING, _ARRAY = 6, 8, 9

# GGUF architecture -> (our model_type, the Hugging Face architecture our registry runs). llama.cpp writes Mistral
# (7B) checkpoints as "llama".
ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gpt2": ("gpt2", "GPT2LMHeadModel"),
}

# GGUF tensor names -> Hugging Face names. "{n}" is the layer index.
_LLAMA_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{n}.attn_norm.weight": "model.layers.{n}.input_layernorm.weight",
    "blk.{n}.attn_q.weight": "model.layers.{n}.self_attn.q_proj.weight",
    "blk.{n}.attn_k.weight": "model.layers.{n}.self_attn.k_proj.weight",
    "blk.{n}.attn_v.weight": "model.layers.{n}.self_attn.v_proj.weight",
    "blk.{n}.attn_q.bias": "model.layers.{n}.self_attn.q_proj.bias",
    "blk.{n}.attn_k.bias": "model.layers.{n}.self_attn.k_proj.bias",
    "blk.{n}.attn_v.bias": "model.layers.{n}.self_attn.v_proj.bias",
    "blk.{n}.attn_output.weight": "model.layers.{n}.self_attn.o_proj.weight",
    "blk.{n}.attn_output.bias": "model.layers.{n}.self_attn.o_proj.bias",
    "blk.{n}.attn_q_norm.weight": "model.layers.{n}.self_attn.q_norm.weight",
    "blk.{n}.attn_k_norm.weight": "model.layers.{n}.self_attn.k_norm.weight",
    "blk.{n}.ffn_norm.weight": "model.layers.{n}.post_attention_layernorm.weight",
    "blk.{n}.ffn_gate.weight": "model.layers.{n}.mlp.gate_proj.weight",
    "blk.{n}.ffn_up.weight": "model.layers.{n}.mlp.up_proj.weight",
    "blk.{n}.ffn_down.weight": "model.layers.{n}.mlp.down_proj.weight",
}
_GPT2_TENSORS = {
    "token_embd.weight": "transformer.wte.weight",
    "position_embd.weight": "transformer.wpe.weight",
    "output_norm.weight": "transformer.ln_f.weight",
    "output_norm.bias": "transformer.ln_f.bias",
    "output.weight": "lm_head.weight",
    "blk.{n}.attn_norm.weight": "transformer.h.{n}.ln_1.weight",
    "blk.{n}.attn_norm.bias": "transformer.h.{n}.ln_1.bias",
    "blk.{n}.attn_qkv.weight": "transformer.h.{n}.attn.c_attn.weight",
    "blk.{n}.attn_qkv.bias": "transformer.h.{n}.attn.c_attn.bias",
    "blk.{n}.attn_output.weight": "transformer.h.{n}.attn.c_proj.weight",
    "blk.{n}.attn_output.bias": "transformer.h.{n}.attn.c_proj.bias",
    "blk.{n}.ffn_norm.weight": "transformer.h.{n}.ln_2.weight",
    "blk.{n}.ffn_norm.bias": "transformer.h.{n}.ln_2.bias",
    "blk.{n}.ffn_up.weight": "transformer.h.{n}.mlp.c_fc.weight",
    "blk.{n}.ffn_up.bias": "transformer.h.{n}.mlp.c_fc.bias",
    "blk.{n}.ffn_down.weight": "transformer.h.{n}.mlp.c_proj.weight",
    "blk.{n}.ffn_down.bias": "transformer.h.{n}.mlp.c_proj.bias",
}
# The architecture's metadata the config needs (every other key has a default).
REQUIRED_KEYS = ("context_length", "embedding_length", "feed_forward_length", "block_count", "attention.head_count")
TENSOR_NAMES = {"llama": _LLAMA_TENSORS, "qwen2": _LLAMA_TENSORS, "qwen3": _LLAMA_TENSORS, "gpt2": _GPT2_TENSORS}


class UnsupportedGGUF(ValueError):
    """A GGUF file batchgen cannot run (or the gguf extra is missing); the message is one line."""


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # in torch's order (GGUF lists the fastest-moving dimension first)
    type_id: int  # a ggml type: gguf.GGMLQuantizationType's value
    offset: int  # from the start of the data section


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    metadata: dict[str, Any]
    tensors: tuple[GGUFTensorInfo, ...]
    data_offset: int  # where the data section starts in the file

    @property
    def architecture(self) -> str:
        return self.metadata["general.architecture"]

    def get(self, key: str, default: Any = None) -> Any:
        """The architecture's own key: get("context_length") reads "llama.context_length" in a llama file."""
        return self.metadata.get(f"{self.architecture}.{key}", default)


class _Cursor:
    """Reads little-endian GGUF values from a buffer, advancing an offset."""

    def __init__(self, buffer: mmap.mmap, path: Path):
        self.buffer = buffer
        self.offset = 0
        self.path = path

    def unpack(self, fmt: str) -> tuple[Any, ...]:
        try:
            values = struct.unpack_from(fmt, self.buffer, self.offset)
        except struct.error:
            raise UnsupportedGGUF(f"{self.path} is truncated or not a GGUF file") from None
        self.offset += struct.calcsize(fmt)
        return values

    def string(self) -> str:
        (length,) = self.unpack("<Q")
        start, self.offset = self.offset, self.offset + length
        if self.offset > len(self.buffer):
            raise UnsupportedGGUF(f"{self.path} is truncated or not a GGUF file")
        # errors="replace": a few vocabularies hold byte tokens that are not valid UTF-8 on their own
        return self.buffer[start:self.offset].decode("utf-8", errors="replace")

    def value(self, type_id: int) -> Any:
        if type_id == _FLOAT32:
            return _shortest_float32(self.unpack("<f")[0])
        if type_id in _SCALAR_FORMATS:
            return self.unpack(_SCALAR_FORMATS[type_id])[0]
        if type_id == _STRING:
            return self.string()
        if type_id == _ARRAY:
            item_type, count = self.unpack("<IQ")
            if item_type in _SCALAR_FORMATS:
                return list(self.unpack(f"<{count}{_SCALAR_FORMATS[item_type][1:]}"))
            return [self.value(item_type) for _ in range(count)]
        raise UnsupportedGGUF(f"{self.path} has a metadata value of unknown type {type_id}")


def _shortest_float32(value: float) -> float:
    """The shortest decimal that rounds to the same float32 (1e-05 for an epsilon stored as 9.9999997e-06): the
    value the checkpoint's config.json held before conversion."""
    stored = struct.pack("<f", value)
    for digits in range(1, 10):
        candidate = float(f"{value:.{digits}g}")
        if struct.pack("<f", candidate) == stored:
            return candidate
    return value


def is_gguf_path(path: str | None) -> bool:
    """Whether model.path names a GGUF file, or a directory without config.json that holds .gguf files."""
    if not path:
        return False
    candidate = Path(path)
    if candidate.is_file():
        return candidate.suffix == GGUF_SUFFIX
    return candidate.is_dir() and not (candidate / "config.json").exists() and any(candidate.glob(f"*{GGUF_SUFFIX}"))


def gguf_file(path: str) -> Path:
    """The GGUF file model.path names: the file itself, or the only .gguf file in its directory."""
    candidate = Path(path)
    if candidate.is_file():
        return candidate
    found = sorted(candidate.glob(f"*{GGUF_SUFFIX}"))
    if len(found) != 1:
        names = ", ".join(file.name for file in found) or "none"
        raise UnsupportedGGUF(f"{path} holds {len(found)} GGUF files ({names}); name the one to load")
    return found[0]


def read_header(path: str | Path) -> GGUFHeader:
    """The file's metadata and tensor table (cached per file, as the config, tokenizer and loader all read it)."""
    file = Path(path).resolve()
    stat = file.stat()
    return _read_header(file, stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=4)
def _read_header(file: Path, mtime_ns: int, size: int) -> GGUFHeader:
    with open(file, "rb") as handle:
        if size < len(MAGIC) or handle.read(len(MAGIC)) != MAGIC:
            raise UnsupportedGGUF(f"{file} is not a GGUF file (no GGUF magic)")
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
            cursor = _Cursor(buffer, file)
            cursor.offset = len(MAGIC)
            (version,) = cursor.unpack("<I")
            if version not in VERSIONS:
                # a big-endian file reads as a version with its low 16 bits zero
                raise UnsupportedGGUF(f"{file} is GGUF version {version} (or big-endian); batchgen reads "
                                      f"little-endian versions {' and '.join(map(str, VERSIONS))}")
            tensor_count, metadata_count = cursor.unpack("<QQ")
            metadata: dict[str, Any] = {}
            for _ in range(metadata_count):
                key = cursor.string()
                (type_id,) = cursor.unpack("<I")
                metadata[key] = cursor.value(type_id)
            tensors = []
            for _ in range(tensor_count):
                name = cursor.string()
                (num_dims,) = cursor.unpack("<I")
                dims = cursor.unpack(f"<{num_dims}Q")
                type_id, offset = cursor.unpack("<IQ")
                tensors.append(GGUFTensorInfo(name, tuple(reversed(dims)), type_id, offset))
            alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
            data_offset = -(-cursor.offset // alignment) * alignment
    if "general.architecture" not in metadata:
        raise UnsupportedGGUF(f"{file} has no general.architecture in its metadata")
    return GGUFHeader(file, metadata, tuple(tensors), data_offset)


def hf_tensor_name(header: GGUFHeader, name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor; None for one our models have no place for."""
    table = TENSOR_NAMES[header.architecture]
    if name in table:
        return table[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        pattern = table.get(f"blk.{{n}}.{parts[2]}")
        return None if pattern is None else pattern.format(n=parts[1])
    return None


def hf_config_values(header: GGUFHeader) -> dict[str, Any]:
    """config.json's values (model_type, architectures, sizes, rope, eps, token ids) for the file's model."""
    model_type, architecture = ARCHITECTURES[header.architecture]
    names = {tensor.name for tensor in header.tensors}
    embedding = next(tensor for tensor in header.tensors if tensor.name == "token_embd.weight")
    values: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [architecture],
        "vocab_size": embedding.shape[0],
        "bos_token_id": header.metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": header.metadata.get("tokenizer.ggml.eos_token_id"),
        "tie_word_embeddings": "output.weight" not in names,
        "max_position_embeddings": header.get("context_length"),
        "hidden_size": header.get("embedding_length"),
        "num_hidden_layers": header.get("block_count"),
        "num_attention_heads": header.get("attention.head_count"),
    }
    if model_type == "gpt2":
        values.update(n_inner=header.get("feed_forward_length"),
                      layer_norm_epsilon=header.get("attention.layer_norm_epsilon", 1e-5))
        return values
    heads = values["num_attention_heads"]
    values.update(
        intermediate_size=header.get("feed_forward_length"),
        num_key_value_heads=header.get("attention.head_count_kv", heads),
        head_dim=header.get("attention.key_length", values["hidden_size"] // heads),
        rms_norm_eps=header.get("attention.layer_norm_rms_epsilon", 1e-6),
        rope_parameters={"rope_type": "default", "rope_theta": header.get("rope.freq_base", 10000.0)},
    )
    if model_type == "llama":
        values["attention_bias"] = "blk.0.attn_q.bias" in names
        values["mlp_bias"] = False
    return values


def check_supported(header: GGUFHeader) -> None:
    """Raises UnsupportedGGUF (one line naming what) for an architecture, tensor or type batchgen cannot run."""
    where = header.path
    if header.architecture not in ARCHITECTURES:
        raise UnsupportedGGUF(f"{where} holds a {header.architecture!r} model; batchgen runs GGUF architectures "
                              f"{', '.join(ARCHITECTURES)}")
    missing = [f"{header.architecture}.{key}" for key in REQUIRED_KEYS if header.get(key) is None]
    if "token_embd.weight" not in {tensor.name for tensor in header.tensors}:
        missing.append("tensor token_embd.weight")
    if missing:
        raise UnsupportedGGUF(f"{where} lacks {', '.join(missing)}")
    unmapped = [tensor.name for tensor in header.tensors if hf_tensor_name(header, tensor.name) is None]
    if unmapped:
        # e.g. rope_freqs.weight: Llama 3.1's rope scaling, which llama.cpp stores as per-frequency factors
        raise UnsupportedGGUF(f"{where}: tensor {unmapped[0]} of this {header.architecture} model has no "
                              f"counterpart in batchgen's model ({len(unmapped)} such tensors)")
    scaling = header.get("rope.scaling.type", "none")
    if scaling != "none":
        raise UnsupportedGGUF(f"{where}: rope scaling {scaling!r} is not supported")
    rope_dims = header.get("rope.dimension_count")
    head_dim = hf_config_values(header).get("head_dim")
    if rope_dims is not None and head_dim is not None and rope_dims != head_dim:
        raise UnsupportedGGUF(f"{where}: rotary embeddings over {rope_dims} of {head_dim} head dimensions "
                              "(partial rotary) are not supported")
    _check_tensor_types(header)


def _check_tensor_types(header: GGUFHeader) -> None:
    """Every tensor type must be one the gguf library dequantizes (probed on one zero block of each type)."""
    try:
        import numpy as np
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import dequantize
    except ImportError:
        raise UnsupportedGGUF(f"{header.path} is a GGUF file: reading it needs the gguf extra ({INSTALL_HINT})") \
            from None
    for type_id in sorted({tensor.type_id for tensor in header.tensors}):
        tensor = next(tensor for tensor in header.tensors if tensor.type_id == type_id)
        try:
            quant_type = GGMLQuantizationType(type_id)
        except ValueError:
            raise UnsupportedGGUF(f"{header.path}: tensor {tensor.name} has ggml type {type_id}, which the gguf "
                                  "library does not know") from None
        _, type_size = GGML_QUANT_SIZES[quant_type]
        try:
            dequantize(np.zeros((1, type_size), dtype=np.uint8), quant_type)
        except NotImplementedError:
            raise UnsupportedGGUF(f"{header.path}: tensor {tensor.name} has type {quant_type.name}, which the gguf "
                                  "library cannot dequantize") from None


def validate_gguf(path: str, own_tokenizer: bool) -> None:
    """Raises UnsupportedGGUF for a GGUF model.path batchgen cannot run. own_tokenizer: the file's tokenizer is used
    (no model.tokenizer given)."""
    from batchgen.models.gguf_tokenizer import check_tokenizer  # it imports this module

    header = read_header(gguf_file(path))
    check_supported(header)
    if own_tokenizer:
        check_tokenizer(header)
