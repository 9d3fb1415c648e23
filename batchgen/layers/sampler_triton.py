"""The random draw of the sampler as one Triton pass over the logits (CUDA only).

argmax(probs / E) with E = -log(U) is the exponential race; taking logs, it is argmax(logits / T - log(-log U)),
so no softmax is needed. U is the same counter-based hash of (seed, position, vocab index) as the torch path's,
computed here in uint32 registers instead of a (B, V) int64 tensor: one read of the logits, nothing written but ids.
The row key (the hash of seed and position) is computed in the kernel too: in torch it is some twenty tiny launches,
which inside a decode graph cost more than the draw itself.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_SALT = 0x9E3779B9
_BLOCK = 2048


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
def _gumbel_argmax_kernel(logits_ptr, stride, inv_temperatures_ptr, seeds_ptr, positions_ptr, out_ptr,
                          VOCAB: tl.constexpr, SALT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    inv_temperature = tl.load(inv_temperatures_ptr + row)
    row_key = _row_key(tl.load(seeds_ptr + row), tl.load(positions_ptr + row))
    best_value = tl.full([BLOCK], float("-inf"), tl.float32)
    best_index = tl.zeros([BLOCK], tl.int32)
    for start in range(0, VOCAB, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < VOCAB
        logits = tl.load(logits_ptr + row * stride + cols, mask=mask, other=float("-inf")).to(tl.float32)
        column_key = _mix32(cols.to(tl.uint32) + SALT)
        bits = _mix32(row_key ^ column_key)
        uniform = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
        value = logits * inv_temperature - tl.log(-tl.log(uniform))
        better = value > best_value
        best_value = tl.where(better, value, best_value)
        best_index = tl.where(better, cols, best_index)
    winner = tl.argmax(best_value, axis=0)
    index = tl.sum(tl.where(tl.arange(0, BLOCK) == winner, best_index, 0), axis=0)
    tl.store(out_ptr + row, index.to(tl.int64))


def gumbel_argmax(logits: torch.Tensor, inv_temperatures: torch.Tensor, seeds: torch.Tensor,
                  positions: torch.Tensor) -> torch.Tensor:
    """logits (B, V), inv_temperatures (B,) float32, seeds (B,) int64 in [0, 2**63), positions (B,) int64
    -> (B,) int64 token ids."""
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    block = min(_BLOCK, triton.next_power_of_2(logits.shape[1]))
    _gumbel_argmax_kernel[(logits.shape[0],)](logits, logits.stride(0), inv_temperatures, seeds, positions, out,
                                              logits.shape[1], SALT=_SALT, BLOCK=block,
                                              num_warps=8 if block >= 1024 else 1)
    return out
