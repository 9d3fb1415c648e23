"""Cascade vs plain decode attention for a batch sharing a KV prefix, on the Qwen3-0.6B attention shape (CUDA only).

Run from the repo root: python -m benchmarks.bench_cascade_attention
Every sequence holds the same 1,000-token prefix (its 62 full blocks shared by reference, as prefix caching leaves
them) and its own 100-token suffix. Times are triton.testing.do_bench medians of one layer's decode attention (L2
flushed before every call); "shared len ms" is the once-per-step shared-length computation. "plain GB/s" counts every
sequence's whole context; "cascade GB/s" the bytes cascade reads at least: the prefix once plus every suffix.
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch

from batchgen.layers import attention_triton
from batchgen.layers.shared_prefix import shared_prefix_len
from benchmarks.bench_attention import (
    BLOCK_SIZE,
    DTYPE,
    HEAD_DIM,
    NUM_HEADS,
    NUM_KV_HEADS,
    median_ms,
    random_kv_cache,
    random_queries,
)


def _inputs(batch: int, prefix_len: int, suffix_len: int) -> tuple[torch.Tensor, ...]:
    """Row b's blocks: the shared prefix's full blocks, then its own blocks, scattered over the cache."""
    shared_blocks = prefix_len // BLOCK_SIZE
    ctx = prefix_len + suffix_len
    blocks_per_seq = -(-ctx // BLOCK_SIZE)
    own_blocks = blocks_per_seq - shared_blocks
    num_blocks = shared_blocks + batch * own_blocks
    k_cache, v_cache = random_kv_cache(num_blocks)
    ids = torch.randperm(num_blocks, device="cuda").to(torch.int32)
    shared = ids[:shared_blocks].expand(batch, shared_blocks)
    block_tables = torch.cat([shared, ids[shared_blocks:].view(batch, own_blocks)], dim=1).contiguous()
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    return random_queries(batch), k_cache, v_cache, block_tables, seq_lens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="*", default=[8, 64, 256])
    parser.add_argument("--prefix-len", type=int, default=1000)
    parser.add_argument("--suffix-len", type=int, default=100)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_cascade_attention needs a CUDA device")
    scale = HEAD_DIM**-0.5
    token_bytes = 2 * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize
    header = ("batch", "shared len", "plain ms", "cascade ms", "shared len ms", "plain GB/s", "cascade GB/s",
              "speedup")
    rows = []
    for batch in args.batches:
        inputs = _inputs(batch, args.prefix_len, args.suffix_len)
        shared = shared_prefix_len(inputs[3], inputs[4], BLOCK_SIZE)
        plain_fn = functools.partial(attention_triton.decode_attention, *inputs, scale)
        cascade_fn = functools.partial(attention_triton.decode_attention, *inputs, scale, shared_prefix_len=shared)
        torch.testing.assert_close(cascade_fn().float(), plain_fn().float(), atol=2e-2, rtol=2e-2)
        plain_ms, cascade_ms = median_ms(plain_fn), median_ms(cascade_fn)
        shared_ms = median_ms(functools.partial(shared_prefix_len, inputs[3], inputs[4], BLOCK_SIZE))
        ctx = args.prefix_len + args.suffix_len
        shared_len = int(shared.item())
        plain_gb = batch * ctx * token_bytes / 1e9
        cascade_gb = (shared_len + batch * (ctx - shared_len)) * token_bytes / 1e9
        rows.append((batch, shared_len, f"{plain_ms:.4f}", f"{cascade_ms:.4f}", f"{shared_ms:.4f}",
                     f"{plain_gb / plain_ms * 1e3:.0f}", f"{cascade_gb / cascade_ms * 1e3:.0f}",
                     f"{plain_ms / cascade_ms:.2f}x"))
        print(f"done batch={batch}", file=sys.stderr)
        del inputs, plain_fn, cascade_fn
        torch.cuda.empty_cache()

    print(f"cascade decode attention on {torch.cuda.get_device_name()}: {NUM_HEADS} q heads, {NUM_KV_HEADS} kv "
          f"heads, head_dim {HEAD_DIM}, {DTYPE}, block size {BLOCK_SIZE}, prefix {args.prefix_len} + suffix "
          f"{args.suffix_len} tokens")
    widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        print("  ".join(str(cell).rjust(w) for cell, w in zip(row, widths, strict=True)))


if __name__ == "__main__":
    main()
