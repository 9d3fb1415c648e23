"""Embeddings (job.task=embed, LLM.embed) equal transformers' final hidden states pooled the same way (float32,
1e-4), whatever the prefill chunks and preemptions; the checkpoint's sentence-transformers pooling is the default;
a job writes an embedding column and answers OpenAI Batch /v1/embeddings lines in OpenAI's shape."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModel

from batchgen import LLM
from tests.engine.test_tokenizer import SHAKESPEARE_MODEL
from tests.helpers.common import batchgen, save_perturbed, tiny_hf_config

SETUPS = {"chunked": dict(max_num_batched_tokens=7),
          "preemption": dict(block_size=4, num_gpu_blocks_override=10, max_num_seqs=6, max_num_batched_tokens=12)}


def hf_embedding(model: torch.nn.Module, prompt: list[int], pooling: str, normalize: bool = True) -> torch.Tensor:
    with torch.no_grad():
        hidden = model(torch.tensor([prompt])).last_hidden_state[0]  # (T, hidden), after the final norm
    pooled = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling]
    return torch.nn.functional.normalize(pooled, dim=-1) if normalize else pooled


def prompts_with_a_repeat(count: int, seed: int = 0) -> list[list[int]]:
    """count prompts of 1 to 30 tokens, then twice a 38-token one (the second may reuse the first's blocks)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 30))] for _ in range(count)]
    repeated = [rng.randrange(256) for _ in range(38)]
    return prompts + [repeated, list(repeated)]


def embed(model_dir: Path, prompts: list[list[int]], **options) -> list:
    llm = LLM(str(model_dir), task="embed", device="cpu", dtype="float32", **options)
    try:
        return llm.embed(prompts, use_tqdm=False)
    finally:
        llm.close()


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
@pytest.mark.parametrize("architecture", ["Qwen3ForCausalLM", "LlamaForCausalLM"])
def test_embeddings_equal_transformers(tiny_model_dir, architecture, pooling, setup):
    model_dir = tiny_model_dir(architecture)
    prompts = prompts_with_a_repeat(8)
    outputs = embed(model_dir, prompts, pooling=pooling, **SETUPS[setup])
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.finish_reason == "length" and output.error is None and output.token_ids == []
        assert torch.allclose(torch.tensor(output.embedding), hf_embedding(model, prompt, pooling), atol=1e-4)
    # The last prompt repeats the one before: last-token pooling takes its leading blocks from the prefix cache;
    # mean and cls pooling need every position's (the first's) hidden state, so they take none.
    if setup == "chunked":
        assert (outputs[-1].num_cached_tokens > 0) == (pooling == "last")
    else:
        assert sum(output.num_preemptions for output in outputs) > 0


def test_unnormalized_embeddings(tiny_model_dir):
    model_dir = tiny_model_dir("Qwen2ForCausalLM")
    prompts = prompts_with_a_repeat(3)
    outputs = embed(model_dir, prompts, pooling="mean", normalize=False, max_num_batched_tokens=9)
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prompt, output in zip(prompts, outputs, strict=True):
        reference = hf_embedding(model, prompt, "mean", normalize=False)
        assert torch.allclose(torch.tensor(output.embedding), reference, atol=1e-4)


@pytest.mark.parametrize("architecture", ["Qwen3Model", "Qwen3ForCausalLM"])
def test_a_bare_decoders_checkpoint_embeds(tmp_path, architecture):
    """A checkpoint of the decoder alone (tensors without the "model." prefix and no LM head), as Qwen3-Embedding
    ships one: its config.json names Qwen3ForCausalLM; transformers' own save names Qwen3Model."""
    torch.manual_seed(0)
    reference = AutoModel.from_config(tiny_hf_config("Qwen3ForCausalLM")).float()
    save_perturbed(reference, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": [architecture]}))
    prompts = prompts_with_a_repeat(3)
    outputs = embed(tmp_path, prompts, pooling="last")
    for prompt, output in zip(prompts, outputs, strict=True):
        assert torch.allclose(torch.tensor(output.embedding), hf_embedding(reference.eval(), prompt, "last"),
                              atol=1e-4)
    if architecture == "Qwen3Model":
        with pytest.raises(ValueError, match="job.task=generate needs a model with a head; Qwen3Model"):
            LLM(str(tmp_path), device="cpu")


def sentence_transformers_dir(tiny_model_dir, tmp_path: Path, modes: dict[str, bool]) -> Path:
    checkpoint = tmp_path / "st"
    shutil.copytree(tiny_model_dir("Qwen3ForCausalLM"), checkpoint)
    (checkpoint / "1_Pooling").mkdir()
    config = {"word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False,
              "pooling_mode_max_tokens": False, "pooling_mode_lasttoken": False, **modes}
    (checkpoint / "1_Pooling" / "config.json").write_text(json.dumps(config))
    return checkpoint


def test_the_default_pooling_is_the_checkpoints_sentence_transformers_one(tiny_model_dir, tmp_path):
    checkpoint = sentence_transformers_dir(tiny_model_dir, tmp_path, {"pooling_mode_mean_tokens": True})
    prompts = prompts_with_a_repeat(2)
    llm = LLM(str(checkpoint), task="embed", device="cpu", dtype="float32")
    try:
        outputs = llm.embed(prompts, use_tqdm=False)
        assert llm.engine.info["pooling"] == "mean"
    finally:
        llm.close()
    model = AutoModel.from_pretrained(checkpoint, dtype=torch.float32).eval()
    for prompt, output in zip(prompts, outputs, strict=True):
        assert torch.allclose(torch.tensor(output.embedding), hf_embedding(model, prompt, "mean"), atol=1e-4)


def test_a_pooling_batchgen_does_not_do_names_model_pooling(tiny_model_dir, tmp_path):
    checkpoint = sentence_transformers_dir(tiny_model_dir, tmp_path, {"pooling_mode_max_tokens": True})
    with pytest.raises(ValueError, match="pooling_mode_max_tokens.*set model.pooling"):
        LLM(str(checkpoint), task="embed", device="cpu")


def test_an_embed_job_writes_embeddings_and_openai_responses(tmp_path):
    texts = ["ROMEO:\nBut soft", "JULIET:\nO Romeo, Romeo"]
    lines = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": "model", "input": text, "encoding_format": "float"}} for i, text in enumerate(texts)]
    lines.append({"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"messages": [{"role": "user", "content": "hi"}]}})
    lines.append({"custom_id": "b64", "method": "POST", "url": "/v1/embeddings",
                  "body": {"input": "KING", "encoding_format": "base64"}})
    data = tmp_path / "batch.jsonl"
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    run_dir = tmp_path / "run"
    result = batchgen(run_dir, "job=shakespeare", "job.task=embed", "model.pooling=mean", f"data.path={data}")
    assert result.returncode == 0, result.stdout + result.stderr
    table = pq.read_table(run_dir / "completions.parquet").to_pylist()
    model = AutoModel.from_pretrained(SHAKESPEARE_MODEL, dtype=torch.float32).eval()
    characters = json.loads((SHAKESPEARE_MODEL / "tokenizer.json").read_text())["model"]["vocab"]
    for text, row in zip(texts, table, strict=False):
        reference = hf_embedding(model, [characters[c] for c in text], "mean")
        assert torch.allclose(torch.tensor(row["embedding"]), reference, atol=1e-4)
        assert row["completion"] is None and row["continuation_logprob"] is None and row["probs"] is None
    results = [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines()]
    assert [line["custom_id"] for line in results] == ["e0", "e1", "chat", "b64"]
    body = results[0]["response"]["body"]
    assert body["object"] == "list" and body["model"] == "model"
    assert body["data"] == [{"object": "embedding", "embedding": table[0]["embedding"], "index": 0}]
    assert body["usage"] == {"prompt_tokens": len(texts[0]), "total_tokens": len(texts[0])}
    assert "not supported with job.task=embed" in results[2]["error"]["message"]
    assert "encoding_format='base64' is not supported" in results[3]["error"]["message"]
