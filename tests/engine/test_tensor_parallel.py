"""engine.tensor_parallel_size=2 on CPU: two real processes (gloo), float32 tiny models. Every native architecture
gives one process's greedy tokens; prefix caching, n > 1, seeded sampling, penalties, logprobs, stop strings,
structured output, scoring, embeddings, chunked prefill and preemption give one process's results; so do fp8 weights,
quantized at load or from fp8 checkpoints."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from batchgen import LLM, SamplingParams
from batchgen.config import EngineConfig, ModelConfig
from batchgen.core.kv_sizing import KVDemand
from batchgen.engine.llm_engine import LLMEngine
from batchgen.engine.outputs import RequestOutput
from batchgen.tp.errors import FollowerExited
from batchgen.tp.ranks import Followers, FollowerSpec
from tests.helpers.common import KV_SETUPS, NATIVE_ARCHITECTURES, VOCAB, build_tiny_model_dir, random_prompts
from tests.helpers.fp8_checkpoints import write_fp8_checkpoint

SHAKESPEARE = Path(__file__).resolve().parents[2] / "jobs" / "shakespeare" / "model"
TP_ARCHITECTURES = [*NATIVE_ARCHITECTURES, "Qwen2MoeForCausalLM", "GemmaForCausalLM"]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PREFIX = "ROMEO:\nBut soft, what light through yonder window breaks? It is the east, and Juliet is the sun.\n"


def generate(model: Path, size: int, prompts: list, params: SamplingParams | list[SamplingParams],
             **engine) -> list[RequestOutput]:
    llm = LLM(str(model), tensor_parallel_size=size, device="cpu", **engine)
    try:
        return llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.close()


def tokens(outputs: list[RequestOutput]) -> list[list[list[int]]]:
    return [[sample.token_ids for sample in output.outputs] for output in outputs]


@pytest.mark.parametrize("architecture", TP_ARCHITECTURES)
def test_greedy_tokens_equal_one_process(tiny_model_dir: Callable[..., Path], architecture: str):
    model, prompts = tiny_model_dir(architecture), random_prompts(VOCAB, 4)
    assert tokens(generate(model, 2, prompts, GREEDY)) == tokens(generate(model, 1, prompts, GREEDY))


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Olmo2ForCausalLM"])
def test_one_kv_head_replicated_on_both_ranks(tmp_path_factory: pytest.TempPathFactory, architecture: str):
    model = build_tiny_model_dir(architecture, tmp_path_factory.mktemp(architecture), overrides={
        "num_key_value_heads": 1})
    prompts = random_prompts(VOCAB, 3)
    assert tokens(generate(model, 2, prompts, GREEDY)) == tokens(generate(model, 1, prompts, GREEDY))


def test_followers_start_with_the_jobs_rows(monkeypatch: pytest.MonkeyPatch):
    """Each rank sizes its KV cache and limits its CUDA graphs to the job's rows as rank 0 does: the graphs' captures
    hold collectives, which pair up only where every rank captures the same sizes."""
    started: list[FollowerSpec] = []
    start = Followers._start

    def recording_start(spec: FollowerSpec):
        started.append(spec)
        return start(spec)

    monkeypatch.setattr(Followers, "_start", staticmethod(recording_start))
    demand = KVDemand([(12, 1), (30, 8), (7, 1)])
    engine = LLMEngine(ModelConfig(path=str(SHAKESPEARE)), EngineConfig(device="cpu", tensor_parallel_size=2),
                       kv_demand=demand)
    try:
        assert [spec.kv_demand for spec in started] == [demand]
    finally:
        engine.close()


# (model, fp8 weights): quantized at load, or a checkpoint with per-tensor scales (q, k and v each its own) or
# per-channel ones; one_kv_head: Llama's with its one KV head (and its scales) on both ranks.
FP8_CASES = [
    *[("LlamaForCausalLM", source) for source in ("quantization=fp8", "compressed_tensors_fp8",
                                                  "compressed_tensors_fp8_dynamic")],
    ("one_kv_head", "compressed_tensors_fp8"),
    ("Phi3ForCausalLM", "compressed_tensors_fp8"),  # one scale over the checkpoint's fused q, k and v
    ("Qwen2MoeForCausalLM", "quantization=fp8"), ("Qwen2MoeForCausalLM", "compressed_tensors_fp8_dynamic"),
]


@pytest.mark.parametrize(("model_name", "source"), FP8_CASES)
def test_fp8_tokens_and_logprobs_equal_one_process(tiny_model_dir: Callable[..., Path], tmp_path: Path,
                                                   model_name: str, source: str):
    """fp8 weights dequantized on CPU: each rank's are the one-process model's slices (quantizing at load scales
    each row-parallel row by its whole row's maximum), so the logprobs agree to float32 sums in another order."""
    if model_name == "one_kv_head":
        float_dir = build_tiny_model_dir("LlamaForCausalLM", tmp_path / "float",
                                         overrides={"num_key_value_heads": 1})
    else:
        float_dir = tiny_model_dir(model_name)
    quantization = "fp8" if source == "quantization=fp8" else None
    model = float_dir
    if quantization is None:
        model = tmp_path / "fp8"
        write_fp8_checkpoint(float_dir, model, source)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    prompts = random_prompts(VOCAB, 4)
    one, two = (generate(model, size, prompts, params, quantization=quantization) for size in (1, 2))
    assert tokens(two) == tokens(one)
    for ours, expected in zip(two, one, strict=True):
        assert_logprobs_close(ours.logprobs, expected.logprobs)


@pytest.fixture(scope="module")
def shakespeare() -> Iterator[tuple[LLM, LLM]]:
    """The Shakespeare model (GPT-2, with its tokenizer) on one process and on two."""
    pair = [LLM(str(SHAKESPEARE), tensor_parallel_size=size, device="cpu", max_num_seqs=8) for size in (1, 2)]
    split = pair[1].engine
    assert len(split.followers.processes) == 1 and split.runner.attention_layers[0].num_heads == 2  # of 4
    yield pair[0], pair[1]
    for llm in pair:
        llm.close()


def both(pair: tuple[LLM, LLM], prompts: list, params: SamplingParams | list[SamplingParams]
         ) -> tuple[list[RequestOutput], list[RequestOutput]]:
    return tuple(llm.generate(prompts, params, use_tqdm=False) for llm in pair)


def assert_logprobs_close(ours: list | None, expected: list | None) -> None:
    assert (ours is None) == (expected is None)
    for entry, reference in zip(ours or [], expected or [], strict=True):
        assert (entry is None) == (reference is None)
        if entry is not None:
            assert (entry["token_id"], entry["rank"]) == (reference["token_id"], reference["rank"])
            assert [t["token_id"] for t in entry["top"]] == [t["token_id"] for t in reference["top"]]
            assert abs(entry["logprob"] - reference["logprob"]) < 1e-4


def test_prefix_caching_gives_the_same_tokens_and_cache_hits(shakespeare):
    prompts = [PREFIX + suffix for suffix in ("JULIET:", "ROMEO:", "NURSE:", "FRIAR:")]
    one, two = both(shakespeare, prompts, SamplingParams(max_tokens=12, temperature=0))
    assert tokens(two) == tokens(one)
    assert [o.num_cached_tokens for o in two] == [o.num_cached_tokens for o in one]
    assert sum(o.num_cached_tokens for o in two) > 0


def test_seeded_samples_and_penalties_equal_one_process(shakespeare):
    params = [SamplingParams(n=3, temperature=0.9, top_p=0.9, top_k=20, seed=7, max_tokens=16),
              SamplingParams(temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2,
                             min_tokens=4, logit_bias={5: 2.0}, seed=3, max_tokens=16),
              SamplingParams(temperature=1.0, min_p=0.1, seed=11, max_tokens=16, stop=["\n"])]
    one, two = both(shakespeare, ["KING:", "To be, or not", "JULIET:\n"], params)
    assert tokens(two) == tokens(one)
    assert [o.text for o in two] == [o.text for o in one]


def test_logprobs_and_prompt_logprobs_equal_one_process(shakespeare):
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=3, prompt_logprobs=2)
    one, two = both(shakespeare, ["ROMEO:\nWhat light", "KING"], params)
    assert tokens(two) == tokens(one)
    for ours, expected in zip(two, one, strict=True):
        assert_logprobs_close(ours.logprobs, expected.logprobs)
        assert_logprobs_close(ours.prompt_logprobs, expected.prompt_logprobs)


def test_loglikelihoods_equal_one_process(shakespeare):
    requests = [("ROMEO:\n", "But soft"), ("To be, or ", "not to be")]
    one, two = (llm.loglikelihood(requests, use_tqdm=False) for llm in shakespeare)
    for (ours, ours_greedy), (expected, expected_greedy) in zip(two, one, strict=True):
        assert abs(ours - expected) < 1e-4 and ours_greedy == expected_greedy


def test_structured_output_equals_one_process(shakespeare):
    pytest.importorskip("llguidance", reason="structured output needs the guided extra (llguidance)")
    params = [SamplingParams(max_tokens=30, temperature=temperature, seed=5, guided_regex=regex)
              for temperature in (0.0, 1.0) for regex in (r"(yes|no|ay), my (lord|liege)[.!]", r"[A-Z]+: [a-z ]+\.")]
    one, two = both(shakespeare, ["KING HENRY:\n"] * len(params), params)
    assert tokens(two) == tokens(one)


def test_embeddings_equal_one_process(tiny_model_dir: Callable[..., Path]):
    model = tiny_model_dir("Qwen3ForCausalLM")
    prompts = random_prompts(VOCAB, 3)
    embedded = []
    for size in (1, 2):
        llm = LLM(str(model), task="embed", tensor_parallel_size=size, device="cpu")
        embedded.append([o.embedding for o in llm.embed(prompts, use_tqdm=False)])
        llm.close()
    torch.testing.assert_close(torch.tensor(embedded[1]), torch.tensor(embedded[0]), rtol=0, atol=1e-5)


@pytest.mark.parametrize("setup", list(KV_SETUPS))
def test_chunked_prefill_and_preemption_equal_one_process(setup: str):
    prompts = [PREFIX[:length] for length in (30, 45, 60, 20, 75, 50)]
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=1)
    one, two = (generate(SHAKESPEARE, size, prompts, params, **KV_SETUPS[setup]) for size in (1, 2))
    assert tokens(two) == tokens(one)
    if setup == "preemption":
        assert sum(o.num_preemptions for o in two) > 0


def test_a_follower_that_died_ends_the_next_step_with_its_rank():
    llm = LLM(str(SHAKESPEARE), tensor_parallel_size=2, device="cpu")
    try:
        followers = llm.engine.followers
        (follower,) = followers.processes
        assert not followers.died()
        assert llm.engine.info["tensor_parallel_all_reduce"] == "gloo"  # the mapped buffers are CUDA's
        follower.kill()
        follower.wait()
        assert followers.died()  # LLMEngine.close then waits for nothing on the device
        with pytest.raises(FollowerExited, match=rf"tensor-parallel rank 1 of 2 \(pid {follower.pid}\) exited on "
                                                 "signal SIGKILL"):
            llm.generate(["KING:"], GREEDY, use_tqdm=False)
    finally:
        llm.close()
