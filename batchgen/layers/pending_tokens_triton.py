"""A step's input ids with its pending tokens filled in from the previous step's sampled ids, as one Triton kernel
(CUDA only).

A decode step is queued before the step that samples its input token has finished: that token is "pending", named
by its row in `last_sampled`, where the previous step's sampling left it on the device. In torch the fill is four
kernels (a clamp, a gather, a compare, a select): at the head of a Qwen3-0.6B decode graph at batch 1 they took 2-4
us more than this one on an H200 (benchmarks/RESULTS.md, sixteenth session).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.layers.pdl import launch_options, wait_for_previous

_BLOCK = 1024


@triton.jit(do_not_specialize=["num_tokens"])
def _fill_pending_kernel(input_ids_ptr, pending_source_ptr, last_sampled_ptr, out_ptr, num_tokens,
                         BLOCK: tl.constexpr, PDL: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_tokens
    wait_for_previous(PDL)
    source = tl.load(pending_source_ptr + offs, mask=mask, other=-1)
    pending = source >= 0
    sampled = tl.load(last_sampled_ptr + source, mask=mask & pending)
    ids = tl.load(input_ids_ptr + offs, mask=mask & ~pending)
    tl.store(out_ptr + offs, tl.where(pending, sampled, ids), mask=mask)


def fill_pending_tokens(input_ids: torch.Tensor, pending_source: torch.Tensor,
                        last_sampled: torch.Tensor) -> torch.Tensor:
    """input_ids (T,) with token t replaced by last_sampled[pending_source[t]] where pending_source[t] >= 0: a new
    tensor of input_ids' dtype."""
    out = torch.empty_like(input_ids)
    num_tokens = input_ids.numel()
    if num_tokens:
        _fill_pending_kernel[(triton.cdiv(num_tokens, _BLOCK),)](
            input_ids, pending_source, last_sampled, out, num_tokens, BLOCK=_BLOCK, num_warps=4,
            **launch_options(input_ids.device),
        )  # fmt: skip
    return out
