"""Continuation scoring (job.task=score, LLM.loglikelihood) equals transformers' log_softmax of the same float32
model, with chunked prefill and a context shared through the prefix cache; texts pair up as lm-eval's _encode_pair
pairs them; bad rows become error rows in place."""

from __future__ import annotations

import json
import random

import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM

from batchgen import LLM
from batchgen.config import Config, ConfigError, DataConfig, JobConfig
from batchgen.engine.continuation import encode_pair
from batchgen.engine.tokenizer import load_tokenizer
from batchgen.io.openai_results import openai_results_wanted
from tests.engine.test_tokenizer import SHAKESPEARE_MODEL, byte_level_bpe_dir  # noqa: F401 (a fixture)
from tests.helpers.common import batchgen

VOCAB_SIZE = 256  # the tiny models'


def hf_loglikelihood(model: torch.nn.Module, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """lm-eval's loglikelihood of one pair: the continuation's logprobs summed, and whether each is the argmax."""
    with torch.no_grad():
        logprobs = model(torch.tensor([context + continuation])).logits[0].float().log_softmax(-1)
    scoring = logprobs[len(context) - 1:-1]  # position p scores token p + 1
    target = torch.tensor(continuation)
    return scoring.gather(1, target[:, None]).sum().item(), bool((scoring.argmax(-1) == target).all())


def greedy_continuation(model: torch.nn.Module, context: list[int], length: int) -> list[int]:
    tokens = list(context)
    with torch.no_grad():
        for _ in range(length):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(context):]


@pytest.mark.parametrize("architecture", ["Qwen3ForCausalLM", "LlamaForCausalLM", "GPT2LMHeadModel"])
def test_loglikelihood_equals_transformers(tiny_model_dir, architecture):
    model_dir = tiny_model_dir(architecture)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rng = random.Random(0)
    contexts = [[rng.randrange(VOCAB_SIZE) for _ in range(length)] for length in (40, 17, 1)]
    pairs = [(context, [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(1, 9))])
             for context in contexts for _ in range(3)]
    pairs += [(context, greedy_continuation(model, context, 4)) for context in contexts]
    # Chunks of 7 tokens: contexts and continuations are cut across steps.
    llm = LLM(str(model_dir), device="cpu", dtype="float32", max_num_batched_tokens=7, block_size=4)
    try:
        results = llm.loglikelihood(pairs, use_tqdm=False)
    finally:
        llm.close()
    for (context, continuation), (logprob, is_greedy) in zip(pairs, results, strict=True):
        reference_logprob, reference_greedy = hf_loglikelihood(model, context, continuation)
        assert abs(logprob - reference_logprob) < 1e-4
        assert is_greedy == reference_greedy
    assert [is_greedy for _, is_greedy in results[-3:]] == [True] * 3


def score(llm: LLM, pairs: list[tuple[list[int], list[int]]]) -> list:
    """The engine's outputs of score requests, in order (LLM.loglikelihood keeps only the two numbers)."""
    for i, (context, continuation) in enumerate(pairs):
        llm.engine.add_score_request(i, context, continuation)
    outputs = []
    while llm.engine.has_unfinished_requests:
        outputs += llm.engine.step()[0]
    return sorted(outputs, key=lambda output: output.request_id)


@pytest.mark.parametrize(("context_length", "cached"), [(40, 32), (32, 16)])
def test_a_shared_context_is_computed_once(tiny_model_dir, context_length, cached):
    """Four choices of one context: the later ones take its full blocks from the cache, all but the block holding
    the last context position, whose logits score the first continuation token; the results do not change."""
    model_dir = tiny_model_dir("Qwen3ForCausalLM")
    rng = random.Random(1)
    context = [rng.randrange(VOCAB_SIZE) for _ in range(context_length)]
    pairs = [(context, [rng.randrange(VOCAB_SIZE) for _ in range(3)]) for _ in range(4)]
    results = {}
    for caching in (True, False):
        llm = LLM(str(model_dir), device="cpu", dtype="float32", block_size=16, enable_prefix_caching=caching)
        try:
            results[caching] = score(llm, pairs)
        finally:
            llm.close()
    assert [o.num_cached_tokens for o in results[True]] == [0] + [cached] * 3
    assert [o.num_cached_tokens for o in results[False]] == [0] * 4
    for with_cache, without in zip(results[True], results[False], strict=True):
        assert abs(with_cache.continuation_logprob - without.continuation_logprob) < 1e-4
        assert with_cache.continuation_num_tokens == 3 and with_cache.prompt_logprobs is None


def test_loglikelihood_names_a_request_that_cannot_be_scored(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("Qwen3ForCausalLM")), device="cpu", dtype="float32")
    try:
        with pytest.raises(ValueError, match="request 1: the continuation has no tokens"):
            llm.loglikelihood([([1, 2], [3]), ([1, 2], [])], use_tqdm=False)
        with pytest.raises(ValueError, match=r"request 0: context \+ continuation have 257 tokens"):
            llm.loglikelihood([([1] * 250, [2] * 7)], use_tqdm=False)
        with pytest.raises(ValueError, match="LLM.embed needs"):
            llm.embed([[1, 2]], use_tqdm=False)
    finally:
        llm.close()


def test_pairs_are_encoded_as_lm_eval_encodes_them(byte_level_bpe_dir):  # noqa: F811
    tokenizer = load_tokenizer(str(byte_level_bpe_dir))

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    context_ids, continuation_ids = encode_pair(tokenizer, "the quick brown  ", "fox jumps")
    # The context's trailing spaces move to the continuation; the whole text is encoded once, no BOS added.
    assert context_ids == encode("the quick brown")
    assert context_ids + continuation_ids == encode("the quick brown  fox jumps")
    assert tokenizer.decode(continuation_ids) == "  fox jumps"
    assert encode_pair(tokenizer, "", "the lazy dog") == ([], encode("the lazy dog"))


def test_a_score_job_writes_each_rows_result_in_place(tmp_path):
    """Text and token-id rows equal transformers'; an empty continuation, a pair longer than max_model_len and a
    malformed row (data.on_error=skip) are error rows in their places; the other tasks' columns stay null."""
    model = AutoModelForCausalLM.from_pretrained(SHAKESPEARE_MODEL, dtype=torch.float32).eval()
    tokenizer = load_tokenizer(str(SHAKESPEARE_MODEL))
    rows = [
        {"id": "text", "context": "ROMEO:\nBut soft, what light ", "continuation": "through yonder window"},
        {"id": "ids", "context_token_ids": tokenizer.encode("JULIET:\nO"), "continuation_token_ids":
            tokenizer.encode(" Romeo")},
        {"id": "empty", "context": "To be", "continuation": ""},
        {"id": "long", "context": "a" * 250, "continuation": "bcdefghij"},
        {"id": "half", "context": "no continuation"},
        {"id": "empty-context", "context": "", "continuation": "KING"},
    ]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    run_dir = tmp_path / "run"
    result = batchgen(run_dir, "job=mc_eval", f"data.path={data}", "data.on_error=skip")
    assert result.returncode == 0, result.stdout + result.stderr
    table = pq.read_table(run_dir / "completions.parquet").to_pylist()
    assert [row["id"] for row in table] == [row["id"] for row in rows]
    text, ids, empty, long, half, empty_context = table
    eos = tokenizer.eos_token_id
    for output, context, continuation in ((text, "ROMEO:\nBut soft, what light", " through yonder window"),
                                          (ids, "JULIET:\nO", " Romeo"), (empty_context, None, "KING")):
        context_ids = [eos] if context is None else tokenizer.encode(context)  # the prefix token: BOS = EOS here
        reference_logprob, reference_greedy = hf_loglikelihood(model, context_ids, tokenizer.encode(continuation))
        assert abs(output["continuation_logprob"] - reference_logprob) < 1e-4
        assert output["continuation_is_greedy"] == reference_greedy
        assert output["continuation_num_tokens"] == len(continuation)  # one token per character
        assert output["finish_reason"] == "length" and output["output_token_ids"] == []
        assert output["embedding"] is None and output["probs"] is None and output["prompt_logprobs"] is None
    assert text["prompt"] == rows[0]["context"] + rows[0]["continuation"]
    assert empty["finish_reason"] == "error" and "continuation has no tokens" in empty["error"]
    assert long["finish_reason"] == "error" and "context + continuation have 259 tokens" in long["error"]
    assert half["finish_reason"] == "error" and "line 5: field 'continuation' must be a string" in half["error"]
    for output in (empty, long, half):
        assert output["continuation_logprob"] is None


@pytest.mark.parametrize("task", ["score", "classify"])
def test_openai_batch_files_are_refused_by_tasks_that_do_not_read_them(tmp_path, task):
    batch = tmp_path / "batch.jsonl"
    batch.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                                 "body": {"prompt": "x"}}) + "\n")
    config = Config(job=JobConfig(task=task), data=DataConfig(path=str(batch)))
    with pytest.raises(ConfigError, match=f"job.task={task} does not read OpenAI Batch files"):
        openai_results_wanted(config)
