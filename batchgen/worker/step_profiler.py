"""Kernel timelines of a few steps (job.profile_steps): torch.profiler around each chosen step's launch.

The window opens after the warm-up steps, at the next prefill or mixed step (or at a decode step when no prompt
waits), and closes once `num_decode_steps` decode steps are recorded. Each recorded step gets its own profiler
session, with the device synchronized before and after, so every kernel it lists belongs to that step, including the
kernels of a replayed CUDA graph; steps outside the window run untouched. The profiler's own start and stop land in
the recorded steps' step_ms (a step's launch counts in its own step_ms), so read the timings of those steps from
kernels.parquet, not steps.parquet.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

WARMUP_STEPS = 2  # the first steps compile kernels and allocate lazily: not what a timeline should show


class StepProfiler:
    def __init__(self, num_decode_steps: int, device: torch.device):
        self.num_decode_steps = num_decode_steps
        self.cuda = device.type == "cuda"
        self.activity = ProfilerActivity.CUDA if self.cuda else ProfilerActivity.CPU
        self.rows: list[dict[str, Any]] = []
        self._open = False
        self._decode_steps = 0
        with profile(activities=[self.activity]):
            pass  # the first session initialises the profiler (seconds with CUPTI), here rather than in a step

    def wants(self, index: int, kind: str, num_waiting: int) -> bool:
        if self._decode_steps >= self.num_decode_steps or index < WARMUP_STEPS:
            return False
        if not self._open:
            self._open = kind != "decode" or num_waiting == 0
        return self._open

    def launch(self, launch_step, step, index: int):
        """Runs `launch_step(step)` under the profiler and records its kernels (CPU ops on CPU) as step `index`."""
        if self.cuda:
            torch.cuda.synchronize()
        with profile(activities=[self.activity]) as prof:
            launched = launch_step(step)
            if self.cuda:
                torch.cuda.synchronize()
        self._decode_steps += step.kind == "decode"
        self._record(prof.events(), index, step.kind, launched.padded_size is not None)
        return launched

    def _record(self, events, index: int, kind: str, cuda_graph: bool) -> None:
        if self.cuda:
            chosen = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        else:  # top-level CPU ops only: nested ones would overlap their parents
            chosen = [e for e in events if e.cpu_parent is None]
        chosen.sort(key=lambda e: e.time_range.start)
        if not chosen:
            return
        origin = chosen[0].time_range.start
        busy_until = origin
        for event in chosen:
            start, end = event.time_range.start, event.time_range.end
            self.rows.append({"step": index, "kind": kind, "cuda_graph": cuda_graph, "name": event.name,
                              "start_us": float(start - origin), "duration_us": float(end - start),
                              "gap_before_us": float(max(0, start - busy_until))})
            busy_until = max(busy_until, end)
