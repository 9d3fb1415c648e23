"""An embedding lookup as a Triton kernel launched with PDL (CUDA only): weight rows gathered by token id.

torch's lookup is as fast on its own, but it cannot take part in PDL: the kernel after it (a decode step's first
GEMV) then starts only once it has finished. Launched with PDL, that GEMV requests its weight while the lookup runs.
It also takes a decode graph's pending tokens from the previous step's sampled ids (embedding.InputIdsWithPending).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.layers.pdl import launch_options, wait_for_previous


# pending is 0 or 1: specialized, each would compile on its own.
@triton.jit(do_not_specialize=["pending"])
def _embedding_kernel(ids_ptr, pending_rows_ptr, pending_ids_ptr, weight_ptr, out_ptr, stride_w, stride_out,
                      pending, DIM: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One program per token: out[t] = weight[id], where id is pending_ids[pending_rows[t]] if pending and
    pending_rows[t] >= 0, else ids[t]."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < DIM
    wait_for_previous(PDL)
    token = tl.load(ids_ptr + t).to(tl.int64)
    if pending:
        pending_row = tl.load(pending_rows_ptr + t)
        if pending_row >= 0:
            token = tl.load(pending_ids_ptr + pending_row).to(tl.int64)
    row = tl.load(weight_ptr + token * stride_w + offs, mask=mask)
    tl.store(out_ptr + t * stride_out + offs, row, mask=mask)


def embedding(ids: torch.Tensor, weight: torch.Tensor, pending_rows: torch.Tensor | None = None,
              pending_ids: torch.Tensor | None = None) -> torch.Tensor:  # (T,), (V, D) -> (T, D)
    """F.embedding(ids, weight) for 1-D ids, each in [0, V): nothing checks them here (the engine rejects prompts
    with ids outside the vocabulary, and sampled ids are inside it). With pending_rows (T,) and pending_ids, token t
    is pending_ids[pending_rows[t]] where pending_rows[t] >= 0 (embedding.InputIdsWithPending)."""
    num_tokens, dim = ids.numel(), weight.shape[1]
    out = torch.empty(num_tokens, dim, dtype=weight.dtype, device=weight.device)
    pending = pending_rows is not None
    if num_tokens:
        block = triton.next_power_of_2(dim)
        # Without pending tokens the id tensor stands in for the others (the kernel does not read them), so that
        # both uses share one compile.
        _embedding_kernel[(num_tokens,)](
            ids, pending_rows if pending else ids, pending_ids if pending else ids, weight, out,
            weight.stride(0), out.stride(0), int(pending),
            DIM=dim, BLOCK=block, num_warps=max(1, min(8, block * weight.element_size() // 512)),
            **launch_options(ids.device),
        )  # fmt: skip
    return out
