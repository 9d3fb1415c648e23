"""The generic path (model.impl): transformers' own modules with batchgen's paged KV cache and attention.

GPT-NeoX and Starcoder2 also run every engine-level test parametrized over tests.helpers.common.ARCHITECTURES
(greedy tokens, chunked prefill, preemption, prefix caching, the sliding window); here: Granite's multipliers,
Llama on the generic path against its native modules, what the probe builds and refuses, and the choice of path.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AttentionInterface

from batchgen import LLM, SamplingParams
from batchgen.config import ConfigError, ModelConfig
from batchgen.layers.attention import Attention
from batchgen.models import transformers_backend
from batchgen.models.hf_config import check_checkpoint, model_implementation
from batchgen.models.loader import load_hf_config, load_model
from batchgen.models.transformers_backend import ATTENTION_IMPLEMENTATION, TransformersCausalLM
from tests.helpers.common import (
    KV_SETUPS,
    LLAMA_LIKE,
    REPO,
    assert_logits_close,
    hf_greedy_on,
    load_ours,
    random_prompts,
    random_tokens,
    reference_logits,
)
from tests.helpers.paged import PagedTestCache

MAX_TOKENS = 10
TINY = {key: value for key, value in LLAMA_LIKE.items() if key != "rms_norm_eps"}


def dummy(hf_config: dict[str, Any], impl: str = "transformers") -> Any:
    model_config = ModelConfig(load_format="dummy", hf_config=hf_config, impl=impl)
    return load_model(model_config, load_hf_config(model_config), torch.float32, torch.device("cpu"))


def test_probe_gives_each_attending_module_a_paged_layer(tiny_model_dir: Callable[..., Path]) -> None:
    neox = load_ours(tiny_model_dir("GPTNeoXForCausalLM"))
    assert isinstance(neox, TransformersCausalLM) and neox.impl == "transformers" and not neox.cuda_graphs
    layers = [m for m in neox.modules() if isinstance(m, Attention)]
    assert [(a.num_heads, a.num_kv_heads, a.head_dim, a.scale, a.sliding_window) for a in layers] == \
        [(4, 4, 16, 0.25, None)] * 2
    windowed = load_ours(tiny_model_dir("Starcoder2ForCausalLM", sliding_window=8))
    assert [(a.num_kv_heads, a.sliding_window) for a in windowed.modules() if isinstance(a, Attention)] == [(2, 8)] * 2


def test_transformers_builds_no_mask_for_the_paged_attention(tiny_model_dir: Callable[..., Path],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    model = load_ours(tiny_model_dir("Starcoder2ForCausalLM", sliding_window=8))
    masks = []

    def spy(module, query, key, value, attention_mask, **kwargs):
        masks.append(attention_mask)
        return transformers_backend.paged_attention(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, ATTENTION_IMPLEMENTATION, spy)
    cache = PagedTestCache(model, block_size=4)
    cache.run(model, [(0, [1, 2, 3, 4, 5]), (1, [6, 7])])
    assert len(masks) == 2 and all(mask is None for mask in masks)


def test_granite_multipliers_and_logit_scaling_match_transformers(tiny_model_dir: Callable[..., Path]) -> None:
    directory = tiny_model_dir("GraniteForCausalLM")
    model = load_ours(directory)
    assert model.logit_scale == 0.25  # logits / logits_scaling=4
    tokens = random_tokens(14, seed=3)
    expected = reference_logits(directory, tokens)
    cache = PagedTestCache(model, block_size=4)
    start = 0
    for step in [tokens[:5], tokens[5:11]] + [[t] for t in tokens[11:]]:
        (logits,) = cache.run(model, [(0, step)], num_padding_rows=2 if len(step) == 1 else 0)
        assert_logits_close(logits, expected[start : start + len(step)])
        start += len(step)


@pytest.mark.parametrize("setup", list(KV_SETUPS))
def test_granite_greedy_tokens_equal_transformers(tiny_model_dir: Callable[..., Path], setup: str) -> None:
    directory = tiny_model_dir("GraniteForCausalLM")
    prompts = random_prompts(256)
    llm = LLM(str(directory), device="cpu", dtype="float32", **KV_SETUPS[setup])
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                           use_tqdm=False)
    llm.close()
    assert [o.token_ids for o in outputs] == hf_greedy_on(directory, prompts, MAX_TOKENS)
    if setup == "preemption":
        assert sum(o.num_preemptions for o in outputs) > 0


def test_llama_on_transformers_modules_equals_its_native_modules(tiny_model_dir: Callable[..., Path]) -> None:
    """Greedy tokens, sampled-token and prompt logprobs alike on both paths, through chunked prefill and the prefix
    cache (the second half of the prompts, without prompt logprobs, extends the first half's)."""
    directory = tiny_model_dir("LlamaForCausalLM")
    prompts = random_prompts(256, count=4, seed=2)
    prompts += [p + [7, 8] for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)
    with_prompt = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    results = {}
    for impl in ("native", "transformers"):
        llm = LLM(str(directory), device="cpu", dtype="float32", model_impl=impl, block_size=4,
                  max_num_batched_tokens=7)
        assert llm.engine.info["model_impl"] == impl
        assert llm.engine.config.enforce_eager == (impl == "transformers")
        results[impl] = (llm.generate(prompts[:4], with_prompt, use_tqdm=False)
                         + llm.generate(prompts[4:], params, use_tqdm=False))
        llm.close()
    native, generic = results["native"], results["transformers"]
    assert [o.token_ids for o in generic] == [o.token_ids for o in native] == hf_greedy_on(directory, prompts,
                                                                                           MAX_TOKENS)
    assert sum(o.num_cached_tokens for o in generic) == sum(o.num_cached_tokens for o in native) > 0
    for ours, theirs in zip(generic, native, strict=True):
        entries = zip(ours.logprobs + (ours.prompt_logprobs or [None])[1:],
                      theirs.logprobs + (theirs.prompt_logprobs or [None])[1:], strict=True)
        for mine, other in entries:
            assert (mine["token_id"], mine["rank"]) == (other["token_id"], other["rank"])
            assert [t["token_id"] for t in mine["top"]] == [t["token_id"] for t in other["top"]]
            assert abs(mine["logprob"] - other["logprob"]) < 1e-4


@pytest.mark.parametrize(("hf_config", "refusal"), [
    (dict(model_type="gemma2", head_dim=16, **TINY), "Gemma2ForCausalLM's attention uses softcap"),
    (dict(model_type="roberta", architectures=["RobertaForCausalLM"], **TINY), "uses is_causal=False"),
    (dict(model_type="bloom", vocab_size=256, hidden_size=64, n_layer=2, n_head=4),
     "BloomForCausalLM does not attend through transformers' attention interface"),
], ids=["softcap", "bidirectional", "own attention"])
def test_what_the_paged_attention_cannot_run_is_refused_in_one_line(hf_config: dict[str, Any], refusal: str) -> None:
    with pytest.raises(ValueError, match=refusal) as error:
        dummy(hf_config)
    assert "\n" not in str(error.value)


def test_logits_computed_otherwise_than_the_models_forward_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TransformersCausalLM, "compute_logits", lambda self, hidden: self.lm_head(hidden))
    with pytest.raises(ValueError, match="GraniteForCausalLM computes its logits in a way batchgen's generic path"):
        dummy(dict(model_type="granite", logits_scaling=4.0, **TINY))


def test_layers_that_keep_their_own_state_are_refused() -> None:
    """LFM2's short-convolution layers carry state from step to step that only transformers' own cache holds."""
    lfm2 = dict(model_type="lfm2", **TINY, layer_types=["conv", "full_attention"])
    with pytest.raises(ValueError, match="1 of its 2 layers attend through transformers' attention interface"):
        dummy(lfm2)


@pytest.mark.parametrize(("impl", "values", "path"), [
    ("auto", {"model_type": "llama"}, "native"),
    ("auto", {"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"]}, "transformers"),
    ("transformers", {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}, "transformers"),
    ("native", {"model_type": "gpt2"}, "native"),
])
def test_auto_picks_native_where_it_exists(impl: str, values: dict[str, Any], path: str) -> None:
    assert model_implementation(values, impl) == path


@pytest.mark.parametrize(("values", "impl", "message"), [
    ({"model_type": "bert", "architectures": ["BertModel"]}, "auto",
     r"architecture BertModel is not supported by either path \(model.impl=auto\): batchgen's native modules run "
     r"LlamaForCausalLM, .*; transformers' modules build BertLMHeadModel for model_type 'bert', not a \*ForCausalLM"),
    ({"model_type": "t5", "architectures": ["T5ForConditionalGeneration"]}, "auto",
     r"architecture T5ForConditionalGeneration is not supported by either path .* no causal LM for model_type 't5'"),
    ({"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"]}, "native",
     r"architecture GPTNeoXForCausalLM is not supported; supported: .* \(model.impl=native; model.impl=auto also "),
], ids=["encoder", "encoder-decoder", "native only"])
def test_unsupported_models_name_the_architecture_and_the_paths_tried(values: dict[str, Any], impl: str,
                                                                      message: str) -> None:
    with pytest.raises(ConfigError, match=f"^model.hf_config: {message}") as error:
        check_checkpoint(ModelConfig(load_format="dummy", hf_config=values, impl=impl), None)
    assert "\n" not in str(error.value)


def test_checkpoint_check_imports_no_torch(tiny_model_dir: Callable[..., Path]) -> None:
    """For native architectures and for the generic path's (transformers' model mapping is read, not imported)."""
    directories = [str(tiny_model_dir(a)) for a in ("LlamaForCausalLM", "GPTNeoXForCausalLM")]
    code = ("import sys\nfrom batchgen.config import ModelConfig\nfrom batchgen.models.hf_config import "
            "check_checkpoint\n"
            f"for path in {directories!r}:\n    check_checkpoint(ModelConfig(path=path), None)\n"
            "print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "False", result.stdout + result.stderr


def test_code_in_a_model_directory_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "code_ran"
    directory = tmp_path / "custom"
    directory.mkdir()
    (directory / "modeling_custom.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (directory / "configuration_custom.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (directory / "config.json").write_text(json.dumps({
        "model_type": "custom", "architectures": ["CustomForCausalLM"], **TINY,
        "auto_map": {"AutoConfig": "configuration_custom.CustomConfig",
                     "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}}))
    with pytest.raises(ConfigError, match="the checkpoint's own code \\(auto_map\\) is never run"):
        check_checkpoint(ModelConfig(path=str(directory), load_format="dummy"), None)
    with pytest.raises(ValueError):
        LLM(str(directory), load_format="dummy", device="cpu")
    assert not marker.exists()
    sources = (REPO / "batchgen").rglob("*.py")
    assert not [path for path in sources if "trust_remote_code=True" in path.read_text()]


def test_pickled_weights_are_refused(tmp_path: Path, tiny_model_dir: Callable[..., Path]) -> None:
    directory = tmp_path / "pickles"
    directory.mkdir()
    (directory / "config.json").write_text((tiny_model_dir("LlamaForCausalLM") / "config.json").read_text())
    (directory / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(ConfigError, match=f"model.path={directory}: holds only PyTorch pickles"):
        check_checkpoint(ModelConfig(path=str(directory)), None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("architecture", ["GPTNeoXForCausalLM", "GraniteForCausalLM"])
def test_generic_path_runs_eagerly_on_gpu_and_equals_transformers(tiny_model_dir: Callable[..., Path],
                                                                  architecture: str,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    directory = tiny_model_dir(architecture)
    prompts = random_prompts(256, count=12)
    expected = hf_greedy_on(directory, prompts, MAX_TOKENS, device="cuda")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for setup in (dict(cuda_graph_capture_sizes=[1, 2, 4, 8, 16]), dict(max_num_batched_tokens=7, block_size=4)):
        with caplog.at_level("INFO"):
            llm = LLM(str(directory), dtype="float32", max_num_seqs=16, **setup)
        assert llm.engine.runner.graphs is None and "CUDA graphs off" in caplog.text
        assert llm.engine.config.attention_backend == "triton"
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.token_ids for o in outputs] == expected, setup
        llm.close()


def test_pooling_tasks_need_native_modules():
    from batchgen.models.registry import check_task

    config = {"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"]}
    check_task("generate", config, "auto")  # the generic path runs it
    check_task("score", config, "auto")
    with pytest.raises(ValueError, match="job.task=embed runs on batchgen's native modules only"):
        check_task("embed", config, "auto")
