"""The attention layer every model uses: writes new K/V into the paged cache, then attends over the cache.

The model runner binds each layer's `k_cache`/`v_cache` and may swap `ops` for another module with the same three
functions (store_kv, decode_attention, prefill_attention); the default is the plain-PyTorch reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from batchgen.layers import attention_torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) int64: cache slot (block_id * block_size + offset) of each new token; -1: none
    seq_lens: torch.Tensor  # (B,) int64 (or int32): context length of each sequence after this step (cached + new);
    # 0 for padding
    block_tables: torch.Tensor  # (B, max_blocks_per_seq) int32; entries past a sequence's blocks are 0 and never read
    query_start_loc: torch.Tensor  # (B + 1,) int32: cumulative query lengths
    max_query_len: int  # host ints, used only by the prefill path
    max_seq_len: int
    is_decode: bool  # every sequence has exactly one query token
    # (1,) int32 on the device: leading positions every decode row reads from the same blocks (cascade attention);
    # None: no cascade this step
    shared_prefix_len: torch.Tensor | None = None
    # (>= B * KVH,) int32 zeros on the device, left zero by every decode attention launch (its count of finished KV
    # splits); the model runner keeps one for every layer and step. None: each launch allocates its own.
    split_arrivals: torch.Tensor | None = None


class Attention(nn.Module):
    """Writes the new K/V into the paged cache, then attends over the cache (which now includes them)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, softcap: float | None = None) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        # Each query attends to the last `sliding_window` positions (itself included); None: the whole context.
        self.sliding_window = sliding_window
        # Scores s become softcap * tanh(s / softcap) (Gemma 2's attn_logit_softcapping); None: left as they are.
        self.softcap = softcap
        # Plain attributes, not buffers: the cache is owned by the model runner and stays out of state_dict.
        self.k_cache = torch.empty(0)  # (num_blocks, block_size, num_kv_heads, head_dim) once bound
        self.v_cache = torch.empty(0)
        self.ops: ModuleType = attention_torch

    def decode_early_read_limit(self, batch: int, q_dtype: torch.dtype) -> int:
        """The longest context whose KV this layer's decode attention of `batch` rows (no cascade) reads before its
        PDL wait; 0 for none."""
        return self.ops.decode_early_read_limit(batch, self.num_kv_heads, self.head_dim, q_dtype, self.k_cache.dtype,
                                                self.k_cache.device)

    def forward(
        self,
        q: torch.Tensor,  # (T, H * D) or (T, H, D)
        k: torch.Tensor,  # (T, KVH * D) or (T, KVH, D)
        v: torch.Tensor,  # (T, KVH * D) or (T, KVH, D)
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # (T, H * D)
        if self.k_cache.numel() == 0:
            raise RuntimeError("the KV cache is not bound: set k_cache and v_cache on every Attention layer first")
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        self.ops.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        return self.attend(q, meta)

    def attend(
        self,
        q: torch.Tensor,  # (T, H * D) or (T, H, D)
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # (T, H * D)
        """Attention over the cache, which already holds this step's K/V."""
        q = q.view(-1, self.num_heads, self.head_dim)
        if meta.is_decode:
            # A window cuts the shared prefix differently for every row: windowed layers never cascade.
            shared = meta.shared_prefix_len if self.sliding_window is None else None
            out = self.ops.decode_attention(q, self.k_cache, self.v_cache, meta.block_tables, meta.seq_lens, self.scale,
                                            sliding_window=self.sliding_window, softcap=self.softcap,
                                            shared_prefix_len=shared, split_arrivals=meta.split_arrivals)
        else:
            out = self.ops.prefill_attention(
                q, self.k_cache, self.v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, self.scale,
                meta.max_query_len, meta.max_seq_len, sliding_window=self.sliding_window, softcap=self.softcap,
            )
        return out.reshape(-1, self.num_heads * self.head_dim)
