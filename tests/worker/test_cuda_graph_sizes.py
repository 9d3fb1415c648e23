"""Capture-size lists (`EngineConfig.cuda_graph_sizes`), the size -> padded bucket lookup, and the buckets a lazy start
defers (no GPU needed)."""

import torch

from batchgen.config import CudaGraphConfig, EngineConfig
from batchgen.worker.cuda_graph import (
    CAPTURE_AFTER_USES,
    CudaGraphRunner,
    GraphCaptureBuffers,
    padded_size,
    start_sizes,
)
from batchgen.worker.pending_tokens import PendingTokens


def test_default_capture_sizes_follow_vllm():
    assert EngineConfig(max_num_seqs=256).cuda_graph_sizes == (1, 2, 4, *range(8, 257, 8))
    assert EngineConfig(max_num_seqs=1024).cuda_graph_sizes[-1] == 512
    assert EngineConfig(max_num_seqs=6).cuda_graph_sizes == (1, 2, 4, 6)
    assert EngineConfig(max_num_seqs=256, cuda_graph=CudaGraphConfig(max_capture_size=16)).cuda_graph_sizes == (
        1, 2, 4, 8, 16)


def test_given_capture_sizes_are_sorted_once_each():
    config = EngineConfig(max_num_seqs=8, cuda_graph=CudaGraphConfig(capture_sizes=[16, 1, 4, 4]))
    assert config.cuda_graph_sizes == (1, 4, 16)


def test_step_buffers_hold_a_bucket_larger_than_max_num_seqs():
    assert EngineConfig(max_num_seqs=8, cuda_graph=CudaGraphConfig(capture_sizes=[1, 16])).max_step_rows == 16
    assert EngineConfig(max_num_seqs=8, cuda_graph=CudaGraphConfig(capture_sizes=[1, 4])).max_step_rows == 8


def test_padded_size_is_the_smallest_bucket_that_holds_the_batch():
    sizes = [1, 2, 4, 8, 16]
    assert [padded_size(sizes, n) for n in range(1, 18)] == [1, 2, 4, 4, 8, 8, 8, 8] + [16] * 8 + [None]


def test_a_lazy_start_captures_the_powers_of_two_and_the_largest_bucket():
    assert start_sizes(list(EngineConfig(max_num_seqs=512).cuda_graph_sizes)) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert start_sizes([1, 2, 4, 6]) == [1, 2, 4, 6]
    assert start_sizes([3, 24, 40]) == [40]


def deferring_runner(buckets: list[int], start: list[int], out_of_memory_at: int | None = None):
    """A CudaGraphRunner on CPU whose captures only record their keys (a CUDA capture is the GPU tests')."""
    runner = CudaGraphRunner(torch.nn.Linear(2, 2), GraphCaptureBuffers(buckets[-1], 4, 16, torch.device("cpu")),
                             buckets, PendingTokens(buckets[-1], torch.device("cpu")))
    captured = []

    def capture_one(key):
        if key.size == out_of_memory_at:
            raise torch.OutOfMemoryError("no memory for the graph")
        captured.append(key.size)
        runner.graphs[key] = object()

    runner._capture_one = capture_one
    for size in start:
        runner._capture_size(size)
    runner.sizes = sorted(start)
    return runner, captured


def test_a_deferred_bucket_is_captured_at_its_nth_step_and_replays_the_next_captured_bucket_before():
    runner, captured = deferring_runner([1, 2, 4, 8, 16, 24, 32], start=[1, 2, 4, 8, 16, 32])
    rows = [17 + i % 8 for i in range(CAPTURE_AFTER_USES - 1)]  # every one of them in bucket 24
    assert [runner.step_size(n) for n in rows] == [32] * (CAPTURE_AFTER_USES - 1)
    assert captured == [1, 2, 4, 8, 16, 32]
    assert runner.step_size(22) == 24  # its CAPTURE_AFTER_USES-th step captures it
    assert captured[-1] == 24 and runner.deferred_seconds.keys() == {24}
    assert runner.step_size(20) == 24 and runner.step_size(5) == 8 and runner.step_size(33) is None
    assert captured.count(24) == 1 and runner.sizes == [1, 2, 4, 8, 16, 24, 32]


def test_a_deferred_bucket_without_memory_for_its_graph_stays_padded():
    runner, captured = deferring_runner([1, 8, 16, 24, 32], start=[1, 8, 16, 32], out_of_memory_at=24)
    assert [runner.step_size(20) for _ in range(CAPTURE_AFTER_USES + 3)] == [32] * (CAPTURE_AFTER_USES + 3)
    assert 24 not in runner.buckets and 24 not in runner.sizes
    assert list(runner.deferred_seconds) == [24]  # tried once


def test_the_dry_runs_warm_ups_take_the_start_buckets_first_then_the_others_each_smallest_first():
    """compile_ahead's dry run meets nearly every kernel in the start buckets (one of each launch configuration that
    changes with the rows), so it warms those up before the rest; between them every bucket warms up once."""
    runner, _ = deferring_runner([1, 2, 4, 8, 16, 24, 32, 40], start=[])
    assert [key.size for key in runner.warm_up_keys(start_buckets=True)] == [1, 2, 4, 8, 16, 32, 40]
    assert [key.size for key in runner.warm_up_keys(start_buckets=False)] == [24]
