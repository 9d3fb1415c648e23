"""Decode attention by KV split count (CUDA only): the engine's launcher at each power-of-two split count, against
the count it chooses itself, at the batch sizes a draining nanovllm_bench passes through.

Run from the repo root: python -m benchmarks.sweep_decode_splits [--kv-cache-dtype fp8] [--out DIR]
Contexts are uniform in [100, 2048] (nanovllm_bench's prompt plus output lengths) or all 1,000; lengths are int64,
as the engine's graph buffers hold them. Microseconds are triton.testing.do_bench medians (L2 flushed per call).
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch
from triton.testing import do_bench

from batchgen.layers import attention_triton as at
from benchmarks.bench_attention import HEAD_DIM, NUM_KV_HEADS
from benchmarks.common import environment, markdown_table, save_json
from benchmarks.sweep_decode_attention import parse_sweep_args, ragged_inputs

BATCHES = (8, 16, 32, 48, 64, 96, 128, 192, 256)
CONTEXTS = ((100, 2048), (1000, 1000))
SPLITS = (1, 2, 4, 8, 16)


def main() -> None:
    args, cache_dtype = parse_sweep_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    rows = []
    for (lo, hi), batch in itertools.product(CONTEXTS, BATCHES):
        q, k_cache, v_cache, block_tables, seq_lens = ragged_inputs(batch, lo, hi, cache_dtype)
        seq_lens = seq_lens.long()
        arrivals = torch.zeros(batch * NUM_KV_HEADS, dtype=torch.int32, device="cuda")
        row = {"batch": batch, "ctx": f"{lo}-{hi}"}
        for splits in (None, *SPLITS):  # None: the launcher's own choice
            run = functools.partial(at.decode_attention, q, k_cache, v_cache, block_tables, seq_lens, HEAD_DIM**-0.5,
                                    num_splits=splits, split_arrivals=arrivals)
            row["default" if splits is None else f"{splits}"] = do_bench(run, return_mode="median") * 1e3
        tile = at.decode_tile(HEAD_DIM, q.dtype, cache_dtype)
        row["default_splits"] = at._default_num_splits(batch * NUM_KV_HEADS, q.device, tile)
        rows.append(row)
    suffix = "_fp8" if args.kv_cache_dtype == "fp8" else ""
    save_json(args.out, "sweep_decode_splits" + suffix,
              {"environment": environment(), "kv_cache_dtype": str(cache_dtype), "rows": rows})
    headers = ["batch", "ctx", "default_splits", "default", *(f"{s}" for s in SPLITS)]
    print(f"\n## sweep_decode_splits ({torch.cuda.get_device_name()}, {cache_dtype}): us by split count\n")
    print(markdown_table(headers, [[r[h] for h in headers] for r in rows]))


if __name__ == "__main__":
    main()
