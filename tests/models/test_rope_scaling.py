"""Llama checkpoints with yarn and dynamic NTK RoPE: greedy tokens equal transformers' past max_position_embeddings,
which these scalings let engine.max_model_len exceed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from batchgen import LLM, SamplingParams
from tests.helpers.common import LLAMA_LIKE, hf_greedy_on, random_tokens, save_perturbed

MAX_POSITIONS = 32
ROPE = {
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": MAX_POSITIONS},
}


def build_checkpoint(directory: Path, rope: dict) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(**{**LLAMA_LIKE, "max_position_embeddings": MAX_POSITIONS},
                         rope_parameters={"rope_theta": 10000.0, **rope})
    return save_perturbed(AutoModelForCausalLM.from_config(config).float(), directory)


@pytest.mark.parametrize("name", list(ROPE))
def test_greedy_tokens_past_max_position_embeddings_equal_transformers(name: str, tmp_path: Path) -> None:
    checkpoint = build_checkpoint(tmp_path, ROPE[name])
    prompts = [random_tokens(n, seed=n) for n in (5, 20, 31)]  # within the limit; generations go past it
    expected = hf_greedy_on(checkpoint, prompts, 30)
    llm = LLM(str(checkpoint), device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=9)
    assert llm.engine.config.max_model_len == 2 * MAX_POSITIONS
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outputs] == expected
    llm.close()
