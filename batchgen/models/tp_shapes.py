"""Which engine.tensor_parallel_size a model can be split by (no torch: the command line checks it from config.json
before anything loads, the engine again for the Python API)."""

from __future__ import annotations

from typing import Any

# The widths that column- and row-parallel projections split evenly: the MLP's, a MoE expert's, Qwen2-MoE's shared
# expert's, GPT-2's inner size.
SPLIT_SIZES = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size", "n_inner")


def check_tensor_parallel(config: Any, size: int, implementation: str, gguf: bool) -> None:
    """Raises ValueError naming engine.tensor_parallel_size and the model's key that it cannot split. config: the
    model's config (an HFConfig or config.json's values); implementation: native | transformers (model.impl as
    resolved)."""
    if size == 1:
        return
    key = f"engine.tensor_parallel_size={size}"
    if gguf:
        raise ValueError(f"{key}: a GGUF model runs on one rank; use a safetensors checkpoint or "
                         "engine.tensor_parallel_size=1")
    if implementation == "transformers":
        raise ValueError(f"{key}: transformers' modules (model.impl=transformers, or an architecture without a "
                         "native implementation) run on one rank; use engine.tensor_parallel_size=1")

    def value(name: str) -> Any:
        return config.get(name) if isinstance(config, dict) else getattr(config, name, None)

    heads = value("num_attention_heads")
    if heads % size:
        raise ValueError(f"{key} is invalid: it must divide the model's num_attention_heads ({heads})")
    kv_heads = value("num_key_value_heads") or heads
    if kv_heads % size and size % kv_heads:
        raise ValueError(f"{key} is invalid: it and the model's num_key_value_heads ({kv_heads}) must divide one "
                         "another")
    for name in SPLIT_SIZES:
        width = value(name)
        if width and width % size:
            raise ValueError(f"{key} is invalid: it must divide the model's {name} ({width})")
