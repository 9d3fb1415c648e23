"""Decode attention launch configurations on ragged contexts (CUDA only): which tile, warps, stages and split count
read the paged KV cache fastest at the batch sizes of nanovllm_bench.

Run from the repo root: python -m benchmarks.sweep_decode_attention [--kv-cache-dtype fp8] [--batches 64 128 256]
                                                                   [--out DIR]
Contexts are uniform in [100, 2048] (nanovllm_bench's prompt plus output lengths), blocks scattered over the cache;
with fp8 the random cache is rounded to float8_e4m3fn.
GB/s = K and V bytes of every sequence's context / median time (triton.testing.do_bench, L2 flushed per call).
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch
import triton
from triton.testing import do_bench

from batchgen.engine.model_worker import resolve_kv_cache_dtype
from batchgen.layers import attention_triton as at
from benchmarks.bench_attention import (
    BLOCK_SIZE,
    DTYPE,
    HEAD_DIM,
    NUM_KV_HEADS,
    random_kv_cache,
    random_queries,
)
from benchmarks.common import add_kv_cache_dtype_argument, add_out_argument, environment, save_json


def ragged_inputs(batch: int, lo: int, hi: int, cache_dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (batch,), generator=gen)
    width = -(-hi // BLOCK_SIZE)
    num_blocks = batch * width
    k_cache, v_cache = (cache.to(cache_dtype) for cache in random_kv_cache(num_blocks))
    block_tables = torch.randperm(num_blocks, device="cuda").to(torch.int32).view(batch, width)
    return random_queries(batch), k_cache, v_cache, block_tables, lens.to(torch.int32).cuda()


def launch(q, k_cache, v_cache, block_tables, seq_lens, scale, splits, block_n, warps, stages):
    batch, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    mid_o = torch.empty(batch, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(batch, num_heads, splits, dtype=torch.float32, device=q.device)

    arrivals = torch.zeros(batch * NUM_KV_HEADS, dtype=torch.int32, device=q.device)

    def run():  # as the engine launches it: one split is a compile of its own; with more, the last to finish merges
        at._decode_kernel[(batch, NUM_KV_HEADS, splits)](
            q, k_cache, v_cache, block_tables, seq_lens, seq_lens, out, mid_o, mid_lse, arrivals,
            scale * at._LOG2E, at._NO_WINDOW,
            *q.stride(), *k_cache.stride(), *v_cache.stride(), block_tables.stride(0), *out.stride(),
            splits, splits, 0,
            GROUP=num_heads // NUM_KV_HEADS, HEAD_DIM=head_dim, BLOCK_SIZE=BLOCK_SIZE,
            BLOCK_G=16, BLOCK_D=head_dim, BLOCK_N=block_n, SHORT_N=block_n, DOT_PRECISION="tf32", CASCADE=False,
            MERGE=splits > 1,
            GROUP_ROWS=triton.next_power_of_2(num_heads // NUM_KV_HEADS), MAX_SLOTS=at._MAX_SPLITS, PDL=False,
            num_warps=warps, num_stages=stages, **at.register_cap(block_n, q.device),
        )  # fmt: skip
        return out

    return run


def parse_sweep_args(parser: argparse.ArgumentParser) -> tuple[argparse.Namespace, torch.dtype]:
    """The attention sweeps' arguments with --kv-cache-dtype and --out, and the cache dtype; exits without CUDA."""
    add_kv_cache_dtype_argument(parser)
    add_out_argument(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    return args, resolve_kv_cache_dtype(args.kv_cache_dtype, DTYPE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 128, 256])
    args, cache_dtype = parse_sweep_args(parser)
    scale = HEAD_DIM**-0.5
    results = []
    for batch, (lo, hi) in itertools.product(args.batches, ((100, 2048), (512, 512), (2048, 2048))):
        inputs = ragged_inputs(batch, lo, hi, cache_dtype)
        kv_gb = 2 * int(inputs[4].sum()) * NUM_KV_HEADS * HEAD_DIM * cache_dtype.itemsize / 1e9
        reference = at.decode_attention(*inputs, scale).float()
        best = None
        for splits, block_n, warps, stages in itertools.product((1, 2, 4, 8), (32, 64, 128), (4, 8), (2, 3, 4)):
            try:
                fn = launch(*inputs, scale, splits, block_n, warps, stages)
                torch.testing.assert_close(fn().float(), reference, atol=2e-2, rtol=2e-2)
                ms = do_bench(fn, return_mode="median")
            except Exception as exc:  # out of shared memory, registers
                print(f"skip {batch} {lo}-{hi} {splits} {block_n} {warps} {stages}: {type(exc).__name__}",
                      file=sys.stderr)
                continue
            row = {"batch": batch, "ctx": f"{lo}-{hi}", "splits": splits, "block_n": block_n, "warps": warps,
                   "stages": stages, "ms": ms, "gb_s": kv_gb / ms * 1e3}
            results.append(row)
            if best is None or ms < best["ms"]:
                best = row
        # The engine's own launch: its tile for the cache, 4 warps, 3 stages, its split count for the batch.
        engine_tile = at.decode_tile(HEAD_DIM, DTYPE, cache_dtype)
        engine = {"batch": batch, "ctx": f"{lo}-{hi}", "block_n": engine_tile, "warps": 4, "stages": 3,
                  "splits": at._default_num_splits(batch * NUM_KV_HEADS, inputs[0].device, engine_tile)}
        engine_row = next((r for r in results if all(r[key] == value for key, value in engine.items())), best)
        print(f"batch {batch} ctx {lo}-{hi}: engine's {engine_row['ms']:.4f} ms {engine_row['gb_s']:.0f} GB/s; best "
              f"{best['ms']:.4f} ms {best['gb_s']:.0f} GB/s with splits={best['splits']} block_n={best['block_n']} "
              f"warps={best['warps']} stages={best['stages']}")
        del inputs
        torch.cuda.empty_cache()
    suffix = "_fp8" if args.kv_cache_dtype == "fp8" else ""
    save_json(args.out, "sweep_decode_attention" + suffix,
              {"environment": environment(), "kv_cache_dtype": str(cache_dtype), "rows": results})


if __name__ == "__main__":
    main()
