"""A tensor-parallel rank's model: built with its share of the heads and columns, loaded with only its slices of the
checkpoint, each slice equal to the matching part of the whole model; and the model shapes a size cannot split."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from batchgen.config import ModelConfig
from batchgen.layers.attention import Attention
from batchgen.layers.tensor_parallel import Shard, TensorParallel, shard_of
from batchgen.models import loader
from batchgen.models.loader import load_hf_config, load_model
from batchgen.models.tp_shapes import check_tensor_parallel
from tests.helpers.common import NATIVE_ARCHITECTURES, build_tiny_model_dir, tiny_hf_config
from tests.helpers.fp8_checkpoints import FORMATS, write_fp8_checkpoint

TP_ARCHITECTURES = [*NATIVE_ARCHITECTURES, "Qwen2MoeForCausalLM", "GemmaForCausalLM"]


def load_rank(directory: Path, tp: TensorParallel) -> torch.nn.Module:
    model_config = ModelConfig(path=str(directory))
    return load_model(model_config, load_hf_config(model_config), torch.float32, torch.device("cpu"), tp=tp)


def expected_shard(whole: torch.Tensor, layout: Shard, dim: int) -> torch.Tensor:
    """The rank's parameter cut from the whole model's (loaded without tensor parallelism): each part's range."""
    offsets = [sum(part.full for part in layout.parts[:i]) for i in range(len(layout.parts))]
    return torch.cat([whole.narrow(dim, offset + part.start, part.size)
                      for part, offset in zip(layout.parts, offsets, strict=True)], dim=dim)


def assert_ranks_hold_their_slices(directory: Path) -> None:
    """Each of two ranks holds its slices of the whole model's parameters (fp8 weights dequantized, on CPU, as the
    whole model's are), and its share of the heads."""
    whole = dict(load_rank(directory, TensorParallel()).named_parameters())
    for rank in range(2):
        model = load_rank(directory, TensorParallel(rank, 2))
        shards = dict(model.named_parameters())
        assert shards.keys() == whole.keys()
        num_sharded = 0
        for name, param in shards.items():
            layout = shard_of(param)
            if layout is None:
                torch.testing.assert_close(param, whole[name], rtol=0, atol=0, msg=name)
                continue
            num_sharded += 1
            dim = layout.dim + (param.dim() == 3)  # a stacked experts' layout counts the dims of one expert
            expected = expected_shard(whole[name], layout, dim)
            # The vocabulary's last rank may hold padding rows past the checkpoint's.
            held = param.narrow(dim, 0, expected.shape[dim])
            torch.testing.assert_close(held, expected, rtol=0, atol=0, msg=name)
        assert num_sharded > 0
        attention = [m for m in model.modules() if isinstance(m, Attention)]
        assert all(a.num_heads == 2 for a in attention)  # 4 query heads over 2 ranks


@pytest.mark.parametrize("architecture", TP_ARCHITECTURES)
def test_each_rank_holds_its_slices_of_the_whole_model(tiny_model_dir: Callable[..., Path], architecture: str):
    assert_ranks_hold_their_slices(tiny_model_dir(architecture))


@pytest.mark.parametrize(("architecture", "format_name"), [
    *[("LlamaForCausalLM", name) for name in FORMATS],
    # Phi-3's checkpoint fuses q, k and v (gate and up) under one scale; experts have scales of their own.
    ("Phi3ForCausalLM", "compressed_tensors_fp8"), ("Phi3ForCausalLM", "compressed_tensors_fp8_dynamic"),
    ("Qwen2MoeForCausalLM", "compressed_tensors_fp8"), ("MixtralForCausalLM", "compressed_tensors_fp8_dynamic"),
])
def test_each_rank_holds_its_slices_of_an_fp8_checkpoint(tiny_model_dir: Callable[..., Path], tmp_path: Path,
                                                         architecture: str, format_name: str):
    """Per-tensor scales (q, k and v each its own, repeated over the rank's rows of it) and per-channel ones (split as
    the weight's rows; whole for a row-parallel layer)."""
    write_fp8_checkpoint(tiny_model_dir(architecture), tmp_path, format_name)
    assert_ranks_hold_their_slices(tmp_path)


@pytest.mark.parametrize("format_name", ["compressed_tensors_fp8", "compressed_tensors_fp8_dynamic"])
def test_an_fp8_kv_head_is_replicated_with_its_scales(tmp_path: Path, format_name: str):
    float_dir = build_tiny_model_dir("LlamaForCausalLM", tmp_path / "float", overrides={"num_key_value_heads": 1})
    write_fp8_checkpoint(float_dir, tmp_path / "fp8", format_name)
    assert_ranks_hold_their_slices(tmp_path / "fp8")


class RecordingSlice:
    """A safetensors slice that records the elements read through it, by tensor name."""

    def __init__(self, inner: Any, name: str, reads: list[tuple[str, int]]) -> None:
        self.inner, self.name, self.reads = inner, name, reads

    def get_shape(self) -> list[int]:
        return self.inner.get_shape()

    def __getitem__(self, index: Any) -> torch.Tensor:
        tensor = self.inner[index]
        self.reads.append((self.name, tensor.numel()))
        return tensor


@pytest.mark.parametrize("format_name", [None, "compressed_tensors_fp8", "compressed_tensors_fp8_dynamic"])
def test_a_rank_reads_only_its_slices_of_the_safetensors(tiny_model_dir: Callable[..., Path], tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch, format_name: str | None):
    """Of an fp8 checkpoint too, whose weight scales (a float a row at most) are read whole and cut in memory."""
    directory = tiny_model_dir("LlamaForCausalLM")
    if format_name is not None:
        write_fp8_checkpoint(directory, tmp_path, format_name)
        directory = tmp_path
    files = loader.safetensors_files(str(directory))
    total = sum(tensor.numel() for name, tensor in loader.iter_safetensors(files) if not name.endswith("_scale"))
    reads: list[tuple[str, int]] = []
    lazy_reads = []
    real = loader.iter_safetensors

    def recording(files: list[Path], lazy: bool = False) -> Iterator[tuple[str, Any]]:
        lazy_reads.append(lazy)
        for name, tensor in real(files, lazy):
            yield name, RecordingSlice(tensor, name, reads)

    monkeypatch.setattr(loader, "iter_safetensors", recording)
    model = load_rank(directory, TensorParallel(1, 2))
    assert lazy_reads == [True]
    held = sum(p.numel() for p in model.parameters())
    # Only the norms are whole: everything else is half of the checkpoint.
    norms = sum(p.numel() for name, p in model.named_parameters() if "norm" in name)
    read = sum(count for name, count in reads if not name.endswith("_scale"))
    assert read == held == (total - norms) // 2 + norms


def test_kv_heads_fewer_than_ranks_are_replicated(tmp_path: Path):
    config = tiny_hf_config("LlamaForCausalLM")
    config.num_key_value_heads = 1
    model_config = ModelConfig(load_format="dummy", hf_config=config.to_dict())
    for rank in range(2):
        model = load_model(model_config, load_hf_config(model_config), torch.float32, torch.device("cpu"),
                           tp=TensorParallel(rank, 2))
        attention = model.model.layers[0].self_attn
        assert (attention.num_heads, attention.num_kv_heads) == (2, 1)
        q, k, v = shard_of(attention.qkv_proj.weight).parts
        assert (q.start, q.stop, k.start, k.stop, k.full) == (32 * rank, 32 * (rank + 1), 0, 16, 16)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"num_attention_heads": 6}, r"engine.tensor_parallel_size=4 is invalid: it must divide the model's "
                                 r"num_attention_heads \(6\)"),
    ({"num_key_value_heads": 6, "num_attention_heads": 12}, r"num_key_value_heads \(6\) must divide one another"),
    ({"intermediate_size": 130}, r"must divide the model's intermediate_size \(130\)"),
])
def test_sizes_that_do_not_split_the_model_name_the_key(overrides: dict, message: str):
    config = {**tiny_hf_config("LlamaForCausalLM").to_dict(), "num_key_value_heads": 4, **overrides}
    with pytest.raises(ValueError, match=message):
        check_tensor_parallel(config, 4, "native", gguf=False)
    check_tensor_parallel(config, 1, "native", gguf=False)


def test_gguf_and_transformers_modules_run_on_one_rank():
    config = tiny_hf_config("LlamaForCausalLM").to_dict()
    with pytest.raises(ValueError, match="engine.tensor_parallel_size=2: a GGUF model runs on one rank"):
        check_tensor_parallel(config, 2, "native", gguf=True)
    with pytest.raises(ValueError, match=r"engine.tensor_parallel_size=2: transformers' modules \(model.impl"):
        check_tensor_parallel(config, 2, "transformers", gguf=False)
    check_tensor_parallel(config, 2, "native", gguf=False)
