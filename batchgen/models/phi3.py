"""Phi-3 and Phi-4 (Phi3ForCausalLM; Phi-4 and Phi-4-mini use it too): a Llama decoder whose checkpoint stores the
q/k/v and gate/up projections already fused, as ours are.

What sets it apart is in its config, which LlamaModel reads: partial rotary embeddings (`partial_rotary_factor`,
Phi-4-mini rotates 3/4 of each head), LongRoPE `rope_scaling` (the 128k models) and a sliding window on every layer
where `sliding_window` is set.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from batchgen.models.llama import LlamaForCausalLM
from batchgen.models.weights import WeightTarget, load_into


class Phi3ForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Loads Hugging Face-named tensors: qkv_proj and gate_up_proj go straight into our fused projections."""
        targets = {name: WeightTarget(param) for name, param in self.named_parameters()}
        tied = self.config.tie_word_embeddings
        load_into(targets, weights, lambda name: tied and name == "lm_head.weight")
