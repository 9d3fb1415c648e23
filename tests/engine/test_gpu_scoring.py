"""On CUDA: a scoring job of 4,000-token prompts at Qwen3-0.6B's shape (its 151,936-token vocabulary) and
gpu_memory_utilization=0.9 completes: its prompt logprobs are computed in slices of rows, which the KV sizing
leaves memory for (scored whole, a 16,384-token step's logits would need about 25 GB)."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
import yaml

from batchgen import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.whole_gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

QWEN3_0_6B = Path(__file__).resolve().parents[2] / "conf" / "model" / "qwen3_0_6b.yaml"


def test_a_4000_token_scoring_job_on_the_qwen3_vocabulary_runs_without_running_out_of_memory():
    model = yaml.safe_load(QWEN3_0_6B.read_text())
    rng = random.Random(0)
    prompts = [[rng.randrange(10000) for _ in range(4000)] for _ in range(64)]
    llm = LLM(load_format=model["load_format"], hf_config=model["hf_config"], dtype=model["dtype"],
              gpu_memory_utilization=0.9, max_model_len=8192, max_num_batched_tokens=16384)
    try:
        slice_rows = llm.engine.runner.logprobs_slice_rows
        assert slice_rows.general < slice_rows.fused < 16384
        outputs = llm.generate(prompts, SamplingParams(max_tokens=0, prompt_logprobs=1), use_tqdm=False)
    finally:
        llm.close()
    assert len(outputs) == len(prompts)
    for output in outputs:
        assert output.finish_reason == "length" and output.error is None and output.token_ids == []
        entries = output.prompt_logprobs
        assert len(entries) == 4000 and entries[0] is None
        assert all(math.isfinite(e["logprob"]) and e["logprob"] <= 0 and len(e["top"]) == 1 for e in entries[1:])
