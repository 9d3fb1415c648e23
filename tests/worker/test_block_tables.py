"""The persistent host block tables: only new blocks are written, preemption rewrites, rows are reused."""

import random

import numpy as np
import pytest

from batchgen.core.request import Request
from batchgen.sample.params import SamplingParams
from batchgen.worker.block_tables import BlockTables


def request(request_id: int, blocks: list[int]) -> Request:
    return Request(request_id, [1, 2, 3], SamplingParams(), block_ids=list(blocks))


def table_of(tables: BlockTables, requests: list[Request]) -> list[list[int]]:
    rows = tables.rows(requests)
    return [tables.table[row, :len(r.block_ids)].tolist() for row, r in zip(rows, requests, strict=True)]


def test_rows_follow_growing_block_lists():
    tables = BlockTables(width=8, rows=2)
    a, b = request(0, [5]), request(1, [7, 3])
    assert table_of(tables, [a, b]) == [[5], [7, 3]]
    a.block_ids.append(9)
    assert table_of(tables, [b, a]) == [[7, 3], [5, 9]]


def test_preemption_rewrites_the_row():
    tables = BlockTables(width=8)
    a = request(0, [5, 6])
    tables.rows([a])
    a.block_ids, a.num_preemptions = [1, 2, 4], 1
    assert table_of(tables, [a]) == [[1, 2, 4]]


def test_released_rows_are_reused_and_the_table_grows():
    tables = BlockTables(width=4, rows=2)
    first = [request(i, [i]) for i in range(2)]
    rows_before = set(tables.rows(first).tolist())
    tables.release(first)
    same_id_new_request = [request(0, [8, 9]), request(1, [7])]
    assert set(tables.rows(same_id_new_request).tolist()) == rows_before
    assert table_of(tables, same_id_new_request) == [[8, 9], [7]]
    many = [request(10 + i, [i, i + 1]) for i in range(5)]
    assert table_of(tables, many) == [[i, i + 1] for i in range(5)]
    assert len(np.unique(tables.rows(many + same_id_new_request))) == 7


def test_step_inputs_survive_the_table_growing_mid_step():
    from batchgen.core.scheduler import SchedulerOutput
    from batchgen.worker.step_inputs import build_step_inputs

    requests = [request(i, [i, 100 + i]) for i in range(5)]
    for r in requests:
        r.num_computed_tokens = 2
    step = SchedulerOutput(requests, [1] * 5, [], 5, 0)  # each request's last prompt token
    inputs = build_step_inputs(step, block_size=2, tables=BlockTables(width=4, rows=2))
    assert inputs.block_tables[:, :2].tolist() == [[i, 100 + i] for i in range(5)]
    assert inputs.slot_mapping.tolist() == [(100 + i) * 2 for i in range(5)]


def test_held_finds_only_requests_that_hold_a_row():
    from batchgen.core.request_rows import RequestRows

    rows = RequestRows(lambda row: type("Entry", (), {"row": row})(), range(2))
    a = request(0, [])
    assert rows.held(a) is None
    entry, taken = rows.entry(a, grow=lambda: range(2, 4))
    assert taken and rows.held(a) is entry
    rows.release([a])
    assert rows.held(a) is None


def test_entries_take_the_rows_entry_takes_one_request_at_a_time():
    """A prefill step's requests take their rows in one pass, the table growing midway: the rows one entry call per
    request would give, the held ones kept."""
    from batchgen.core.request_rows import RequestRows

    def table_rows(take_all: bool) -> list[int]:
        grown = [2]
        def grow() -> range:
            grown[0] *= 2
            return range(grown[0] // 2, grown[0])
        rows = RequestRows(lambda row: type("Entry", (), {"row": row})(), range(2))
        held = requests[1]
        rows.entry(held, grow)
        if take_all:
            return [entry.row for entry in rows.entries(requests, grow)]
        return [rows.entry(r, grow)[0].row for r in requests]

    requests = [request(i, []) for i in range(7)]
    assert table_rows(take_all=True) == table_rows(take_all=False) == [1, 0, 2, 3, 4, 5, 6]


def test_the_same_requests_again_write_only_their_new_blocks_and_a_preemption_still_rewrites():
    tables = BlockTables(width=8)
    a, b = request(0, [5]), request(1, [7, 3])
    rows = tables.rows([a, b]).tolist()
    b.block_ids.append(4)
    assert tables.rows([a, b]).tolist() == rows and table_of(tables, [a, b]) == [[5], [7, 3, 4]]
    a.block_ids, a.num_preemptions = [6], 1  # recomputed into as many blocks as it held
    assert table_of(tables, [a, b]) == [[6], [7, 3, 4]]


def test_a_released_row_given_to_a_new_request_is_written_for_it():
    tables = BlockTables(width=4, rows=1)
    old = request(0, [5, 6])
    tables.rows([old])
    tables.release([old])
    new = request(1, [8, 9])
    assert table_of(tables, [new]) == [[8, 9]]


def test_one_call_writes_new_grown_and_preempted_rows_alike():
    tables = BlockTables(width=6, rows=2)
    kept, grown, preempted = request(0, [1, 2]), request(1, [3]), request(2, [4, 5, 6])
    tables.rows([kept, grown, preempted])
    tables.rows([kept])  # another step: the next call is not a repeat of the first
    grown.block_ids += [7, 8]
    preempted.block_ids, preempted.num_preemptions = [9], 1
    new = [request(10 + i, [20 + i, 30 + i, 40 + i][:i + 1]) for i in range(3)]
    step = [new[0], preempted, kept, new[1], grown, new[2]]
    assert table_of(tables, step) == [r.block_ids for r in step]


@pytest.mark.parametrize("seed", range(20))
def test_random_steps_read_every_request_s_blocks_and_the_widest(seed):
    """Steps of the previous step's requests (blocks appended, a preemption now and then) mixed with steps of other
    requests (released, new, reordered): each request's row holds its blocks, and widest is the most any holds."""
    rng = random.Random(seed)
    tables = BlockTables(width=12, rows=2)
    live = [request(i, [rng.randrange(100)]) for i in range(6)]
    next_id = len(live)
    step = list(live)
    for _ in range(60):
        action = rng.random()
        if action < 0.6:  # the same requests again, some of them a block longer
            for r in step:
                if rng.random() < 0.3 and len(r.block_ids) < 12:
                    r.block_ids.append(rng.randrange(100))
        elif action < 0.7:  # one preempted and readmitted into fewer or more blocks
            victim = rng.choice(step)
            victim.block_ids = [rng.randrange(100) for _ in range(rng.randint(1, 12))]
            victim.num_preemptions += 1
        else:  # one finished and released, a new one admitted, the order shuffled
            done = live.pop(rng.randrange(len(live)))
            tables.release([done])
            live.append(request(next_id, [rng.randrange(100) for _ in range(rng.randint(1, 12))]))
            next_id += 1
            step = rng.sample(live, len(live))
        assert table_of(tables, step) == [r.block_ids for r in step]
        assert tables.widest == max(len(r.block_ids) for r in step)
