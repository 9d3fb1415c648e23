"""b1_latency: decode ms per token of the Qwen3-0.6B shape (dummy bf16 weights), graph vs eager, against the floor.

One request (128 prompt tokens, random ids < 10000, seed 0; 256 new tokens, greedy, ignore_eos), eager, graph
without async scheduling (graph_sync) and graph; then the graph engine at batch 2, 4, 8, 64 and 256 (each 128 + 256).
The weight-read floor of a decode step is the bytes of the weights it reads / measured device-to-device copy
bandwidth: no step can read them faster. Those are its active parameters (`common.decode_read_bytes`): all weights for
a dense model with tied embeddings; for a mixture of experts (--model qwen3_30b_a3b) the experts its rows route to,
so the floor grows with the batch.

With --tensor-parallel-size N the model is split over N GPUs (engine.tensor_parallel_size), and the floor is that
of one GPU's shard: the bytes of rank 0's weights.

Usage: python -m benchmarks.b1_latency [--model qwen3_0_6b] [--repeats 3] [--batches 2 4 8 64 256] [--tiny]
                                       [--unfused | --unfused-silu] [--no-pdl] [--kv-cache-dtype fp8]
                                       [--quantization fp8] [--tensor-parallel-size N]
                                       [--modes eager graph_sync graph] [--out DIR]
(--unfused turns off the norm and SiLU fusions into the GEMV and --unfused-silu only the SiLU one,
batchgen/layers/fused.py; --no-pdl turns off the programmatic dependent launches, batchgen/layers/pdl.py.
--quantization fp8 quantizes the linear and expert layers to fp8 at load, model.quantization=fp8: the floor is then
that of the fp8 weight bytes.)
"""

from __future__ import annotations

import argparse
from typing import Any

from batchgen.config import ModelConfig
from batchgen.engine.llm_engine import LLMEngine
from batchgen.layers import fused, pdl
from batchgen.sample.params import SamplingParams
from benchmarks.common import (
    QWEN3,
    Request,
    add_kv_cache_dtype_argument,
    add_model_argument,
    add_out_argument,
    add_quantization_argument,
    add_tensor_parallel_argument,
    benchmark_model_config,
    build_engine,
    copy_bandwidth_gbs,
    cuda_available,
    decode_medians,
    decode_read_bytes,
    environment,
    markdown_table,
    median,
    random_prompt,
    run_engine,
    save_json,
    tensor_parallel_options,
    tensor_parallel_suffix,
    weight_bytes,
)


def make_requests(batch: int, prompt_len: int, new_tokens: int) -> list[Request]:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    return [(random_prompt(prompt_len, seed=i), params) for i in range(batch)]


def measure(engine: LLMEngine, batch: int, prompt_len: int, new_tokens: int, repeats: int) -> dict[str, Any]:
    run_engine(engine, make_requests(batch, prompt_len, min(new_tokens, 16)))  # warm-up: Triton compiles per shape
    runs = [run_engine(engine, make_requests(batch, prompt_len, new_tokens)) for _ in range(repeats)]
    records = [r for _, step_records, _ in runs for r in step_records]
    walls = [wall for _, _, wall in runs]
    result = {"batch": batch, "prompt_tokens": prompt_len, "new_tokens": new_tokens, "repeats": repeats,
              **decode_medians(records), "wall_s_runs": walls,
              "output_tok_s": median([batch * new_tokens / wall for wall in walls]),
              "e2e_ms_per_token": median([wall * 1000 / new_tokens for wall in walls])}
    result["decode_tok_s"] = batch * 1000 / result["decode_step_ms"] if result["decode_step_ms"] else None
    return result


def run_mode(model_config: ModelConfig, mode: str, batches: list[int], args: argparse.Namespace) -> dict[str, Any]:
    engine = build_engine(model_config, enforce_eager=mode == "eager", max_num_seqs=max([1, *batches]),
                          max_model_len=args.max_model_len, async_scheduling=mode != "graph_sync",
                          kv_cache_dtype=args.kv_cache_dtype, **tensor_parallel_options(args))
    try:
        results = []
        for batch in batches:
            results.append({"mode": mode, **measure(engine, batch, args.prompt_len, args.new_tokens, args.repeats)})
            print(f"{mode} batch {batch}: decode step {results[-1]['decode_step_ms']:.3f} ms", flush=True)
        model = engine.runner.model
        return {"results": results, "engine_info": dict(engine.info), "weight_bytes": weight_bytes(model),
                "read_bytes": {batch: decode_read_bytes(model, batch) for batch in batches}}
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--batches", type=int, nargs="*", default=[2, 4, 8, 64, 256],
                        help="graph-mode batch sizes after batch 1")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--copy-mib", type=int, default=1024, help="size of the bandwidth-test copy")
    parser.add_argument("--tiny", action="store_true", help="a two-layer model of --model's family (CPU test)")
    parser.add_argument("--unfused", action="store_true", help="no add+RMSNorm / SiLU-and-mul fusion into the GEMV")
    parser.add_argument("--no-pdl", action="store_true", help="launch every kernel without PDL")
    parser.add_argument("--unfused-silu", action="store_true",
                        help="SiLU-and-mul as a kernel of its own, not in the gate/up projection's GEMV")
    parser.add_argument("--modes", nargs="+", choices=["eager", "graph_sync", "graph"],
                        default=["eager", "graph_sync", "graph"], help="the engines to time (each loads the model)")
    add_model_argument(parser)
    add_kv_cache_dtype_argument(parser)
    add_quantization_argument(parser)
    add_tensor_parallel_argument(parser)
    add_out_argument(parser)
    args = parser.parse_args()
    if args.unfused:
        fused.FUSE_ADD_RMS_NORM = False
    fused.FUSE_SILU_AND_MUL = not (args.unfused or args.unfused_silu)
    pdl.ENABLED = not args.no_pdl

    model_config = benchmark_model_config(args.model, args.tiny, args.quantization)
    bandwidth = copy_bandwidth_gbs(args.copy_mib * 2**20)
    modes = {mode: batches for mode, batches in {"eager": [1], "graph_sync": [1], "graph": [1, *args.batches]}.items()
             if mode in args.modes and (mode == "eager" or cuda_available())}
    if not cuda_available():
        print("no CUDA device: graph modes skipped", flush=True)
    runs = {mode: run_mode(model_config, mode, batches, args) for mode, batches in modes.items()}

    first = next(iter(runs.values()))
    weights = first["weight_bytes"]  # one GPU's shard with tensor parallelism
    kv_cache_dtype = first["engine_info"]["kv_cache_dtype"]
    read_bytes = {batch: read for run in runs.values() for batch, read in run["read_bytes"].items()}
    floors_ms = {batch: read / (bandwidth * 1e9) * 1000 for batch, read in read_bytes.items()}
    floor_ms = floors_ms[1]
    results = [r for run in runs.values() for r in run["results"]]
    for r in results:
        r["read_gib"] = read_bytes[r["batch"]] / 2**30
        r["weight_floor_ms"] = floors_ms[r["batch"]]
        r["floor_fraction"] = r["weight_floor_ms"] / r["decode_forward_ms"] if r["decode_forward_ms"] else None
    variants = {f"_{args.model}": args.model != QWEN3, "_tiny": args.tiny, "_unfused": args.unfused,
                "_no_pdl": args.no_pdl, "_unfused_silu": args.unfused_silu, "_fp8": args.kv_cache_dtype == "fp8",
                "_fp8_weights": args.quantization == "fp8"}
    suffix = "".join(name for name, on in variants.items() if on) + tensor_parallel_suffix(args)
    save_json(args.out, "b1_latency" + suffix, {
        "environment": environment(), "tensor_parallel_size": args.tensor_parallel_size,
        "custom_all_reduce": not args.no_custom_all_reduce,
        "gemv_fusions": not args.unfused, "pdl": not args.no_pdl,
        "silu_fused": fused.FUSE_SILU_AND_MUL,
        "model": model_config.hf_config,
        "dtype": model_config.dtype,
        "quantization": args.quantization,
        "kv_cache_dtype": kv_cache_dtype,
        "weight_bytes": weights, "read_bytes_batch_1": read_bytes[1], "copy_bandwidth_gbs": bandwidth,
        "copy_bytes": args.copy_mib * 2**20, "weight_floor_ms": floor_ms, "results": results,
        "engine_info": {mode: run["engine_info"] for mode, run in runs.items()},
        "notes": "decode_step_ms: median engine step (host + device) over decode steps = ms per token at batch 1; "
                 "decode_forward_ms: CUDA-event time of the forward (graph replay or eager); floor_fraction = "
                 "weight_floor_ms / decode_forward_ms, weight_floor_ms = the bytes of the active weights a step "
                 "of that batch reads (read_gib; mixtures of experts: the experts expected under uniform routing) "
                 "/ copy bandwidth; copy bandwidth counts bytes read + written",
    })
    headers = ["mode", "batch", "decode_step_ms", "decode_forward_ms", "e2e_ms_per_token", "decode_tok_s", "read_gib",
               "weight_floor_ms", "floor_fraction"]
    print(f"\n## b1_latency ({args.model}{' tiny' if args.tiny else ''}"
          f"{'; fp8 weights' if args.quantization else ''}; {environment()['device']}; "
          f"tensor parallel {args.tensor_parallel_size}; weights "
          f"{weights / 2**30:.3f} GiB, {read_bytes[1] / 2**30:.3f} GiB active at batch 1, copy {bandwidth:.0f} GB/s, "
          f"weight-read floor {floor_ms:.3f} ms at batch 1; KV cache {kv_cache_dtype}; {args.prompt_len} prompt + "
          f"{args.new_tokens} new tokens, median of {args.repeats})\n")
    print(markdown_table(headers, [[r[h] for h in headers] for r in results]))


if __name__ == "__main__":
    main()
