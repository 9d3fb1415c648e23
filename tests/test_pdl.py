"""Programmatic dependent launch: off wherever the GPU lacks it, and on a Hopper GPU the same tokens as without."""

from __future__ import annotations

import pytest
import torch
from test_engine_greedy import random_prompts
from transformers import AutoModelForCausalLM, Qwen3Config

from batchgen import LLM, SamplingParams
from batchgen.layers import pdl


def test_off_on_cpu_and_when_disabled(monkeypatch):
    assert pdl.launch_options(torch.device("cpu")) == {"PDL": pdl.OFF.value, "launch_pdl": False}
    with pdl.early_start():
        assert pdl.launch_options(torch.device("cpu")) == {"PDL": pdl.OFF.value, "launch_pdl": False}
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert not pdl.pdl_enabled(torch.device("cuda", 0))


def test_early_start_holds_only_inside_its_block(monkeypatch):
    monkeypatch.setattr(pdl, "pdl_enabled", lambda device: True)
    cuda = torch.device("cuda", 0)

    def mode() -> int:
        options = pdl.launch_options(cuda)
        assert options["launch_pdl"]
        return options["PDL"]

    assert mode() == pdl.ON.value
    with pdl.early_start():
        assert mode() == pdl.EARLY.value
        with pdl.early_start(False):
            assert mode() == pdl.ON.value
        assert mode() == pdl.EARLY.value
    with pytest.raises(RuntimeError), pdl.early_start():
        raise RuntimeError("a capture that fails")
    assert mode() == pdl.ON.value


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a CUDA GPU of compute capability 9.0 or later")
def test_graph_decode_gives_the_same_tokens_with_and_without_pdl(tmp_path, monkeypatch):
    """A Qwen3 whose projections are large enough for the Triton GEMV (>= 1 MB each), so that every kernel of a
    decode step but the embedding and the sampler launches with PDL: a read before the wait would show here. Its 8
    kv heads make batch 1 a sparse attention launch (batch 2 too on 128 SMs or more), which reads its KV before
    the wait and is captured under pdl.early_start."""
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=2048, hidden_size=1024, intermediate_size=3072, num_hidden_layers=3,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=1024,
                         tie_word_embeddings=True)
    config.architectures = ["Qwen3ForCausalLM"]
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(tmp_path)
    prompts = random_prompts(2048, count=8, seed=5)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    tokens = {}
    for enabled in (True, False):
        monkeypatch.setattr(pdl, "ENABLED", enabled)
        llm = LLM(str(tmp_path), dtype="bfloat16", max_num_seqs=8, cuda_graph_capture_sizes=[1, 2, 4, 8])
        graphs = llm.engine.runner.graphs
        assert [graphs._early_start(size, cascade=False) for size in (1, 8)] == [True, False]
        tokens[enabled] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.close()
    assert tokens[True] == tokens[False]
