"""On CUDA: continuation scoring, embeddings and classification equal transformers' (float32), with chunked prefill
and async scheduling; pooling engines capture no CUDA graph, and one of Qwen3-0.6B's shape runs at
gpu_memory_utilization=0.9."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

from batchgen import LLM
from tests.engine.test_tasks_classify import classifier_dir, hf_logits
from tests.engine.test_tasks_classify import random_prompts as classify_prompts
from tests.engine.test_tasks_embed import hf_embedding, prompts_with_a_repeat
from tests.engine.test_tasks_score import hf_loglikelihood

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

QWEN3_0_6B = Path(__file__).resolve().parents[2] / "conf" / "model" / "qwen3_0_6b.yaml"
TOLERANCE = 1e-4


def test_loglikelihood_on_gpu_equals_transformers(tiny_model_dir):
    model_dir = tiny_model_dir("Qwen3ForCausalLM")
    rng = random.Random(0)
    context = [rng.randrange(256) for _ in range(40)]
    pairs = [(context, [rng.randrange(256) for _ in range(rng.randint(1, 9))]) for _ in range(4)]
    llm = LLM(str(model_dir), dtype="float32", max_num_batched_tokens=7, block_size=4)
    try:
        results = llm.loglikelihood(pairs, use_tqdm=False)
    finally:
        llm.close()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for (context, continuation), (logprob, is_greedy) in zip(pairs, results, strict=True):
        reference_logprob, reference_greedy = hf_loglikelihood(model, context, continuation)
        assert abs(logprob - reference_logprob) < TOLERANCE and is_greedy == reference_greedy


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_embeddings_on_gpu_equal_transformers(tiny_model_dir, pooling):
    model_dir = tiny_model_dir("Qwen3ForCausalLM")
    prompts = prompts_with_a_repeat(8)
    llm = LLM(str(model_dir), task="embed", pooling=pooling, dtype="float32", max_num_batched_tokens=7)
    try:
        assert llm.engine.runner.graphs is None
        outputs = llm.embed(prompts, use_tqdm=False)
    finally:
        llm.close()
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prompt, output in zip(prompts, outputs, strict=True):
        reference = hf_embedding(model, prompt, pooling)
        assert torch.allclose(torch.tensor(output.embedding), reference, atol=TOLERANCE)


def test_classification_on_gpu_equals_transformers(tmp_path_factory):
    model_dir = classifier_dir(tmp_path_factory, "Qwen3ForCausalLM", num_labels=3)
    prompts = classify_prompts(6)
    llm = LLM(str(model_dir), task="classify", dtype="float32", max_num_batched_tokens=7)
    try:
        outputs = llm.classify(prompts, use_tqdm=False)
    finally:
        llm.close()
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prompt, output in zip(prompts, outputs, strict=True):
        reference = hf_logits(model, prompt)
        assert torch.allclose(torch.tensor(output.probs), reference.softmax(-1), atol=TOLERANCE)


@pytest.mark.whole_gpu
def test_an_embed_engine_of_qwen3_shape_sizes_its_cache_and_runs():
    model = yaml.safe_load(QWEN3_0_6B.read_text())
    rng = random.Random(0)
    prompts = [[rng.randrange(10000) for _ in range(1000)] for _ in range(64)]
    llm = LLM(task="embed", pooling="mean", load_format=model["load_format"], hf_config=model["hf_config"],
              dtype=model["dtype"], gpu_memory_utilization=0.9, max_num_batched_tokens=16384)
    try:
        outputs = llm.embed(prompts, use_tqdm=False)
    finally:
        llm.close()
    for output in outputs:
        embedding = torch.tensor(output.embedding)
        assert output.error is None and embedding.shape == (1024,) and torch.isfinite(embedding).all()
        assert abs(embedding.norm().item() - 1) < 1e-3
