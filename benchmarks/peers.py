"""The peer ratio: the named workloads through Hugging Face transformers on the same shapes and settings.

- generate: `generate` at batch 1 on the Qwen3-0.6B shape (bf16, random init, sdpa), 128 prompt tokens (b1_latency's
  prompt), 256 new, greedy; ms per token = wall / new tokens, median of --repeats after a warm-up.
- cb: transformers continuous batching (attn_implementation="paged|sdpa") on the first --num-seqs of nanovllm_bench's
  256 requests (temperature 0.6, per-request max_new_tokens, EOS off), stopped after --time-limit seconds.
- shakespeare: `generate` at batch 1 on the Shakespeare model for the seed table's named workloads.

Usage: python -m benchmarks.peers [--parts generate cb shakespeare] [--num-seqs 64] [--time-limit 150] [--tiny]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from batchgen.models.loader import DTYPES, load_hf_config
from benchmarks.common import (
    Request,
    add_out_argument,
    cuda_available,
    environment,
    hf_generate_ms_per_token,
    load_model_config,
    markdown_table,
    nanovllm_requests,
    qwen3_model_config,
    random_prompt,
    save_json,
    synchronize,
)
from benchmarks.seed_table import NAMED, TEXT, prompt_windows

PARTS = ("generate", "cb", "shakespeare")


def device() -> str:
    return "cuda" if cuda_available() else "cpu"


def qwen3_hf_model(tiny: bool, attn_implementation: str) -> nn.Module:
    model_config = qwen3_model_config(tiny)
    with torch.device(device()):
        model = AutoModelForCausalLM.from_config(load_hf_config(model_config), dtype=DTYPES[model_config.dtype],
                                                 attn_implementation=attn_implementation)
    return model.eval()


def cb_generation_config(requests: list[Request]) -> GenerationConfig:
    # top_k=0 turns off transformers' default top-k 50, so the sampling matches nano-vllm's temperature-only one.
    return GenerationConfig(do_sample=True, temperature=requests[0][1].temperature, top_k=0, top_p=1.0,
                            max_new_tokens=max(p.max_tokens for _, p in requests), eos_token_id=-1, pad_token_id=0)


def workload_hints(requests: list[Request]) -> dict[str, Any]:
    """The hints generate_batch computes, so the manager sizes its cache as generate_batch would."""
    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints
    except ImportError:
        return {}
    return {"workload_hints": WorkloadHints(max_prompt_length=max(len(ids) for ids, _ in requests),
                                            max_generated_length=max(p.max_tokens for _, p in requests),
                                            num_requests=len(requests))}


def cb_manager(model: nn.Module, requests: list[Request], time_limit: float) -> dict[str, Any]:
    """Every request through the manager API, each with its own max_new_tokens; partial results on a timeout."""
    manager = model.init_continuous_batching(generation_config=cb_generation_config(requests),
                                             **workload_hints(requests))
    finished: dict[str, Any] = {}
    start = time.perf_counter()
    if hasattr(manager, "warmup"):
        manager.warmup()
    manager.start()
    try:
        manager.add_request(input_ids=requests[0][0][:16], request_id="warmup", max_new_tokens=4, eos_token_id=-1)
        while (result := manager.get_result(timeout=60)) is not None and not result.is_finished():
            pass
        warmup_seconds = time.perf_counter() - start

        synchronize()
        start = time.perf_counter()
        for i, (ids, params) in enumerate(requests):
            manager.add_request(input_ids=ids, request_id=f"req_{i}", max_new_tokens=params.max_tokens,
                                eos_token_id=-1)
        while len(finished) < len(requests) and time.perf_counter() - start < time_limit:
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("the transformers generation thread stopped before all requests finished")
            elif result.is_finished():
                finished[result.request_id] = result
        synchronize()
        wall = time.perf_counter() - start
    finally:
        timed_out = len(finished) < len(requests)
        manager.stop(block=True, timeout=30, hard_stop=timed_out)
    errors = [r.error for r in finished.values() if r.error]
    return {"api": "manager", "warmup_seconds": warmup_seconds, "wall_seconds": wall, "timed_out": timed_out,
            "finished": len(finished), "errors": len(errors), "first_error": errors[0] if errors else None,
            "output_tokens": sum(len(r.generated_tokens) for r in finished.values()),
            "continuous_batching_config": str(getattr(manager, "continuous_batching_config", None))}


def cb_generate_batch(model: nn.Module, requests: list[Request]) -> dict[str, Any]:
    """generate_batch takes one max_new_tokens for all requests: the mean of theirs, so the token total matches."""
    config = cb_generation_config(requests)
    config.max_new_tokens = round(statistics.mean(p.max_tokens for _, p in requests))
    synchronize()
    start = time.perf_counter()
    outputs = model.generate_batch(inputs=[ids for ids, _ in requests], generation_config=config)
    synchronize()
    return {"api": "generate_batch", "max_new_tokens": config.max_new_tokens, "wall_includes_warmup": True,
            "wall_seconds": time.perf_counter() - start, "timed_out": False, "finished": len(outputs),
            "output_tokens": sum(len(o.generated_tokens) for o in outputs.values())}


def continuous_batching(tiny: bool, num_seqs: int, time_limit: float) -> dict[str, Any]:
    requests = nanovllm_requests()[:num_seqs]
    model = qwen3_hf_model(tiny, "paged|sdpa")
    try:
        result = cb_manager(model, requests, time_limit)
    except (AttributeError, TypeError) as exc:  # the manager API of another transformers version
        print(f"continuous batching manager API failed ({exc!r}); falling back to generate_batch", flush=True)
        result = {**cb_generate_batch(model, requests), "manager_error": repr(exc)}
    result.update(num_seqs=num_seqs, requested_output_tokens=sum(p.max_tokens for _, p in requests),
                  prompt_tokens=sum(len(ids) for ids, _ in requests), attn_implementation="paged|sdpa",
                  output_tok_s=result["output_tokens"] / result["wall_seconds"])
    return result


def shakespeare_generate(model_path: str, repeats: int) -> dict[str, Any]:
    model = AutoModelForCausalLM.from_pretrained(model_path).to(device()).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    text = TEXT.read_text(encoding="utf-8")
    # The seed table's batch-1 prompts (same windows and seeds), so the two tables line up.
    return {name: hf_generate_ms_per_token(model, prompt_windows(tokenizer, text, p, 1, seed=p * 1000 + 1)[0], n,
                                           repeats)
            for name, (p, n) in NAMED.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--num-seqs", type=int, default=64, help="first N of nanovllm_bench's 256 requests")
    parser.add_argument("--time-limit", type=float, default=150.0, help="seconds before the cb run is stopped")
    parser.add_argument("--shakespeare-path", help="default: conf/model/shakespeare.yaml's path")
    parser.add_argument("--tiny", action="store_true", help="a two-layer Qwen3 instead of the 0.6B shape (CPU test)")
    add_out_argument(parser)
    args = parser.parse_args()

    results: dict[str, Any] = {}
    rows = []
    model_name = "tiny qwen3" if args.tiny else "qwen3_0_6b"
    if "generate" in args.parts:
        model = qwen3_hf_model(args.tiny, "sdpa")
        results["generate"] = hf_generate_ms_per_token(model, random_prompt(args.prompt_len, seed=0),
                                                       args.new_tokens, args.repeats)
        del model
        ms = results["generate"]["ms_per_token"]
        rows.append(["generate b1 greedy", model_name, f"{args.prompt_len} prompt + {args.new_tokens} new",
                     1000 / ms, ms])
        print(f"generate: {ms:.3f} ms/token", flush=True)
    if "cb" in args.parts:
        cb = results["cb"] = continuous_batching(args.tiny, args.num_seqs, args.time_limit)
        status = "TIMED OUT, finished requests only" if cb["timed_out"] else "all finished"
        rows.append([f"{cb['api']} paged|sdpa t=0.6", model_name,
                     f"nanovllm_bench first {cb['num_seqs']} of 256 ({cb['finished']} done, {status})",
                     cb["output_tok_s"], None])
    if "shakespeare" in args.parts:
        path = args.shakespeare_path or load_model_config("shakespeare").path
        if Path(path).is_dir():
            results["shakespeare"] = shakespeare_generate(path, args.repeats)
            for name, r in results["shakespeare"].items():
                rows.append(["generate b1 greedy", "shakespeare", f"{name} ({r['prompt_tokens']} + {r['new_tokens']})",
                             1000 / r["ms_per_token"], r["ms_per_token"]])
        else:
            print(f"no Shakespeare model at {path}: shakespeare part skipped", flush=True)

    settings = {k: v for k, v in vars(args).items() if k != "out"}
    save_json(args.out, "peers" + ("_tiny" if args.tiny else ""),
              {"environment": environment(), "settings": settings, "results": results})
    print(f"\n## peers: Hugging Face transformers ({environment()['device']}; {settings})\n")
    print(markdown_table(["peer", "model", "workload", "output_tok_s", "ms_per_token"], rows))


if __name__ == "__main__":
    main()
