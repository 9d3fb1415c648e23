"""The engine's host time per decode step at a full batch, on the many_rows shape (`benchmarks/real_jobs.py
many_rows`): the Shakespeare model, windows of 8-32 characters of the play text, max_tokens 16, temperature 0.8 /
top-k 40 (the job's sampling), max_num_seqs 512. The 4-layer, 128-wide model's forward is small next to the host
work of 512 rows, so on CPU this measures the host path of a decode step: scheduling, building the inputs,
committing the sampled ids, stop checks and the finished rows' outputs.

--max-tokens LOW HIGH draws each row's max_tokens uniformly from LOW..HIGH instead (seeded), each row with a
parameters object of its own, as a job's rows with per-row max_tokens have (chat_mix's shape): rows then leave the
batch at different steps, and most steps carry the previous step's rows less a few.

Reports, over the decode steps that ran at least 90% of max_num_seqs rows, the median of each steps.parquet column
(schedule_ms, prepare_ms, forward_ms, sample_ms, wait_ms, step_ms) and outside_ms: step_ms less the five, the host
time in no timed part (commit, stop checks, outputs, releasing finished rows). host_ms = schedule + prepare +
outside. With --profile, cProfile's top functions by own time over the engine loop.

Usage: python -m benchmarks.decode_host [--rows N] [--max-num-seqs N] [--max-tokens N [HIGH]] [--tiny] [--profile]
                                        [--out DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import io
import pstats
import statistics

import numpy as np

from batchgen.engine.outputs import RequestOutput
from batchgen.sample.params import SamplingParams
from benchmarks.common import (
    SHAKESPEARE,
    add_out_argument,
    build_engine,
    environment,
    load_model_config,
    markdown_table,
    run_engine,
    save_json,
    text_windows,
)

TIMED = ("schedule_ms", "prepare_ms", "forward_ms", "sample_ms", "wait_ms")
FULL_SHARE = 0.9  # decode steps with at least this share of max_num_seqs rows count as full


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, nargs="+", default=[16],
                        help="every row's, or LOW HIGH: each row's drawn from that range")
    parser.add_argument("--tiny", action="store_true", help="256 rows at max_num_seqs 64: a quick smoke test")
    parser.add_argument("--profile", action="store_true", help="print cProfile's top functions of the engine loop")
    add_out_argument(parser)
    args = parser.parse_args()
    rows, max_num_seqs = (256, 64) if args.tiny else (args.rows, args.max_num_seqs)
    options = dict(device="cpu", cpu_threads=1, max_num_seqs=max_num_seqs, max_num_batched_tokens=2048)
    engine = build_engine(load_model_config(SHAKESPEARE), **options)
    if len(args.max_tokens) > 2:
        parser.error("--max-tokens takes one value or a range LOW HIGH")
    prompts = [engine.detokenizer.encode(prompt) for prompt in text_windows(rows, (8, 32))]
    if len(args.max_tokens) == 1:
        params = SamplingParams(max_tokens=args.max_tokens[0], temperature=0.8, top_k=40)
        requests = [(prompt, params) for prompt in prompts]
    else:
        low, high = args.max_tokens
        max_tokens = np.random.default_rng(0).integers(low, high + 1, rows).tolist()
        requests = [(prompt, SamplingParams(max_tokens=n, temperature=0.8, top_k=40))
                    for prompt, n in zip(prompts, max_tokens, strict=True)]
    profiler = cProfile.Profile() if args.profile else None
    if profiler is not None:
        profiler.enable()
    outputs, records, wall = run_engine(engine, requests)
    if profiler is not None:
        profiler.disable()
    engine.close()
    full = [r for r in records if r.kind == "decode" and r.num_seqs >= FULL_SHARE * max_num_seqs]
    if not full:
        raise RuntimeError(f"no decode step ran {FULL_SHARE:.0%} of max_num_seqs={max_num_seqs} rows")
    medians = {name: statistics.median(getattr(r, name) for r in full) for name in (*TIMED, "step_ms")}
    outside = statistics.median(r.step_ms - sum(getattr(r, name) for name in TIMED) for r in full)
    result = {"full_decode_steps": len(full), "num_seqs": statistics.median(r.num_seqs for r in full), **medians,
              "outside_ms": outside, "host_ms": medians["schedule_ms"] + medians["prepare_ms"] + outside}
    name = "decode_host" + ("_range" if len(args.max_tokens) == 2 else "") + ("_tiny" if args.tiny else "")
    save_json(args.out, name,
              {"environment": environment(), "options": options, "rows": rows, "max_tokens": args.max_tokens,
               "wall_s": wall, "steps": len(records),
               "output_tokens_digest": tokens_digest(outputs), "result": result})
    if profiler is not None:
        stream = io.StringIO()
        pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(30)
        print(stream.getvalue())
    print(f"{rows} rows, {len(records)} steps, {wall:.2f} s; output tokens digest {tokens_digest(outputs)}")
    print("Median ms per full decode step (host_ms = schedule + prepare + outside)")
    headers = ["full_decode_steps", "num_seqs", *TIMED, "outside_ms", "host_ms", "step_ms"]
    print(markdown_table(headers, [[result[h] for h in headers]]))


def tokens_digest(outputs: list[RequestOutput]) -> str:
    """A short hash of every row's output tokens: equal across runs of the same commit and seed, so a change that
    alters a token shows."""
    tokens = np.array([t for o in outputs for t in (*o.token_ids, -1)], dtype=np.int64)
    return hashlib.sha256(tokens.tobytes()).hexdigest()[:16]


if __name__ == "__main__":
    main()
