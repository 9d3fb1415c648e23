"""engine.kv_cache_dtype=fp8: K/V stored as float8_e4m3fn (scale 1.0) still give what the unquantized model would,
up to fp8's rounding: on CPU through the torch path, on CUDA through the Triton kernels and CUDA graphs (the
kernels' own fp8 tests are in test_attention_triton.py).
"""

from __future__ import annotations

import pytest
import torch

from batchgen import LLM, SamplingParams
from batchgen.config import ConfigError
from batchgen.engine.model_worker import check_kv_cache_dtype_supported
from batchgen.layers.attention_torch import FP8_DTYPE
from tests.helpers.common import KV_SETUPS as SETUPS
from tests.helpers.common import hf_logprobs, random_prompts

MAX_TOKENS = 8
# fp8 keeps 3 mantissa bits: K/V off by up to 1/16 move the tiny model's log-probabilities by a few hundredths.
LOGPROB_ATOL = 0.15


def _logprob_errors(model_dir, prompt: list[int], output) -> list[float]:
    """|engine - transformers| log-probability of every prompt token after the first and every generated token,
    with transformers scoring the engine's own tokens (so one rounding flip cannot derail the comparison)."""
    reference = hf_logprobs(model_dir, prompt + output.token_ids)
    sequence = prompt + output.token_ids
    entries = output.prompt_logprobs[1:] + output.logprobs
    return [abs(entry["logprob"] - reference[position][sequence[position + 1]].item())
            for position, entry in enumerate(entries)]


def _check_fp8_engine_is_close_to_transformers(model_dir, device: str, **engine_options) -> None:
    prompts = random_prompts(256, count=4)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    llm = LLM(str(model_dir), device=device, dtype="float32", kv_cache_dtype="fp8", **engine_options)
    try:
        assert llm.engine.runner.kv_cache.dtype == FP8_DTYPE
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.close()
    errors = []
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.finish_reason == "length" and len(output.token_ids) == MAX_TOKENS
        errors += _logprob_errors(model_dir, prompt, output)
    assert max(errors) < LOGPROB_ATOL
    assert max(errors) > 1e-4  # the float32 cache matches transformers to 1e-4 (test_logprobs.py): this one rounds


@pytest.mark.parametrize("setup", list(SETUPS))
def test_fp8_cache_generates_close_to_the_unquantized_model(tiny_model_dir, setup: str) -> None:
    _check_fp8_engine_is_close_to_transformers(tiny_model_dir("Qwen3ForCausalLM"), "cpu", **SETUPS[setup])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("architecture", ["Qwen3ForCausalLM", "LlamaForCausalLM"])
def test_fp8_cache_on_triton_with_graphs_generates_close_to_the_unquantized_model(tiny_model_dir,
                                                                                 architecture: str) -> None:
    """The fused rotate-and-store kernel (Llama, Qwen3's q/k norms), prefill, and decode replayed in graphs."""
    _check_fp8_engine_is_close_to_transformers(tiny_model_dir(architecture), "cuda", max_num_seqs=16,
                                               cuda_graph_capture_sizes=[1, 2, 4, 8, 16])


def test_fp8_cache_holds_four_times_the_blocks_of_a_float32_one(tiny_model_dir) -> None:
    model_dir = str(tiny_model_dir("Qwen3ForCausalLM"))
    budget = dict(device="cpu", dtype="float32", max_num_seqs=64, cpu_kv_cache_space_gib=2**-10)
    infos = {}
    for kv_cache_dtype in ("auto", "fp8"):
        llm = LLM(model_dir, kv_cache_dtype=kv_cache_dtype, **budget)
        infos[kv_cache_dtype] = dict(llm.engine.info)
        llm.close()
    assert infos["auto"]["kv_cache_dtype"] == "float32" and infos["fp8"]["kv_cache_dtype"] == "float8_e4m3fn"
    assert infos["fp8"]["kv_blocks"] == 4 * infos["auto"]["kv_blocks"]
    assert "cpu_kv_cache_space_gib" in infos["fp8"]["kv_blocks_reason"]
    assert infos["fp8"]["kv_cache_bytes"] == infos["auto"]["kv_cache_bytes"] == 2**20


def test_invalid_kv_cache_dtype_names_the_key(tiny_model_dir) -> None:
    with pytest.raises(ConfigError, match=r"engine\.kv_cache_dtype='fp16' is invalid: allowed values are auto, fp8"):
        LLM(str(tiny_model_dir("Qwen3ForCausalLM")), device="cpu", kv_cache_dtype="fp16")


def test_triton_fp8_cache_needs_compute_capability_8_9(monkeypatch) -> None:
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    with pytest.raises(ValueError, match=r"engine\.kv_cache_dtype='fp8'.*8\.9 or newer, this one has 8\.6"):
        check_kv_cache_dtype_supported(FP8_DTYPE, "triton", cuda)
    check_kv_cache_dtype_supported(FP8_DTYPE, "torch", cuda)  # the torch path converts fp8 on any GPU
    check_kv_cache_dtype_supported(torch.bfloat16, "triton", cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_kv_cache_dtype_supported(FP8_DTYPE, "triton", cuda)
