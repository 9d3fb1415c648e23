"""The NanoGPT CUDA-graph post's seed table on the shipped Shakespeare model: eager vs graph engine, and HF generate.

Usage: python -m benchmarks.seed_table [--model-path DIR] [--repeats 5] [--no-batch32] [--out DIR]

Each workload runs once untimed, then --repeats times; tok/s is the median over repeats, the step times are medians
over every decode step of those repeats. On CPU only the eager mode exists; graph mode is skipped.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from typing import Any

from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from batchgen.config import ModelConfig
from batchgen.engine.llm_engine import LLMEngine
from batchgen.sample.params import SamplingParams
from benchmarks.common import (
    REPO,
    Request,
    add_out_argument,
    build_engine,
    cuda_available,
    decode_medians,
    environment,
    hf_generate_ms_per_token,
    load_model_config,
    markdown_table,
    median,
    run_engine,
    save_json,
)

TEXT = REPO / "jobs" / "shakespeare" / "tinyshakespeare.txt"
NAMED = {"smoke_test": (4, 8), "medium_generation": (8, 32), "long_generation": (8, 48), "heavy_prompt": (32, 16),
         "near_context_limit": (4, 56)}
SWEEP = {f"sweep_gen_{n}": (8, n) for n in range(8, 57, 8)}
WORKLOADS = {**NAMED, **SWEEP}  # name -> (prompt tokens, new tokens)


def prompt_windows(tokenizer: PreTrainedTokenizerBase, text: str, prompt_len: int, count: int,
                   seed: int) -> list[list[int]]:
    """`count` prompts of exactly prompt_len tokens, each from a window of the text at a seeded random offset."""
    rng = random.Random(seed)
    chars = 8 * prompt_len + 64  # enough text for prompt_len tokens with any sensible tokenizer
    prompts = []
    for _ in range(count):
        start = rng.randrange(len(text) - chars)
        ids = tokenizer(text[start:start + chars], add_special_tokens=False).input_ids[:prompt_len]
        if len(ids) != prompt_len:
            raise ValueError(f"a {chars}-character window gave only {len(ids)} tokens")
        prompts.append(ids)
    return prompts


def greedy(new_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)


def measure(engine: LLMEngine, requests: list[Request], repeats: int) -> dict[str, Any]:
    run_engine(engine, requests)  # warm-up: Triton compiles and caches per shape outside the timed runs
    runs = [run_engine(engine, requests) for _ in range(repeats)]
    tok_s = [sum(o.num_output_tokens for o in outputs) / wall for outputs, _, wall in runs]
    records = [r for _, step_records, _ in runs for r in step_records]
    return {
        "output_tok_s": median(tok_s),
        "output_tok_s_runs": tok_s,
        "wall_ms_runs": [wall * 1000 for _, _, wall in runs],
        **decode_medians(records),
        "prefill_step_ms": median([r.step_ms for r in records if r.kind == "prefill"]),
        "token_ids": [o.token_ids for o in runs[0][0]],
    }


def warm_up(engine: LLMEngine, prompts: list[list[int]], seconds: float = 3.0) -> None:
    """Generate for a few seconds first: the host and GPU clocks ramp up under load, and this model is small enough
    that the first second of a run measured up to twice the step time of the rest."""
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        run_engine(engine, [(ids, greedy(56)) for ids in prompts])


def run_mode(model_config: ModelConfig, mode: str, prompts: dict[tuple[int, int], list[list[int]]],
             batches: list[int], repeats: int) -> tuple[dict[str, Any], dict[str, Any]]:
    max_len = max(p + n for p, n in WORKLOADS.values())
    block_size = 16
    engine = build_engine(model_config, enforce_eager=mode == "eager", max_num_seqs=max(batches),
                          block_size=block_size, num_gpu_blocks_override=max(batches) * -(-max_len // block_size) + 8)
    results = {}
    try:
        warm_up(engine, prompts[(8, max(batches))])
        for batch in batches:
            for name, (prompt_len, new_tokens) in WORKLOADS.items():
                requests = [(ids, greedy(new_tokens)) for ids in prompts[(prompt_len, batch)]]
                results[f"{name}/b{batch}"] = measure(engine, requests, repeats)
                print(f"{mode} b{batch} {name}: {results[f'{name}/b{batch}']['output_tok_s']:.1f} tok/s", flush=True)
        info = dict(engine.info)
    finally:
        engine.close()
    return results, info


def hf_peer(model_path: str, prompts: dict[tuple[int, int], list[list[int]]], repeats: int) -> dict[str, Any]:
    device = "cuda" if cuda_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_path).to(device).eval()
    results = {name: hf_generate_ms_per_token(model, prompts[(p, 1)][0], n, repeats)
               for name, (p, n) in WORKLOADS.items()}
    del model
    return results


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", help="checkpoint directory (default: conf/model/shakespeare.yaml's path)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch32", action=argparse.BooleanOptionalAction, default=True,
                        help="also run every workload with 32 concurrent requests")
    parser.add_argument("--hf-repeats", type=int, default=5, help="0 skips the HF generate peer")
    add_out_argument(parser)
    args = parser.parse_args()

    model_config = load_model_config("shakespeare")
    if args.model_path:
        model_config.path = args.model_path
    if not Path(model_config.path).is_dir():
        raise SystemExit(f"no Shakespeare model at {model_config.path}: train it (jobs/shakespeare/train.py) "
                         "or pass --model-path")
    batches = [1, 32] if args.batch32 else [1]
    tokenizer = AutoTokenizer.from_pretrained(model_config.tokenizer or model_config.path)
    text = TEXT.read_text(encoding="utf-8")
    prompts = {(p, b): prompt_windows(tokenizer, text, p, b, seed=p * 1000 + b)
               for p in sorted({p for p, _ in WORKLOADS.values()}) for b in batches}
    modes = ["eager", "graph"] if cuda_available() else ["eager"]
    if not cuda_available():
        print("no CUDA device: graph mode skipped", flush=True)

    results: dict[str, dict[str, Any]] = {}
    engine_info = {}
    for mode in modes:
        results[mode], engine_info[mode] = run_mode(model_config, mode, prompts, batches, args.repeats)
    hf = hf_peer(model_config.path, prompts, args.hf_repeats) if args.hf_repeats > 0 else {}

    graph = results.get("graph", {})
    rows, summary = [], []
    for key, eager in results["eager"].items():
        name, batch = key.split("/b")
        prompt_len, new_tokens = WORKLOADS[name]
        g = graph.get(key, {})
        peer = hf.get(name, {}).get("ms_per_token") if batch == "1" else None
        row = {
            "workload": name, "batch": int(batch), "prompt_tokens": prompt_len, "new_tokens": new_tokens,
            "eager_tok_s": eager["output_tok_s"], "graph_tok_s": g.get("output_tok_s"),
            "e2e_speedup": ratio(g.get("output_tok_s"), eager["output_tok_s"]),
            "eager_step_ms": eager["decode_step_ms"], "graph_step_ms": g.get("decode_step_ms"),
            "step_speedup": ratio(eager["decode_step_ms"], g.get("decode_step_ms")),
            "eager_forward_ms": eager["decode_forward_ms"], "graph_forward_ms": g.get("decode_forward_ms"),
            "tokens_match": g["token_ids"] == eager["token_ids"] if g else None,
            "hf_generate_ms_per_token": peer,
        }
        summary.append(row)
        rows.append(list(row.values()))
    save_json(args.out, "seed_table", {
        "environment": environment(), "model_path": model_config.path, "repeats": args.repeats,
        "batches": batches, "modes": modes, "engine_info": engine_info, "workloads": WORKLOADS,
        "summary": summary, "engine": results, "hf_generate": hf,
        "notes": "greedy, ignore_eos; tok/s = output tokens / wall of one run (median of repeats); step/forward ms "
                 "= median over all decode steps; hf ms/token = generate wall / new tokens at batch 1",
    })
    print(f"\n## seed_table ({environment()['device']}; {args.repeats} repeats; median decode step ms)\n")
    print(markdown_table(list(summary[0]), rows))


if __name__ == "__main__":
    main()
