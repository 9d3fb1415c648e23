"""The engine's warm-up step (ModelRunner.warm_up_step; run at a CUDA start, before the job's first step) leaves
nothing behind: the outputs after it, sampled with logprobs, prompt logprobs, n > 1 and pooling, equal a fresh
engine's; its prompt's K/V lands in the cache's first blocks, which a job may then take; over a scratch cache it
unbinds the cache again."""

from __future__ import annotations

import pytest
import torch

from batchgen import LLM, SamplingParams
from batchgen.core.kv_sizing import KVDemand
from batchgen.layers import attention_torch
from batchgen.worker.model_runner import WARM_UP_ROWS
from tests.engine.test_tasks_embed import prompts_with_a_repeat
from tests.helpers.common import build_tiny_classifier_dir, hf_greedy_on, random_prompts

SAMPLED = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=8, seed=3, n=2, logprobs=2,
                         prompt_logprobs=1, ignore_eos=True)
OPTIONS = dict(device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=64)


def _generated(llm: LLM, prompts: list[list[int]]) -> list[tuple]:
    outputs = llm.generate(prompts, SAMPLED, use_tqdm=False)
    return [(o.token_ids, o.logprobs, list(o.prompt_logprobs)) for o in outputs]


@pytest.mark.parametrize("architecture", ["Qwen3ForCausalLM", "GPT2LMHeadModel"])
def test_generations_after_the_warm_up_equal_a_fresh_engines(tiny_model_dir, architecture):
    model_dir = tiny_model_dir(architecture)
    prompts = random_prompts(256, 12)
    fresh = LLM(str(model_dir), **OPTIONS)
    expected = _generated(fresh, prompts)
    fresh.close()

    warmed = LLM(str(model_dir), **OPTIONS)
    runner = warmed.engine.runner
    runner.kv_cache.fill_(float("nan"))
    runner.warm_up_step()
    written = (~runner.kv_cache.isnan()).flatten(3).any(-1).any(0).any(0).nonzero().flatten().tolist()
    assert len(written) >= WARM_UP_ROWS  # the step ran: its prompts' K/V is in the cache's first blocks, and only there
    assert written == list(range(len(written)))
    assert _generated(warmed, prompts) == expected
    warmed.close()


def test_greedy_tokens_after_the_warm_up_equal_transformers(tiny_model_dir):
    model_dir = tiny_model_dir("LlamaForCausalLM")
    prompts = random_prompts(256, 16)
    llm = LLM(str(model_dir), **OPTIONS)
    llm.engine.runner.warm_up_step()
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outputs] == hf_greedy_on(model_dir, prompts, 6)
    llm.close()


@pytest.mark.parametrize("task", ["embed", "classify"])
def test_pooled_outputs_after_the_warm_up_equal_a_fresh_engines(tiny_model_dir, tmp_path, task):
    model_dir = (tiny_model_dir("Qwen3ForCausalLM") if task == "embed"
                 else build_tiny_classifier_dir("Qwen3ForCausalLM", tmp_path, num_labels=3))
    prompts = prompts_with_a_repeat(6)

    def pooled(warm_up: bool) -> list[list[float]]:
        llm = LLM(str(model_dir), task=task, **OPTIONS)
        if warm_up:
            llm.engine.runner.warm_up_step(llm.engine.pooler)
        outputs = getattr(llm, task)(prompts, use_tqdm=False)
        llm.close()
        return [o.embedding if task == "embed" else o.probs for o in outputs]

    for after, before in zip(pooled(True), pooled(False), strict=True):
        assert torch.allclose(torch.tensor(after), torch.tensor(before), atol=1e-6)


def test_an_engine_too_small_for_the_warm_up_skips_it(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("Qwen3ForCausalLM")), **{**OPTIONS, "max_num_batched_tokens": 5})
    runner = llm.engine.runner
    runner.kv_cache.fill_(float("nan"))
    runner.warm_up_step()
    assert runner.kv_cache.isnan().all()
    llm.close()


def test_an_engine_of_one_row_a_step_warms_up_on_one_row(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("Qwen3ForCausalLM")), **{**OPTIONS, "max_num_seqs": 1})
    runner = llm.engine.runner
    runner.kv_cache.fill_(float("nan"))
    runner.warm_up_step()  # three rows would not fit the step's buffers of one
    assert not runner.kv_cache[:, :, 0].isnan().all()
    outputs = llm.generate(random_prompts(256, 3), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                           use_tqdm=False)
    assert all(len(o.token_ids) == 4 for o in outputs)
    llm.close()


def test_a_long_context_adds_a_step_of_one_prompt_that_long(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("Qwen3ForCausalLM")), **OPTIONS)
    runner = llm.engine.runner
    runner.kv_cache.fill_(float("nan"))
    runner.warm_up_step(long_contexts=[60, 100])  # 100: more than a step's 64 tokens, skipped
    written = (~runner.kv_cache.isnan()).flatten(3).any(-1).any(0).any(0).nonzero().flatten().tolist()
    assert written == list(range(60 // 4))  # the long prompt's 15 blocks; the short step's three prompts take 12
    llm.close()


def test_the_warm_up_adds_only_the_long_contexts_a_job_reaches(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(attention_torch, "prefill_warm_up_contexts", lambda head_dim, q_dtype, device: (40, 90))
    llm = LLM(str(tiny_model_dir("Qwen3ForCausalLM")), **OPTIONS, max_model_len=64)
    worker = llm.engine.worker
    assert worker._warm_up_contexts(KVDemand([(10, 5), (20, 19)])) == []  # its longest row: 39 tokens
    assert worker._warm_up_contexts(KVDemand([(10, 5), (30, 10)])) == [40]
    assert worker._warm_up_contexts(KVDemand([(60, 500)])) == [40]  # a row ends at max_model_len
    assert worker._warm_up_contexts(None) == [40]  # rows unknown (LLM.generate): as long as max_model_len
    llm.close()


def test_over_a_scratch_cache_the_cache_is_unbound_again(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("Qwen3ForCausalLM")), **OPTIONS)
    runner = llm.engine.runner
    runner._unbind_kv_cache()  # as before the KV cache is sized (compile_ahead's dry run)
    runner.warm_up_step()
    assert runner.kv_cache is None
    assert all(layer.k_cache.numel() == 0 for layer in runner.attention_layers)
    llm.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("setup", [dict(enforce_eager=True), dict(cuda_graph_capture_sizes=[1, 2, 4, 8])])
def test_a_cuda_start_runs_the_warm_up_step_and_gives_transformers_tokens(tiny_model_dir, setup):
    model_dir = tiny_model_dir("Qwen3ForCausalLM")
    prompts = random_prompts(256, 8)
    llm = LLM(str(model_dir), dtype="float32", max_num_seqs=8, **setup)
    assert llm.engine.info["warm_up_seconds"] > 0
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outputs] == hf_greedy_on(model_dir, prompts, 6, device="cuda")
    llm.close()
