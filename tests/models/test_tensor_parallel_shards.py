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
from tests.helpers.common import NATIVE_ARCHITECTURES, tiny_hf_config
from tests.helpers.fp8_checkpoints import compressed_tensors_config

TP_ARCHITECTURES = [*NATIVE_ARCHITECTURES, "Qwen2MoeForCausalLM", "GemmaForCausalLM"]


def load_rank(directory: Path, tp: TensorParallel) -> torch.nn.Module:
    model_config = ModelConfig(path=str(directory))
    return load_model(model_config, load_hf_config(model_config), torch.float32, torch.device("cpu"), tp=tp)


def expected_shard(whole: torch.Tensor, layout: Shard, dim: int) -> torch.Tensor:
    """The rank's parameter cut from the whole model's (loaded without tensor parallelism): each part's range."""
    offsets = [sum(part.full for part in layout.parts[:i]) for i in range(len(layout.parts))]
    return torch.cat([whole.narrow(dim, offset + part.start, part.size)
                      for part, offset in zip(layout.parts, offsets, strict=True)], dim=dim)


@pytest.mark.parametrize("architecture", TP_ARCHITECTURES)
def test_each_rank_holds_its_slices_of_the_whole_model(tiny_model_dir: Callable[..., Path], architecture: str):
    directory = tiny_model_dir(architecture)
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


class RecordingSlice:
    """A safetensors slice that counts the elements read through it."""

    def __init__(self, inner: Any, reads: list[int]) -> None:
        self.inner, self.reads = inner, reads

    def get_shape(self) -> list[int]:
        return self.inner.get_shape()

    def __getitem__(self, index: Any) -> torch.Tensor:
        tensor = self.inner[index]
        self.reads.append(tensor.numel())
        return tensor


def test_a_rank_reads_only_its_slices_of_the_safetensors(tiny_model_dir: Callable[..., Path],
                                                         monkeypatch: pytest.MonkeyPatch):
    directory = tiny_model_dir("LlamaForCausalLM")
    files = loader.safetensors_files(str(directory))
    total = sum(tensor.numel() for _, tensor in loader.iter_safetensors(files))
    reads: list[int] = []
    lazy_reads = []
    real = loader.iter_safetensors

    def recording(files: list[Path], lazy: bool = False) -> Iterator[tuple[str, Any]]:
        lazy_reads.append(lazy)
        for name, tensor in real(files, lazy):
            yield name, RecordingSlice(tensor, reads)

    monkeypatch.setattr(loader, "iter_safetensors", recording)
    model = load_rank(directory, TensorParallel(1, 2))
    assert lazy_reads == [True]
    held = sum(p.numel() for p in model.parameters())
    # Only the norms are whole: everything else is half of the checkpoint.
    norms = sum(p.numel() for name, p in model.named_parameters() if "norm" in name)
    assert sum(reads) == held == (total - norms) // 2 + norms


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


def test_fp8_weights_run_on_one_rank():
    config = tiny_hf_config("LlamaForCausalLM").to_dict()
    with pytest.raises(ValueError, match=r"^engine.tensor_parallel_size=2 with model.quantization=fp8: fp8 weights run "
                                         r"on one rank; use engine.tensor_parallel_size=1 or leave model.quantization"):
        check_tensor_parallel(config, 2, "native", gguf=False, quantization="fp8")
    checkpoint = {**config, "quantization_config": compressed_tensors_config("channel", None)}
    with pytest.raises(ValueError, match=r"^engine.tensor_parallel_size=2 with an fp8 checkpoint \(quantization_config "
                                         r"quant_method compressed-tensors\): fp8 weights run on one rank"):
        check_tensor_parallel(checkpoint, 2, "native", gguf=False)
    check_tensor_parallel(checkpoint, 1, "native", gguf=False, quantization="fp8")
