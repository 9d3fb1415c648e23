"""nano-vllm's bench.py on our engine: 256 random requests on the Qwen3-0.6B shape (dummy bf16), output tok/s.

Requests exactly as nano-vllm draws them (random.seed(0); prompt ids randint(0, 10000), prompt lengths and max_tokens
randint(100, 1024); temperature 0.6, ignore_eos), max_model_len 4096. --num-seqs N takes the first N of those 256,
so a run with N = 64 matches the transformers peer in peers.py. Warm-up: the first 16 requests cut to 8 new tokens.

Beside the throughput: the decode steps' weight-read floor, the sum over decode steps of the bytes of the active
weights each reads (`common.decode_read_bytes`: a mixture of experts, --model qwen3_30b_a3b, reads only the experts its
rows route to) / measured copy bandwidth, against their measured forward time; and their KV-read floor, the K and V
bytes of every position each decode step attends over / the same bandwidth. At this workload's contexts the KV reads
are about as large as the weight reads, and fp8 weights shrink only the weight reads (an fp8 KV cache, the KV reads):
the two floors bound what each can buy. --quantization fp8 quantizes the linear and expert layers to fp8 at load
(model.quantization=fp8).

With --tensor-parallel-size N the model is split over N GPUs (engine.tensor_parallel_size); the floor is one GPU's
shard's.

Usage: python -m benchmarks.nanovllm_bench [--model qwen3_0_6b] [--num-seqs 256] [--mixed] [--greedy] [--sync]
                                           [--kv-cache-dtype fp8] [--quantization fp8] [--tensor-parallel-size N]
                                           [--tiny] [--out DIR]
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from batchgen.engine.llm_engine import StepRecord
from batchgen.engine.outputs import RequestOutput
from benchmarks.common import (
    NANOVLLM_NUM_SEQS,
    QWEN3,
    add_kv_cache_dtype_argument,
    add_model_argument,
    add_out_argument,
    add_quantization_argument,
    add_tensor_parallel_argument,
    benchmark_model_config,
    breakdown_table,
    build_engine,
    copy_bandwidth_gbs,
    cuda_available,
    decode_read_bytes,
    environment,
    nanovllm_requests,
    records_as_dicts,
    run_engine,
    save_json,
    step_breakdown,
    step_counts,
    tensor_parallel_options,
    tensor_parallel_suffix,
)


def result_name(args: argparse.Namespace) -> str:
    parts = ["nanovllm_bench"]
    if args.model != QWEN3:
        parts.append(args.model)
    if args.num_seqs != NANOVLLM_NUM_SEQS:
        parts.append(f"n{args.num_seqs}")
    parts += [flag for flag in ("mixed", "greedy", "eager", "sync", "tiny") if getattr(args, flag)]
    if args.kv_cache_dtype != "auto":
        parts.append(args.kv_cache_dtype)
    if args.quantization == "fp8":
        parts.append("fp8_weights")
    return "_".join(parts) + tensor_parallel_suffix(args)


def decode_kv_positions(outputs: list[RequestOutput]) -> int:
    """The KV positions the requests' decode steps attend over, without preemption: a request of p prompt tokens and m
    output tokens takes its first token from its prefill, then m - 1 decode steps, the j-th over p + j positions."""
    return sum((m - 1) * p + (m - 1) * m // 2
               for p, m in ((len(o.prompt_token_ids), o.num_output_tokens) for o in outputs) if m > 1)


def decode_floor(records: list[StepRecord], read_bytes: dict[int, float], kv_read_bytes: float,
                 bandwidth_gbs: float) -> dict[str, float]:
    """The decode steps' measured forward seconds, their weight-read floor (read_bytes: by the step's rows) and
    their KV-read floor (kv_read_bytes: all decode steps' K and V reads)."""
    decode = [r for r in records if r.kind == "decode"]
    forward_s = sum(r.forward_ms for r in decode) / 1000
    floor_s = sum(read_bytes[r.num_seqs] for r in decode) / (bandwidth_gbs * 1e9)
    kv_floor_s = kv_read_bytes / (bandwidth_gbs * 1e9)
    return {"decode_forward_s": forward_s, "decode_weight_floor_s": floor_s,
            "decode_floor_fraction": floor_s / forward_s if forward_s else 0.0, "decode_kv_floor_s": kv_floor_s,
            "decode_weight_and_kv_fraction": (floor_s + kv_floor_s) / forward_s if forward_s else 0.0}


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
    parser.add_argument("--tiny", action="store_true", help="a two-layer model of --model's family (CPU test)")
    parser.add_argument("--copy-mib", type=int, default=1024, help="size of the bandwidth-test copy")
    add_model_argument(parser)
    add_kv_cache_dtype_argument(parser)
    add_quantization_argument(parser)
    add_tensor_parallel_argument(parser)
    add_out_argument(parser)
    args = parser.parse_args()

    requests = nanovllm_requests(args.num_seqs)
    if args.greedy:
        requests = [(ids, replace(params, temperature=0.0)) for ids, params in requests]
    bandwidth = copy_bandwidth_gbs(args.copy_mib * 2**20)
    model_config = benchmark_model_config(args.model, args.tiny, args.quantization)
    engine = build_engine(model_config, enforce_eager=args.eager or not cuda_available(),
                          max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          max_model_len=args.max_model_len, mixed_prefill_decode=args.mixed,
                          async_scheduling=not args.sync, kv_cache_dtype=args.kv_cache_dtype,
                          **tensor_parallel_options(args))
    try:
        run_engine(engine, [(ids, replace(params, max_tokens=8)) for ids, params in requests[:16]])
        outputs, records, wall = run_engine(engine, requests)
        info = dict(engine.info)
        model = engine.runner.model
        read_bytes = {rows: decode_read_bytes(model, rows) for rows in {r.num_seqs for r in records}}
        kv_bytes_per_position = info["kv_cache_bytes"] / info["kv_capacity_tokens"]  # one rank's, as the weights
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
        "copy_bandwidth_gbs": bandwidth,
        **decode_floor(records, read_bytes, decode_kv_positions(outputs) * kv_bytes_per_position, bandwidth),
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
          f"KV cache {summary['kv_cache_dtype']} ({summary['kv_blocks']} blocks); decode forward "
          f"{summary['decode_forward_s']:.2f} s against a weight-read floor of "
          f"{summary['decode_weight_floor_s']:.2f} s (active weights / copy {bandwidth:.0f} GB/s: "
          f"{summary['decode_floor_fraction']:.0%} of it) and a KV-read floor of {summary['decode_kv_floor_s']:.2f} s "
          f"(both: {summary['decode_weight_and_kv_fraction']:.0%})\n")
    print(breakdown_table(breakdown))


if __name__ == "__main__":
    main()
