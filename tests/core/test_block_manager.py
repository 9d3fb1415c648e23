"""BlockManager: allocation grows a request's block list as its tokens need, free returns everything."""

import pytest

from batchgen.core.block_manager import BlockManager, PrefixLookup, hash_block, hash_blocks
from batchgen.core.request import PENDING_TOKEN, Request
from batchgen.sample.params import SamplingParams


def make_request(request_id: int = 0, prompt_len: int = 10, prompt: list[int] | None = None) -> Request:
    return Request(request_id, list(range(prompt_len)) if prompt is None else prompt, SamplingParams())


def compute(manager: BlockManager, request: Request, num_tokens: int | None = None) -> None:
    """Allocate for the request's remaining tokens and mark them computed, as a step that ran would."""
    num_new = (request.num_tokens if num_tokens is None else num_tokens) - request.num_computed_tokens
    manager.allocate(request, num_new)
    request.num_computed_tokens += num_new
    manager.cache_full_blocks(request, request.num_computed_tokens)


def admit(manager: BlockManager, request: Request) -> list[int]:
    """Admit a new request with its cache hits, as the scheduler does; returns the hits."""
    hits = manager.computed_blocks(request)
    manager.allocate(request, request.num_tokens - len(hits) * manager.block_size, hits)
    request.num_computed_tokens = len(hits) * manager.block_size
    return hits


def test_blocks_needed_rounds_up():
    manager = BlockManager(num_blocks=8, block_size=4)
    assert [manager.blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_holds_exactly_when_no_block_is_missing():
    manager = BlockManager(num_blocks=8, block_size=4)
    request = make_request(prompt_len=6)
    compute(manager, request)  # 6 tokens in 2 blocks of 4
    for num_new in range(0, 6):
        assert manager.holds(request, num_new) == (manager.num_missing_blocks(request, num_new) == 0)
    assert manager.holds(request, 2) and not manager.holds(request, 3)


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


def test_freed_blocks_are_reused_in_order_uncached_first():
    manager = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    first, second = make_request(0), make_request(1)
    manager.allocate(first, 4)
    manager.allocate(second, 2)
    manager.free(first)
    third = make_request(2)
    manager.allocate(third, 6)
    assert third.block_ids == [0, 1, 3]


def test_cannot_allocate_more_than_free():
    manager = BlockManager(num_blocks=2, block_size=4)
    request = make_request()
    assert manager.can_allocate(request, 8)
    assert not manager.can_allocate(request, 9)
    with pytest.raises(RuntimeError, match="needs 3 more KV blocks, only 2 free"):
        manager.allocate(request, 9)
    assert manager.num_free_blocks == 2 and request.block_ids == []


def test_try_allocate_allocates_only_what_fits():
    manager = BlockManager(num_blocks=2, block_size=4)
    request = make_request()
    assert not manager.try_allocate(request, 9)
    assert manager.num_free_blocks == 2 and request.block_ids == []
    assert manager.try_allocate(request, 8)
    assert request.block_ids == [0, 1] and manager.num_free_blocks == 0


@pytest.mark.parametrize("num_blocks, block_size", [(0, 4), (4, 0)])
def test_rejects_empty_cache(num_blocks, block_size):
    with pytest.raises(ValueError):
        BlockManager(num_blocks, block_size)


# -- prefix caching -------------------------------------------------------------------------------------------


def test_full_computed_blocks_are_cached_and_shared_by_reference():
    manager = BlockManager(num_blocks=10, block_size=4)
    first = make_request(0, 10)  # blocks [0..3], [4..7] full; [8, 9] partial
    compute(manager, first)
    assert manager.num_cached_blocks == 2 and first.block_ids == [0, 1, 2]
    second = make_request(1, prompt=list(range(9)) + [99, 98, 97])  # shares two full blocks and one more token
    assert admit(manager, second) == [0, 1]
    assert second.num_computed_tokens == 8 and second.block_ids == [0, 1, 3]
    assert [manager.ref_counts[i] for i in range(4)] == [2, 2, 1, 1]
    assert manager.num_used_blocks == 4
    manager.free(first)
    assert [manager.ref_counts[i] for i in range(4)] == [1, 1, 0, 1]
    assert manager.num_used_blocks == 3


def test_hash_chains_the_parent_block():
    manager = BlockManager(num_blocks=10, block_size=2)
    compute(manager, make_request(0, prompt=[1, 2, 3, 4, 5]))
    # Same second block, different first block: no hit at all.
    assert manager.computed_blocks(make_request(1, prompt=[9, 9, 3, 4, 5])) == []
    assert len(manager.computed_blocks(make_request(2, prompt=[1, 2, 3, 4, 6]))) == 2


def test_hash_blocks_chains_hash_block_over_the_full_blocks():
    parent = hash_block(None, [7, 7])
    first, second = hash_block(parent, [1, 2]), hash_block(hash_block(parent, [1, 2]), [3, 4])
    assert hash_blocks(parent, [1, 2, 3, 4, 5], 2) == [first, second]  # the partial block [5] is left out
    assert hash_blocks(None, [7, 7], 2) == [parent] and hash_blocks(None, [1], 2) == []


def test_lookup_prefix_names_the_first_block_the_request_computes_itself():
    manager = BlockManager(num_blocks=10, block_size=2)
    compute(manager, make_request(0, prompt=[1, 2, 3, 4, 5]))
    request = make_request(1, prompt=[1, 2, 3, 9, 5, 6, 7])
    hits, next_hash = manager.lookup_prefix(request)
    assert hits == [0] and next_hash == request.block_hashes[1] == hash_block(hash_block(None, [1, 2]), [3, 9])
    assert manager.lookup_prefix(make_request(2, prompt=[1, 2, 3, 4, 5])) == PrefixLookup([0, 1], None)
    assert manager.lookup_prefix(make_request(3, prompt=[1, 2, 3, 4])) == PrefixLookup([0], None)  # last token out


def test_uncached_prompt_blocks_are_those_missing_from_the_cache():
    manager = BlockManager(num_blocks=10, block_size=2)
    compute(manager, make_request(0, prompt=[1, 2, 3, 4]))
    request = make_request(1, prompt=[1, 2, 5, 6, 7, 8, 9])
    assert manager.uncached_prompt_blocks(request) == set(request.block_hashes[1:3])
    assert len(request.block_hashes) == 3
    assert manager.uncached_prompt_blocks(request, num_hits=2) == {request.block_hashes[2]}


def test_lookup_admission_answers_as_lookup_prefix_and_uncached_prompt_blocks():
    manager = BlockManager(num_blocks=12, block_size=2)
    compute(manager, make_request(0, prompt=[1, 2, 3, 4, 5]))
    for seq_id, prompt in enumerate(([1, 2, 3, 9, 5, 6, 7], [1, 2, 3, 4, 5], [8, 8, 8], [1, 2]), start=1):
        hits, next_hash, uncached = manager.lookup_admission(make_request(seq_id, prompt=prompt))
        request = make_request(seq_id, prompt=prompt)
        assert (hits, next_hash) == manager.lookup_prefix(request)
        assert uncached == manager.uncached_prompt_blocks(request, num_hits=len(hits))


def test_hash_prompt_hashes_the_full_prompt_blocks_of_requests_that_use_the_cache():
    manager = BlockManager(num_blocks=10, block_size=2)
    request = make_request(0, prompt=[1, 2, 3, 4, 5])
    manager.hash_prompt(request)
    assert request.block_hashes == hash_blocks(None, [1, 2, 3, 4], 2)
    assert manager.num_cached_blocks == 0  # hashed, not cached: nothing is computed yet
    opted_out = make_request(1, prompt=[1, 2, 3, 4, 5])
    opted_out.use_prefix_cache = False
    manager.hash_prompt(opted_out)
    off = BlockManager(num_blocks=10, block_size=2, enable_prefix_caching=False)
    uncached = make_request(2, prompt=[1, 2, 3])
    off.hash_prompt(uncached)
    assert opted_out.block_hashes == [] and uncached.block_hashes == []


def test_an_entirely_cached_prompt_still_computes_its_last_token():
    manager = BlockManager(num_blocks=10, block_size=4)
    compute(manager, make_request(0, 8))
    again = make_request(1, 8)
    assert admit(manager, again) == [0]  # the second block is recomputed, so that the last token has logits
    assert again.num_computed_tokens == 4 and again.block_ids == [0, 2]
    compute(manager, again)
    assert manager.block_hashes[2] is None and manager.num_cached_blocks == 2  # the duplicate stays unhashed
    longer = make_request(2, 9)
    assert admit(manager, longer) == [0, 1] and longer.num_computed_tokens == 8


def test_freed_cached_blocks_survive_until_needed_least_recently_freed_first():
    manager = BlockManager(num_blocks=6, block_size=2)
    old, new = make_request(0, prompt=[1, 2, 3, 4]), make_request(1, prompt=[5, 6, 7, 8])
    compute(manager, old)
    compute(manager, new)
    manager.free(old)
    manager.free(new)
    assert (manager.num_free_blocks, manager.num_cached_blocks) == (6, 4)
    # Never-cached blocks go first, then the old request's blocks tail first, then the new one's.
    filler = make_request(2, prompt=[0] * 5)
    manager.allocate(filler, 5)
    assert filler.block_ids == [4, 5, 1]
    assert manager.num_cached_blocks == 3
    assert manager.computed_blocks(make_request(3, prompt=[1, 2, 3, 4, 0])) == [0]
    assert manager.computed_blocks(make_request(4, prompt=[5, 6, 7, 8, 0])) == [2, 3]


def test_a_hit_on_a_free_block_takes_it_from_the_free_queue():
    manager = BlockManager(num_blocks=3, block_size=2)
    first = make_request(0, prompt=[1, 2, 3])
    compute(manager, first)
    manager.free(first)
    second = make_request(1, prompt=[1, 2, 3, 4, 5, 6])
    hits = manager.computed_blocks(second)
    assert hits == [0]
    assert manager.num_missing_blocks(second, 4, hits) == 3  # the hit and two new blocks
    assert manager.can_allocate(second, 4, hits)
    manager.allocate(second, 4, hits)
    assert second.block_ids[0] == 0 and manager.num_free_blocks == 0


def test_pending_tokens_are_never_hashed():
    manager = BlockManager(num_blocks=10, block_size=2)
    request = make_request(0, prompt=[1, 2, 3])
    request.output_token_ids = [PENDING_TOKEN]
    compute(manager, request)
    assert manager.num_cached_blocks == 1


def test_requests_that_opt_out_take_no_hits_and_caching_off_caches_nothing():
    manager = BlockManager(num_blocks=10, block_size=2)
    compute(manager, make_request(0, 6))
    opted_out = make_request(1, 6)
    opted_out.use_prefix_cache = False
    assert manager.computed_blocks(opted_out) == []
    off = BlockManager(num_blocks=10, block_size=2, enable_prefix_caching=False)
    compute(off, make_request(0, 6))
    assert off.num_cached_blocks == 0 and off.computed_blocks(make_request(1, 6)) == []


def test_blocks_filled_chunk_by_chunk_are_cached_as_they_fill():
    manager = BlockManager(num_blocks=10, block_size=4)
    request = make_request(0, 14)
    compute(manager, request, 6)
    assert manager.num_cached_blocks == 1
    compute(manager, request, 13)
    assert manager.num_cached_blocks == 3 and request.num_hashed_blocks == 3
    request.output_token_ids = [7, 8]  # decode-filled blocks are cached too
    compute(manager, request)
    assert manager.num_cached_blocks == 4


def test_known_token_ids_stop_at_the_first_pending_slot():
    request = make_request(prompt=[1, 2, 3])
    assert request.known_token_ids(0, 3) == [1, 2, 3]
    request.output_token_ids = [4, 5, PENDING_TOKEN, PENDING_TOKEN]
    assert request.known_token_ids(1, 7) == [2, 3, 4, 5]
    assert request.known_token_ids(3, 5) == [4, 5]
    assert request.known_token_ids(5, 7) == []
    assert request.known_token_ids(6, 7) == []


def test_known_block_is_the_range_when_every_token_is_known():
    for outputs in ([], [4, 5], [4, 5, PENDING_TOKEN, PENDING_TOKEN]):
        request = make_request(prompt=[1, 2, 3])
        request.output_token_ids = outputs
        for start in range(7):
            for end in range(start + 1, 10):  # up to two past the last token
                known = request.known_token_ids(start, end)
                assert request.known_block(start, end) == (known if len(known) == end - start else None)


def test_one_block_at_a_time_hashes_as_the_whole_sequence():
    """A decode fills one block per step: hashed alone, the chain is the one hash_blocks gives the whole sequence."""
    manager = BlockManager(num_blocks=16, block_size=4)
    request = make_request(prompt=[9, 8, 7, 6, 5])
    admit(manager, request)
    request.num_computed_tokens = 5
    outputs = [11, 12, 13, 14, 15, 16, 17, 18]
    for token in outputs:
        request.output_token_ids += [token, PENDING_TOKEN]  # the next step's token is still pending
        manager.allocate(request, 1)
        request.num_computed_tokens += 1
        manager.cache_full_blocks(request, request.num_computed_tokens)
        request.output_token_ids.pop()
    assert request.block_hashes == hash_blocks(None, [9, 8, 7, 6, 5, *outputs], 4)
    assert request.num_hashed_blocks == 3
