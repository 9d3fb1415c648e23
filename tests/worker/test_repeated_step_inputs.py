"""A step that repeats the previous step's rows, or those of them still running (`SchedulerOutput.previous_rows`),
writes only its grown block-table rows and moves the previous step's inputs on; its inputs are those of the same step
built without that signal, each row's token read from the pending tokens instead of the host."""

from __future__ import annotations

import copy
import random
from dataclasses import fields

import numpy as np
import pytest
import torch

from batchgen.config import EngineConfig
from batchgen.core.block_manager import BlockManager
from batchgen.core.scheduler import Scheduler, SchedulerOutput
from batchgen.worker.block_tables import BlockTables
from batchgen.worker.pending_tokens import PendingTokens
from batchgen.worker.step_inputs import StepInputs, build_step_inputs
from tests.core.test_repeated_decodes import WORKLOADS, make_requests, sampled_token


def token_ids(inputs: StepInputs, pending: PendingTokens) -> np.ndarray:
    """The step's input ids as the device's embedding reads them."""
    if inputs.pending_rows is None:
        return inputs.input_ids
    pending_ids = pending.ids.numpy()
    return np.where(inputs.pending_rows >= 0, pending_ids[inputs.pending_rows], inputs.input_ids)


def assert_same_inputs(inputs: StepInputs, expected: StepInputs) -> None:
    for field in fields(StepInputs):
        if field.name in ("input_ids", "pending_rows"):  # compared as token_ids
            continue
        value, expected_value = getattr(inputs, field.name), getattr(expected, field.name)
        if isinstance(expected_value, np.ndarray):
            assert np.array_equal(value, expected_value), field.name
        else:
            assert value == expected_value, field.name


@pytest.mark.parametrize("workload", WORKLOADS, ids=lambda w: f"seed{w.seed}")
@pytest.mark.parametrize("width", [None, 80], ids=["eager", "graph-width"])
def test_repeated_steps_build_the_inputs_of_the_general_path(workload, width):
    config = EngineConfig(max_num_seqs=workload.max_num_seqs, max_num_batched_tokens=workload.max_num_batched_tokens,
                          max_model_len=256, mixed_prefill_decode=workload.mixed)
    scheduler = Scheduler(config, BlockManager(workload.num_blocks, workload.block_size, workload.prefix_caching))
    for request in make_requests(workload):
        scheduler.add_request(request)
    # Small tables, so that they grow; one pair for the signalled steps, one for the same steps without it.
    tables, general_tables = BlockTables(80, rows=4), BlockTables(80, rows=4)
    pending, general_pending = (PendingTokens(workload.max_num_seqs, torch.device("cpu")) for _ in range(2))
    in_flight: SchedulerOutput | None = None
    previous_inputs = None
    repeated = carried = 0
    rng = random.Random(workload.seed)
    while scheduler.has_unfinished_requests() or in_flight is not None:
        step = scheduler.schedule() if scheduler.has_unfinished_requests() else None
        if step is not None and not step.is_empty:
            unsignalled = copy.copy(step)
            unsignalled.same_rows_as_previous, unsignalled.grown_rows, unsignalled.previous_rows = False, [], None
            repeated += step.same_rows_as_previous
            carried += step.previous_rows is not None and not step.same_rows_as_previous
            inputs = build_step_inputs(step, workload.block_size, tables, width, pending, previous_inputs)
            expected = build_step_inputs(unsignalled, workload.block_size, general_tables, width, general_pending)
            assert_same_inputs(inputs, expected)
            assert np.array_equal(token_ids(inputs, pending), token_ids(expected, general_pending))
            previous_inputs = inputs
            # The device's sampled ids: each sampling row's, by its row among the sampling rows.
            sampled = [sampled_token(step.requests[row], step.output_slots[row]) for row in inputs.sample_rows]
            for ids in (pending.ids, general_pending.ids):
                ids[:len(sampled)] = torch.tensor(sampled, dtype=torch.int64)
            pending.sampled(step.requests, inputs.sample_rows)
            general_pending.sampled(step.requests, expected.sample_rows)
            scheduler.advance(step)
        else:
            step = None
        to_commit = in_flight if workload.async_order else step
        in_flight = step if workload.async_order else None
        if to_commit is not None:
            finished = scheduler.commit(to_commit, [sampled_token(r, slot) if samples else -1 for r, slot, samples in
                                                    zip(to_commit.requests, to_commit.output_slots,
                                                        to_commit.samples, strict=True)])
            if rng.random() < 0.3:  # as the engine, which releases a step's finished rows after committing it
                tables.release(finished)
                general_tables.release(finished)
    assert repeated > 0 and carried > 0
