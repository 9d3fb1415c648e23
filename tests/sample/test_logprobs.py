"""Logprobs of generated and prompt tokens equal transformers' log_softmax of the same logits (float32, 1e-4), in
every way a step can be cut; a scoring job (max_tokens=0) only prefills."""

from __future__ import annotations

import pytest
import torch

from batchgen import LLM, SamplingParams
from tests.helpers.common import batchgen, check_entry, hf_logprobs, random_prompts

SETUPS = {"plain": {}, "chunked": dict(max_num_batched_tokens=7),
          "preemption": dict(block_size=4, num_gpu_blocks_override=14, max_num_seqs=6)}






@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("architecture", ["Qwen3ForCausalLM", "GPT2LMHeadModel"])
def test_logprobs_equal_transformers(tiny_model_dir, architecture, setup):
    model_dir = tiny_model_dir(architecture)
    prompts = random_prompts(256, count=4)
    llm = LLM(str(model_dir), device="cpu", dtype="float32", **SETUPS[setup])
    params = [SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.9 * (i % 2), logprobs=3, prompt_logprobs=2)
              for i in range(len(prompts))]
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.close()
    for prompt, output in zip(prompts, outputs, strict=True):
        reference = hf_logprobs(model_dir, prompt + output.token_ids)
        assert len(output.logprobs) == len(output.token_ids) == 6
        for i, (token, entry) in enumerate(zip(output.token_ids, output.logprobs, strict=True)):
            check_entry(entry, token, reference[len(prompt) - 1 + i], 3)
        assert len(output.prompt_logprobs) == len(prompt) and output.prompt_logprobs[0] is None
        for position in range(1, len(prompt)):
            check_entry(output.prompt_logprobs[position], prompt[position], reference[position - 1], 2)


def test_each_request_gets_the_number_of_top_tokens_it_asked_for(tiny_model_dir):
    """A step computes the most alternatives any of its rows asks for; each row keeps only its own k."""
    prompts = random_prompts(256, count=3)
    llm = LLM(str(tiny_model_dir("LlamaForCausalLM")), device="cpu", dtype="float32")
    params = [SamplingParams(max_tokens=4, ignore_eos=True, logprobs=k, prompt_logprobs=k) for k in (0, 1, 5)]
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.close()
    for output, k in zip(outputs, (0, 1, 5), strict=True):
        assert [len(entry["top"]) for entry in output.logprobs] == [k] * 4
        assert [len(entry["top"]) for entry in output.prompt_logprobs[1:]] == [k] * (len(output.prompt_token_ids) - 1)


def test_processed_logprobs_are_of_the_sampled_distribution(tiny_model_dir):
    model_dir = tiny_model_dir("LlamaForCausalLM")
    prompt = random_prompts(256, count=1)[0]
    llm = LLM(str(model_dir), device="cpu", dtype="float32", logprobs_mode="processed_logprobs")
    try:
        output = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0.5, top_k=10, logprobs=10,
                                                       ignore_eos=True), use_tqdm=False)[0]
    finally:
        llm.close()
    logits = hf_logprobs(model_dir, prompt + output.token_ids)  # log_softmax shifts logits; top-k keeps its set
    for i, entry in enumerate(output.logprobs):
        scaled = logits[len(prompt) - 1 + i] / 0.5
        kept = scaled.topk(10)
        filtered = torch.full_like(scaled, float("-inf")).scatter(0, kept.indices, kept.values).log_softmax(-1)
        check_entry(entry, output.token_ids[i], filtered, 10)
        assert all(t["logprob"] > float("-inf") for t in entry["top"])  # the ten kept tokens


def test_no_logprobs_unless_asked(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("LlamaForCausalLM")), device="cpu")
    try:
        output = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    finally:
        llm.close()
    assert output.logprobs is None and output.prompt_logprobs is None


def test_scoring_job_prefills_only(tmp_path):
    result = batchgen(tmp_path, "job=shakespeare", "preset=smoke_test", "data.limit=6", "sampling.max_tokens=0",
                      "sampling.prompt_logprobs=1")
    assert result.returncode == 0, result.stdout + result.stderr
    completions = tmp_path / "completions.parquet"
    duckdb = pytest.importorskip("duckdb")
    rows = duckdb.sql(f"""
        SELECT num_output_tokens, len(prompt_logprobs) AS n, num_prompt_tokens, prompt_logprobs[1] IS NULL AS first,
               list_sum(list_transform(prompt_logprobs[2:], lambda x: x.logprob)) AS total
        FROM '{completions}'""").fetchall()
    assert len(rows) == 6
    for output_tokens, n, prompt_tokens, first_is_null, total in rows:
        assert output_tokens == 0 and n == prompt_tokens and first_is_null and total < 0
    steps = duckdb.sql(f"SELECT DISTINCT kind FROM '{tmp_path / 'steps.parquet'}'").fetchall()
    assert steps == [("prefill",)]


def test_prompt_logprobs_are_complete_for_a_prompt_already_in_the_prefix_cache(tiny_model_dir):
    """A request with prompt_logprobs takes no prefix-cache hits: every prompt position needs its logits."""
    model_dir = tiny_model_dir("Qwen3ForCausalLM")
    prompt = [(7 * i + 3) % 256 for i in range(40)]  # five full blocks of 8
    llm = LLM(str(model_dir), device="cpu", dtype="float32", block_size=8)
    try:
        llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)  # caches its blocks
        [output] = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1),
                                use_tqdm=False)
    finally:
        llm.close()
    assert output.num_cached_tokens == 0
    reference = hf_logprobs(model_dir, prompt)
    assert len(output.prompt_logprobs) == len(prompt)
    for position in range(1, len(prompt)):
        check_entry(output.prompt_logprobs[position], prompt[position], reference[position - 1], 1)


@pytest.mark.parametrize("max_tokens", [0, 8])
def test_prompt_logprobs_are_recorded_once_when_their_requests_are_preempted(tiny_model_dir, max_tokens):
    """A preempted request recomputes its prompt and scores its positions again: each is recorded once, and equals
    transformers'."""
    model_dir = tiny_model_dir("Qwen3ForCausalLM")
    prompts = [[(5 * i + 11 * p) % 256 for i in range(40 + 4 * p)] for p in range(4)]
    llm = LLM(str(model_dir), device="cpu", dtype="float32", block_size=4, num_gpu_blocks_override=16,
              max_num_batched_tokens=32, max_num_seqs=4)  # room for one prompt of these at a time
    try:
        params = SamplingParams(max_tokens=max_tokens, prompt_logprobs=1, ignore_eos=True)
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.close()
    assert sum(output.num_preemptions for output in outputs) > 0
    for prompt, output in zip(prompts, outputs, strict=True):
        assert len(output.prompt_logprobs) == len(prompt) and output.prompt_logprobs[0] is None
        reference = hf_logprobs(model_dir, prompt)
        for position in range(1, len(prompt)):
            check_entry(output.prompt_logprobs[position], prompt[position], reference[position - 1], 1)
