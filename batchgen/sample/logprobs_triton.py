"""The logprobs of the common case (at most one alternative) as one read of the logits (CUDA only).

For each row: the chosen token's logprob (its logit - logsumexp of the row), its rank (1 + the logits above it)
and the most likely token with its logprob. torch needs a float32 copy of the (N, V) logits and several passes over
it; here each program reads one block of a row in its own dtype and leaves the block's max, sum of exp(logit - max)
and count of logits above the chosen one; a second kernel merges a row's blocks, and finds the most likely token by
reading again the one block that holds the row's max first. A row is split over many programs so that a few rows
(sampled logprobs of a decode step) still keep every SM reading.

A long scoring job's block kernel is bound by its instructions a logit, not by the read: its exponential is one fused
multiply-add and a base-2 exponential, and the argmax is left to the merge.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.sample.logprobs import LogprobsTensors

_BLOCK = 4096  # logits per program
MANY_ROWS = 256  # rows from which the blocks alone keep every SM reading
_SCAN = 1024  # logits the merge compares with the row's max at a time, in the block that holds it
_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _score_block_kernel(logits_ptr, stride, token_ids_ptr, maxes_ptr, sums_ptr, greater_ptr,
                        VOCAB: tl.constexpr, BLOCK: tl.constexpr):
    """One program per (row, block of logits): the block's partial results."""
    row = tl.program_id(0)
    block = tl.program_id(1)
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    cols = block * BLOCK + tl.arange(0, BLOCK)
    values = tl.load(row_ptr + cols, mask=cols < VOCAB, other=float("-inf")).to(tl.float32)
    chosen = tl.load(row_ptr + tl.load(token_ids_ptr + row)).to(tl.float32)
    block_max = tl.max(values, axis=0)
    shift = tl.where(block_max == float("-inf"), 0.0, block_max)  # a block of -inf logits sums to 0, not NaN
    at = row * tl.num_programs(1) + block
    tl.store(maxes_ptr + at, block_max)
    tl.store(sums_ptr + at, tl.sum(tl.exp2(values * _LOG2E - shift * _LOG2E), axis=0))
    tl.store(greater_ptr + at, tl.sum((values > chosen).to(tl.int32), axis=0))


@triton.jit
def _score_merge_kernel(logits_ptr, stride, token_ids_ptr, maxes_ptr, sums_ptr, greater_ptr,
                        logprobs_ptr, ranks_ptr, top_ids_ptr, top_logprobs_ptr, blocks, VOCAB: tl.constexpr,
                        BLOCK: tl.constexpr, BLOCKS: tl.constexpr, SCAN: tl.constexpr):
    """One program per row: its blocks' partials merged; the most likely token is the first logit equal to the row's
    max in the first block whose max it is (VOCAB where no block's max equals it: a NaN max)."""
    row = tl.program_id(0)
    offsets = tl.arange(0, BLOCKS)
    mask = offsets < blocks
    at = row * blocks + offsets
    maxes = tl.load(maxes_ptr + at, mask=mask, other=float("-inf"))
    row_max = tl.max(maxes, axis=0)
    shift = tl.where(row_max == float("-inf"), 0.0, row_max)
    total = tl.sum(tl.load(sums_ptr + at, mask=mask, other=0.0) * tl.exp(maxes - shift), axis=0)
    log_total = shift + tl.log(total)
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    chosen = tl.load(row_ptr + tl.load(token_ids_ptr + row)).to(tl.float32)
    greater = tl.sum(tl.load(greater_ptr + at, mask=mask, other=0), axis=0)
    first_block = tl.min(tl.where(mask & (maxes == row_max), offsets, BLOCKS), axis=0)
    winner = tl.full((), VOCAB, tl.int32)
    if first_block < blocks:
        for start in tl.static_range(0, BLOCK, SCAN):
            cols = first_block * BLOCK + start + tl.arange(0, SCAN)
            values = tl.load(row_ptr + cols, mask=cols < VOCAB, other=float("-inf")).to(tl.float32)
            winner = tl.minimum(winner, tl.min(tl.where(values == row_max, cols, VOCAB), axis=0))
    tl.store(logprobs_ptr + row, chosen - log_total)
    tl.store(ranks_ptr + row, greater.to(tl.int64) + 1)
    tl.store(top_ids_ptr + row, winner.to(tl.int64))
    tl.store(top_logprobs_ptr + row, row_max - log_total)


def score_top1(logits: torch.Tensor, token_ids: torch.Tensor) -> LogprobsTensors:
    """logits (N, V) of any float dtype with unit stride along V, token_ids (N,) int64 on the same device -> the
    chosen tokens' logprobs (N,) and ranks (N,), and the most likely token (N, 1) with its logprob (N, 1)."""
    rows, vocab = logits.shape
    device = logits.device
    scored = LogprobsTensors(torch.empty(rows, dtype=torch.float32, device=device),
                             torch.empty(rows, dtype=torch.int64, device=device),
                             torch.empty(rows, 1, dtype=torch.int64, device=device),
                             torch.empty(rows, 1, dtype=torch.float32, device=device))
    if rows == 0:
        return scored
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    block = min(_BLOCK, triton.next_power_of_2(vocab))
    blocks = triton.cdiv(vocab, block)
    maxes = torch.empty(rows, blocks, dtype=torch.float32, device=device)
    sums = torch.empty(rows, blocks, dtype=torch.float32, device=device)
    greater = torch.empty(rows, blocks, dtype=torch.int32, device=device)
    # Four warps (more bytes in flight per thread) read fastest once the rows alone fill the GPU: prompt logprobs'
    # slices of about 1,700 rows (benchmarks/RESULTS.md, 2026-11-27d); a decode step's few rows keep eight.
    warps = 4 if block < 2048 or rows >= MANY_ROWS else 8
    _score_block_kernel[(rows, blocks)](logits, logits.stride(0), token_ids, maxes, sums, greater,
                                        VOCAB=vocab, BLOCK=block, num_warps=warps)
    _score_merge_kernel[(rows,)](logits, logits.stride(0), token_ids, maxes, sums, greater, scored.logprobs,
                                 scored.ranks, scored.top_ids, scored.top_logprobs, blocks, VOCAB=vocab, BLOCK=block,
                                 BLOCKS=max(16, triton.next_power_of_2(blocks)), SCAN=min(_SCAN, block), num_warps=1)
    return scored
