"""job.profile_steps: which steps the profiler records, and the rows it writes on CPU."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from batchgen.worker.step_profiler import WARMUP_STEPS, StepProfiler


def no_kernels(step):
    return SimpleNamespace(padded_size=None)


def chosen(profiler: StepProfiler, steps: list[tuple[str, int]]) -> list[int]:
    """Indices the profiler records among (kind, num_waiting) steps, launched as the engine launches them."""
    picked = []
    for index, (kind, waiting) in enumerate(steps):
        if profiler.wants(index, kind, waiting):
            picked.append(index)
            profiler.launch(no_kernels, SimpleNamespace(kind=kind), index)
    return picked


def test_window_opens_at_the_first_prefill_after_warm_up_and_holds_n_decodes():
    steps = [("prefill", 8), ("decode", 8), ("decode", 8), ("decode", 8), ("prefill", 4), ("decode", 4),
             ("mixed", 2), ("decode", 2), ("decode", 2), ("decode", 2)]
    assert chosen(StepProfiler(3, torch.device("cpu")), steps) == [4, 5, 6, 7, 8]


def test_window_opens_at_a_decode_when_no_prompt_waits():
    steps = [("prefill", 0)] + [("decode", 0)] * 6
    assert chosen(StepProfiler(2, torch.device("cpu")), steps) == [WARMUP_STEPS, WARMUP_STEPS + 1]


def test_cpu_ops_of_a_step_become_rows_with_gaps():
    profiler = StepProfiler(1, torch.device("cpu"))
    x = torch.ones(64, 64)

    def launch(step):
        (x @ x).sum()
        return SimpleNamespace(padded_size=None)

    profiler.launch(launch, SimpleNamespace(kind="decode"), 7)
    rows = profiler.rows
    assert {r["name"] for r in rows} >= {"aten::matmul", "aten::sum"}
    assert all(r["step"] == 7 and r["kind"] == "decode" and not r["cuda_graph"] for r in rows)
    assert rows[0]["start_us"] == 0 and rows[0]["gap_before_us"] == 0
    assert all(r["duration_us"] >= 0 and r["gap_before_us"] >= 0 for r in rows)
    assert [r["start_us"] for r in rows] == sorted(r["start_us"] for r in rows)
