"""Async scheduling (step N+1 staged while step N runs) gives exactly what one-step-at-a-time scheduling gives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchgen import LLM, SamplingParams

MODEL_DIR = Path(__file__).resolve().parents[2] / "jobs" / "shakespeare" / "model"
PROMPTS_FILE = MODEL_DIR.parent / "prompts.jsonl"


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    with PROMPTS_FILE.open() as f:
        return [json.loads(line)["prompt"] for line in f][:24]


def mixed_params(llm: LLM) -> list[SamplingParams]:
    """Rows that end in every way: length, a stop token id, a stop string, early or late, greedy or sampled."""
    newline = llm.engine.detokenizer.encode("\n")[0]
    params = []
    for i in range(24):
        stop = {0: {"stop_token_ids": [newline]}, 1: {"stop": ["e ", "th"]}, 2: {}}[i % 3]
        sampling = {"temperature": 0} if i % 2 else {"temperature": 0.9, "top_k": 20, "seed": i}
        params.append(SamplingParams(max_tokens=1 + (i * 7) % 40, **stop, **sampling))
    return params


def generate(prompts: list[str], **engine_options):
    llm = LLM(str(MODEL_DIR), device="cpu", max_num_seqs=8, **engine_options)
    try:
        outputs = llm.generate(prompts, mixed_params(llm), use_tqdm=False)
    finally:
        llm.close()
    return [(o.token_ids, o.text, o.finish_reason) for o in outputs], sum(o.num_preemptions for o in outputs)


@pytest.mark.parametrize("options", [{}, {"num_gpu_blocks_override": 40, "block_size": 4},
                                     {"mixed_prefill_decode": True, "max_num_batched_tokens": 16}],
                         ids=["plain", "preemption", "mixed-chunked"])
def test_async_scheduling_equals_sync(prompts, options):
    sync, sync_preemptions = generate(prompts, async_scheduling=False, **options)
    assert {reason for _, _, reason in sync} == {"length", "stop"}
    outputs, preemptions = generate(prompts, async_scheduling=True, **options)
    assert outputs == sync
    assert (preemptions > 0) == (sync_preemptions > 0) == ("num_gpu_blocks_override" in options)


def test_async_step_rows_cover_every_launched_step(prompts):
    llm = LLM(str(MODEL_DIR), device="cpu", max_num_seqs=4)
    for i, prompt in enumerate(prompts[:6]):
        llm.engine.add_request(i, prompt, None, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    records, finished = [], []
    while llm.engine.has_unfinished_requests:
        done, record = llm.engine.step()
        finished += done
        records += [record] if record is not None else []
    llm.close()
    assert sorted(o.request_id for o in finished) == list(range(6))
    assert [r.step for r in records] == list(range(len(records)))
    assert sum(r.num_decode_tokens + r.num_prefill_tokens for r in records) >= sum(
        o.num_output_tokens - 1 + len(o.prompt_token_ids) for o in finished)
    assert all(r.step_ms >= r.wait_ms >= 0 for r in records)
    # Each step's launch counts in its own step_ms, although the next step is launched before it is applied.
    assert all(r.schedule_ms + r.prepare_ms + r.forward_ms + r.sample_ms + r.wait_ms <= r.step_ms for r in records)


def test_rows_that_end_together_make_room_for_waiting_rows_within_the_same_call(prompts):
    """Rows of one length that start together end on one step, which leaves the next schedule empty. The waiting rows
    they make room for are launched within the step() call that returns them, so that their outputs are built and
    written while the device runs the new rows: no later call only launches (a call without a record), and the tokens
    are one-step-at-a-time scheduling's."""
    runs = {}
    for async_scheduling in (True, False):
        llm = LLM(str(MODEL_DIR), device="cpu", max_num_seqs=4, async_scheduling=async_scheduling)
        for i, prompt in enumerate(prompts[:10]):
            llm.engine.add_request(i, prompt, None, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
        calls_without_record, finished = 0, []
        while llm.engine.has_unfinished_requests:
            done, record = llm.engine.step()
            finished += done
            calls_without_record += record is None
        llm.close()
        runs[async_scheduling] = sorted((o.request_id, o.token_ids) for o in finished), calls_without_record
    assert runs[True][0] == runs[False][0] and len(runs[True][0]) == 10
    assert runs[True][1] == 1  # the first call: it launches the first step and has nothing to apply yet
    assert runs[False][1] == 0
