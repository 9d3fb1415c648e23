"""Prefix caching: 1,024 requests sharing a 1,000-token prefix, 50-token suffixes, 64 new tokens, Qwen3-0.6B shape
(dummy bf16), with engine.enable_prefix_caching on and off: prefill tokens computed and wall time.

Greedy, ignore_eos. Each engine first runs warm-up requests (8 new tokens: 16 unrelated, then 16 sharing another
prefix), so that neither run pays for compilation or graph warm-up in its timing and the shared prefix is not cached
before the timed run. Each setting then runs `--repeats` workloads (3), each with its own prefix; the wall time is
their median.

Usage: python -m benchmarks.prefix_cache [--num-requests 1024] [--repeats 3] [--small] [--out DIR]
"""

from __future__ import annotations

import argparse
import random

from batchgen.sample.params import SamplingParams
from benchmarks.common import (
    Request,
    add_out_argument,
    build_engine,
    cuda_available,
    environment,
    markdown_table,
    median,
    qwen3_model_config,
    random_prompt,
    run_engine,
    save_json,
    step_counts,
)


def shared_prefix_requests(num_requests: int, prefix_len: int, suffix_len: int, max_tokens: int,
                           seed: int = 0) -> list[Request]:
    prefix = random_prompt(prefix_len, seed=seed)
    rng = random.Random(seed + 1)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [(prefix + [rng.randrange(10000) for _ in range(suffix_len)], params) for _ in range(num_requests)]


def warmup_requests() -> list[list[Request]]:
    """Unrelated prompts, then (once its first row is cached) 16 rows sharing another 320-token prefix, so that
    cascade attention's kernels compile here too."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    unrelated = [(random_prompt(100, seed=1000 + i), params) for i in range(16)]
    prefix = random_prompt(320, seed=999)
    sharing = [(prefix + random_prompt(20, seed=2000 + i), params) for i in range(16)]
    return [unrelated, sharing[:1], sharing]


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def step_time(records: list) -> list[dict]:
    """Per kind of step (and whether it cascaded): how many, their summed and median step ms, median forward ms."""
    groups: dict[tuple[str, bool], list] = {}
    for record in records:
        groups.setdefault((record.kind, record.cascade_attention), []).append(record)
    return [{"kind": kind, "cascade_attention": cascade, "steps": len(group),
             "total_step_ms": sum(r.step_ms for r in group), "median_step_ms": median([r.step_ms for r in group]),
             "median_forward_ms": median([r.forward_ms for r in group])}
            for (kind, cascade), group in sorted(groups.items())]


def run(args: argparse.Namespace, workloads: list[list[Request]], enable_prefix_caching: bool) -> dict:
    """Each workload (its own prefix, so none finds another's cached) on one warmed-up engine; wall seconds are their
    median, the counts those of the first."""
    engine = build_engine(qwen3_model_config(args.small), enforce_eager=not cuda_available(),
                          max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          max_model_len=args.max_model_len, enable_prefix_caching=enable_prefix_caching)
    try:
        for warmup in warmup_requests():
            run_engine(engine, warmup)
        runs = [run_engine(engine, requests) for requests in workloads]
    finally:
        engine.close()
    outputs, records, _ = runs[0]
    walls = [wall for _, _, wall in runs]
    wall = median(walls)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(o.num_output_tokens for o in outputs)
    return {
        "enable_prefix_caching": enable_prefix_caching,
        "prompt_tokens": prompt_tokens,
        "prefill_tokens_computed": sum(r.num_prefill_tokens for r in records),
        "cached_tokens": sum(o.num_cached_tokens for o in outputs),
        "hit_rate": sum(o.num_cached_tokens for o in outputs) / prompt_tokens,
        "output_tokens": output_tokens,
        "wall_seconds": wall,
        "wall_seconds_per_repeat": walls,
        "output_tok_s": output_tokens / wall,
        "steps_by_kind": step_counts(records),
        "step_time": step_time(records),
        "cascade_decode_steps": sum(r.cascade_attention for r in records),
        "preemptions": sum(r.num_preempted for r in records),
        "token_ids": [[o.token_ids for o in run_outputs] for run_outputs, _, _ in runs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=1024)
    parser.add_argument("--prefix-len", type=int, default=1000)
    parser.add_argument("--suffix-len", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per setting, each with its own prefix")
    parser.add_argument("--small", action="store_true",
                        help="a CPU smoke check: a two-layer Qwen3, 64 requests, 200-token prefix, 8 new tokens")
    add_out_argument(parser)
    args = parser.parse_args()
    if args.small:
        args.num_requests, args.prefix_len, args.suffix_len, args.max_tokens, args.repeats = 64, 200, 20, 8, 1
        args.max_num_seqs, args.max_num_batched_tokens = 32, 1024

    workloads = [shared_prefix_requests(args.num_requests, args.prefix_len, args.suffix_len, args.max_tokens, seed)
                 for seed in range(0, 2 * args.repeats, 2)]
    off = run(args, workloads, enable_prefix_caching=False)
    on = run(args, workloads, enable_prefix_caching=True)
    pairs = [(a, b) for on_run, off_run in zip(on.pop("token_ids"), off.pop("token_ids"), strict=True)
             for a, b in zip(on_run, off_run, strict=True)]
    diverged_at = [first_difference(a, b) for a, b in pairs if a != b]
    same_tokens = len(pairs) - len(diverged_at)
    comparison = {
        "prefill_tokens_drop": 1 - on["prefill_tokens_computed"] / off["prefill_tokens_computed"],
        "speedup": off["wall_seconds"] / on["wall_seconds"],
        "requests_with_identical_tokens": same_tokens,
        # Where differing requests part: at token 0 the prefill's logits differ, later a decode step's.
        "differing_at_first_token": sum(position == 0 for position in diverged_at),
        "median_first_differing_token": median(diverged_at) if diverged_at else None,
    }
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    name = "prefix_cache_small" if args.small else "prefix_cache"
    save_json(args.out, name, {"environment": environment(), "settings": settings, "caching_off": off,
                               "caching_on": on, "comparison": comparison})
    print(f"\n## {name} ({environment()['device']}; {settings})\n")
    print(f"prefill tokens computed drop {comparison['prefill_tokens_drop']:.1%}, "
          f"speedup {comparison['speedup']:.2f}x (median of {args.repeats}), greedy tokens identical for "
          f"{same_tokens} of {args.repeats * args.num_requests} requests (bf16 logits may differ with the batch "
          f"shape; of the others, {comparison['differing_at_first_token']} differ from the first token, the median "
          f"first differing token is {comparison['median_first_differing_token']})\n")
    headers = ["enable_prefix_caching", "prompt_tokens", "prefill_tokens_computed", "cached_tokens", "hit_rate",
               "output_tokens", "wall_seconds", "output_tok_s", "preemptions"]
    print(markdown_table(headers, [[run_result[h] for h in headers] for run_result in (off, on)]))
    time_headers = ["kind", "cascade_attention", "steps", "total_step_ms", "median_step_ms", "median_forward_ms"]
    for run_result in (off, on):
        print(f"\nenable_prefix_caching={run_result['enable_prefix_caching']}: steps by kind\n")
        print(markdown_table(time_headers, [[row[h] for h in time_headers] for row in run_result["step_time"]]))


if __name__ == "__main__":
    main()
