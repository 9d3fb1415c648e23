"""Whole generations with decode steps that repeat the previous step's rows, or those still running, scheduled from
its arrays give exactly what the general loop gives, row for row and token for token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchgen import LLM, SamplingParams
from batchgen.core.scheduler import Scheduler

MODEL_DIR = Path(__file__).resolve().parents[2] / "jobs" / "shakespeare" / "model"
PROMPTS_FILE = MODEL_DIR.parent / "prompts.jsonl"


def generate(monkeypatch: pytest.MonkeyPatch, repeat: bool, **engine_options) -> tuple[list, int, int]:
    """Outputs of 24 rows ending every way (length, stop id, stop string; n > 1; greedy and sampled), the number of
    steps that repeated the previous step's rows, and of those that repeated some of them."""
    with PROMPTS_FILE.open() as f:
        prompts = [json.loads(line)["prompt"] for line in f][:24]
    repeated = carried = 0
    schedule = Scheduler.schedule

    def counted(self):
        nonlocal repeated, carried
        output = schedule(self)
        repeated += output.same_rows_as_previous
        carried += output.previous_rows is not None and not output.same_rows_as_previous
        return output

    with monkeypatch.context() as patch:
        patch.setattr(Scheduler, "schedule", counted)
        if not repeat:
            patch.setattr(Scheduler, "_repeat_decodes", lambda self, step: False)
        llm = LLM(str(MODEL_DIR), device="cpu", max_num_seqs=8, **engine_options)
        try:
            newline = llm.engine.detokenizer.encode("\n")[0]
            params = [SamplingParams(max_tokens=1 + (i * 7) % 40, n=1 + (i % 4 == 0),
                                     **{0: {"stop_token_ids": [newline]}, 1: {"stop": ["e ", "th"]}, 2: {}}[i % 3],
                                     **({"temperature": 0} if i % 2 else {"temperature": 0.9, "top_k": 20, "seed": i}))
                      for i in range(24)]
            outputs = llm.generate(prompts, params, use_tqdm=False)
        finally:
            llm.close()
    rows = [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outputs]
    return rows, repeated, carried


@pytest.mark.parametrize("options", [{}, {"async_scheduling": False},
                                     {"num_gpu_blocks_override": 40, "block_size": 4},
                                     {"mixed_prefill_decode": True, "max_num_batched_tokens": 16}],
                         ids=["async", "sync", "preemption", "mixed-chunked"])
def test_repeated_decode_steps_give_the_general_loop_s_outputs(monkeypatch, options):
    outputs, repeated, carried = generate(monkeypatch, True, **options)
    general, general_repeated, general_carried = generate(monkeypatch, False, **options)
    assert repeated > 0 and carried > 0 and general_repeated == general_carried == 0
    assert outputs == general
    assert {reason for row in general for _, _, reason in row} == {"length", "stop"}
