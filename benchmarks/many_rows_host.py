"""The many_rows job's host time per row, on CPU: `python -m batchgen job=shakespeare` in a subprocess, as
`real_jobs many_rows` runs it (windows of 8-32 characters of the play text, max_tokens 16, max_num_seqs 512), on
--rows rows with engine.device=cpu.

The 4-layer, 128-wide model's forward is small on a GPU, so the job is bound by the host's work per row. On CPU the
steps' forward_ms and sample_ms are the CPU's own compute (what a GPU runs on the device); every other part is the
host path a GPU run pays too. Reports microseconds per row:
- each phase of the process (summary.json's time_seconds): start-up, reading the input, opening the outputs, engine
  start (loading the model, tokenizing the prompts to size the KV cache), the engine loop, closing, finish (merging
  the part files);
- the engine loop split by steps.parquet: job (job_ms: the job's work between steps: adding rows to the engine,
  writing finished rows), schedule, prepare (building the step's inputs), compute (forward_ms + sample_ms: the CPU's
  forward and sampling) and other_host (the rest of step_ms: committing the sampled ids, stop checks, building the
  finished rows' outputs, the launch around the timed forward), and the loop's garbage collections (inside the rest);
- host_loop: the loop less compute; host_total: the process less compute.
And, per step kind, the steps, their mean rows and tokens.

With --profile a second run goes under cProfile (its profile written by an exit handler), and two tables list the host
functions (outside the model, its layers and torch): the most own time, and chosen entry points' cumulative time, per
row.
cProfile slows what it counts: read these for shares, the first run's figures for time.

With --stub-forward the model's forward returns zeros (its hidden states and logits): the job is its host path and
the CPU's sampling alone, 20,000 rows in seconds instead of minutes, and no forward flushes the host's caches
between steps, as a GPU's does not. Tokens drawn from equal logits end some rows early (EOS): compare trees under the
same options only.

Usage: python -m benchmarks.many_rows_host [--rows N] [--set KEY=VALUE ...] [--profile] [--stub-forward] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import pstats
import tempfile
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from benchmarks.common import add_out_argument, environment, markdown_table, save_json
from benchmarks.process_timing import run_process
from benchmarks.real_jobs import TINY_WORKLOADS, job_arguments, write_text_rows

WORKLOAD = TINY_WORKLOADS["many_rows"]  # the many_rows shape and overrides, on CPU
PHASES = ("startup", "read_input", "open_outputs", "engine_start", "engine_loop", "engine_close", "finish")
LOOP_PARTS = ("job", "schedule", "prepare", "compute", "other_host")
# Functions whose own time is the device's work on a GPU (the model, its layers, torch's operators).
COMPUTE_MARKERS = ("/batchgen/models/", "/batchgen/layers/", "/torch/", "torch._C", "built-in method torch.")
# Functions that run while modules are imported (start-up, which summary.json times on its own).
IMPORT_MARKERS = ("<frozen importlib", "marshal.loads", "builtins.compile", "builtins.exec", "_imp.",
                  "builtins.__build_class__", "io.open_code")
# (file suffix, function): the host path's entry points, for their cumulative time per row.
ENTRY_POINTS = (
    ("batchgen/io/readers.py", "iter_prompts"),
    ("batchgen/job/run.py", "_tokenize"),
    ("batchgen/job/run.py", "_add_requests"),
    ("batchgen/engine/llm_engine.py", "add_request"),
    ("batchgen/core/scheduler.py", "add_request"),
    ("batchgen/core/scheduler.py", "schedule"),
    ("batchgen/core/scheduler.py", "advance"),
    ("batchgen/worker/step_inputs.py", "build_step_inputs"),
    ("batchgen/worker/model_runner.py", "_step_sampling"),
    ("batchgen/worker/model_runner.py", "collect"),
    ("batchgen/core/scheduler.py", "commit"),
    ("batchgen/engine/llm_engine.py", "_output"),
    ("batchgen/job/run.py", "completion_values"),
    ("batchgen/io/writers.py", "write_values"),
    ("batchgen/io/writers.py", "flush"),
    ("batchgen/job/progress.py", "update"),
    ("batchgen/job/run_outputs.py", "close"),
    ("batchgen/job/run_outputs.py", "write_summary"),
)

# `python -m batchgen` as a script, for the options that run code ahead of it.
JOB = """import runpy, sys
sys.argv = ["batchgen", *sys.argv[1:]]
runpy.run_module("batchgen", run_name="__main__", alter_sys=True)
"""
# The job under cProfile: it ends by os._exit after the exit handlers, so the profile is written by one of them
# (`python -m cProfile -o` would write it after the script returns, which never happens).
PROFILED_JOB = """import atexit, cProfile
profiler = cProfile.Profile()
atexit.register(lambda: (profiler.disable(), profiler.dump_stats({path!r})))
profiler.enable()
""" + JOB
# --stub-forward, ahead of the job's script: every eager forward (all of them on CPU) returns zeros.
STUB_FORWARD = """import torch
from batchgen.worker.model_runner import ModelRunner

def stub_forward(self, inputs, input_ids, positions, meta, sample_token_index):
    hidden = torch.zeros(len(input_ids), 1)
    if not inputs.sample_rows:
        return hidden, hidden[:0]
    return hidden, torch.zeros(len(sample_token_index), self.vocab_size)

ModelRunner._eager_forward = stub_forward
"""


def loop_parts(steps: list[dict[str, Any]]) -> dict[str, float]:
    """Seconds of the engine loop's steps in each of LOOP_PARTS."""
    parts: dict[str, float] = defaultdict(float)
    for step in steps:
        compute = step["forward_ms"] + step["sample_ms"]
        parts["job"] += step["job_ms"]
        parts["schedule"] += step["schedule_ms"]
        parts["prepare"] += step["prepare_ms"]
        parts["compute"] += compute
        parts["other_host"] += (step["step_ms"] - step["job_ms"] - step["schedule_ms"] - step["prepare_ms"] - compute)
    return {part: parts[part] / 1000 for part in LOOP_PARTS}


def step_kinds(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_kind: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for step in steps:
        by_kind[step["kind"]].append(step)
    return [{"kind": kind, "steps": len(rows), "mean_rows": sum(r["num_seqs"] for r in rows) / len(rows),
             "mean_tokens": sum(r["num_tokens"] for r in rows) / len(rows),
             "host_ms_per_step": sum(r["step_ms"] - r["forward_ms"] - r["sample_ms"] for r in rows) / len(rows)}
            for kind, rows in sorted(by_kind.items())]


def run_job(directory: Path, input_path: Path, rows: int, extra: list[str], profile: Path | None,
            stub_forward: bool = False) -> dict[str, Any]:
    run_dir = directory / ("run_profiled" if profile else "run")
    arguments = job_arguments(WORKLOAD, input_path, run_dir, tiny=True, extra=extra)
    if profile is not None or stub_forward:
        script = (STUB_FORWARD if stub_forward else "") + (JOB if profile is None else
                                                           PROFILED_JOB.format(path=str(profile)))
        arguments = ["-c", script, *arguments[2:]]  # arguments[:2]: -m batchgen
    run = run_process(arguments, timeout=3600)
    if run.returncode != 0:
        raise RuntimeError(f"the job exited {run.returncode}:\n{run.output[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = pq.read_table(run_dir / "steps.parquet").to_pylist()
    times = summary["this_attempt"]["time_seconds"]
    phases = {phase: times[phase] for phase in PHASES if phase != "engine_loop"}
    phases["engine_loop"] = times["steps"] + times["outside_steps"]
    parts = loop_parts(steps)
    seconds = {**phases, **parts,
               "loop_gc": summary["this_attempt"]["engine_loop_collections"]["seconds"],
               "host_loop": phases["engine_loop"] - parts["compute"],
               "process": run.seconds, "host_total": run.seconds - parts["compute"]}
    return {"process_s": run.seconds, "seconds": seconds,
            "us_per_row": {name: 1e6 * value / rows for name, value in seconds.items()},
            "step_kinds": step_kinds(steps)}


def is_host(function: tuple[str, int, str]) -> bool:
    file, _, name = function
    return not any(marker in file or marker in name for marker in (*COMPUTE_MARKERS, *IMPORT_MARKERS))


def profile_tables(path: Path, rows: int, top: int = 30) -> tuple[list[list[Any]], list[list[Any]]]:
    """(the host functions with the most own time, import machinery left out, the entry points' cumulative time):
    rows of [function, calls, us per row]."""
    stats = pstats.Stats(str(path)).stats  # (file, line, name) -> (primitive calls, calls, own s, cumulative s, ...)
    own = sorted(((function, values[1], values[2]) for function, values in stats.items() if is_host(function)),
                 key=lambda item: -item[2])[:top]
    own_rows = [[f"{Path(f[0]).name}:{f[1]}({f[2]})", calls, 1e6 * seconds / rows] for f, calls, seconds in own]
    entry_rows = []
    for suffix, name in ENTRY_POINTS:
        for function, values in stats.items():
            if function[0].endswith(suffix) and function[2] == name:
                entry_rows.append([f"{suffix}:{function[1]}({name})", values[1], 1e6 * values[3] / rows])
    return own_rows, entry_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE",
                        help="a Hydra override for the job (repeatable), e.g. engine.max_num_batched_tokens=2048")
    parser.add_argument("--profile", action="store_true", help="a second run under cProfile: its host functions")
    parser.add_argument("--stub-forward", action="store_true", help="the model's forward returns zeros: the host path")
    parser.add_argument("--tag", default="", help="a suffix for the JSON's name, to tell runs with --set apart")
    add_out_argument(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="batchgen_many_rows_host_") as tmp:
        directory = Path(tmp)
        input_path = directory / "input.jsonl"
        write_text_rows(input_path, replace(WORKLOAD.rows, rows=args.rows))
        result = run_job(directory, input_path, args.rows, args.extra, None, args.stub_forward)
        profiled = None
        if args.profile:
            profile_path = directory / "job.prof"
            run_job(directory, input_path, args.rows, args.extra, profile_path, args.stub_forward)
            profiled = profile_tables(profile_path, args.rows)
    save_json(args.out, "many_rows_host" + (f"_{args.tag}" if args.tag else ""),
              {"environment": environment(), "rows": args.rows, "overrides": args.extra,
               "stub_forward": args.stub_forward, **result,
               "profile": None if profiled is None else {"own": profiled[0], "entry_points": profiled[1]}})
    if profiled is not None:
        print("Host functions by own time under cProfile (us per row):")
        print(markdown_table(["function", "calls", "us_per_row"], profiled[0]))
        print("\nEntry points' cumulative time under cProfile (us per row):")
        print(markdown_table(["function", "calls", "us_per_row"], profiled[1]) + "\n")
    print(markdown_table(["kind", "steps", "mean_rows", "mean_tokens", "host_ms_per_step"],
                         [[k[h] for h in ("kind", "steps", "mean_rows", "mean_tokens", "host_ms_per_step")]
                          for k in result["step_kinds"]]))
    overrides = f"; {' '.join(args.extra)}" if args.extra else ""
    stub = "; the forward stubbed" if args.stub_forward else ""
    print(f"\n## many_rows on CPU: {args.rows} rows, {result['process_s']:.1f} s{overrides}{stub}, us per row\n")
    names = [*PHASES, *(f"engine_loop: {part}" for part in LOOP_PARTS), "engine_loop: gc", "host_loop", "host_total",
             "process"]
    keys = [*PHASES, *LOOP_PARTS, "loop_gc", "host_loop", "host_total", "process"]
    print(markdown_table(["phase", "us_per_row"], [[name, result["us_per_row"][key]] for name, key in zip(names, keys,
                                                                                                         strict=True)]))


if __name__ == "__main__":
    main()
