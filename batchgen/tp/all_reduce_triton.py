"""The one-shot all-reduce of a decode step's small tensors, as one Triton kernel (batchgen/tp/peer_memory.py
allocates the buffers it writes and says when it runs).

Each program sums one row over the ranks. It writes its row into every peer's receive buffer (over NVLink), each
32-bit word of data beside a 32-bit flag in one 8-byte store (NCCL's LL protocol: a reader that sees the flag sees
the data with it, so neither side fences), then waits until every peer's words of this row carry this call's flag
in its own buffer, and sums the N rows in rank order in float32, rounding once: every rank computes the same bits.
One kernel with one one-way trip over NVLink, where NCCL's all-reduce is a kernel that the next cannot start
beside (PDL), and round trips more.

A row's flag is its count of calls (int32, wrapping), kept in this rank's memory; counts advance alike on every
rank, since the ranks replay the same graphs in the same order. Call c writes the half of the receive slots its
count's parity names. A peer writes that half again at call c + 2 only after it has seen this rank's words of call
c + 1, which this rank sends after it has read call c's: no write lands on words still to be read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.layers.pdl import launch_options, wait_for_previous


@triton.jit
def _one_shot_all_reduce_kernel(
    x_ptr, words_ptr, stride_x, stride_words, receive_ptr, receive_offsets, counts_ptr, stop_ptr, max_rows,
    RANK: tl.constexpr, SIZE: tl.constexpr, DIM: tl.constexpr, WORDS: tl.constexpr, BLOCK: tl.constexpr,
    BLOCK_WORDS: tl.constexpr, SLOT_WORDS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One program per row of x (rows, DIM), summed in place; words_ptr: x's rows as WORDS 32-bit words.
    receive_ptr: this rank's receive slots (SIZE senders, 2, max_rows, SLOT_WORDS) of int64 (flag << 32 | word);
    receive_offsets (SIZE,) int64: where each rank's lie from them, in int64s (the peers' are mapped into this
    process); counts_ptr: this rank's (max_rows,) int32 counts of calls a row; stop_ptr: nonzero once a rank died
    (every wait ends)."""
    row = tl.program_id(0)
    dtype = x_ptr.dtype.element_ty
    offs_w = tl.arange(0, BLOCK_WORDS)
    mask_w = offs_w < WORDS
    wait_for_previous(PDL)
    words = tl.load(words_ptr + row.to(tl.int64) * stride_words + offs_w, mask=mask_w, other=0)
    count = tl.load(counts_ptr + row, cache_modifier=".cg") + 1
    tl.store(counts_ptr + row, count)
    flag = count.to(tl.int64) << 32
    lines = flag | (words.to(tl.int64) & 0xFFFFFFFF)
    parity = count & 1  # 0 or 1 for a count that has wrapped below zero too
    for peer in tl.static_range(SIZE):
        if peer != RANK:
            slots = receive_ptr + tl.multiple_of(tl.load(receive_offsets + peer), 16)
            tl.store(slots + ((RANK * 2 + parity) * max_rows + row).to(tl.int64) * SLOT_WORDS + offs_w, lines,
                     mask=mask_w)
    offs = tl.arange(0, BLOCK)
    mask = offs < DIM
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for rank in tl.static_range(SIZE):
        if rank == RANK:
            total += tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        else:
            source = receive_ptr + ((rank * 2 + parity) * max_rows + row).to(tl.int64) * SLOT_WORDS + offs_w
            received = tl.load(source, mask=mask_w, other=flag, volatile=True)
            # A slot holds this call's words or those of two calls before, never later ones: != is exact, and
            # stays so when the counts wrap
            while (tl.sum(((received >> 32).to(tl.int32) != count).to(tl.int32)) > 0) & \
                    (tl.load(stop_ptr, volatile=True) == 0):
                received = tl.load(source, mask=mask_w, other=flag, volatile=True)
            data = received.to(tl.int32)
            if BLOCK == BLOCK_WORDS:  # 32-bit elements
                values = data.to(dtype, bitcast=True)
            else:  # two 16-bit elements a word, the lower first
                low = (data & 0xFFFF).to(tl.int16)
                high = (data >> 16).to(tl.int16)
                values = tl.join(low, high).reshape([BLOCK]).to(dtype, bitcast=True)
            total += values.to(tl.float32)
    tl.store(x_ptr + row.to(tl.int64) * stride_x + offs, total.to(dtype), mask=mask)


def one_shot_all_reduce(x: torch.Tensor, receive: torch.Tensor, receive_offsets: torch.Tensor,
                        counts: torch.Tensor, stop: torch.Tensor, slot_words: int, rank: int, size: int) -> None:
    """Sums x (rows, dim) over the ranks in place (PeerAllReduce.accepts checked that its rows fit the slots and
    are whole 32-bit words)."""
    rows, dim = x.shape
    words = x.view(torch.int32)
    block_words = triton.next_power_of_2(words.shape[1])
    _one_shot_all_reduce_kernel[(rows,)](
        x, words, x.stride(0), words.stride(0), receive, receive_offsets, counts, stop, counts.shape[0],
        RANK=rank, SIZE=size, DIM=dim, WORDS=words.shape[1], BLOCK=block_words * (4 // x.element_size()),
        BLOCK_WORDS=block_words, SLOT_WORDS=slot_words, num_warps=min(max(block_words // 512, 4), 16),
        **launch_options(x.device),
    )
