"""The sampler's argmaxes as Triton passes over the logits (CUDA only): the random draw, and the greedy one that
decode graphs run after their logits.

argmax(probs / E) with E = -log(U) is the exponential race; taking logs, it is argmax(logits / T - log(-log U)),
so no softmax is needed. U is the same counter-based hash of (seed, position, vocab index) as the torch path's,
computed here in uint32 registers instead of a (B, V) int64 tensor: one read of the logits, one candidate written
per block of them. The row key (the hash of seed and position) is computed in the kernel too: in torch it is some
twenty tiny launches, which inside a decode graph cost more than the draw itself. Both argmaxes split each row over
many programs and merge their candidates: one program per row reads a 151,936-logit row in a serial loop, too slow
for a decode step. The draw rounds as the torch path does (the host's 1 / T, no fused multiply-add), so both pick the
same tokens.

The two exact logarithms a logit are most of the draw's arithmetic, and only the winner's matter. A block first bounds
each score from above, with logarithms read off the floats' bits (`_gumbel_lower_bound`, within 0.08 of the exact
term), takes the column of the highest bound and computes that column's exact score: where no other column's bound
reaches it, no other score can, and that column wins. Otherwise (scores within the bounds' slack of the lead, a NaN)
the block computes every exact score, as it always did.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from batchgen.layers.fp8_gemm_triton import gpu_limits
from batchgen.layers.pdl import launch_options, wait_for_previous

_SALT = 0x9E3779B9


@triton.jit
def _mix32(x):
    x ^= x >> 16
    x *= 0x45D9F3B
    x ^= x >> 16
    x *= 0x45D9F3B
    x ^= x >> 16
    return x


@triton.jit
def _row_key(seed, position):
    """The torch path's `_row_keys` for one row: seed in [0, 2**63), position >= 0, both int64."""
    key = _mix32((seed & 0xFFFFFFFF).to(tl.uint32))
    key = _mix32(key ^ ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
    return _mix32(key ^ (position & 0xFFFFFFFF).to(tl.uint32))


@triton.jit
def _uniform_bits(row_key, cols, SALT: tl.constexpr):
    """The 23 random bits of the torch path's `_uniform` for one row's columns, as int32 in [0, 2**23)."""
    return (_mix32(row_key ^ _mix32(cols.to(tl.uint32) + SALT)) >> 9).to(tl.int32)


@triton.jit
def _gumbel_of(bits):
    """log(-log U) for U = (bits + 0.5) / 2**23, as the torch path rounds it."""
    return tl.log(-tl.log((bits.to(tl.float32) + 0.5) * (1.0 / 8388608.0)))


@triton.jit
def _gumbel(seed, position, cols, SALT: tl.constexpr):
    """log(-log U) of the torch path's `_uniform` for one row's columns."""
    return _gumbel_of(_uniform_bits(_row_key(seed, position), cols, SALT))


# log2(1 + m) for a mantissa's fraction m in [0, 1) lies between m + CURVE * m * (1 - m) and that plus GAP.
_MANTISSA_CURVE = tl.constexpr(0.278)
_MANTISSA_GAP = tl.constexpr(0.0202)
# What _gumbel_lower_bound subtracts so that its bound holds as computed in float32, not only in exact arithmetic: far
# above the rounding of its own operations and of _gumbel_of's logarithms (a few 1e-6 at their largest values).
_BOUND_MARGIN = tl.constexpr(1e-4)
_LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _log2_below(x):
    """At most log2(x), and at most _MANTISSA_GAP below it, for a positive normal float x: its exponent plus a
    quadratic under log2(1 + m) of its mantissa's fraction m, read off its bits."""
    word = x.to(tl.int32, bitcast=True)
    fraction = (word & 0x7FFFFF).to(tl.float32) * (1.0 / 8388608.0)
    return ((word >> 23) - 127).to(tl.float32) + fraction + _MANTISSA_CURVE * fraction * (1.0 - fraction)


@triton.jit
def _gumbel_lower_bound(bits):
    """At most _gumbel_of(bits), and within 0.08 of it (tests/sample/test_sampler_triton.py checks every bits value),
    without a logarithm: -log U from below as the larger of 1 - U (close where U is near 1) and the bound from
    _log2_below's on log2 U (close where U is small), then _log2_below of that."""
    u = (bits.to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    one_minus_u = (8388607.5 - bits.to(tl.float32)) * (1.0 / 8388608.0)  # exact: a half-integer below 2**23
    neg_log_u = tl.maximum(one_minus_u, -(_log2_below(u) + _MANTISSA_GAP) * _LN2)
    return _log2_below(neg_log_u) * _LN2 - _BOUND_MARGIN


@triton.jit
def _best(rank, value, index):
    """The first index of the largest (rank, value) of 1-D tensors, and that rank and value."""
    top_rank = tl.max(rank, axis=0)
    top_value = tl.max(tl.where(rank == top_rank, value, float("-inf")), axis=0)
    winner = tl.min(tl.where((rank == top_rank) & (value == top_value), index, 2**31 - 1), axis=0)
    return top_rank, top_value, winner


@triton.jit
def _argmax(values, cols):
    """torch.argmax's candidate of a 1-D block (rank, value, index): NaN ranks above every number (torch's argmax
    returns the first NaN), then the largest value, then the first index."""
    rank = (values != values).to(tl.int32)
    return _best(rank, tl.where(rank == 1, 0.0, values), cols)


@triton.jit
def _row_winner(ranks_ptr, values_ptr, indices_ptr, row, chunks, CHUNKS: tl.constexpr):
    """The index of the best of a row's `chunks` block candidates (ranks, values, indices as the block kernels
    write them, row-major), the earlier block on a tie; CHUNKS: a power of two of at least chunks."""
    offsets = tl.arange(0, CHUNKS)
    mask = offsets < chunks
    at = row * chunks + offsets
    _, _, winner = _best(tl.load(ranks_ptr + at, mask=mask, other=-1),
                         tl.load(values_ptr + at, mask=mask, other=float("-inf")),
                         tl.load(indices_ptr + at, mask=mask, other=2**31 - 1))
    return winner.to(tl.int64)


class _Blocks(NamedTuple):
    """How a launch splits each row of logits (B, V) into blocks, and where its block kernel writes each block's
    torch.argmax candidate for the merge kernel: `buffers`, the (B, chunks) ranks (NaN 1, else 0), values and
    indices."""

    block: int  # logits a block
    chunks: int  # blocks a row
    buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor]

    @classmethod
    def of(cls, logits: torch.Tensor, block: int) -> _Blocks:
        """Blocks of at most `block` logits (a power of two)."""
        rows, vocab = logits.shape
        block = min(block, triton.next_power_of_2(vocab))
        chunks = triton.cdiv(vocab, block)
        empty = functools.partial(torch.empty, rows, chunks, device=logits.device)
        return cls(block, chunks, (empty(dtype=torch.int32), empty(dtype=torch.float32), empty(dtype=torch.int32)))

    @property
    def num_warps(self) -> int:  # of a block kernel's program
        return 4 if self.block >= 1024 else 1

    @property
    def pow2_chunks(self) -> int:  # the merge kernel's CHUNKS
        return triton.next_power_of_2(self.chunks)


_DRAW_BLOCK = 2048  # logits a program draws from: a row is split so that a batch keeps every SM busy


@triton.jit
def _draw_chunk_kernel(logits_ptr, stride, inv_temperatures_ptr, seeds_ptr, positions_ptr, ranks_ptr, values_ptr,
                       indices_ptr, VOCAB: tl.constexpr, SCALE: tl.constexpr, SALT: tl.constexpr,
                       BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One program per (row, block of logits): the block's torch.argmax candidate of logits / T - log(-log U), its
    exact scores computed only where the bounds leave more than one column in the race (module docstring).
    SCALE: multiply by the row's 1 / T (False where the logits are already divided)."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    row_key = _row_key(tl.load(seeds_ptr + row), tl.load(positions_ptr + row))
    bits = _uniform_bits(row_key, cols, SALT)
    lower_bounds = _gumbel_lower_bound(bits)
    # Staged with the seeds and positions (SamplingTensors' one buffer), which no kernel before this one writes.
    inv_temperature = tl.load(inv_temperatures_ptr + row)
    row_ptr = logits_ptr + row * stride
    wait_for_previous(PDL)
    logits = tl.load(row_ptr + cols, mask=cols < VOCAB, other=float("-inf")).to(tl.float32)
    if SCALE:
        logits = logits * inv_temperature
    # Each score rounded from its logit minus at most its Gumbel term: never below the exact score.
    bounds = logits - lower_bounds
    _, lead = tl.max(bounds, axis=0, return_indices=True, return_indices_tie_break_left=True)
    lead_col = chunk * BLOCK + lead
    lead_logit = tl.load(row_ptr + lead_col).to(tl.float32)
    if SCALE:
        lead_logit = lead_logit * inv_temperature
    lead_score = lead_logit - _gumbel_of(_uniform_bits(row_key, lead_col, SALT))
    # NaN bounds count as reaching the lead: a NaN logit (which torch.argmax picks) takes the exact pass.
    contenders = tl.sum((~(bounds < lead_score)).to(tl.int32), axis=0)
    if contenders == 1:
        top_rank, top_value, winner = tl.zeros((), tl.int32), lead_score, lead_col
    else:
        top_rank, top_value, winner = _argmax(logits - _gumbel_of(bits), cols)
    at = row * tl.num_programs(1) + chunk
    tl.store(ranks_ptr + at, top_rank)
    tl.store(values_ptr + at, top_value)
    tl.store(indices_ptr + at, winner)


@triton.jit
def _draw_merge_kernel(ranks_ptr, values_ptr, indices_ptr, temperatures_ptr, greedy_ids_ptr, out_ptr, chunks,
                       CHUNKS: tl.constexpr, PDL: tl.constexpr):
    """One program per row: the best of its blocks' candidates (the earlier block on a tie), or the row's greedy id
    where its temperature is 0."""
    row = tl.program_id(0)
    wait_for_previous(PDL)
    winner = _row_winner(ranks_ptr, values_ptr, indices_ptr, row, chunks, CHUNKS)
    greedy = tl.load(temperatures_ptr + row) == 0
    tl.store(out_ptr + row, tl.where(greedy, tl.load(greedy_ids_ptr + row), winner))


def seeded_draw(logits: torch.Tensor, temperatures: torch.Tensor, inv_temperatures: torch.Tensor, seeds: torch.Tensor,
                positions: torch.Tensor, greedy_ids: torch.Tensor, scale: bool = True) -> torch.Tensor:
    """The seeded draw of every row: logits (B, V), temperatures (B,) float32 (0 = greedy), inv_temperatures (B,)
    float32 (1 / temperature, 1 for greedy rows), seeds (B,) int64 in [0, 2**63), positions (B,) int64, greedy_ids
    (B,) int64 (what greedy rows take). scale=False where the logits are already divided by the temperatures.
    -> (B,) int64 token ids."""
    rows, vocab = logits.shape
    token_ids = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return token_ids
    blocks = _Blocks.of(logits, _DRAW_BLOCK)
    options = launch_options(logits.device)
    _draw_chunk_kernel[(rows, blocks.chunks)](logits, logits.stride(0), inv_temperatures, seeds, positions,
                                              *blocks.buffers, VOCAB=vocab, SCALE=scale, SALT=_SALT, BLOCK=blocks.block,
                                              num_warps=blocks.num_warps, enable_fp_fusion=False, **options)
    _draw_merge_kernel[(rows,)](*blocks.buffers, temperatures, greedy_ids, token_ids, blocks.chunks,
                                CHUNKS=blocks.pow2_chunks, num_warps=1, **options)
    return token_ids


_GREEDY_BLOCK = 2048  # logits a block: one row alone still keeps dozens of SMs reading
# Programs a launch takes per SM (of four warps; twice what an SM holds at once): a launch of more rows gives each
# row fewer programs, each looping over its row's blocks. With a program a block, a sampled decode step at 512 rows
# of Qwen3's vocabulary launched 38,000 programs only to find their row drawing; fewer programs a row read all rows
# slower (benchmarks/RESULTS.md, 2026-11-28, thirteenth session).
_GREEDY_PROGRAMS_PER_SM = 32


@triton.jit
def _greedy_chunk_kernel(logits_ptr, stride, wanted_ptr, ranks_ptr, values_ptr, indices_ptr, VOCAB: tl.constexpr,
                         BLOCK: tl.constexpr, WANTED: tl.constexpr, PDL: tl.constexpr):
    """Programs (row, i) of a grid (rows, P): the torch.argmax candidate of each of the row's blocks of BLOCK logits
    i, i + P, ...; nothing for a row that is not wanted (WANTED: wanted_ptr holds a flag per row)."""
    row = tl.program_id(0)
    chunks = (VOCAB + BLOCK - 1) // BLOCK
    wait_for_previous(PDL)
    if WANTED:
        if tl.load(wanted_ptr + row) == 0:
            return
    for chunk in range(tl.program_id(1), chunks, tl.num_programs(1)):
        cols = chunk * BLOCK + tl.arange(0, BLOCK)
        logits = tl.load(logits_ptr + row * stride + cols, mask=cols < VOCAB, other=float("-inf"))
        top_rank, top_value, winner = _argmax(logits.to(tl.float32), cols)
        at = row * chunks + chunk
        tl.store(ranks_ptr + at, top_rank)
        tl.store(values_ptr + at, top_value)
        tl.store(indices_ptr + at, winner)


# pending_rows is the bucket size or max_num_seqs: specialized, it would compile once for 1, once for multiples of 16
# and once for the rest.
@triton.jit(do_not_specialize=["pending_rows"])
def _greedy_merge_kernel(ranks_ptr, values_ptr, indices_ptr, wanted_ptr, out_ptr, pending_ids_ptr, pending_rows,
                         chunks, CHUNKS: tl.constexpr, WANTED: tl.constexpr, PDL: tl.constexpr):
    """One program per row: the best of its blocks' candidates (the earlier block on a tie), into out and, for rows
    below pending_rows, into pending_ids; for a row that is not wanted, id 0 into out (a valid id for whatever reads
    it as greedy: a sampler's padding rows) and nothing into pending_ids."""
    row = tl.program_id(0)
    wait_for_previous(PDL)
    if WANTED:
        if tl.load(wanted_ptr + row) == 0:
            tl.store(out_ptr + row, tl.zeros((), dtype=tl.int64))
            return
    winner = _row_winner(ranks_ptr, values_ptr, indices_ptr, row, chunks, CHUNKS)
    tl.store(out_ptr + row, winner)
    if row < pending_rows:
        tl.store(pending_ids_ptr + row, winner)


def greedy_argmax(logits: torch.Tensor, pending_ids: torch.Tensor, wanted: torch.Tensor | None = None, *,
                  programs: int | None = None) -> torch.Tensor:
    """logits (B, V) -> (B,) int64 token ids, torch.argmax's (NaN first, then the first largest value); also written
    into pending_ids's first min(B, len(pending_ids)) rows. Each row is read in blocks of _GREEDY_BLOCK logits by
    `programs` // B programs (at least one, at most one a block; default: _GREEDY_PROGRAMS_PER_SM for each of the
    GPU's SMs, an H100's off CUDA, as `gpu_limits` gives). wanted: (B,) flags, nonzero for the rows whose argmax is
    wanted (a decode graph's greedy rows: the others draw, and the sampler writes their ids); the other rows' logits
    are not read, their id is 0 and their pending id is left as it was. None: every row's."""
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    blocks = _Blocks.of(logits, _GREEDY_BLOCK)
    flags = out if wanted is None else wanted  # read only under WANTED
    options = launch_options(logits.device)
    if programs is None:
        programs = _GREEDY_PROGRAMS_PER_SM * gpu_limits(logits.device).sm_count
    per_row = max(1, min(blocks.chunks, programs // rows))
    _greedy_chunk_kernel[(rows, per_row)](logits, logits.stride(0), flags, *blocks.buffers, VOCAB=vocab,
                                          BLOCK=blocks.block, WANTED=wanted is not None, num_warps=blocks.num_warps,
                                          **options)
    _greedy_merge_kernel[(rows,)](*blocks.buffers, flags, out, pending_ids, min(rows, len(pending_ids)), blocks.chunks,
                                  CHUNKS=blocks.pow2_chunks, WANTED=wanted is not None, num_warps=1, **options)
    return out
