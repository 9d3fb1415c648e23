"""PendingTokens: the rows of the latest step's sampled ids, and how a later step's input ids point at them."""

import torch

from batchgen.core.request import PENDING_TOKEN, Request
from batchgen.sample.params import SamplingParams
from batchgen.worker.pending_tokens import PendingTokens


def test_a_step_reads_its_pending_tokens_from_the_rows_the_previous_step_sampled_into():
    requests = [Request(i, [1, 2], SamplingParams()) for i in range(4)]
    pending = PendingTokens(4, torch.device("cpu"))
    pending.sampled(requests, [1, 3])  # the launched step samples only requests 1 and 3
    pending.ids[:2] = torch.tensor([70, 90])  # what the sampler wrote, in sampling order

    rows = pending.rows([requests[3], requests[0], requests[1]], [PENDING_TOKEN, 5, PENDING_TOKEN])
    assert rows.tolist() == [1, -1, 0] and pending.row(requests[3]) == 1

    ids = torch.tensor([PENDING_TOKEN, 5, PENDING_TOKEN])
    assert pending.input_ids(ids, torch.from_numpy(rows)).filled().tolist() == [90, 5, 70]


def test_the_next_launch_replaces_the_rows():
    first, second = Request(0, [1], SamplingParams()), Request(1, [1], SamplingParams())
    pending = PendingTokens(2, torch.device("cpu"))
    pending.sampled([first, second], [0, 1])
    pending.sampled([first, second], [1])
    assert pending.rows([first, second], [5, PENDING_TOKEN]).tolist() == [-1, 0]


def test_a_decode_step_of_the_previous_steps_requests_reads_row_i_for_request_i():
    requests = [Request(i, [1], SamplingParams()) for i in range(3)]
    pending = PendingTokens(3, torch.device("cpu"))
    pending.sampled(requests, [0, 1, 2])
    assert pending.rows(list(requests), [PENDING_TOKEN] * 3).tolist() == [0, 1, 2]
    assert pending.rows(requests[::-1], [PENDING_TOKEN] * 3).tolist() == [2, 1, 0]
    assert pending.rows(requests, [PENDING_TOKEN, 4, PENDING_TOKEN]).tolist() == [0, -1, 2]
