"""A scoring job (max_tokens=0, prompt_logprobs) whose prompts span several prefill chunks, each chunk's logits
scored in several slices of rows, equals transformers' log_softmax of the same float32 model."""

from __future__ import annotations

import random

import pytest
import torch

from batchgen import LLM, SamplingParams
from batchgen.core import kv_sizing
from batchgen.sample import logprobs
from tests.helpers.common import check_entry, hf_logprobs

VOCAB_SIZE = 256  # the tiny models'
SLICE_ROWS = 100


@pytest.mark.parametrize("mixed_prefill_decode", [False, True])
def test_a_chunked_scoring_job_equals_transformers(tiny_model_dir, monkeypatch, mixed_prefill_decode):
    model_dir = tiny_model_dir("Qwen3ForCausalLM")
    monkeypatch.setattr(kv_sizing, "LOGPROBS_SLICE_BYTES",
                        SLICE_ROWS * VOCAB_SIZE * kv_sizing.LOGPROBS_BYTES_PER_LOGIT)
    slice_sizes: list[int] = []
    score_slice = logprobs.score_slice

    def recording_score_slice(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> logprobs.LogprobsTensors:
        slice_sizes.append(len(logits))
        return score_slice(logits, token_ids, k)

    monkeypatch.setattr(logprobs, "score_slice", recording_score_slice)
    rng = random.Random(0)
    prompts = [[rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(700, 1200))] for _ in range(4)]
    # The tiny checkpoint's 256 positions, extended: its rotary embedding has no length of its own.
    llm = LLM(str(model_dir), hf_config={"max_position_embeddings": 2048}, device="cpu", dtype="float32",
              max_num_batched_tokens=256, mixed_prefill_decode=mixed_prefill_decode)
    try:
        outputs = llm.generate(prompts, SamplingParams(max_tokens=0, prompt_logprobs=3), use_tqdm=False)
    finally:
        llm.close()
    assert max(slice_sizes) == SLICE_ROWS and sum(slice_sizes) == sum(len(p) - 1 for p in prompts)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.finish_reason == "length" and output.token_ids == []
        assert len(output.prompt_logprobs) == len(prompt) and output.prompt_logprobs[0] is None
        reference = hf_logprobs(model_dir, prompt)
        for position in range(1, len(prompt)):
            check_entry(output.prompt_logprobs[position], prompt[position], reference[position - 1], 3)
