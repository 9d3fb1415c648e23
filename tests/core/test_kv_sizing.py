"""The KV cache holds what the job can use at once, never more than the memory budget allows."""

from __future__ import annotations

import pickle
from concurrent.futures import Future

import pytest

from batchgen import LLM
from batchgen.core.kv_sizing import (
    FUSED_LOGPROBS_BYTES_PER_LOGIT,
    LOGPROBS_BYTES_PER_LOGIT,
    LOGPROBS_SLICE_BYTES,
    KVDemand,
    choose_num_blocks,
    job_block_limit,
    logprobs_slice_rows,
)


def test_limit_without_rows_is_max_num_seqs_full_sequences() -> None:
    assert job_block_limit(4, 100, 16).num_blocks == 4 * 7


def test_limit_with_rows_is_the_largest_rows_running_together() -> None:
    # Blocks per row (16-token blocks): 1, 2, 3 (capped at max_model_len=40), 1; two run at once: 3 + 2.
    demand = KVDemand([(4, 8), (20, 10), (30, 500), (1, 1)])
    choice = job_block_limit(2, 40, 16, demand)
    assert choice.num_blocks == 5 and "2 largest of the job's 4 rows" in choice.reason


def test_rows_never_raise_the_limit_above_max_num_seqs_full_sequences() -> None:
    demand = KVDemand([(100, 100)] * 3)
    assert job_block_limit(2, 64, 16, demand).num_blocks == 2 * 4


def test_only_rows_of_more_than_one_token_decode() -> None:
    assert KVDemand([(4, 0), (4, 1), (4, 2), (9, 30)]).num_decoding == 2
    assert KVDemand([]).num_decoding == 0


def test_a_coming_demand_knows_its_decoding_rows_at_once_and_waits_for_its_rows() -> None:
    """A job tokenizes its prompts while the engine loads: the engine reads num_decoding before the rows exist, and
    the rows (or what working them out raised) once it sizes the cache; a tensor-parallel follower's copy holds them."""
    rows: Future = Future()
    demand = KVDemand.coming(rows, num_decoding=1)
    assert demand.num_decoding == 1 and not rows.done()
    rows.set_result([(4, 1), (9, 30)])
    assert job_block_limit(2, 64, 16, demand).num_blocks == 1 + 3
    assert pickle.loads(pickle.dumps(demand)).rows == [(4, 1), (9, 30)]

    failed: Future = Future()
    failed.set_exception(ValueError("row 3: the prompt is not text"))
    with pytest.raises(ValueError, match="row 3"):
        job_block_limit(2, 64, 16, KVDemand.coming(failed, num_decoding=0))


def test_memory_budget_stays_an_upper_bound() -> None:
    limit = job_block_limit(8, 64, 16)
    assert choose_num_blocks(10, "budget", limit).num_blocks == 10
    assert choose_num_blocks(1000, "budget", limit).num_blocks == 32


def test_a_slice_of_logprobs_rows_stays_within_its_memory_bound() -> None:
    rows = logprobs_slice_rows(151936, LOGPROBS_BYTES_PER_LOGIT)  # Qwen3's vocabulary: 47 slices of 16,384 tokens
    assert rows == 353 and rows * 151936 * LOGPROBS_BYTES_PER_LOGIT <= LOGPROBS_SLICE_BYTES
    fused_rows = logprobs_slice_rows(151936, FUSED_LOGPROBS_BYTES_PER_LOGIT)  # the fused kernel copies nothing
    assert fused_rows == 1766 and fused_rows * 151936 * FUSED_LOGPROBS_BYTES_PER_LOGIT <= LOGPROBS_SLICE_BYTES
    assert logprobs_slice_rows(LOGPROBS_SLICE_BYTES, 1) == 1  # a row wider than the bound is still scored


def test_engine_cache_is_sized_to_max_num_seqs_and_override_wins(tiny_model_dir) -> None:
    model_dir = str(tiny_model_dir("LlamaForCausalLM"))  # max_position_embeddings=256
    llm = LLM(model_dir, device="cpu", max_num_seqs=3, block_size=16)
    assert llm.engine.info["kv_blocks"] == 3 * 16 and "max_num_seqs=3" in llm.engine.info["kv_blocks_reason"]
    llm.close()
    llm = LLM(model_dir, device="cpu", max_num_seqs=3, block_size=16, num_gpu_blocks_override=100)
    assert llm.engine.info["kv_blocks"] == 100
    llm.close()
