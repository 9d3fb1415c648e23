"""Decode attention, Triton kernel vs the PyTorch reference, on Qwen3-0.6B attention shapes (CUDA only).

Run from the repo root: python -m benchmarks.bench_attention
Times are triton.testing.do_bench medians; do_bench flushes L2 before every call, so even the small cases read K/V
from HBM. GB/s = K and V bytes of every sequence's context (all kv heads) / median time.
"""

from __future__ import annotations

import functools
import sys

import torch
from triton.testing import do_bench

from batchgen.layers import attention_torch, attention_triton

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE = 16, 8, 128, 16, torch.bfloat16
BATCHES = (1, 8, 64, 256)
CONTEXTS = (512, 2048)


def random_kv_cache(num_blocks: int, device: str = "cuda") -> tuple[torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache) of num_blocks random blocks, laid out as the engine's."""
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return torch.randn(shape, dtype=DTYPE, device=device), torch.randn(shape, dtype=DTYPE, device=device)


def random_queries(batch: int, device: str = "cuda") -> torch.Tensor:
    return torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=device)


def _inputs(batch: int, ctx: int) -> tuple[torch.Tensor, ...]:
    """Every sequence at full context, its blocks scattered over the cache like a long-running engine's."""
    blocks_per_seq = -(-ctx // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    k_cache, v_cache = random_kv_cache(num_blocks)
    block_tables = torch.randperm(num_blocks, device="cuda").to(torch.int32).view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    return random_queries(batch), k_cache, v_cache, block_tables, seq_lens


def median_ms(fn: functools.partial) -> float:
    return do_bench(fn, return_mode="median")


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("bench_attention needs a CUDA device")
    scale = HEAD_DIM**-0.5
    header = ("batch", "ctx", "splits", "torch ms", "triton ms", "1-split ms", "torch GB/s", "triton GB/s", "speedup")
    rows = []
    for ctx in CONTEXTS:
        for batch in BATCHES:
            inputs = _inputs(batch, ctx)
            triton_fn = functools.partial(attention_triton.decode_attention, *inputs, scale)
            single_fn = functools.partial(attention_triton.decode_attention, *inputs, scale, num_splits=1)
            torch_fn = functools.partial(attention_torch.decode_attention, *inputs, scale)
            torch.testing.assert_close(triton_fn().float(), torch_fn().float(), atol=2e-2, rtol=2e-2)
            torch_ms, triton_ms, single_ms = median_ms(torch_fn), median_ms(triton_fn), median_ms(single_fn)
            kv_gb = 2 * batch * ctx * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize / 1e9
            splits = attention_triton._default_num_splits(batch * NUM_KV_HEADS, inputs[0].device, 64)
            rows.append(
                (batch, ctx, splits, f"{torch_ms:.4f}", f"{triton_ms:.4f}", f"{single_ms:.4f}",
                 f"{kv_gb / torch_ms * 1e3:.0f}", f"{kv_gb / triton_ms * 1e3:.0f}", f"{torch_ms / triton_ms:.1f}x")
            )  # fmt: skip
            print(f"done batch={batch} ctx={ctx}", file=sys.stderr)
            del inputs, triton_fn, single_fn, torch_fn
            torch.cuda.empty_cache()

    print(f"decode_attention on {torch.cuda.get_device_name()}: {NUM_HEADS} q heads, {NUM_KV_HEADS} kv heads, "
          f"head_dim {HEAD_DIM}, {DTYPE}, block size {BLOCK_SIZE}")  # fmt: skip
    widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        print("  ".join(str(cell).rjust(w) for cell, w in zip(row, widths, strict=True)))


if __name__ == "__main__":
    main()
