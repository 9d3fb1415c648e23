"""On CUDA: graph replay equals eager decode for every bucket, and greedy tokens equal transformers'."""

from __future__ import annotations

import pytest
import torch

from batchgen import LLM, SamplingParams
from batchgen.config import CudaGraphConfig, EngineConfig, ModelConfig
from batchgen.core.kv_sizing import KVDemand
from batchgen.engine.llm_engine import LLMEngine
from batchgen.worker.cuda_graph import CAPTURE_AFTER_USES, CudaGraphRunner, GraphOutputs
from tests.helpers.common import ARCHITECTURES, MAX_TOKENS, hf_greedy_on, random_prompts
from tests.helpers.graph_replay import first_decode_logits

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CAPTURE_SIZES = [1, 2, 4, 8, 16]


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_greedy_tokens_equal_transformers_on_gpu(tiny_model_dir, architecture):
    model_dir = tiny_model_dir(architecture)
    prompts = random_prompts(256, count=12)
    expected = hf_greedy_on(model_dir, prompts, MAX_TOKENS, device="cuda")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for setup in (dict(enforce_eager=True), dict(cuda_graph_capture_sizes=CAPTURE_SIZES),
                  dict(cuda_graph_capture_sizes=CAPTURE_SIZES, max_num_batched_tokens=7, block_size=4,
                       num_gpu_blocks_override=40)):
        llm = LLM(str(model_dir), dtype="float32", max_num_seqs=16, **setup)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.token_ids for o in outputs] == expected, setup
        llm.close()


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("architecture", ["Qwen3ForCausalLM", "GPT2LMHeadModel", "Phi3ForCausalLM", "Olmo2ForCausalLM",
                                          "Qwen3MoeForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM"])
def test_graph_replay_equals_eager_for_every_bucket(tiny_model_dir, architecture, kv_cache_dtype):
    llm = LLM(str(tiny_model_dir(architecture)), dtype="float32", max_num_seqs=16,
              cuda_graph_capture_sizes=CAPTURE_SIZES, kv_cache_dtype=kv_cache_dtype)
    runner = llm.engine.runner
    assert runner.graphs.sizes == CAPTURE_SIZES
    for num_seqs in range(1, 17):
        assert runner.graphs.padded_size(num_seqs) == min(s for s in CAPTURE_SIZES if s >= num_seqs)
        graph_logits, eager_logits = first_decode_logits(llm, random_prompts(256, count=num_seqs, seed=num_seqs))
        torch.testing.assert_close(graph_logits, eager_logits, rtol=1e-4, atol=1e-4)
        assert torch.equal(graph_logits.argmax(-1), eager_logits.argmax(-1))
    llm.close()


def test_capture_out_of_memory_drops_only_that_bucket(tiny_model_dir, monkeypatch, caplog):
    capture_forward = CudaGraphRunner._forward

    def forward(self, size: int, cascade: bool, sampled_into: torch.Tensor) -> GraphOutputs:
        if size == 8:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return capture_forward(self, size, cascade, sampled_into)

    monkeypatch.setattr(CudaGraphRunner, "_forward", forward)
    model_dir = str(tiny_model_dir("Qwen3ForCausalLM"))
    llm = LLM(model_dir, dtype="float32", max_num_seqs=16, cuda_graph_capture_sizes=CAPTURE_SIZES)
    assert llm.engine.runner.graphs.sizes == llm.engine.info["cuda_graph_sizes"] == [1, 2, 4, 16]
    assert "out of memory at batch size 8" in caplog.text
    assert list(llm.engine.info["cuda_graph_capture_seconds_per_size"]) == ["1", "2", "4", "16"]
    prompts = random_prompts(256, count=6, seed=3)  # 6 running requests: replayed in the 16 bucket now
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.close()
    eager = LLM(model_dir, dtype="float32", max_num_seqs=16, enforce_eager=True)
    assert outputs == [o.token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    eager.close()


def test_a_deferred_bucket_is_captured_mid_run_and_its_steps_equal_eager(tiny_model_dir):
    model_dir = str(tiny_model_dir("Qwen3ForCausalLM"))
    prompts = random_prompts(256, count=20, seed=5)
    params = SamplingParams(temperature=0, max_tokens=CAPTURE_AFTER_USES + 16, ignore_eos=True)
    llm = LLM(model_dir, dtype="float32", max_num_seqs=40)  # buckets 1, 2, 4, then steps of 8 up to 40
    info = llm.engine.info
    assert info["cuda_graph_sizes"] == [1, 2, 4, 8, 16, 32, 40] and info["cuda_graph_deferred_sizes"] == [24]
    # 20 rows: their first decode steps replay the 32 bucket, then bucket 24 is captured and replayed
    outputs = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert list(info["cuda_graph_deferred_capture_seconds"]) == [24]
    assert llm.engine.runner.graphs.sizes == [1, 2, 4, 8, 16, 24, 32, 40]
    llm.close()
    eager = LLM(model_dir, dtype="float32", max_num_seqs=40, enforce_eager=True)
    assert outputs == [o.token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    eager.close()


@pytest.mark.parametrize(("max_tokens", "expected_sizes"),
                         [([1, 1, 0], []), ([1, 5, 9], [1, 2]), ([9] * 5, [1, 2, 4, 8])])
def test_capture_takes_only_the_buckets_that_the_jobs_decodes_can_fill(tiny_model_dir, max_tokens, expected_sizes):
    model_dir = tiny_model_dir("Qwen3ForCausalLM")
    prompts = random_prompts(256, count=len(max_tokens), seed=4)
    demand = KVDemand([(len(prompt), tokens) for prompt, tokens in zip(prompts, max_tokens, strict=True)])
    config = EngineConfig(max_num_seqs=16, cuda_graph=CudaGraphConfig(capture_sizes=tuple(CAPTURE_SIZES)))
    engine = LLMEngine(ModelConfig(path=str(model_dir), dtype="float32"), config, kv_demand=demand)
    assert engine.info.get("cuda_graph_sizes", []) == expected_sizes
    for i, (prompt, tokens) in enumerate(zip(prompts, max_tokens, strict=True)):
        engine.add_request(i, None, prompt, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True,
                                                          prompt_logprobs=0 if tokens == 0 else None))
    outputs = {}
    while engine.has_unfinished_requests:
        outputs.update((o.request_id, o.token_ids) for o in engine.step()[0])
    engine.close()
    eager = LLM(str(model_dir), dtype="float32", max_num_seqs=16, enforce_eager=True)
    for i, (prompt, tokens) in enumerate(zip(prompts, max_tokens, strict=True)):
        if tokens:
            params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
            assert outputs[i] == eager.generate([prompt], params, use_tqdm=False)[0].token_ids
    eager.close()
