"""Where a job's device waits for its host: a real_jobs workload through `python -m batchgen`, with the engine's host
phases timed and each step's device span taken from its CUDA events, put on the host's clock.

steps.parquet's device_busy says how much of the engine loop the device worked; this says where the rest went. In
the job's process (a script run ahead of `python -m batchgen`, as many_rows_host's options are), each step's device
span runs from the CUDA event recorded before its forward to the one after its sampling, converted to the host's
clock through a reference event recorded on an idle device at the first launch; the engine's host phases (the job
between engine steps, scheduling, building the inputs, launching the forward, committing, ...) are timed with
perf_counter. The report:
- idle by transition: the device's idle time before each step, by the previous step's kind and this one's (decode
  steps that replayed a graph marked), with the median and the longest gap;
- idle by host phase: each stretch of idle time given to the innermost host phase running then (a launch of the next
  step, its scheduling, the job's work between engine steps, ...): what the device waited for;
- eager steps: the host's time launching an eager forward against the device's time running it, for steps of at
  least half the token budget and for the smaller ones (an eager step whose launch is as slow as its forward leaves
  the rest of the host's work between steps exposed).
With --sync-debug, torch's sync debug mode warns at every synchronizing call after the 50th step and the report
counts them by their batchgen call stack. On CPU the "device" spans are the host's own forward and sampling.

Usage: python -m benchmarks.device_idle [WORKLOAD] [--rows N] [--tiny] [--sync-debug] [--set KEY=VALUE ...] [--out DIR]
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
import tempfile
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import replace
from itertools import pairwise
from pathlib import Path
from typing import Any

from benchmarks.common import add_out_argument, environment, markdown_table, save_json
from benchmarks.many_rows_host import JOB
from benchmarks.process_timing import run_process
from benchmarks.real_jobs import TINY_WORKLOADS, WORKLOADS, TextRows, job_arguments, write_text_rows, write_token_rows

OUTSIDE = "job (between engine steps)"
SYNC_DEBUG_AFTER = 50  # steps: the first ones compile and allocate
# The host phases timed in the job's process: {(module, class or None for the module's own function): {function: label}}
PHASES = {
    ("batchgen.engine.llm_engine", "LLMEngine"): {
        "step": "engine step", "add_requests": "add rows", "_launch_next": "launch next step",
        "_apply": "apply a step's results"},
    ("batchgen.core.scheduler", "Scheduler"): {"schedule": "schedule", "advance": "advance", "commit": "commit"},
    ("batchgen.worker.model_runner", "ModelRunner"): {
        "launch": "launch", "collect": "collect (wait for the ids)", "_step_sampling": "sampling rows",
        "_to_device": "upload inputs", "_eager_forward": "eager forward launch", "_sample": "sampling launch"},
    ("batchgen.worker.model_runner", None): {"build_step_inputs": "build step inputs"},
}


# -- in the job's process ----------------------------------------------------------------------------------------


def install(path: str, sync_debug: bool = False) -> None:
    """Times the engine's host phases and records each launched step's timer; writes both to `path` as the process
    exits (the command ends with its exit handlers and os._exit)."""
    import atexit
    import importlib
    import time
    import traceback
    import warnings

    import torch

    intervals: list[tuple[float, float, str]] = []
    steps: list[tuple[Any, ...]] = []
    reference: dict[str, Any] = {}
    sync_calls: Counter = Counter()

    def timed(owner: Any, name: str, label: str) -> None:
        original = getattr(owner, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                intervals.append((start, time.perf_counter(), label))

        setattr(owner, name, wrapper)

    for (module_name, class_name), labels in PHASES.items():
        module = importlib.import_module(module_name)
        for function, label in labels.items():
            timed(getattr(module, class_name) if class_name else module, function, label)
    runner_class = importlib.import_module("batchgen.worker.model_runner").ModelRunner
    launch = runner_class.launch  # the timed one

    def launch_recorded(self: Any, step: Any) -> Any:
        if not reference and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            event.synchronize()
            reference.update(event=event, host=time.perf_counter())
        start = time.perf_counter()
        launched = launch(self, step)
        steps.append((step.kind, step.num_seqs, step.num_tokens, launched.timer, start, time.perf_counter(),
                      launched.padded_size is not None))
        if sync_debug and len(steps) == SYNC_DEBUG_AFTER and self.device.type == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        return launched

    runner_class.launch = launch_recorded

    def record_warning(message: Any, *_: Any, **__: Any) -> None:
        frames = [f"{frame.filename.rsplit('batchgen/', 1)[-1]}:{frame.lineno} {frame.name}"
                  for frame in traceback.extract_stack()[:-1] if "/batchgen/" in frame.filename]
        sync_calls[(str(message)[:100], " < ".join(reversed(frames[-4:])))] += 1

    if sync_debug:
        warnings.simplefilter("always")
        warnings.showwarning = record_warning

    def write() -> None:
        if sync_debug and torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode(0)
        rows = []
        for kind, seqs, tokens, timer, launch_start, launch_end, graph in steps:
            if len(timer.marks) < 2:
                continue
            if reference:  # CUDA events: milliseconds after the reference event, on the host's clock
                first, last = (reference["host"] + reference["event"].elapsed_time(mark) / 1000
                               for mark in (timer.marks[0], timer.marks[-1]))
                forward = timer.marks[0].elapsed_time(timer.marks[1]) / 1000
            else:  # CPU: the marks are host times
                first, last, forward = timer.marks[0], timer.marks[-1], timer.marks[1] - timer.marks[0]
            rows.append([kind, seqs, tokens, first, last, forward, launch_start, launch_end, graph])
        Path(path).write_text(json.dumps({
            "steps": rows, "intervals": intervals, "on_gpu": bool(reference),
            "sync_calls": [[message, stack, count] for (message, stack), count in sync_calls.most_common()],
        }))

    atexit.register(write)


# -- the report --------------------------------------------------------------------------------------------------


def idle_by_transition(steps: Sequence[Sequence[Any]]) -> dict[str, dict[str, Any]]:
    """{"previous -> kind": steps, idle seconds, median and longest gap in ms}; a gap is the device's idle time
    from the previous step's end to this step's start, in launch order (negative overlaps count as none)."""
    gaps: dict[str, list[float]] = defaultdict(list)
    for previous, step in pairwise(steps):
        key = f"{previous[0]} -> {step[0]}" + (" (graph)" if step[8] else "")
        gaps[key].append(max(0.0, step[3] - previous[4]))
    return {key: {"steps": len(values), "idle_s": sum(values), "median_ms": 1000 * statistics.median(values),
                  "longest_ms": 1000 * max(values)}
            for key, values in sorted(gaps.items(), key=lambda item: -sum(item[1]))}


def idle_by_phase(steps: Sequence[Sequence[Any]], intervals: Sequence[Sequence[Any]]) -> dict[str, float]:
    """Seconds of device idle time by the innermost host phase running then (OUTSIDE where none was)."""
    ordered = sorted(intervals)
    starts = [interval[0] for interval in ordered]
    longest = max((end - start for start, end, _ in ordered), default=0.0)
    seconds: dict[str, float] = defaultdict(float)
    for previous, step in pairwise(steps):
        idle_start, idle_end = previous[4], step[3]
        if idle_end <= idle_start:
            continue
        near = ordered[bisect.bisect_left(starts, idle_start - longest):bisect.bisect_right(starts, idle_end)]
        near = [interval for interval in near if interval[1] > idle_start]
        cuts = sorted({idle_start, idle_end, *(t for s, e, _ in near for t in (s, e) if idle_start < t < idle_end)})
        for left, right in pairwise(cuts):
            middle = (left + right) / 2
            inside = [(e - s, label) for s, e, label in near if s <= middle < e]
            seconds[min(inside)[1] if inside else OUTSIDE] += right - left
    return dict(sorted(seconds.items(), key=lambda item: -item[1]))


def eager_launches(steps: Sequence[Sequence[Any]], chunk_budget: int) -> list[dict[str, Any]]:
    """Eager steps (not graph replays) of at least half the token budget and the smaller ones: their count and the
    medians of the host's launch time and the device's forward time, in ms."""
    groups: dict[str, list[Sequence[Any]]] = defaultdict(list)
    for step in steps:
        if not step[8]:
            groups["at least half the budget" if step[2] >= chunk_budget / 2 else "smaller"].append(step)
    return [{"steps": name, "count": len(group),
             "host_launch_ms": 1000 * statistics.median(s[7] - s[6] for s in group),
             "device_forward_ms": 1000 * statistics.median(s[5] for s in group)}
            for name, group in groups.items()]


def report(timeline: dict[str, Any], chunk_budget: int) -> dict[str, Any]:
    steps = timeline["steps"]
    span = steps[-1][4] - steps[0][3] if steps else 0.0
    busy = sum(step[4] - step[3] for step in steps)
    return {"on_gpu": timeline["on_gpu"], "steps": len(steps), "span_s": span, "busy_s": busy,
            "idle_s": sum(max(0.0, b[3] - a[4]) for a, b in pairwise(steps)),
            "by_transition": idle_by_transition(steps), "by_phase": idle_by_phase(steps, timeline["intervals"]),
            "eager": eager_launches(steps, chunk_budget), "sync_calls": timeline["sync_calls"]}


def print_report(name: str, result: dict[str, Any]) -> None:
    where = "the device" if result["on_gpu"] else "the CPU's forward and sampling"
    print(f"{name}: {result['steps']} steps over {result['span_s']:.2f} s of {where}: busy {result['busy_s']:.2f} s, "
          f"idle between steps {result['idle_s']:.3f} s")
    print("\nIdle before a step, by the previous step's kind and its own:")
    print(markdown_table(["transition", "steps", "idle_s", "median_ms", "longest_ms"],
                         [[key, *row.values()] for key, row in result["by_transition"].items()]))
    print("\nIdle by the host phase running then (the innermost one):")
    print(markdown_table(["host phase", "idle_s"], list(result["by_phase"].items())))
    print("\nEager steps: the host's launch against the device's forward (medians):")
    print(markdown_table(["steps", "count", "host_launch_ms", "device_forward_ms"],
                         [list(row.values()) for row in result["eager"]]))
    if result["sync_calls"]:
        print("\nSynchronizing calls after step 50 (torch's sync debug mode):")
        print(markdown_table(["warning", "batchgen stack", "calls"], result["sync_calls"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workload", nargs="?", default="chat_mix", choices=sorted(WORKLOADS))
    parser.add_argument("--rows", type=int, help="this many rows of the workload instead of its own number")
    parser.add_argument("--tiny", action="store_true", help="the workload shrunk, on CPU (real_jobs --tiny)")
    parser.add_argument("--sync-debug", action="store_true", help="count synchronizing calls after step 50")
    parser.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE",
                        help="a Hydra override for the job (repeatable)")
    add_out_argument(parser)
    args = parser.parse_args()
    workload = (TINY_WORKLOADS if args.tiny else WORKLOADS)[args.workload]
    if args.rows:
        workload = replace(workload, rows=replace(workload.rows, rows=args.rows))
    with tempfile.TemporaryDirectory(prefix="batchgen_device_idle_") as tmp:
        directory = Path(tmp)
        input_path = directory / "input.jsonl"
        (write_text_rows if isinstance(workload.rows, TextRows) else write_token_rows)(input_path, workload.rows)
        run_dir, timeline_path = directory / "run", directory / "timeline.json"
        arguments = job_arguments(workload, input_path, run_dir, args.tiny, args.extra)
        script = f"from benchmarks.device_idle import install\ninstall({str(timeline_path)!r}, {args.sync_debug})\n"
        run = run_process(["-c", script + JOB, *arguments[2:]], timeout=3600)  # arguments[:2]: -m batchgen
        if run.returncode != 0:
            raise SystemExit(f"the job exited {run.returncode}:\n{run.output[-3000:]}")
        summary = json.loads((run_dir / "summary.json").read_text())
        result = report(json.loads(timeline_path.read_text()), summary["engine"]["max_num_batched_tokens"])
    name = workload.name + ("_tiny" if args.tiny else "")
    print_report(name, result)
    save_json(args.out, f"device_idle_{name}", {"environment": environment(), "workload": workload.name,
                                                "rows": workload.rows.rows, "overrides": args.extra,
                                                "process_s": run.seconds, **result})


if __name__ == "__main__":
    main()
