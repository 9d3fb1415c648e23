"""Decode-step cost of sampling on the main Shakespeare job: greedy vs the job's sampling (temperature 0.8, top-k
40), penalized and logprobs rows, graph and eager.

Usage: python -m benchmarks.sampled_decode [--repeats 3] [--limit N] [--out DIR]

Runs the job's prompts (jobs/shakespeare/prompts.jsonl, max_num_seqs 64, 64 new tokens) with each sampling setup;
the decode-step median is over every decode step of the repeats, after one untimed run that also captures each
setup's sampler graphs. Target (issue 11): sampled <= 1.15x greedy in graph mode.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from batchgen.sample.params import SamplingParams
from benchmarks.common import (
    REPO,
    add_out_argument,
    build_engine,
    cuda_available,
    decode_medians,
    environment,
    load_model_config,
    markdown_table,
    median,
    run_engine,
    save_json,
)

PROMPTS = REPO / "jobs" / "shakespeare" / "prompts.jsonl"
JOB = dict(temperature=0.8, top_k=40)
SETUPS: dict[str, dict[str, Any]] = {
    "greedy": dict(temperature=0),
    "sampled (job)": JOB,
    "sampled + penalties": dict(**JOB, repetition_penalty=1.2, frequency_penalty=0.3),
    "sampled + logprobs=5": dict(**JOB, logprobs=5),
}


def run_mode(mode: str, prompts: list[str], repeats: int, cpu_threads: int | None) -> dict[str, dict[str, Any]]:
    engine = build_engine(load_model_config("shakespeare"), enforce_eager=mode == "eager", max_num_seqs=64,
                          max_num_batched_tokens=2048, cpu_threads=cpu_threads)
    token_ids = [engine.detokenizer.encode(p) for p in prompts]
    results = {}
    try:
        for name, options in SETUPS.items():
            requests = [(ids, SamplingParams(max_tokens=64, ignore_eos=True, seed=i, **options))
                        for i, ids in enumerate(token_ids)]
            run_engine(engine, requests)  # warm-up: Triton compiles, sampler graphs captured
            records = []
            for _ in range(repeats):
                records += run_engine(engine, requests)[1]
            decode = [r for r in records if r.kind == "decode"]
            results[name] = {**decode_medians(records), "decode_sample_ms": median([r.sample_ms for r in decode])}
            print(f"{mode} {name}: {results[name]['decode_step_ms']:.3f} ms/decode step", flush=True)
    finally:
        engine.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--limit", type=int, default=None, help="only the first N prompts (a CPU smoke run)")
    parser.add_argument("--cpu-threads", type=int, default=None,
                        help="engine.cpu_threads (default: the engine's, 1 with a GPU; 1 on CPU, as the main job)")
    add_out_argument(parser)
    args = parser.parse_args()
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines()][:args.limit]
    modes = ["graph", "eager"] if cuda_available() else ["eager"]
    threads = args.cpu_threads if args.cpu_threads is not None or cuda_available() else 1
    results = {mode: run_mode(mode, prompts, args.repeats, threads) for mode in modes}
    save_json(args.out, "sampled_decode", {"environment": environment(), "cpu_threads": threads, "results": results})
    rows = []
    for mode, by_setup in results.items():
        greedy = by_setup["greedy"]["decode_step_ms"]
        for name, r in by_setup.items():
            rows.append([mode, name, r["decode_step_ms"], r["decode_forward_ms"], r["decode_sample_ms"],
                         r["decode_step_ms"] / greedy if greedy else None, r["decode_cuda_graph_steps"]])
    print("## Sampled vs greedy decode step, Shakespeare job")
    print(markdown_table(["mode", "sampling", "decode step ms (median)", "forward ms", "sample ms", "x greedy",
                          "graph steps"], rows))


if __name__ == "__main__":
    main()
