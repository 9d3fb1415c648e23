"""Cascade attention in the engine: which decode steps cascade, the shared length they pass to the attention ops,
and (on CUDA) greedy tokens equal to transformers' and to the engine without cascade, in graphs and eagerly."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from batchgen import LLM, SamplingParams
from batchgen.layers import attention_torch
from batchgen.worker import cascade
from batchgen.worker.cascade import shares_long_prefix
from tests.helpers.common import hf_greedy_on

BLOCK_SIZE = 16
PREFIX_LEN = 70  # four full blocks (64 tokens) and a partial one
MAX_TOKENS = 12


@pytest.fixture
def short_prefixes_cascade(monkeypatch):
    """The tiny models hold 256 positions: cascade from a 32-token prefix on (two blocks of 16)."""
    monkeypatch.setattr(cascade, "CASCADE_MIN_SHARED_TOKENS", 32)


def _requests(*block_ids: list[int]) -> list[SimpleNamespace]:
    return [SimpleNamespace(block_ids=ids) for ids in block_ids]


def test_shares_long_prefix_needs_enough_rows_and_the_same_block_at_the_threshold(short_prefixes_cascade) -> None:
    shared = [[7, 8, 9], [7, 8, 10]] * 4
    assert shares_long_prefix(_requests(*shared), BLOCK_SIZE)
    assert not shares_long_prefix(_requests(*shared[:7]), BLOCK_SIZE)  # fewer than 8 rows
    assert not shares_long_prefix(_requests(*shared[:7], [7, 3, 9]), BLOCK_SIZE)  # one row diverges in block 1
    assert not shares_long_prefix(_requests(*shared[:7], [7]), BLOCK_SIZE)  # one row shorter than the threshold
    assert not shares_long_prefix(_requests(*[[7]] * 8), BLOCK_SIZE)


def shared_prefix_prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(256) for _ in range(PREFIX_LEN)]
    return [prefix + [rng.randrange(256) for _ in range(rng.randint(1, 20))] for _ in range(count)]


def run(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> tuple[list[list[int]], list]:
    """The first prompt alone (so that the others find its blocks cached), then all: tokens and step records."""
    engine = llm.engine
    records, tokens = [], {}
    for batch in (prompts[:1], prompts):
        for i, prompt in enumerate(batch):
            engine.add_request(i, None, prompt, SamplingParams(temperature=0, max_tokens=max_tokens[i],
                                                               ignore_eos=True))
        while engine.has_unfinished_requests:
            finished, record = engine.step()
            tokens.update({o.request_id: o.token_ids for o in finished})
            records += [record] if record is not None else []
    return [tokens[i] for i in range(len(prompts))], records


class RecordingOps:
    """The torch attention ops, recording the shared length each decode call gets."""

    def __init__(self) -> None:
        self.shared: list[int | None] = []
        self.store_kv = attention_torch.store_kv
        self.prefill_attention = attention_torch.prefill_attention

    def decode_attention(self, *args, shared_prefix_len=None, **kwargs):
        self.shared.append(None if shared_prefix_len is None else shared_prefix_len.item())
        return attention_torch.decode_attention(*args, shared_prefix_len=shared_prefix_len, **kwargs)


@pytest.mark.parametrize("enabled", [True, False])
def test_decode_steps_of_rows_sharing_a_prefix_pass_its_length(tiny_model_dir, short_prefixes_cascade, enabled):
    llm = LLM(str(tiny_model_dir("Qwen3ForCausalLM")), device="cpu", dtype="float32", block_size=BLOCK_SIZE,
              max_num_seqs=16)
    ops = RecordingOps()
    llm.engine.runner.cascade_attention = enabled  # the engine turns it on for the Triton backend only
    num_layers = len(llm.engine.runner.attention_layers)
    for layer in llm.engine.runner.attention_layers:
        layer.ops = ops
    try:
        prompts = shared_prefix_prompts(10)
        _, records = run(llm, prompts, [4] * len(prompts))
    finally:
        llm.close()
    cascaded = [r for r in records if r.cascade_attention]
    if not enabled:
        assert not cascaded and set(ops.shared) == {None}
        return
    # The lone first prompt's decode steps (one row) do not cascade; the ten rows' steps share its 4 full blocks.
    assert cascaded and all(r.kind == "decode" and r.num_seqs == 10 for r in cascaded)
    assert {s for s in ops.shared if s is not None} == {64}
    assert ops.shared.count(64) == len(cascaded) * num_layers


def test_the_samples_of_one_prompt_cascade_over_its_shared_blocks(tiny_model_dir, short_prefixes_cascade):
    llm = LLM(str(tiny_model_dir("Qwen3ForCausalLM")), device="cpu", dtype="float32", block_size=BLOCK_SIZE,
              max_num_seqs=16)
    ops = RecordingOps()
    llm.engine.runner.cascade_attention = True
    for layer in llm.engine.runner.attention_layers:
        layer.ops = ops
    engine, records = llm.engine, []
    try:
        prompt = shared_prefix_prompts(1)[0]
        engine.add_request(0, None, prompt, SamplingParams(n=10, temperature=1.0, seed=0, max_tokens=4,
                                                           ignore_eos=True))
        while engine.has_unfinished_requests:
            _, record = engine.step()
            records += [record] if record is not None else []
    finally:
        llm.close()
    cascaded = [r for r in records if r.cascade_attention]
    # The samples share the prompt's full blocks by reference (the partial last block is each sample's own); the
    # first sample runs a token ahead of the other nine, alone at first (too few rows) and done one step early.
    assert [r.num_seqs for r in cascaded][:-1] == [10] * (len(cascaded) - 1) and cascaded[-1].num_seqs == 9
    assert {s for s in ops.shared if s is not None} == {len(prompt) // BLOCK_SIZE * BLOCK_SIZE}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("architecture", ["Qwen3ForCausalLM", "LlamaForCausalLM", "GPT2LMHeadModel"])
def test_cascade_greedy_tokens_equal_transformers_and_plain_on_gpu(tiny_model_dir, short_prefixes_cascade,
                                                                    architecture):
    model_dir = tiny_model_dir(architecture)
    prompts = shared_prefix_prompts(12, seed=1)
    max_tokens = [MAX_TOKENS] * 8 + [4] * 4  # the last steps run 8 rows: another bucket's cascade graph
    expected = [t[:n] for t, n in zip(hf_greedy_on(model_dir, prompts, MAX_TOKENS, device="cuda"), max_tokens,
                                      strict=True)]
    for setup in (dict(cuda_graph_capture_sizes=[1, 2, 4, 8, 16]), dict(enforce_eager=True)):
        results = {}
        for enabled in (True, False):
            llm = LLM(str(model_dir), dtype="float32", block_size=BLOCK_SIZE, max_num_seqs=16,
                      cascade_attention=enabled, **setup)
            try:
                results[enabled] = run(llm, prompts, max_tokens)
            finally:
                llm.close()
        (tokens, records), (plain_tokens, plain_records) = results[True], results[False]
        assert tokens == plain_tokens == expected, setup
        assert not any(r.cascade_attention for r in plain_records)
        cascaded = [r for r in records if r.cascade_attention]
        assert {r.num_seqs for r in cascaded} == {12, 8}, setup
        if "cuda_graph_capture_sizes" in setup:
            assert {r.padded_size for r in cascaded} == {16, 8}
