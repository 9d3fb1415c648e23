"""build_step_inputs: the flattened arrays of a step with multi-token chunks."""

import torch

from batchgen.core.request import PENDING_TOKEN, Request
from batchgen.core.scheduler import SchedulerOutput
from batchgen.sample.params import SamplingParams
from batchgen.worker.block_tables import BlockTables
from batchgen.worker.pending_tokens import PendingTokens
from batchgen.worker.step_inputs import build_step_inputs


def test_chunks_flatten_in_request_order():
    # block size 2: a new request's first 3 prompt tokens, and the last 2 tokens of a request 4 tokens in.
    first = Request(0, [10, 11, 12, 13, 14], SamplingParams(), block_ids=[7, 3])
    second = Request(1, [20, 21, 22, 23, 24, 25], SamplingParams(), block_ids=[1, 4, 6], num_computed_tokens=4)
    step = SchedulerOutput([first, second], [3, 2], [], 5, 0)
    inputs = build_step_inputs(step, block_size=2, tables=BlockTables(width=4))
    assert inputs.input_ids.tolist() == [10, 11, 12, 24, 25]
    assert inputs.positions.tolist() == [0, 1, 2, 4, 5]
    assert inputs.slot_mapping.tolist() == [14, 15, 6, 12, 13]
    assert inputs.seq_lens.tolist() == [3, 6] and inputs.query_start_loc.tolist() == [0, 3, 5]
    assert inputs.sample_rows == [1] and inputs.sample_token_index.tolist() == [4]
    assert (inputs.max_query_len, inputs.max_seq_len) == (3, 6)
    assert inputs.block_tables.tolist() == [[7, 3, 0], [1, 4, 6]]
    assert not inputs.has_pending_tokens


def test_a_pending_token_in_a_chunk_reads_the_previous_step_sample():
    request = Request(0, [10, 11], SamplingParams(), output_token_ids=[30, PENDING_TOKEN], block_ids=[0, 1])
    step = SchedulerOutput([request], [4], [], 4, 0)
    pending = PendingTokens(8, torch.device("cpu"))
    others = [Request(i, [1], SamplingParams()) for i in range(1, 6)]
    pending.sampled([*others, request], list(range(6)))  # the previous step sampled its token into row 5
    inputs = build_step_inputs(step, block_size=2, tables=BlockTables(width=2), pending=pending)
    assert inputs.input_ids.tolist() == [10, 11, 30, PENDING_TOKEN]
    assert inputs.pending_rows.tolist() == [-1, -1, -1, 5]
    assert inputs.has_pending_tokens


def test_a_chunk_past_the_prompt_joins_prompt_slices_in_order():
    # A recompute after preemption reaches into the outputs; the other chunks are slices of their prompts.
    first = Request(0, [10, 11, 12], SamplingParams(), block_ids=[0, 1])
    recomputed = Request(1, [20, 21], SamplingParams(), output_token_ids=[40, 41, 42], block_ids=[2, 3, 4])
    last = Request(2, [50, 51, 52, 53], SamplingParams(), block_ids=[5, 6], num_computed_tokens=2)
    step = SchedulerOutput([first, recomputed, last], [2, 4, 2], [], 8, 0)
    inputs = build_step_inputs(step, block_size=2, tables=BlockTables(width=3))
    assert inputs.input_ids.tolist() == [10, 11, 20, 21, 40, 41, 52, 53]
    assert inputs.positions.tolist() == [0, 1, 0, 1, 2, 3, 2, 3]
    assert not inputs.has_pending_tokens


def test_a_decode_shaped_step_reads_decodes_last_slots_and_chunks_by_position():
    # Two decodes (their last output slot: one committed, one pending) before a one-token chunk, a prompt's last
    # token left after its cached blocks; the chunk samples too.
    committed = Request(0, [10, 11], SamplingParams(), output_token_ids=[30, 31], block_ids=[0, 1],
                        num_computed_tokens=3)
    waiting = Request(1, [20, 21], SamplingParams(), output_token_ids=[40, PENDING_TOKEN], block_ids=[2, 3],
                      num_computed_tokens=3)
    chunk = Request(2, [50, 51, 52], SamplingParams(), block_ids=[4, 5], num_computed_tokens=2)
    step = SchedulerOutput([committed, waiting, chunk], [1, 1, 1], [], 1, 2)
    pending = PendingTokens(8, torch.device("cpu"))
    pending.sampled([waiting], [0])
    inputs = build_step_inputs(step, block_size=2, tables=BlockTables(width=2), pending=pending)
    assert inputs.input_ids.tolist() == [31, PENDING_TOKEN, 52]
    assert inputs.positions.tolist() == [3, 3, 2]
    assert inputs.pending_rows.tolist() == [-1, 0, -1]
    assert inputs.sample_rows == [0, 1, 2] and inputs.is_decode


def test_a_decode_shaped_step_samples_only_the_chunks_that_reach_their_end():
    # A one-token chunk in the middle of its prompt (the budget left one token) does not sample.
    decode = Request(0, [10, 11], SamplingParams(), output_token_ids=[30], block_ids=[0, 1], num_computed_tokens=2)
    middle = Request(1, [50, 51, 52], SamplingParams(), block_ids=[4, 5], num_computed_tokens=1)
    step = SchedulerOutput([decode, middle], [1, 1], [], 1, 1)
    inputs = build_step_inputs(step, block_size=2, tables=BlockTables(width=2))
    assert inputs.input_ids.tolist() == [30, 51]
    assert inputs.sample_rows == [0] and inputs.sample_token_index.tolist() == [0]
    assert inputs.slot_mapping.tolist() == [2, 9]
