"""Our RoPE tables against transformers' rotary embedding classes, for every rope type and partial rotary.

transformers' classes return cos/sin of shape (1, T, rotary_dim): both halves repeat the angles, so our tables
(P, rotary_dim / 2) are compared with the first half.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, Phi3Config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

from batchgen.config import ConfigError, EngineConfig, ModelConfig
from batchgen.engine.model_worker import resolve_engine_config
from batchgen.layers.rotary import RotaryEmbedding, apply_rotary, rope_parameters, rotary_embedding
from batchgen.models.hf_config import check_checkpoint, max_positions

HEAD_DIM = 16
SIZES = dict(hidden_size=4 * HEAD_DIM, num_attention_heads=4)
SHORT = [1.0, 1.2, 1.5, 2.0, 3.0, 4.5]  # 6 frequencies: rotary_dim 12 of the 16 (partial_rotary_factor 0.75)
LONG = [1.5, 2.5, 4.0, 6.0, 9.0, 16.0]


def transformers_table(rotary: torch.nn.Module, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (len(positions), rotary_dim / 2) of one forward over `positions`."""
    cos, sin = rotary(torch.zeros(1), torch.tensor([positions]))
    half = cos.shape[-1] // 2
    return cos[0, :, :half], sin[0, :, :half]


def assert_rows_equal(ours: RotaryEmbedding, rows: list[int], cos: torch.Tensor, sin: torch.Tensor,
                      atol: float = 0.0) -> None:
    torch.testing.assert_close(ours.cos[rows], cos, rtol=0, atol=atol)
    torch.testing.assert_close(ours.sin[rows], sin, rtol=0, atol=atol)


def llama_config(max_position_embeddings: int, **rope: Any) -> LlamaConfig:
    return LlamaConfig(**SIZES, max_position_embeddings=max_position_embeddings,
                       rope_parameters={"rope_theta": 10000.0, **rope})


@pytest.mark.parametrize("partial_rotary_factor", [1.0, 0.75, 0.5])
def test_default_rope_with_partial_rotary_matches_transformers(partial_rotary_factor: float) -> None:
    config = Phi3Config(**SIZES, max_position_embeddings=128, partial_rotary_factor=partial_rotary_factor)
    ours = rotary_embedding(config, HEAD_DIM)
    assert ours.rotary_dim == int(HEAD_DIM * partial_rotary_factor) and ours.cos.shape[0] == 128
    assert_rows_equal(ours, list(range(128)), *transformers_table(Phi3RotaryEmbedding(config), list(range(128))))


def test_llama3_matches_transformers() -> None:
    config = llama_config(128, rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=16)
    ours = rotary_embedding(config, HEAD_DIM)
    assert_rows_equal(ours, list(range(128)), *transformers_table(LlamaRotaryEmbedding(config), list(range(128))))


YARN = {  # each a different branch of the attention factor or the ramp
    "plain": dict(factor=4.0),
    "attention_factor": dict(factor=4.0, attention_factor=0.9),
    "mscale": dict(factor=4.0, mscale=0.707, mscale_all_dim=1.0),
    "no_truncate_betas": dict(factor=3.0, truncate=False, beta_fast=16, beta_slow=2),
    "partial": dict(factor=2.0, partial_rotary_factor=0.5),
}


@pytest.mark.parametrize("name", list(YARN))
def test_yarn_matches_transformers(name: str) -> None:
    config = llama_config(64, rope_type="yarn", original_max_position_embeddings=16, **YARN[name])
    ours = rotary_embedding(config, HEAD_DIM)
    # A yarn config extends the context to factor times its original length (here past max_position_embeddings).
    num_positions = max(64, int(16 * YARN[name]["factor"]))
    assert ours.cos.shape[0] == max_positions(config) == num_positions
    positions = list(range(num_positions))
    assert_rows_equal(ours, positions, *transformers_table(LlamaRotaryEmbedding(config), positions))
    assert not torch.allclose(ours.cos, RotaryEmbedding(ours.rotary_dim, num_positions, 10000.0).cos, atol=1e-3)


def longrope_config(**rope: Any) -> Phi3Config:
    return Phi3Config(**SIZES, max_position_embeddings=256, original_max_position_embeddings=32,
                      partial_rotary_factor=0.75,
                      rope_scaling={"type": "longrope", "short_factor": SHORT, "long_factor": LONG, **rope})


@pytest.mark.parametrize("rope", [{}, {"factor": 2.0}, {"attention_factor": 1.3}], ids=str)
def test_longrope_is_short_within_the_original_length_and_long_past_it(rope: dict) -> None:
    config = longrope_config(**rope)
    ours = rotary_embedding(config, HEAD_DIM)
    assert ours.cos.shape == (256, 6)
    within, past = list(range(32)), list(range(32, 256))
    # A forward over positions within the original length uses the short factors (and the attention factor).
    assert_rows_equal(ours, within, *transformers_table(Phi3RotaryEmbedding(config), within))
    # One that goes past it uses the long factors, for all of its positions: ours past the original length only.
    long_cos, long_sin = transformers_table(Phi3RotaryEmbedding(config), list(range(256)))
    assert_rows_equal(ours, past, long_cos[32:], long_sin[32:])
    assert not torch.allclose(ours.cos[within], long_cos[:32], atol=1e-3)


def test_longrope_of_a_sequence_decoded_past_the_original_length_matches_transformers() -> None:
    """transformers decoding one token at a time past the original length: each position as our table has it."""
    config = longrope_config()
    ours, theirs = rotary_embedding(config, HEAD_DIM), Phi3RotaryEmbedding(config)
    assert_rows_equal(ours, list(range(20)), *transformers_table(theirs, list(range(20))))  # the prompt
    for position in range(20, 48):
        assert_rows_equal(ours, [position], *transformers_table(theirs, [position]))


def test_dynamic_ntk_within_max_positions_and_decoded_past_them_matches_transformers() -> None:
    config = llama_config(64, rope_type="dynamic", factor=2.0)
    ours, theirs = rotary_embedding(config, HEAD_DIM), LlamaRotaryEmbedding(config)
    assert ours.cos.shape[0] == max_positions(config) == 128
    assert_rows_equal(ours, list(range(64)), *transformers_table(theirs, list(range(64))))
    plain = RotaryEmbedding(HEAD_DIM, 64, 10000.0)
    torch.testing.assert_close(ours.cos[:64], plain.cos, rtol=0, atol=0)
    # Past max_position_embeddings transformers recomputes the frequencies for each longer sequence: decoding one
    # token at a time, position p gets those of p + 1 tokens. (float32 pow of a tensor base: a few ulps apart.)
    for position in range(64, 128):
        assert_rows_equal(ours, [position], *transformers_table(theirs, [position]), atol=2e-5)
    assert not torch.allclose(ours.cos[64:], RotaryEmbedding(HEAD_DIM, 128, 10000.0).cos[64:], atol=1e-3)


@pytest.mark.parametrize("partial_rotary_factor", [1.0, 0.75])
def test_apply_rotary_rotates_the_leading_rotary_dims_as_transformers(partial_rotary_factor: float) -> None:
    config = longrope_config() if partial_rotary_factor < 1 else Phi3Config(**SIZES, max_position_embeddings=256)
    rotary = rotary_embedding(config, HEAD_DIM)
    gen = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 5, 31, 32, 200, 7])
    q, k = torch.randn(6, 4, HEAD_DIM, generator=gen), torch.randn(6, 2, HEAD_DIM, generator=gen)
    ours_q, ours_k = apply_rotary(positions, q, k, rotary.cos, rotary.sin)
    cos = torch.cat([rotary.cos[positions]] * 2, dim=-1)[None]  # (1, T, rotary_dim), as transformers passes them
    sin = torch.cat([rotary.sin[positions]] * 2, dim=-1)[None]
    # transformers' layout is (B, heads, T, D) with unsqueeze_dim=1; ours is (T, heads, D).
    their_q, their_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(ours_q, their_q[0].transpose(0, 1), rtol=0, atol=0)
    torch.testing.assert_close(ours_k, their_k[0].transpose(0, 1), rtol=0, atol=0)
    rotary_dim = rotary.rotary_dim
    assert torch.equal(ours_q[..., rotary_dim:], q[..., rotary_dim:])


def test_max_positions_follows_the_scaling_that_extends_the_context() -> None:
    assert max_positions({"max_position_embeddings": 4096}) == 4096
    assert max_positions({"max_position_embeddings": 4096, "rope_scaling": {"type": "dynamic", "factor": 2.0}}) == 8192
    qwen_yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert max_positions({"max_position_embeddings": 40960, "rope_scaling": qwen_yarn}) == 131072
    deepseek_yarn = {"rope_type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "rope_theta": 1e4}
    assert max_positions({"max_position_embeddings": 163840, "rope_parameters": deepseek_yarn}) == 163840
    assert max_positions(longrope_config()) == 256  # longrope and llama3 configs name the extended length
    assert max_positions(llama_config(128, rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                      original_max_position_embeddings=16)) == 128


def test_engine_and_checkpoint_check_allow_the_extended_length() -> None:
    dynamic = SimpleNamespace(max_position_embeddings=128, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert resolve_engine_config(EngineConfig(), dynamic, torch.device("cpu")).max_model_len == 256
    yarn = {"model_type": "qwen3", "max_position_embeddings": 64,
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}}
    check_checkpoint(ModelConfig(load_format="dummy", hf_config=yarn), 256)
    with pytest.raises(ConfigError, match="engine.max_model_len=257 is invalid: .* at most 256 positions"):
        check_checkpoint(ModelConfig(load_format="dummy", hf_config=yarn), 257)


def test_rope_parameters_read_the_original_length_as_transformers() -> None:
    """Phi-3 keeps original_max_position_embeddings beside rope_scaling: that one wins."""
    _, scaling = rope_parameters(longrope_config())
    assert scaling["original_max_position_embeddings"] == 32 and scaling["max_position_embeddings"] == 256
    _, yarn = rope_parameters(llama_config(64, rope_type="yarn", factor=2.0))  # none given: max_position_embeddings
    assert yarn["original_max_position_embeddings"] == 64


def test_unsupported_rope_type_is_named() -> None:
    with pytest.raises(ValueError, match="rope type 'mrope' is not supported; supported: default, linear, llama3"):
        rope_parameters(llama_config(64, rope_type="mrope", factor=2.0))
