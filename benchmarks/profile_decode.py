"""profile_decode: which kernels one replayed decode step of a model shape spends its GPU time in.

For each batch size: run a short generation so the bucket's graph holds a real decode step, replay that graph
under torch.profiler, and list the kernels by GPU time per step (microseconds), with launches per step.

Usage: python -m benchmarks.profile_decode [--model qwen3_0_6b] [--quantization fp8] [--batches 1 64]
                                          [--context 512] [--replays 20] [--top 20] [--kv-cache-dtype fp8] [--out DIR]
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from batchgen.engine.llm_engine import LLMEngine
from batchgen.sample.params import SamplingParams
from batchgen.worker.cuda_graph import GraphKey
from benchmarks.common import (
    QWEN3,
    add_kv_cache_dtype_argument,
    add_model_argument,
    add_out_argument,
    add_quantization_argument,
    benchmark_model_config,
    build_engine,
    environment,
    markdown_table,
    random_prompt,
    run_engine,
    save_json,
)


def kernel_times(engine: LLMEngine, batch: int, context: int, replays: int) -> dict[str, Any]:
    """Per-kernel GPU microseconds and launch counts of one replay of the batch's decode graph."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    run_engine(engine, [(random_prompt(context, seed=i), params) for i in range(batch)])
    graphs = engine.runner.graphs
    size = graphs.padded_size(batch)
    # Random prompts share no prefix: no cascade. The variant the last decode step chose (by its contexts).
    early = GraphKey(size, cascade=False, early=True)
    fits = context + params.max_tokens <= graphs.early_read_limit(size)
    graph = graphs.graphs[early if fits and early in graphs.graphs else early._replace(early=False)]
    graph.replay()  # the buffers still hold the last decode step of the run above
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.device_time_total / replays
            counts[event.name] += 1
    kernels = sorted(({"kernel": name, "us_per_step": us, "launches_per_step": counts[name] / replays}
                      for name, us in totals.items()), key=lambda k: -k["us_per_step"])
    return {"batch": batch, "padded_size": size, "context": context, "kernels": kernels,
            "kernel_us_per_step": sum(totals.values()),
            "launches_per_step": sum(counts.values()) / replays}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 64])
    parser.add_argument("--context", type=int, default=512, help="prompt tokens of each request")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--top", type=int, default=20, help="kernels listed per batch size")
    add_model_argument(parser)
    add_quantization_argument(parser)
    add_kv_cache_dtype_argument(parser)
    add_out_argument(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.exit(0, "profile_decode needs CUDA: it profiles CUDA-graph replays\n")

    model_config = benchmark_model_config(args.model, quantization=args.quantization)
    engine = build_engine(model_config, max_model_len=4096, max_num_seqs=max(args.batches),
                          kv_cache_dtype=args.kv_cache_dtype)
    try:
        results = [kernel_times(engine, batch, args.context, args.replays) for batch in args.batches]
    finally:
        engine.close()
    suffix = (f"_{args.model}" * (args.model != QWEN3) + "_fp8_weights" * (args.quantization == "fp8")
              + "_fp8" * (args.kv_cache_dtype == "fp8"))
    save_json(args.out, "profile_decode" + suffix, {"environment": environment(), "model": args.model,
                                                    "quantization": args.quantization,
                                                    "kv_cache_dtype": args.kv_cache_dtype, "results": results})
    for result in results:
        print(f"\n## profile_decode: batch {result['batch']} (graph {result['padded_size']}), context "
              f"{result['context']}: {result['kernel_us_per_step']:.0f} us of kernels, "
              f"{result['launches_per_step']:.0f} launches per step\n")
        rows = [[k["kernel"][:90], k["us_per_step"], k["launches_per_step"]] for k in result["kernels"][:args.top]]
        print(markdown_table(["kernel", "us_per_step", "launches_per_step"], rows))


if __name__ == "__main__":
    main()
