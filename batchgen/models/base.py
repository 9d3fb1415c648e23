"""What every architecture shares: a decoder over a step's flattened tokens, and the lm_head over chosen rows."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from batchgen.layers.attention import AttentionMetadata
from batchgen.layers.embedding import InputIdsWithPending
from batchgen.layers.parallel_linear import lm_head
from batchgen.models.hf_config import HFConfig


class CausalLM(nn.Module):
    decoder_name: ClassVar[str]  # the decoder's Hugging Face name, so that checkpoint names are parameter names
    impl: ClassVar[str] = "native"  # model.impl's two paths: native | transformers (models/transformers_backend.py)
    cuda_graphs: ClassVar[bool] = True  # decode steps may replay CUDA graphs of the forward

    def __init__(self, config: HFConfig, decoder: nn.Module, tied_embedding: nn.Embedding | None) -> None:
        """tied_embedding: the input embedding whose weight the lm_head shares; None for an lm_head of its own."""
        super().__init__()
        self.config = config
        self.add_module(self.decoder_name, decoder)
        self.lm_head = lm_head(config.hidden_size, config.vocab_size)
        if tied_embedding is not None:
            self.lm_head.weight = tied_embedding.weight

    def forward(self, input_ids: torch.Tensor | InputIdsWithPending, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:  # (T,) int64 ids and positions -> (T, hidden)
        return getattr(self, self.decoder_name)(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # (N, hidden) -> (N, vocab)
        return self.lm_head(hidden)
