"""Data parallel on one machine: the nanovllm workload scaled to 512 requests, through `python -m batchgen` on one GPU
and on N (engine.data_parallel_size=N), output tok/s each and the speedup.

The requests are nanovllm_bench's draws scaled to 512 (seed 0; prompt ids randint(0, 10000), prompt length and
max_tokens randint(100, 1024), temperature 0.6, ignore_eos), Qwen3-0.6B shape with dummy bf16 weights, max_model_len
4096, written as a prompts file with per-row max_tokens. Three throughputs per run, all output tokens over a span:
`generation` (the goal's figure; nano-vllm's bench times generate() alone) is the summary's generation phase, from the
first rank's engine loop start to the last rank's loop end (the ranks pass a start barrier once every engine is
ready, so their loops overlap; no imports, load, compilation or capture); `job` is the summary's wall time (first
rank start to last rank end, engine start included); `process` is the whole `python -m batchgen` command. Each rank's
engine start, barrier wait and engine loop are listed too. A short warm-up job on all the GPUs first fills the
compile caches, so neither run pays for compilation the other does not (after a warm-up on GPU 0 alone, rank 1's
graph capture took three times rank 0's, and its engine loop had about 1.2 s of outlier steps).

Usage: python -m benchmarks.data_parallel [--num-seqs 512] [--gpus 2] [--tiny] [--max-tokens N] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    QWEN3,
    REPO,
    TINY_QWEN3,
    Request,
    add_out_argument,
    environment,
    markdown_table,
    nanovllm_requests,
    save_json,
)

NUM_SEQS = 512
ENGINE = ["engine.max_model_len=4096", "engine.max_num_seqs=256", "engine.max_num_batched_tokens=16384"]


def write_prompts(path: Path, requests: list[Request], max_tokens: int | None) -> Path:
    with path.open("w") as file:
        for index, (token_ids, params) in enumerate(requests):
            cap = params.max_tokens if max_tokens is None else min(params.max_tokens, max_tokens)
            record = {"id": f"r{index:05d}", "prompt_token_ids": token_ids, "max_tokens": cap,
                      "temperature": params.temperature, "ignore_eos": params.ignore_eos}
            file.write(json.dumps(record) + "\n")
    return path


def run_job(prompts: Path, run_dir: Path, gpus: int, tiny: bool, limit: int | None = None) -> dict[str, Any]:
    """Runs the job; returns its summary, the rank summaries and the whole process's wall seconds."""
    model = [f"model={QWEN3}"] + ([f"model.hf_config.{k}={v}" for k, v in TINY_QWEN3.items()] if tiny else [])
    command = [sys.executable, "-m", "batchgen", *model, f"data.path={prompts}", "data.id_field=id", *ENGINE,
               f"engine.data_parallel_size={gpus}", "job.name=data_parallel_bench", "job.progress=false",
               f"hydra.run.dir={run_dir}", *([f"data.limit={limit}"] if limit else [])]
    start = time.perf_counter()
    subprocess.run(command, cwd=REPO, check=True)
    process_seconds = time.perf_counter() - start
    ranks = sorted(run_dir.glob("shard-*/summary.json")) or [run_dir / "summary.json"]
    return {"summary": json.loads((run_dir / "summary.json").read_text()), "process_seconds": process_seconds,
            "ranks": [json.loads(path.read_text()) for path in ranks]}


SPEEDUPS = ("generation", "job", "process")


def _rank_seconds(run: dict[str, Any], phase: str) -> list[float]:
    return [round(rank["this_attempt"]["time_seconds"][phase], 2) for rank in run["ranks"]]


def row(gpus: int, run: dict[str, Any], baseline: dict[str, Any] | None) -> dict[str, Any]:
    summary = run["summary"]
    generation = summary["generation"]
    result = {"gpus": gpus, "output_tokens": summary["output_tokens"],
              "rank_output_tokens": [rank["output_tokens"] for rank in run["ranks"]],
              "generation_s": generation["seconds"], "generation_output_tok_s": generation["output_tokens_per_s"],
              "job_s": summary["wall_seconds"], "job_output_tok_s": summary["output_tokens_per_s"],
              "process_s": run["process_seconds"],
              "process_output_tok_s": summary["output_tokens"] / run["process_seconds"],
              "rank_engine_start_s": _rank_seconds(run, "engine_start"),
              "rank_wait_for_ranks_s": _rank_seconds(run, "wait_for_ranks"),
              "rank_engine_loop_s": _rank_seconds(run, "steps")}
    if baseline is not None:
        for name in SPEEDUPS:
            result[f"{name}_speedup"] = result[f"{name}_output_tok_s"] / baseline[f"{name}_output_tok_s"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=NUM_SEQS)
    parser.add_argument("--gpus", type=int, default=2, help="ranks of the data-parallel run")
    parser.add_argument("--tiny", action="store_true", help="a two-layer Qwen3 instead of the 0.6B shape (CPU test)")
    parser.add_argument("--max-tokens", type=int, help="caps each request's max_tokens (a quick CPU smoke test)")
    add_out_argument(parser)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="batchgen_dp_") as tmp:
        directory = Path(tmp)
        prompts = write_prompts(directory / "prompts.jsonl", nanovllm_requests(args.num_seqs, total=args.num_seqs),
                                args.max_tokens)
        run_job(prompts, directory / "warmup", args.gpus, args.tiny, limit=16 * args.gpus)
        single = run_job(prompts, directory / "gpus1", 1, args.tiny)
        parallel = run_job(prompts, directory / f"gpus{args.gpus}", args.gpus, args.tiny)
    baseline = row(1, single, None)
    rows = [baseline, row(args.gpus, parallel, baseline)]
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    save_json(args.out, "data_parallel", {"environment": environment(), "settings": settings, "rows": rows,
                                          "summaries": {"gpus1": single, f"gpus{args.gpus}": parallel}})
    headers = ["gpus", "rank_output_tokens", "rank_engine_start_s", "rank_wait_for_ranks_s", "rank_engine_loop_s",
               "generation_s", "generation_output_tok_s", "generation_speedup", "job_output_tok_s", "job_speedup",
               "process_output_tok_s", "process_speedup"]
    print(f"\n## data_parallel ({environment()['device']}; {settings})\n")
    print(markdown_table(headers, [[r.get(h) for h in headers] for r in rows]))


if __name__ == "__main__":
    main()
