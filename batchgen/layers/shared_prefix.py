"""The KV prefix every sequence of a decode batch shares, for cascade attention (`attention_triton`).

Computed on the device from the step's block tables once per step (not per layer), with fixed shapes and no host
sync, so it runs inside decode CUDA graphs.
"""

from __future__ import annotations

import torch


def shared_prefix_len(
    block_tables: torch.Tensor,  # (B, M) int32
    seq_lens: torch.Tensor,  # (B,) int, 0 for padding rows
    block_size: int,
) -> torch.Tensor:  # (1,) int32
    """The number of leading positions that every real row reads from the same physical blocks as row 0.

    Only whole leading blocks identical in every real row count (padding rows match anything), and never more than
    the shortest real context. 0 when row 0 is padding: the shared-prefix kernel reads through row 0's table.
    """
    padding = seq_lens <= 0  # (B,)
    same = (block_tables == block_tables[:1]) | padding[:, None]  # (B, M)
    shared_blocks = same.all(dim=0).to(torch.int32).cumprod(dim=0).sum()  # leading columns where every row matches
    shortest = torch.where(padding, torch.iinfo(torch.int32).max, seq_lens.to(torch.int32)).min()
    shared = torch.minimum(shared_blocks * block_size, shortest) * (~padding[:1]).to(torch.int32)
    return shared.to(torch.int32).view(1)
