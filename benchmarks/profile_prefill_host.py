"""Where a step's host time goes, on the main job's sizes (the Shakespeare model, its 640 prompts, max_num_seqs 64,
2048-token steps, temperature 0.8 / top-k 40, 64 new tokens): milliseconds of host time per step, by kind (prefill
or decode), in each part of the engine loop, next to the device's forward time.

Host time is wall time on the host around each part, never waiting for the device except in `collect` (where it
waits for the sampled ids): on a GPU the launch parts are what the host pays to queue the work.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

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
)

PARTS = ("schedule", "build_step_inputs", "sampling_tensors", "to_device", "forward_launch", "sample_launch",
         "collect", "commit", "stop_strings")


class HostClock:
    """Accumulates host seconds per (step kind, part); the kind is that of the step being launched or applied."""

    def __init__(self) -> None:
        self.seconds: dict[tuple[str, str], list[float]] = defaultdict(list)
        self.kind = "?"
        self._current: dict[str, float] = defaultdict(float)
        self._open: set[str] = set()

    def wrap(self, part: str, fn: Callable) -> Callable:
        """fn, timed into `part`; a call nested in another call of the same part counts once."""
        def timed(*args: Any, **kwargs: Any) -> Any:
            if part in self._open:
                return fn(*args, **kwargs)
            self._open.add(part)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._current[part] += time.perf_counter() - start
                self._open.discard(part)
        return timed

    def begin(self, kind: str) -> None:
        self.kind, self._current = kind, defaultdict(float)

    def end(self) -> None:
        for part, seconds in self._current.items():
            self.seconds[(self.kind, part)].append(seconds)


def instrument(engine, clock: HostClock) -> None:
    runner, scheduler = engine.runner, engine.scheduler
    launch_next, apply = engine._launch_next, engine._apply

    def timed_launch_next():
        clock.begin("?")
        in_flight = launch_next()
        if in_flight is not None:
            clock.kind = in_flight.step.kind
            clock.end()
        return in_flight

    def timed_apply(in_flight):
        clock.begin(in_flight.step.kind)
        result = apply(in_flight)
        clock.end()
        return result

    engine._launch_next, engine._apply = timed_launch_next, timed_apply
    scheduler.schedule = clock.wrap("schedule", scheduler.schedule)
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
    parser.add_argument("--rows", type=int, default=640)
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs")
    add_out_argument(parser)
    args = parser.parse_args()
    options = dict(max_num_seqs=64, max_num_batched_tokens=2048, enforce_eager=args.eager)
    if not cuda_available():
        options["cpu_threads"] = 1  # as conf/job/shakespeare.yaml
    engine = build_engine(load_model_config("shakespeare"), **options)
    lines = (REPO / "jobs" / "shakespeare" / "prompts.jsonl").read_text().splitlines()[:args.rows]
    params = SamplingParams(max_tokens=64, temperature=0.8, top_k=40)
    requests = [(engine.detokenizer.encode(json.loads(line)["prompt"]), params) for line in lines]
    clock = HostClock()
    instrument(engine, clock)
    _, records, wall = run_engine(engine, requests)
    engine.close()
    results = []
    for kind in sorted({r.kind for r in records}):
        steps = [r for r in records if r.kind == kind]
        parts = {part: 1000 * statistics.median(clock.seconds[(kind, part)] or [0.0]) for part in PARTS}
        host = sum(ms for part, ms in parts.items() if part != "collect")
        # On CPU the launches run the work itself: the host's own share is what lies outside them.
        outside = host - parts["forward_launch"] - parts["sample_launch"]
        results.append({"kind": kind, "steps": len(steps), **parts, "host_ms": host, "host_outside_launch_ms": outside,
                        "median_forward_ms": statistics.median(r.forward_ms for r in steps),
                        "median_step_ms": statistics.median(r.step_ms for r in steps)})
    save_json(args.out, "profile_prefill_host", {"environment": environment(), "options": options, "wall_s": wall,
                                                 "results": results})
    headers = ["kind", "steps", *PARTS, "host_ms", "host_outside_launch_ms", "median_forward_ms", "median_step_ms"]
    print("Host ms per step (median) by part; collect includes waiting for the device and is not in host_ms")
    print(markdown_table(headers, [[r[h] for h in headers] for r in results]))


if __name__ == "__main__":
    main()
