"""BlockManager: allocation grows a request's block list as its tokens need, free returns everything."""

import pytest

from batchgen.engine.block_manager import BlockManager
from batchgen.engine.request import Request
from batchgen.sampling_params import SamplingParams


def make_request(request_id: int = 0, prompt_len: int = 10) -> Request:
    return Request(request_id, list(range(prompt_len)), SamplingParams())


def test_blocks_needed_rounds_up():
    manager = BlockManager(num_blocks=8, block_size=4)
    assert [manager.blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_allocate_and_free_accounting():
    manager = BlockManager(num_blocks=8, block_size=4)
    request = make_request()
    manager.allocate(request, 10)
    assert request.block_ids == [0, 1, 2]
    assert (manager.num_used_blocks, manager.num_free_blocks, manager.num_total_blocks) == (3, 5, 8)
    manager.free(request)
    assert request.block_ids == []
    assert (manager.num_used_blocks, manager.num_free_blocks) == (0, 8)


def test_allocate_counts_tokens_already_computed():
    manager = BlockManager(num_blocks=8, block_size=4)
    request = make_request()
    manager.allocate(request, 4)
    request.num_computed_tokens = 4
    assert manager.can_allocate(request, 0)
    manager.allocate(request, 0)
    assert request.block_ids == [0]
    manager.allocate(request, 1)  # token 4 opens the second block
    assert request.block_ids == [0, 1]
    request.num_computed_tokens = 5
    manager.allocate(request, 3)  # tokens 5..7 still fit in the second block
    assert request.block_ids == [0, 1]


def test_free_list_is_fifo():
    manager = BlockManager(num_blocks=4, block_size=2)
    first, second = make_request(0), make_request(1)
    manager.allocate(first, 4)
    manager.allocate(second, 2)
    manager.free(first)
    third = make_request(2)
    manager.allocate(third, 6)
    assert third.block_ids == [3, 0, 1]


def test_cannot_allocate_more_than_free():
    manager = BlockManager(num_blocks=2, block_size=4)
    request = make_request()
    assert manager.can_allocate(request, 8)
    assert not manager.can_allocate(request, 9)
    with pytest.raises(RuntimeError, match="needs 3 more KV blocks, only 2 free"):
        manager.allocate(request, 9)
    assert manager.num_free_blocks == 2 and request.block_ids == []


@pytest.mark.parametrize("num_blocks, block_size", [(0, 4), (4, 0)])
def test_rejects_empty_cache(num_blocks, block_size):
    with pytest.raises(ValueError):
        BlockManager(num_blocks, block_size)
