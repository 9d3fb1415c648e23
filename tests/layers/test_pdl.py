"""Programmatic dependent launch: off wherever the GPU lacks it, and on a Hopper GPU the same tokens as without."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from batchgen import LLM, SamplingParams
from batchgen.worker.cuda_graph import GraphKey
from tests.helpers.common import random_prompts

pdl = pytest.importorskip("batchgen.layers.pdl", reason="PDL's kernels need triton (torch's CPU build has none)")


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


def _save_gemv_sized_qwen3(model_dir) -> None:
    """A Qwen3 whose projections are large enough for the Triton GEMV (>= 1 MB each), so that every kernel of a
    decode step but the embedding and the sampler launches with PDL. Its 8 kv heads make batch 1 a sparse attention
    launch (batch 2 too on 128 SMs or more), which reads its KV before the wait: its graph is captured under
    pdl.early_start."""
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=2048, hidden_size=1024, intermediate_size=3072, num_hidden_layers=3,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=1024,
                         tie_word_embeddings=True)
    config.architectures = ["Qwen3ForCausalLM"]
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(model_dir)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a CUDA GPU of compute capability 9.0 or later")
def test_graph_decode_gives_the_same_tokens_with_and_without_pdl(tmp_path, monkeypatch):
    """A read before the wait of what the kernel before writes would show here."""
    _save_gemv_sized_qwen3(tmp_path)
    prompts = random_prompts(2048, count=8, seed=5)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    tokens = {}
    for enabled in (True, False):
        monkeypatch.setattr(pdl, "ENABLED", enabled)
        llm = LLM(str(tmp_path), dtype="bfloat16", max_num_seqs=8, cuda_graph_capture_sizes=[1, 2, 4, 8])
        graphs = llm.engine.runner.graphs
        assert graphs.early_read_limit(1) > 0 and graphs.early_read_limit(8) == 0
        tokens[enabled] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.close()
    assert tokens[True] == tokens[False]


def _record_replayed_variants(graphs) -> list[GraphKey]:
    """The variant of every replay of `graphs` from now on, in order."""
    keys: list[GraphKey] = []
    choose = graphs._key

    def recorded(*args):
        keys.append(choose(*args))
        return keys[-1]

    graphs._key = recorded
    return keys


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a CUDA GPU of compute capability 9.0 or later")
def test_a_context_past_the_early_read_limit_replays_the_plain_graph(tmp_path, monkeypatch):
    """A sequence that grows past its bucket's early-read limit moves from the early-start graph to the plain one,
    with the same tokens as without PDL."""
    _save_gemv_sized_qwen3(tmp_path)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    tokens, replayed = {}, {}
    for enabled in (True, False):
        monkeypatch.setattr(pdl, "ENABLED", enabled)
        llm = LLM(str(tmp_path), dtype="bfloat16", max_num_seqs=1, cuda_graph_capture_sizes=[1])
        graphs = llm.engine.runner.graphs
        replayed[enabled] = _record_replayed_variants(graphs)
        rng = random.Random(3)
        prompt = [rng.randrange(2048) for _ in range(graphs.early_read_limit(1) - 12)]
        tokens[enabled] = llm.generate([prompt], params, use_tqdm=False)[0].token_ids
        llm.close()
    early, plain = GraphKey(1, cascade=False, early=True), GraphKey(1, cascade=False, early=False)
    assert replayed[True][0] == early and replayed[True][-1] == plain and set(replayed[True]) == {early, plain}
    assert tokens[True] == tokens[False]
