"""bench_sampling: top-k / top-p of a large vocabulary, torch's sort against the sort-free Triton filters (CUDA only),
each followed by the same seeded draw.

Qwen's vocabulary (151,936 logits a row), bf16 logits drawn from N(0, --logit-std), temperature 0.7, batches 1, 8,
64, 256 and 512, three setups: top-k 20 + top-p 0.95 (Qwen's chat defaults), top-p 0.9 alone, top-k 40 alone. Each
path is sampler._draw_cuda with LARGE_VOCAB_FILTERS_MIN_ROWS set to take it. Milliseconds are triton.testing
medians, eager (do_bench, L2 flushed before every call) and replayed in a CUDA graph (do_bench_cudagraph), as the
engine's sampler graphs run them. "rows differing": rows whose kept tokens differ between the paths (torch's float32
cumsum on the GPU rounds top-p's masses otherwise; none for top-k alone). The last line suggests
LARGE_VOCAB_FILTERS_MIN_ROWS: the smallest batch from which the sort-free path is faster in a graph, for every setup
and every larger batch.

Usage: python -m benchmarks.bench_sampling [--batches 1 8 64 256 512] [--logit-std 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from triton.testing import do_bench, do_bench_cudagraph

from batchgen.sample import sampler
from batchgen.sample.batch import SamplingBatch
from batchgen.sample.params import SamplingParams
from benchmarks.common import add_out_argument, environment, markdown_table, save_json

VOCAB = 151_936
TEMPERATURE = 0.7
SETUPS: dict[str, dict[str, Any]] = {
    "top-k 20 + top-p 0.95": dict(top_k=20, top_p=0.95),
    "top-p 0.9": dict(top_p=0.9),
    "top-k 40": dict(top_k=40),
}
PATHS = {"sort": sys.maxsize, "sort_free": 1}  # the LARGE_VOCAB_FILTERS_MIN_ROWS that takes each


@contextlib.contextmanager
def path(min_rows: int) -> Iterator[None]:
    previous = sampler.LARGE_VOCAB_FILTERS_MIN_ROWS
    sampler.LARGE_VOCAB_FILTERS_MIN_ROWS = min_rows
    try:
        yield
    finally:
        sampler.LARGE_VOCAB_FILTERS_MIN_ROWS = previous


def draw(batch: int, setup: dict[str, Any], logit_std: float) -> Callable[[], sampler.SamplerOutput]:
    """The draw of one step's logits (batch, VOCAB) with the setup's filters."""
    gen = torch.Generator(device="cuda").manual_seed(batch)
    logits = (torch.randn(batch, VOCAB, device="cuda", generator=gen) * logit_std).to(torch.bfloat16)
    params = [SamplingParams(temperature=TEMPERATURE, seed=i, **setup) for i in range(batch)]
    tensors = SamplingBatch.prepare(params, [100] * batch).to_device("cuda")
    greedy_ids = logits.argmax(dim=-1)
    return lambda: sampler._draw_cuda(logits, tensors, greedy_ids, True)


def measure(batch: int, setup_name: str, logit_std: float) -> dict[str, Any]:
    fn = draw(batch, SETUPS[setup_name], logit_std)
    result: dict[str, Any] = {"batch": batch, "setup": setup_name}
    outputs = {}
    for name, min_rows in PATHS.items():
        with path(min_rows):
            outputs[name] = fn()
            result[f"{name}_ms"] = do_bench(fn, return_mode="median")
            result[f"{name}_graph_ms"] = do_bench_cudagraph(fn, return_mode="median")
    sort, sort_free = outputs["sort"], outputs["sort_free"]
    kept_differs = torch.isfinite(sort.filtered) != torch.isfinite(sort_free.filtered)
    result["rows_differing"] = int(kept_differs.any(dim=1).sum())
    result["tokens_differing"] = int((sort.token_ids != sort_free.token_ids).sum())
    return result


def suggested_min_rows(results: list[dict[str, Any]]) -> int | None:
    """The smallest batch from which the sort-free path wins in a graph for every setup and larger batch (None:
    it loses at the largest)."""
    batches = sorted({r["batch"] for r in results})
    suggestion = None
    for batch in reversed(batches):
        if not all(r["sort_free_graph_ms"] < r["sort_graph_ms"] for r in results if r["batch"] == batch):
            break
        suggestion = batch
    return suggestion


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 8, 64, 256, 512])
    parser.add_argument("--logit-std", type=float, default=3.0, help="standard deviation of the random logits")
    add_out_argument(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_sampling needs a CUDA device")
    results = []
    for batch in args.batches:
        for setup_name in SETUPS:
            results.append(measure(batch, setup_name, args.logit_std))
            print(f"done batch={batch} {setup_name}", file=sys.stderr, flush=True)
        torch.cuda.empty_cache()
    suggestion = suggested_min_rows(results)
    env = environment()
    save_json(args.out, "bench_sampling", {
        "environment": env, "vocab": VOCAB, "logit_std": args.logit_std, "temperature": TEMPERATURE,
        "results": results, "suggested_large_vocab_filters_min_rows": suggestion,
        "notes": "ms of sampler._draw_cuda (filters + seeded draw); eager: do_bench median, graph: "
                 "do_bench_cudagraph median",
    })
    print(f"\n## bench_sampling ({env['device']}, vocab {VOCAB}, bf16 logits N(0, {args.logit_std}), "
          f"temperature {TEMPERATURE})\n")
    headers = ["batch", "filters", "sort ms", "sort-free ms", "speedup", "sort graph ms", "sort-free graph ms",
               "graph speedup", "rows differing"]
    print(markdown_table(headers, [
        [r["batch"], r["setup"], r["sort_ms"], r["sort_free_ms"], r["sort_ms"] / r["sort_free_ms"],
         r["sort_graph_ms"], r["sort_free_graph_ms"], r["sort_graph_ms"] / r["sort_free_graph_ms"],
         r["rows_differing"]]
        for r in results
    ]))
    print(f"\nLARGE_VOCAB_FILTERS_MIN_ROWS now {sampler.LARGE_VOCAB_FILTERS_MIN_ROWS}; these timings suggest "
          f"{suggestion if suggestion is not None else 'keeping the sort (it wins at the largest batch)'}")


if __name__ == "__main__":
    main()
