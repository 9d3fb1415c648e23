"""OLMo 2 against transformers: its layer layout and norms, their rounding in bfloat16, and on the GPU greedy tokens
in eager and graph mode."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import Olmo2Config
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm as TransformersOlmo2RMSNorm
from transformers.models.olmo2.modeling_olmo2 import Olmo2RotaryEmbedding, apply_rotary_pos_emb

from batchgen import LLM, SamplingParams
from batchgen.config import ModelConfig
from batchgen.layers.activation import SiluAndMul
from batchgen.layers.embedding import Embedding
from batchgen.layers.linear import Linear
from batchgen.layers.norms import rms_norm
from batchgen.layers.rotary import apply_rotary, rotary_embedding
from batchgen.models.loader import load_hf_config, load_model
from batchgen.models.olmo2 import Olmo2RMSNorm, norm_whole_and_rotate, olmo2_rms_norm
from tests.helpers.common import hf_greedy_on, load_ours, random_prompts
from tests.helpers.paged import PagedTestCache

ARCHITECTURE = "Olmo2ForCausalLM"
bf16 = torch.bfloat16


def test_layers_norm_after_their_sublayers_and_q_k_over_whole_projections(
    tiny_model_dir: Callable[..., Path],
) -> None:
    model = load_ours(tiny_model_dir(ARCHITECTURE))
    layer = model.model.layers[0]
    names = {name for name, _ in layer.named_parameters()}
    assert {"post_attention_layernorm.weight", "post_feedforward_layernorm.weight"} <= names
    assert not any("input_layernorm" in name for name in names)
    assert layer.self_attn.q_norm.weight.shape == (4 * 16,) and layer.self_attn.k_norm.weight.shape == (2 * 16,)


def test_only_layers_of_the_same_math_offer_a_triton_kernel(tiny_model_dir: Callable[..., Path]) -> None:
    """The engine switches every module with use_triton(): for OLMo 2 only the projections, the embedding and
    SiLU-and-mul may have one (no pre-norm fused into a projection, no per-head q/k norm kernel)."""
    model = load_ours(tiny_model_dir(ARCHITECTURE))
    offering = {type(m) for m in model.modules() if hasattr(m, "use_triton")}
    assert offering == {Linear, Embedding, SiluAndMul}


def test_rms_norm_rounds_as_transformers_in_bfloat16() -> None:
    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(7, 64, generator=gen)).to(bf16)
    theirs = TransformersOlmo2RMSNorm(64, eps=1e-6).to(bf16)
    with torch.no_grad():
        theirs.weight.copy_(torch.rand(64, generator=gen) + 0.5)
    expected = theirs(x)
    ours = olmo2_rms_norm(x, theirs.weight, 1e-6)
    assert torch.equal(ours, expected)
    # Llama's order (round, then multiply by the weight) differs: the test sees the rounding.
    assert not torch.equal(rms_norm(x, theirs.weight, 1e-6), expected)


def test_q_k_norm_and_rope_round_as_transformers_in_bfloat16() -> None:
    num_tokens, heads, kv_heads, head_dim = 6, 4, 2, 16
    config = Olmo2Config(hidden_size=heads * head_dim, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=64)
    gen = torch.Generator().manual_seed(1)
    q = (3 * torch.randn(num_tokens, heads * head_dim, generator=gen)).to(bf16)
    k = (3 * torch.randn(num_tokens, kv_heads * head_dim, generator=gen)).to(bf16)
    q_norm = TransformersOlmo2RMSNorm(heads * head_dim, 1e-6)
    k_norm = TransformersOlmo2RMSNorm(kv_heads * head_dim, 1e-6)
    with torch.no_grad():
        q_norm.weight.copy_(torch.rand(heads * head_dim, generator=gen) + 0.5)
        k_norm.weight.copy_(torch.rand(kv_heads * head_dim, generator=gen) + 0.5)
    q_norm, k_norm = q_norm.to(bf16), k_norm.to(bf16)
    positions = torch.tensor([0, 3, 17, 40, 63, 5])
    cos, sin = Olmo2RotaryEmbedding(config)(q, positions[None])

    def heads_first(x: torch.Tensor) -> torch.Tensor:  # (T, N * D) -> transformers' (1, N, T, D)
        return x.view(num_tokens, -1, head_dim).transpose(0, 1)[None]

    expected_q, expected_k = apply_rotary_pos_emb(heads_first(q_norm(q)), heads_first(k_norm(k)), cos, sin)
    rotary = rotary_embedding(config, head_dim)
    ours_q, ours_k = norm_whole_and_rotate(positions, q, k, q_norm.weight, k_norm.weight, 1e-6, head_dim, rotary.cos,
                                           rotary.sin)
    assert torch.equal(ours_q, expected_q[0].transpose(0, 1)) and torch.equal(ours_k, expected_k[0].transpose(0, 1))
    # Rotating in bfloat16 (tables cast first, as Llama does) rounds differently: the test sees it.
    llama_q, _ = apply_rotary(positions, olmo2_rms_norm(q, q_norm.weight, 1e-6).view(num_tokens, heads, head_dim),
                              ours_k, rotary.cos, rotary.sin)
    assert not torch.equal(llama_q, ours_q)


def test_dummy_weights_set_the_norms_to_one() -> None:
    hf_config = {"model_type": "olmo2", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
                 "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64}
    model_config = ModelConfig(load_format="dummy", hf_config=hf_config)
    model = load_model(model_config, load_hf_config(model_config), torch.float32, torch.device("cpu"))
    norms = [m for m in model.modules() if isinstance(m, Olmo2RMSNorm)]
    assert len(norms) == 2 * 4 + 1 and all(bool(m.weight.eq(1).all()) for m in norms)
    (logits,) = PagedTestCache(model).run(model, [(0, [1, 2, 3])])
    assert logits.shape == (3, 64) and logits.isfinite().all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_and_eager_decode_equal_transformers_on_gpu(tiny_model_dir: Callable[..., Path]) -> None:
    checkpoint = tiny_model_dir(ARCHITECTURE)
    prompts = random_prompts(256, count=8, seed=3)
    expected = hf_greedy_on(checkpoint, prompts, 20, device="cuda")
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for setup in (dict(enforce_eager=True), dict(cuda_graph_capture_sizes=[1, 2, 4, 8]),
                  dict(cuda_graph_capture_sizes=[1, 2, 4, 8], max_num_batched_tokens=9, block_size=4)):
        llm = LLM(str(checkpoint), dtype="float32", max_num_seqs=8, **setup)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.token_ids for o in outputs] == expected, setup
        llm.close()
