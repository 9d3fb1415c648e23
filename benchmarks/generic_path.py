"""generic_path: what the generic path (model.impl=transformers) costs against batchgen's native modules.

The Qwen3-0.6B shape with dummy bf16 weights, three ways: native with CUDA graphs (the default), native eager, and
on transformers' modules with batchgen's paged KV cache and attention (always eager: that path captures no graphs).
b1: one request, 128 prompt tokens, 256 new, greedy: median decode step ms (= ms per token). Throughput: the first
--num-seqs nanovllm_bench requests (64 by default): output tok/s of the whole run, prefill included.

Usage: python -m benchmarks.generic_path [--num-seqs 64] [--repeats 3] [--tiny] [--out DIR]
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from batchgen.config import ModelConfig
from batchgen.sample.params import SamplingParams
from benchmarks.common import (
    add_out_argument,
    build_engine,
    cuda_available,
    decode_medians,
    environment,
    markdown_table,
    median,
    nanovllm_requests,
    qwen3_model_config,
    random_prompt,
    run_engine,
    save_json,
)

MODES = {  # name: (model.impl, enforce_eager)
    "native_graph": ("native", False),
    "native_eager": ("native", True),
    "transformers": ("transformers", False),  # eager whatever enforce_eager says
}


def measure(model_config: ModelConfig, enforce_eager: bool, args: argparse.Namespace) -> dict[str, Any]:
    engine = build_engine(model_config, enforce_eager=enforce_eager, max_num_seqs=args.num_seqs,
                          max_num_batched_tokens=16384, max_model_len=4096)
    try:
        b1 = [(random_prompt(128), SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True))]
        run_engine(engine, [(ids, replace(params, max_tokens=16)) for ids, params in b1])  # warm-up
        b1_runs = [run_engine(engine, b1) for _ in range(args.repeats)]
        requests = nanovllm_requests(args.num_seqs)
        run_engine(engine, [(ids, replace(params, max_tokens=8)) for ids, params in requests[:16]])  # warm-up
        outputs, records, wall = run_engine(engine, requests)
        return {
            "model_impl": engine.info["model_impl"],
            "cuda_graph_steps": sum(r.cuda_graph for r in records),
            "b1": decode_medians([r for _, step_records, _ in b1_runs for r in step_records]),
            "b1_wall_s": median([run_wall for _, _, run_wall in b1_runs]),
            "throughput_output_tokens": sum(o.num_output_tokens for o in outputs),
            "throughput_wall_s": wall,
            "throughput_output_tok_s": sum(o.num_output_tokens for o in outputs) / wall,
            "throughput_decode": decode_medians(records),
        }
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="a two-layer Qwen3 instead of the 0.6B shape (CPU test)")
    add_out_argument(parser)
    args = parser.parse_args()
    modes = {name: mode for name, mode in MODES.items() if cuda_available() or name != "native_graph"}
    results = {}
    for name, (impl, enforce_eager) in modes.items():
        model_config = replace(qwen3_model_config(args.tiny), impl=impl)
        results[name] = measure(model_config, enforce_eager, args)
        print(f"{name}: b1 decode step {results[name]['b1']['decode_step_ms']:.3f} ms, "
              f"{results[name]['throughput_output_tok_s']:.0f} output tok/s", flush=True)
    save_json(args.out, "generic_path" + ("_tiny" if args.tiny else ""),
              {"environment": environment(), "num_seqs": args.num_seqs, "repeats": args.repeats, "results": results})
    rows = [[name, r["model_impl"], r["cuda_graph_steps"] > 0, r["b1"]["decode_step_ms"], r["b1"]["decode_forward_ms"],
             r["throughput_output_tok_s"], r["throughput_decode"]["decode_step_ms"]] for name, r in results.items()]
    shape = "two-layer Qwen3" if args.tiny else "Qwen3-0.6B shape"
    print(f"\n## generic_path ({environment()['device']}; {shape}, bf16 dummy weights; b1: 128 prompt + 256 "
          f"new tokens, median of {args.repeats}; throughput: {args.num_seqs} nanovllm_bench requests)\n")
    print(markdown_table(["mode", "model_impl", "cuda_graph", "b1_decode_step_ms", "b1_decode_forward_ms",
                          "output_tok_s", "decode_step_ms"], rows))


if __name__ == "__main__":
    main()
