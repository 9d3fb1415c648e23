"""nano-vllm's bench.py on our engine: 256 random requests on the Qwen3-0.6B shape (dummy bf16), output tok/s.

Requests exactly as nano-vllm draws them (random.seed(0); prompt ids randint(0, 10000), prompt lengths and max_tokens
randint(100, 1024); temperature 0.6, ignore_eos), max_model_len 4096. --num-seqs N takes the first N of those 256,
so a run with N = 64 matches the transformers peer in peers.py. Warm-up: the first 16 requests cut to 8 new tokens.

Usage: python -m benchmarks.nanovllm_bench [--num-seqs 256] [--mixed] [--greedy] [--sync] [--kv-cache-dtype fp8]
                                           [--tiny] [--out DIR]
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from benchmarks.common import (
    NANOVLLM_NUM_SEQS,
    add_kv_cache_dtype_argument,
    add_out_argument,
    breakdown_table,
    build_engine,
    cuda_available,
    environment,
    nanovllm_requests,
    qwen3_model_config,
    records_as_dicts,
    run_engine,
    save_json,
    step_breakdown,
    step_counts,
)


def result_name(args: argparse.Namespace) -> str:
    parts = ["nanovllm_bench"]
    if args.num_seqs != NANOVLLM_NUM_SEQS:
        parts.append(f"n{args.num_seqs}")
    parts += [flag for flag in ("mixed", "greedy", "eager", "sync", "tiny") if getattr(args, flag)]
    if args.kv_cache_dtype != "auto":
        parts.append(args.kv_cache_dtype)
    return "_".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=NANOVLLM_NUM_SEQS)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--mixed", action="store_true", help="mixed prefill/decode steps (vLLM v1 style)")
    parser.add_argument("--greedy", action="store_true", help="temperature 0 instead of 0.6")
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--sync", action="store_true", help="no async scheduling: each step waits for the last")
    parser.add_argument("--tiny", action="store_true", help="a two-layer Qwen3 instead of the 0.6B shape (CPU test)")
    add_kv_cache_dtype_argument(parser)
    add_out_argument(parser)
    args = parser.parse_args()

    requests = nanovllm_requests(args.num_seqs)
    if args.greedy:
        requests = [(ids, replace(params, temperature=0.0)) for ids, params in requests]
    engine = build_engine(qwen3_model_config(args.tiny), enforce_eager=args.eager or not cuda_available(),
                          max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          max_model_len=args.max_model_len, mixed_prefill_decode=args.mixed,
                          async_scheduling=not args.sync, kv_cache_dtype=args.kv_cache_dtype)
    try:
        run_engine(engine, [(ids, replace(params, max_tokens=8)) for ids, params in requests[:16]])
        outputs, records, wall = run_engine(engine, requests)
        info = dict(engine.info)
    finally:
        engine.close()

    output_tokens = sum(o.num_output_tokens for o in outputs)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    breakdown = step_breakdown(records)
    summary = {
        "num_seqs": len(requests), "output_tokens": output_tokens, "prompt_tokens": prompt_tokens,
        "wall_seconds": wall, "output_tok_s": output_tokens / wall, "prompt_tok_s": prompt_tokens / wall,
        "steps": len(records), "steps_by_kind": step_counts(records),
        "preemptions": sum(r.num_preempted for r in records),
        "requests_preempted": sum(o.num_preemptions > 0 for o in outputs),
        "cuda_graph_steps": sum(r.cuda_graph for r in records),
        "kv_cache_dtype": info["kv_cache_dtype"], "kv_blocks": info["kv_blocks"],
    }
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    name = result_name(args)
    save_json(args.out, name, {"environment": environment(), "settings": settings, "engine_info": info,
                               "summary": summary, "step_breakdown": breakdown,
                               "step_records": records_as_dicts(records)})
    print(f"\n## {name} ({environment()['device']}; {settings})\n")
    print(f"output tokens {output_tokens}, prompt tokens {prompt_tokens}, wall {wall:.2f} s, "
          f"output {summary['output_tok_s']:.1f} tok/s, prompt {summary['prompt_tok_s']:.1f} tok/s, "
          f"steps {summary['steps_by_kind']}, preemptions {summary['preemptions']}, "
          f"KV cache {summary['kv_cache_dtype']} ({summary['kv_blocks']} blocks)\n")
    print(breakdown_table(breakdown))


if __name__ == "__main__":
    main()
