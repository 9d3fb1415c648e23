"""Where a step's host time goes, on the main job's sizes (the Shakespeare model, its 640 prompts, max_num_seqs 64,
2048-token steps, temperature 0.8 / top-k 40, 64 new tokens): milliseconds of host time per step, by kind (prefill
or decode), in each part of the engine loop, next to the device's forward time.

--many-rows takes the many_rows shape instead (`benchmarks/real_jobs.py many_rows`: windows of 8-32 characters of the
play text, max_tokens 16, max_num_seqs 512, the steps' token budget of `job=shakespeare` unless
--max-num-batched-tokens says otherwise), on --rows rows (default 4096), and adds a table of microseconds per row in
each part over the whole run, adding the rows to the engine (`add_request`) included: all of them before the first
step here, where a job adds them between steps.

The engine runs with the job's garbage-collection thresholds (`rare_collections`). Host time is wall time on the
host around each part, never waiting for the device except in `collect` (where it
waits for the sampled ids): on a GPU the launch parts are what the host pays to queue the work. On CPU the forward
and sample launches run the work itself; host_outside_launch_ms leaves them out.

Usage: python -m benchmarks.profile_prefill_host [--rows N] [--eager] [--many-rows] [--max-num-batched-tokens N]
                                               [--cpu-time]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import yaml

from batchgen.core.scheduler import SchedulerOutput
from batchgen.engine.collector import rare_collections
from batchgen.sample.params import SamplingParams
from batchgen.worker import model_runner
from benchmarks.common import (
    REPO,
    add_out_argument,
    build_engine,
    cuda_available,
    environment,
    load_model_config,
    markdown_table,
    run_engine,
    save_json,
    text_windows,
)

PARTS = ("schedule", "build_step_inputs", "sampling_tensors", "to_device", "forward_launch", "sample_launch",
         "advance", "collect", "commit", "stop_strings", "release", "outputs")
LAUNCH_PARTS = ("forward_launch", "sample_launch")  # on CPU: the model's work itself


class HostClock:
    """Accumulates host seconds per part for each step, over its launch and its application (the finished rows'
    outputs, built after it is applied, included)."""

    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        """now: the clock, in seconds (wall time, or the thread's CPU time)."""
        self.now = now
        self.steps: list[tuple[str, dict[str, float]]] = []  # (kind, seconds by part) of each applied step
        self._current: dict[str, float] | None = None  # the parts of the step being launched or applied
        self._launched: dict[int, dict[str, float]] = {}  # id(SchedulerOutput) -> its launch's parts
        self._kind = "?"
        self._open: set[str] = set()

    def wrap(self, part: str, fn: Callable) -> Callable:
        """fn, timed into `part`; a call nested in another call of the same part counts once."""
        def timed(*args: Any, **kwargs: Any) -> Any:
            if part in self._open:
                return fn(*args, **kwargs)
            self._open.add(part)
            start = self.now()
            try:
                return fn(*args, **kwargs)
            finally:
                if self._current is not None:
                    self._current[part] += self.now() - start
                self._open.discard(part)
        return timed

    def launching(self) -> None:
        self._current = defaultdict(float)

    def launched(self, step: SchedulerOutput | None) -> None:
        if step is not None:
            self._launched[id(step)] = self._current
        self._current = None

    def applying(self, step: SchedulerOutput) -> None:
        self._kind, self._current = step.kind, self._launched.pop(id(step))

    def applied(self) -> None:
        """Closes the step being applied, if there is one."""
        if self._current is not None:
            self.steps.append((self._kind, self._current))
        self._current = None

    def medians(self, kind: str, parts: tuple[str, ...]) -> dict[str, float]:
        """Milliseconds per step of each part, the median over the steps of this kind (0 where a part did not run)."""
        steps = [seconds for step_kind, seconds in self.steps if step_kind == kind]
        return {part: 1000 * statistics.median(seconds.get(part, 0.0) for seconds in steps) for part in parts}

    def total(self, part: str) -> float:
        """The part's seconds over every step."""
        return sum(seconds.get(part, 0.0) for _, seconds in self.steps)


def instrument(engine, clock: HostClock) -> None:
    runner, scheduler = engine.runner, engine.scheduler
    launch_next, apply, step = engine._launch_next, engine._apply, engine._step

    def timed_launch_next():
        clock.launching()
        in_flight = launch_next()
        clock.launched(None if in_flight is None else in_flight.step)
        return in_flight

    def timed_apply(in_flight):
        clock.applying(in_flight.step)  # open until the step's outputs are built
        return apply(in_flight)

    def timed_step():
        result = step()
        clock.applied()
        return result

    engine._launch_next, engine._apply, engine._step = timed_launch_next, timed_apply, timed_step
    engine._output = clock.wrap("outputs", engine._output)
    engine.worker.release = clock.wrap("release", engine.worker.release)
    scheduler.schedule = clock.wrap("schedule", scheduler.schedule)
    scheduler.advance = clock.wrap("advance", scheduler.advance)
    scheduler.commit = clock.wrap("commit", scheduler.commit)
    model_runner.build_step_inputs = clock.wrap("build_step_inputs", model_runner.build_step_inputs)
    runner._step_sampling = clock.wrap("sampling_tensors", runner._step_sampling)
    runner._sample = clock.wrap("sample_launch", runner._sample)
    runner._to_device = clock.wrap("to_device", runner._to_device)
    runner._eager_forward = clock.wrap("forward_launch", runner._eager_forward)
    if runner.graphs is not None:
        runner.graphs.replay = clock.wrap("forward_launch", runner.graphs.replay)
    runner.collect = clock.wrap("collect", runner.collect)
    if engine.detokenizer is not None:
        engine.detokenizer.apply_stop_strings = clock.wrap("stop_strings", engine.detokenizer.apply_stop_strings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, help="rows to run (default: the main job's 640, or 4096 with --many-rows)")
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--many-rows", action="store_true", help="the many_rows shape instead of the main job's")
    parser.add_argument("--max-num-batched-tokens", type=int, help="the steps' token budget (default: the job's)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time the parts in the thread's CPU time, not wall time: on a shared machine, the host's "
                             "own work without the time other processes took (collect then leaves out the wait)")
    add_out_argument(parser)
    args = parser.parse_args()
    options = dict(max_num_seqs=512 if args.many_rows else 64, enforce_eager=args.eager,
                   max_num_batched_tokens=args.max_num_batched_tokens or job_token_budget())
    if not cuda_available():
        options["cpu_threads"] = 1  # as conf/job/shakespeare.yaml
    engine = build_engine(load_model_config("shakespeare"), **options)
    if args.many_rows:
        prompts = text_windows(args.rows or 4096, (8, 32))
        params = SamplingParams(max_tokens=16, temperature=0.8, top_k=40)
    else:
        lines = (REPO / "jobs" / "shakespeare" / "prompts.jsonl").read_text().splitlines()[:args.rows or 640]
        prompts = [json.loads(line)["prompt"] for line in lines]
        params = SamplingParams(max_tokens=64, temperature=0.8, top_k=40)
    requests = [(engine.detokenizer.encode(prompt), params) for prompt in prompts]
    clock = HostClock(time.thread_time if args.cpu_time else time.perf_counter)
    instrument(engine, clock)
    add_request = engine.add_request
    adding = [0.0]

    def timed_add_request(*args, **kwargs):
        start = clock.now()
        add_request(*args, **kwargs)
        adding[0] += clock.now() - start

    engine.add_request = timed_add_request
    with rare_collections():  # as a job's engine loop runs
        _, records, wall = run_engine(engine, requests)
    engine.close()
    results = []
    for kind in sorted({r.kind for r in records}):
        steps = [r for r in records if r.kind == kind]
        parts = clock.medians(kind, PARTS)
        host = sum(ms for part, ms in parts.items() if part != "collect")
        outside = host - sum(parts[part] for part in LAUNCH_PARTS)
        results.append({"kind": kind, "steps": len(steps), "mean_rows": statistics.fmean(r.num_seqs for r in steps),
                        **parts, "host_ms": host, "host_outside_launch_ms": outside,
                        "median_forward_ms": statistics.median(r.forward_ms for r in steps),
                        "median_step_ms": statistics.median(r.step_ms for r in steps)})
    per_row = {"add_request": adding[0], **{part: clock.total(part) for part in PARTS}}
    per_row["host_outside_launch"] = sum(seconds for part, seconds in per_row.items()
                                         if part not in (*LAUNCH_PARTS, "collect"))
    per_row = {part: 1e6 * seconds / len(requests) for part, seconds in per_row.items()}
    save_json(args.out, "profile_prefill_host" + ("_many_rows" if args.many_rows else ""),
              {"environment": environment(), "options": options, "rows": len(requests), "wall_s": wall,
               "clock": "thread_time" if args.cpu_time else "perf_counter",
               "results": results, "us_per_row": per_row})
    headers = ["kind", "steps", "mean_rows", *PARTS, "host_ms", "host_outside_launch_ms", "median_forward_ms",
               "median_step_ms"]
    clock_name = "thread CPU time" if args.cpu_time else "wall time"
    print(f"Host ms per step (median, {clock_name}) by part; collect includes waiting for the device and is not in "
          "host_ms")
    print(markdown_table(headers, [[r[h] for h in headers] for r in results]))
    if args.many_rows:
        print(f"\nHost us per row over the run ({clock_name}; {len(requests)} rows, {wall:.1f} s)")
        print(markdown_table(list(per_row), [list(per_row.values())]))


def job_token_budget() -> int | None:
    """engine.max_num_batched_tokens as conf/job/shakespeare.yaml sets it; None (the engine's default) where it
    does not."""
    job = yaml.safe_load((REPO / "conf" / "job" / "shakespeare.yaml").read_text())
    return (job.get("engine") or {}).get("max_num_batched_tokens")


if __name__ == "__main__":
    main()
