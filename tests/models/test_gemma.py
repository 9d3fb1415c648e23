"""Gemma, Gemma 2 and Gemma 3 against transformers: each thing they add to Llama, on tiny random checkpoints.

Gemma 2 and 3 are also in tests/helpers/common.py's ARCHITECTURES (logits, engine greedy tokens, prefix caching,
preemption, GPU graphs) and the sliding-window tests; Gemma (1) is checked here alone.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig
from transformers.activations import ACT2FN
from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

from batchgen import LLM, SamplingParams
from batchgen.config import ModelConfig
from batchgen.layers.activation import GeluAndMul
from batchgen.layers.attention import Attention
from batchgen.layers.norms import GemmaRMSNorm, rms_norm
from batchgen.layers.rotary import RotaryEmbedding
from batchgen.models.hf_config import check_checkpoint
from batchgen.models.loader import load_hf_config, load_model
from tests.helpers.common import (
    MAX_TOKENS,
    assert_logits_close,
    hf_greedy_on,
    load_ours,
    random_prompts,
    random_tokens,
    save_perturbed,
    tiny_hf_config,
    with_sliding_window,
)
from tests.helpers.fp8_checkpoints import write_float_twin, write_fp8_checkpoint
from tests.helpers.graph_replay import first_decode_logits
from tests.helpers.paged import PagedTestCache

GEMMAS = ["GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM"]
bf16 = torch.bfloat16


@torch.no_grad()
def hf_logits(directory: Path, tokens: list[int], **config_overrides: object) -> torch.Tensor:  # (len, vocab)
    model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager", **config_overrides)
    return model.float().eval()(torch.tensor([tokens])).logits[0]


def chunked_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """Logits of a prefill in two chunks, then one decode step a token (with padding rows, as a graph bucket)."""
    cache = PagedTestCache(model, block_size=4)
    steps = [tokens[:7], tokens[7:13]] + [[t] for t in tokens[13:]]
    return torch.cat([cache.run(model, [(0, step)], num_padding_rows=2 if len(step) == 1 else 0)[0]
                      for step in steps])


def load_with(directory: Path, **overrides: object) -> torch.nn.Module:
    model_config = ModelConfig(path=str(directory), hf_config=overrides)
    return load_model(model_config, load_hf_config(model_config), torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("architecture", GEMMAS)
def test_chunked_prefill_and_decode_match_transformers(architecture: str, tiny_model_dir: Callable[..., Path]) -> None:
    directory = tiny_model_dir(architecture)
    tokens = random_tokens(24, seed=21)
    model = load_ours(directory)
    assert type(model).__name__ == architecture
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as every Gemma checkpoint
    assert_logits_close(chunked_logits(model, tokens), hf_logits(directory, tokens))


def test_gemma2_soft_caps_match_transformers(tiny_model_dir: Callable[..., Path]) -> None:
    """Attention and final-logit soft caps, each on and off: transformers' logits change with each (the tiny config
    caps low enough to bend them), and ours follow."""
    directory = tiny_model_dir("Gemma2ForCausalLM")
    tokens = random_tokens(20, seed=22)
    capped = hf_logits(directory, tokens)
    for overrides in ({"attn_logit_softcapping": None}, {"final_logit_softcapping": None},
                      {"attn_logit_softcapping": None, "final_logit_softcapping": None}):
        expected = hf_logits(directory, tokens, **overrides)
        assert not torch.allclose(expected, capped, atol=1e-3), f"{overrides} changes nothing in the reference"
        assert_logits_close(chunked_logits(load_with(directory, **overrides), tokens), expected)
    model = load_ours(directory)
    assert [m.softcap for m in model.modules() if isinstance(m, Attention)] == [0.5, 0.5]
    assert model.final_softcap == 2.0


def test_gemma3_has_a_rope_per_layer_type(tiny_model_dir: Callable[..., Path]) -> None:
    """The sliding layer rotates with the local base, the global one with its base and linear scaling, as
    transformers' tables; with the global table on both layers the logits stop matching transformers'."""
    directory = tiny_model_dir("Gemma3ForCausalLM")
    reference = AutoModelForCausalLM.from_pretrained(directory).float().eval()
    model = load_ours(directory)
    local, global_ = (layer.self_attn.rotary for layer in model.model.layers)
    positions = torch.arange(50)[None]
    for ours, layer_type in ((local, "sliding_attention"), (global_, "full_attention")):
        cos, sin = reference.model.rotary_emb(torch.ones(1, dtype=torch.float32), positions, layer_type)
        half = ours.rotary_dim // 2
        torch.testing.assert_close(ours.cos[:50], cos[0, :, :half], rtol=0, atol=1e-6)
        torch.testing.assert_close(ours.sin[:50], sin[0, :, :half], rtol=0, atol=1e-6)
    torch.testing.assert_close(local.cos, RotaryEmbedding(32, 256, 10000.0).cos)
    assert [layer.self_attn.attn.scale for layer in model.model.layers] == [20**-0.5] * 2  # query_pre_attn_scalar
    assert all(layer.self_attn.q_norm.weight.abs().sum() > 0 for layer in model.model.layers)  # loaded q/k norms

    tokens = random_tokens(20, seed=23)
    expected = hf_logits(directory, tokens)
    assert_logits_close(chunked_logits(model, tokens), expected)
    model.model.layers[0].self_attn.rotary = global_
    assert not torch.allclose(chunked_logits(model, tokens), expected, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, bf16])
def test_gemma_rms_norm_equals_transformers(dtype: torch.dtype) -> None:
    """(1 + weight) in float32, rounded once: bit for bit transformers' Gemma RMSNorm; Llama's order (round, then
    scale) gives other bf16 values."""
    gen = torch.Generator().manual_seed(3)
    x, residual = (4 * torch.randn(2, 7, 96, generator=gen)).to(dtype), torch.randn(2, 7, 96, generator=gen).to(dtype)
    ours, theirs = GemmaRMSNorm(96, 1e-6).to(dtype), Gemma2RMSNorm(96, eps=1e-6).to(dtype)
    with torch.no_grad():
        weight = (torch.randn(96, generator=gen) / 2).to(dtype)
        ours.weight.copy_(weight)
        theirs.weight.copy_(weight)
    assert torch.equal(ours(x), theirs(x))
    normed, summed = ours(x, residual)
    assert torch.equal(summed, x + residual) and torch.equal(normed, theirs(x + residual))
    if dtype == bf16:
        assert not torch.equal(rms_norm(x, 1 + weight, 1e-6), theirs(x))


def test_geglu_equals_transformers() -> None:
    gate_up = (3 * torch.randn(5, 64, generator=torch.Generator().manual_seed(4))).to(bf16)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(GeluAndMul("tanh")(gate_up), ACT2FN["gelu_pytorch_tanh"](gate) * up)
    assert torch.equal(GeluAndMul("none")(gate_up), ACT2FN["gelu"](gate) * up)


def test_embeddings_scale_in_the_model_dtype() -> None:
    """sqrt(3072) = 55.43 is 55.5 in bf16, and transformers multiplies by that."""
    hf_config = {"model_type": "gemma2", "vocab_size": 16, "hidden_size": 3072, "intermediate_size": 8,
                 "num_hidden_layers": 1, "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 8}
    model_config = ModelConfig(load_format="dummy", hf_config=hf_config)
    model = load_model(model_config, load_hf_config(model_config), bf16, torch.device("cpu"))
    assert model.model.embed_scale.dtype == bf16 and float(model.model.embed_scale) == 55.5


@pytest.mark.parametrize("model_type", ["gemma", "gemma2", "gemma3_text"])
def test_dummy_weights_from_hf_config_alone(model_type: str) -> None:
    """Reproducible, with every norm at its identity scale (Gemma's zero weight)."""
    hf_config = {"model_type": model_type, "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
                 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                 "max_position_embeddings": 64, "sliding_window": 4}
    model_config = ModelConfig(load_format="dummy", hf_config=hf_config)
    config = load_hf_config(model_config)
    first = load_model(model_config, config, torch.float32, torch.device("cpu"))
    second = load_model(model_config, config, torch.float32, torch.device("cpu"))
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"{name} differs between two dummy builds")
    norms = [m for m in first.modules() if isinstance(m, GemmaRMSNorm)]
    assert norms and all(bool(m.weight.eq(0).all()) for m in norms)
    (logits,) = PagedTestCache(first).run(first, [(0, [1, 2, 3, 4, 5, 6])])
    assert logits.shape == (6, 64) and logits.isfinite().all()


@pytest.mark.parametrize(("overrides", "message"), [
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention=true"),
    ({"hidden_activation": "silu"}, "hidden_activation='silu' is not supported for Gemma2ForCausalLM"),
])
def test_unsupported_variants_are_named(overrides: dict, message: str, tiny_model_dir: Callable[..., Path]) -> None:
    with pytest.raises(ValueError, match=message):
        load_with(tiny_model_dir("Gemma2ForCausalLM"), **overrides)


@pytest.fixture(scope="module")
def multimodal_gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Gemma3ForConditionalGeneration checkpoint (a one-layer SigLIP vision tower and the text model)."""
    torch.manual_seed(0)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    text = tiny_hf_config("Gemma3ForCausalLM").to_dict()
    config = Gemma3Config(text_config=text, vision_config=vision.to_dict(), mm_tokens_per_image=4)
    model = Gemma3ForConditionalGeneration(config).float()
    return save_perturbed(model, tmp_path_factory.mktemp("Gemma3ForConditionalGeneration"))


def test_multimodal_gemma3_checkpoint_runs_its_language_model(multimodal_gemma3: Path) -> None:
    """The loader reads text_config, the weights under the language model (the Hub's names and transformers 5's), the
    vision tower skipped; the logits are the multimodal model's on text."""
    check_checkpoint(ModelConfig(path=str(multimodal_gemma3)), max_model_len=None)
    tokens = random_tokens(20, seed=24)
    reference = Gemma3ForConditionalGeneration.from_pretrained(multimodal_gemma3, attn_implementation="eager")
    with torch.no_grad():
        expected = reference.float().eval()(torch.tensor([tokens])).logits[0]
    model = load_ours(multimodal_gemma3)
    assert type(model).__name__ == "Gemma3ForCausalLM" and model.config.model_type == "gemma3_text"
    assert_logits_close(chunked_logits(model, tokens), expected)

    tensors = load_file(multimodal_gemma3 / "model.safetensors")  # saved under the Hub's names
    assert any(name.startswith("vision_tower.") for name in tensors)
    assert any(name.startswith("language_model.model.layers.") for name in tensors)
    v5_names = {}  # as transformers 5 names them in memory
    for name, tensor in tensors.items():
        for old, new in (("language_model.model.", "model.language_model."), ("vision_tower.", "model.vision_tower."),
                         ("multi_modal_projector.", "model.multi_modal_projector.")):
            if name.startswith(old):
                name = new + name.removeprefix(old)
                break
        v5_names[name] = tensor
    model = load_ours(multimodal_gemma3)
    model.load_weights(v5_names.items())
    assert_logits_close(chunked_logits(model, tokens), expected)


def test_multimodal_gemma3_fp8_checkpoint_runs_its_language_model_in_fp8(multimodal_gemma3: Path,
                                                                          tmp_path: Path) -> None:
    """The quantization_config sits at the top of a multimodal checkpoint's config.json, beside text_config: the
    language model loads its fp8 tensors (dequantized on CPU), with the logits of the same weights in float."""
    dequantized = write_fp8_checkpoint(multimodal_gemma3, tmp_path / "fp8", "compressed_tensors_fp8_dynamic")
    check_checkpoint(ModelConfig(path=str(tmp_path / "fp8")), max_model_len=None)
    twin = write_float_twin(multimodal_gemma3, tmp_path / "twin", dequantized)
    tokens = random_tokens(20, seed=26)
    assert_logits_close(chunked_logits(load_ours(tmp_path / "fp8"), tokens), chunked_logits(load_ours(twin), tokens))


def test_gemma_greedy_tokens_equal_transformers_in_the_engine(tiny_model_dir: Callable[..., Path]) -> None:
    """Gemma (1), which ARCHITECTURES leaves out: chunked prefill, preemption and prefix caching in one engine."""
    directory = tiny_model_dir("GemmaForCausalLM")
    prompts = random_prompts(256, count=6, seed=25)
    prompts += [prompts[0] + prompts[1]]  # a cached prefix
    expected = hf_greedy_on(directory, prompts, MAX_TOKENS)
    llm = LLM(str(directory), device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=7,
              num_gpu_blocks_override=16, max_num_seqs=6, enable_prefix_caching=True)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                           use_tqdm=False)
    llm.close()
    assert [o.token_ids for o in outputs] == expected
    assert sum(o.num_preemptions for o in outputs) > 0, "the small cache should have forced a preemption"


@pytest.mark.parametrize("architecture", ["Gemma2ForCausalLM", "Gemma3ForCausalLM"])
def test_triton_layers_in_the_model_match_transformers(architecture: str, tiny_model_dir: Callable[..., Path],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Every Triton kernel a windowed Gemma takes on the decode path (the GEMV with Gemma's norm fused in, the norm
    kernels, the soft-capped attention), chunks and decodes past the window (runs on CPU through Triton's
    interpreter with TRITON_INTERPRET=1)."""
    pytest.importorskip("triton", reason="Triton kernels need triton (torch's CPU build has none)")
    from tests.helpers.triton_support import DEVICE

    if DEVICE is None:
        pytest.skip("needs CUDA, or TRITON_INTERPRET=1 for Triton's CPU interpreter")
    from batchgen.layers import attention_triton, linear_triton
    from batchgen.layers.linear import Linear
    from batchgen.layers.norms import RMSNorm

    monkeypatch.setattr(linear_triton, "MIN_WEIGHT_BYTES", 0)  # these tiny weights take the GEMV as large ones do
    windowed = tiny_model_dir(architecture, sliding_window=8)
    tokens = random_tokens(18, seed=26)
    expected = hf_logits(windowed, tokens).to(DEVICE)
    model = load_ours(windowed).to(DEVICE)
    cache = PagedTestCache(model, block_size=4)
    for layer in model.modules():
        if isinstance(layer, Attention):
            layer.ops = attention_triton
        elif isinstance(layer, (Linear, RMSNorm)):
            layer.use_triton(DEVICE)
    start = 0
    for step in [tokens[:6], tokens[6:11]] + [[t] for t in tokens[11:]]:
        (logits,) = cache.run(model, [(0, step)], num_padding_rows=2 if len(step) == 1 else 0)
        assert_logits_close(logits, expected[start : start + len(step)])
        start += len(step)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("architecture", ["Gemma2ForCausalLM", "Gemma3ForCausalLM"])
def test_graph_replay_equals_eager_on_gpu(tiny_model_dir: Callable[..., Path], architecture: str, dtype: str) -> None:
    """Decode steps past the window (sliding and global layers, Gemma 2's soft caps, the fused Gemma-norm GEMV):
    each bucket's graph replay gives the eager forward's logits."""
    llm = LLM(str(tiny_model_dir(architecture, sliding_window=8)), dtype=dtype, max_num_seqs=8, max_model_len=128,
              cuda_graph_capture_sizes=[1, 2, 4, 8])
    prompts = [p + p for p in random_prompts(256, count=8, seed=27)]  # most past the window
    for num_seqs in (1, 3, 8):
        graph_logits, eager_logits = first_decode_logits(llm, prompts[:num_seqs])
        tolerance = 1e-4 if dtype == "float32" else 2e-2
        torch.testing.assert_close(graph_logits.float(), eager_logits.float(), rtol=tolerance, atol=tolerance)
        if dtype == "float32":
            assert torch.equal(graph_logits.argmax(-1), eager_logits.argmax(-1))
    llm.close()


def test_sliding_window_helper_keeps_gemma_layer_types() -> None:
    config = with_sliding_window(tiny_hf_config("Gemma2ForCausalLM"), 8)
    assert config.sliding_window == 8 and config.layer_types == ["sliding_attention", "full_attention"]
