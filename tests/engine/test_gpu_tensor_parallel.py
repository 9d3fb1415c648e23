"""On two GPUs: engine.tensor_parallel_size=2 with CUDA graphs (NCCL all-reduces and all-gathers captured in the
decode graphs) gives one GPU's greedy tokens on float32 tiny models, with fp8 weights too; a follower killed mid-run
ends generate with FollowerExited instead of leaving rank 0 waiting in an NCCL collective."""

from __future__ import annotations

import faulthandler
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from batchgen import LLM, SamplingParams
from batchgen.layers.fp8 import Fp8Linear
from batchgen.layers.parallel_linear import Fp8RowParallelLinear
from batchgen.tp.errors import FollowerExited
from batchgen.worker.cuda_graph import CAPTURE_AFTER_USES
from tests.helpers.common import VOCAB, random_prompts, random_tokens
from tests.helpers.fp8_checkpoints import write_fp8_checkpoint

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def greedy(model: Path, size: int, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(str(model), tensor_parallel_size=size, dtype="float32", max_num_seqs=8)
    try:
        assert llm.engine.runner.graphs is not None  # decode steps replay CUDA graphs
        return [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    finally:
        llm.close()


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen3MoeForCausalLM", "GPT2LMHeadModel"])
def test_graph_mode_greedy_tokens_equal_one_gpu(tiny_model_dir: Callable[..., Path], architecture: str):
    model, prompts = tiny_model_dir(architecture), random_prompts(VOCAB, 6)
    assert greedy(model, 2, prompts) == greedy(model, 1, prompts)


# Two GPUs that run fp8 (compute capability 8.9 or later).
FP8_GPUS = torch.cuda.device_count() >= 2 and all(torch.cuda.get_device_capability(i) >= (8, 9) for i in range(2))


@pytest.mark.skipif(not FP8_GPUS, reason="needs two GPUs with fp8 (compute capability 8.9 or later)")
@pytest.mark.parametrize("source", ["quantization=fp8", "compressed_tensors_fp8", "compressed_tensors_fp8_dynamic"])
def test_fp8_graph_mode_greedy_tokens_equal_one_gpu(tiny_model_dir: Callable[..., Path], tmp_path: Path,
                                                    source: str):
    """fp8 weights in fp8 on two GPUs (quantized at load, or a checkpoint with per-tensor or per-channel scales),
    decode steps replayed from CUDA graphs. One-token prompts, one row a step: every fp8 linear runs the weight-only
    GEMV, whose sums are one GPU's in another order. (Steps of several rows quantize the activations per token, and
    a row-parallel rank scales its slice of a token by that slice's maximum, so they match one GPU only to fp8
    rounding.)"""
    float_dir = tiny_model_dir("LlamaForCausalLM")
    quantization = "fp8" if source == "quantization=fp8" else None
    model = float_dir
    if quantization is None:
        model = tmp_path / "fp8"
        write_fp8_checkpoint(float_dir, model, source)
    prompts = [[token] for token in random_tokens(4, seed=3)]
    generated = []
    for size in (2, 1):
        llm = LLM(str(model), tensor_parallel_size=size, dtype="float32", max_num_seqs=1, quantization=quantization)
        try:
            assert llm.engine.runner.graphs is not None
            attention = llm.engine.runner.model.model.layers[0].self_attn
            assert isinstance(attention.qkv_proj, Fp8Linear)
            assert isinstance(attention.o_proj, Fp8RowParallelLinear if size == 2 else Fp8Linear)
            generated.append([o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)])
        finally:
            llm.close()
    assert generated[0] == generated[1]


def test_a_deferred_bucket_is_captured_mid_run_on_every_rank(tiny_model_dir: Callable[..., Path]):
    """Both ranks capture bucket 24 at the same step (its graph holds the all-reduces), and the tokens stay one
    GPU's."""
    model = str(tiny_model_dir("LlamaForCausalLM"))
    prompts = random_prompts(VOCAB, 20, seed=7)  # 20 rows: bucket 24, deferred, their first steps replaying 32
    params = SamplingParams(max_tokens=CAPTURE_AFTER_USES + 16, temperature=0, ignore_eos=True)
    outputs = {}
    for size in (1, 2):
        llm = LLM(model, tensor_parallel_size=size, dtype="float32", max_num_seqs=40)
        try:
            assert llm.engine.info["cuda_graph_deferred_sizes"] == [24]
            outputs[size] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            assert list(llm.engine.info["cuda_graph_deferred_capture_seconds"]) == [24]
        finally:
            llm.close()
    assert outputs[2] == outputs[1]


# A rank 0 left waiting by its dead follower would block the suite for good: this long after the kill, the test
# process prints every thread's stack (where rank 0 waits) and exits.
KILLED_FOLLOWER_HANG_SECONDS = 90


def test_a_killed_follower_ends_generate_with_its_rank(tiny_model_dir: Callable[..., Path]):
    llm = LLM(str(tiny_model_dir("LlamaForCausalLM")), tensor_parallel_size=2, dtype="float32", max_num_seqs=8)
    (follower,) = llm.engine.followers.processes
    killer = threading.Timer(3.0, os.kill, (follower.pid, signal.SIGKILL))
    killer.start()
    faulthandler.dump_traceback_later(3.0 + KILLED_FOLLOWER_HANG_SECONDS, exit=True)
    try:
        with pytest.raises(FollowerExited, match=r"tensor-parallel rank 1 of 2 \(pid \d+\) exited on signal SIGKILL"):
            for _ in range(1000):  # generates until the follower is killed
                llm.generate(random_prompts(VOCAB, 8), SamplingParams(max_tokens=200, ignore_eos=True), use_tqdm=False)
    finally:
        killer.cancel()
        llm.close()
        faulthandler.cancel_dump_traceback_later()
