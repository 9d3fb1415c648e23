"""profile_prefill: which kernels full eager prefill steps spend their GPU time in (the classify and scoring jobs'
steps).

Runs `--rows` prompts of `--prompt-tokens` random ids, max_tokens 1 (0 with --prompt-logprobs, which scores every
prompt token as the scoring job does), once to compile and warm up, then again under torch.profiler; lists the
kernels by GPU time per prefill step (microseconds), with launches per step and each kernel's share.

Usage: python -m benchmarks.profile_prefill [--model qwen3_0_6b] [--rows 64] [--prompt-tokens 1000]
                                           [--max-num-batched-tokens 16384] [--prompt-logprobs] [--top 25] [--out DIR]
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from batchgen.sample.params import SamplingParams
from benchmarks.common import (
    QWEN3,
    add_model_argument,
    add_out_argument,
    benchmark_model_config,
    build_engine,
    environment,
    markdown_table,
    random_prompt,
    run_engine,
    save_json,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--prompt-logprobs", action="store_true", help="score every prompt token (max_tokens 0)")
    parser.add_argument("--top", type=int, default=25, help="kernels listed")
    add_model_argument(parser)
    add_out_argument(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.exit(0, "profile_prefill needs CUDA\n")

    engine = build_engine(benchmark_model_config(args.model), max_model_len=max(2 * args.prompt_tokens, 4096),
                          max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False)
    params = (SamplingParams(max_tokens=0, prompt_logprobs=1) if args.prompt_logprobs
              else SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    requests = [(random_prompt(args.prompt_tokens, seed=i), params) for i in range(args.rows)]
    try:
        run_engine(engine, requests)  # compiles, warms up
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            _, records, wall = run_engine(engine, requests)
    finally:
        engine.close()
    steps = [r for r in records if r.kind == "prefill"]
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.device_time_total / len(steps)
            counts[event.name] += 1
    kernel_us = sum(totals.values())
    kernels = sorted(({"kernel": name, "us_per_step": us, "share": us / kernel_us,
                      "launches_per_step": counts[name] / len(steps)} for name, us in totals.items()),
                     key=lambda k: -k["us_per_step"])
    tokens = args.rows * args.prompt_tokens
    result = {"environment": environment(), "model": args.model, "rows": args.rows,
              "prompt_tokens": args.prompt_tokens, "max_num_batched_tokens": args.max_num_batched_tokens,
              "prompt_logprobs": args.prompt_logprobs, "prefill_steps": len(steps), "wall_s": wall,
              "prompt_tok_s": tokens / wall, "forward_ms": [r.forward_ms for r in steps],
              "kernel_us_per_step": kernel_us, "kernels": kernels}
    suffix = f"_{args.model}" * (args.model != QWEN3) + f"_{args.prompt_tokens}" + "_logprobs" * args.prompt_logprobs
    save_json(args.out, "profile_prefill" + suffix, result)
    print(f"\n## profile_prefill: {args.rows} x {args.prompt_tokens} tokens{' scored' * args.prompt_logprobs}, "
          f"{len(steps)} prefill steps, {tokens / wall:,.0f} prompt tok/s under the profiler; "
          f"{kernel_us:.0f} us of kernels per step\n")
    rows = [[k["kernel"][:90], k["us_per_step"], f"{k['share']:.1%}", k["launches_per_step"]]
            for k in kernels[:args.top]]
    print(markdown_table(["kernel", "us_per_step", "share", "launches_per_step"], rows))


if __name__ == "__main__":
    main()
