"""Classification (job.task=classify, LLM.classify) of *ForSequenceClassification checkpoints equals
transformers' AutoModelForSequenceClassification (float32, 1e-4): the last non-pad token through the score head,
with chunked prefill; a reward model (one label) gives its logit as the score."""

from __future__ import annotations

import json
import random

import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForSequenceClassification

from batchgen import LLM
from tests.helpers.common import batchgen, build_tiny_classifier_dir

PAD = 0


def classifier_dir(tmp_path_factory, architecture: str, num_labels: int, pad_token_id: int | None = PAD):
    directory = tmp_path_factory.mktemp(f"{architecture}-{num_labels}")
    return build_tiny_classifier_dir(architecture, directory, num_labels, pad_token_id)


def random_prompts(count: int) -> list[list[int]]:
    """Prompts of 1 to 40 tokens without the pad token, the first two ending in pad tokens."""
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 256) for _ in range(rng.randint(1, 40))] for _ in range(count)]
    prompts[0] += [PAD] * 3
    prompts[1] += [PAD] * 20
    return prompts


def hf_logits(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0]


def classify(model_dir, prompts: list[list[int]], **options) -> list:
    llm = LLM(str(model_dir), task="classify", device="cpu", dtype="float32", **options)
    try:
        return llm.classify(prompts, use_tqdm=False)
    finally:
        llm.close()


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_classification_equals_transformers(tmp_path_factory, architecture):
    model_dir = classifier_dir(tmp_path_factory, architecture, num_labels=3)
    prompts = random_prompts(6)
    outputs = classify(model_dir, prompts, max_num_batched_tokens=7, block_size=4)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prompt, output in zip(prompts, outputs, strict=True):
        reference = hf_logits(model, prompt)
        assert output.error is None and output.score is None
        assert torch.allclose(torch.tensor(output.logits), reference, atol=1e-4)
        assert torch.allclose(torch.tensor(output.probs), reference.softmax(-1), atol=1e-4)
        assert output.label == model.config.id2label[int(reference.argmax())]


def test_a_reward_model_gives_its_logit_as_the_score(tmp_path_factory):
    """One label and no pad token: the last token's logit, as transformers takes it at batch size 1."""
    model_dir = classifier_dir(tmp_path_factory, "Qwen3ForCausalLM", num_labels=1, pad_token_id=None)
    prompts = random_prompts(4)
    outputs = classify(model_dir, prompts, max_num_batched_tokens=16)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prompt, output in zip(prompts, outputs, strict=True):
        assert abs(output.score - hf_logits(model, prompt).item()) < 1e-4
        assert output.logits == [output.score] and output.probs is None and output.label is None


def test_the_task_must_suit_the_checkpoint(tmp_path_factory, tiny_model_dir):
    with pytest.raises(ValueError, match="job.task=classify needs a sequence-classification checkpoint"):
        LLM(str(tiny_model_dir("Qwen3ForCausalLM")), task="classify", device="cpu")
    classifier = classifier_dir(tmp_path_factory, "LlamaForCausalLM", num_labels=2)
    with pytest.raises(ValueError, match="job.task=generate needs a causal language model"):
        LLM(str(classifier), device="cpu")


def test_a_classify_job_writes_probabilities_and_labels(tmp_path, tmp_path_factory):
    model_dir = classifier_dir(tmp_path_factory, "Qwen2ForCausalLM", num_labels=2)
    prompts = random_prompts(3)
    data = tmp_path / "prompts.jsonl"
    rows = [{"prompt_token_ids": prompt, "temperature": 0.5} for prompt in prompts] + [{"prompt_token_ids": [1] * 300}]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = batchgen(tmp_path / "run", f"model.path={model_dir}", "job.task=classify", f"data.path={data}",
                      "engine.max_num_batched_tokens=16", "engine.max_model_len=256")
    assert result.returncode == 0, result.stdout + result.stderr
    table = pq.read_table(tmp_path / "run" / "completions.parquet").to_pylist()
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prompt, row in zip(prompts, table, strict=False):
        reference = hf_logits(model, prompt)
        assert torch.allclose(torch.tensor(row["probs"]), reference.softmax(-1), atol=1e-4)
        assert row["label"] == model.config.id2label[int(reference.argmax())] and row["embedding"] is None
    assert table[-1]["finish_reason"] == "error" and "more than max_model_len=256" in table[-1]["error"]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["engine"]["task"] == "classify" and summary["rows"] == 4
