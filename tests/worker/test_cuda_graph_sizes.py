"""Capture-size lists (`EngineConfig.cuda_graph_sizes`) and the size -> padded bucket lookup (no GPU needed)."""

from batchgen.config import CudaGraphConfig, EngineConfig
from batchgen.worker.cuda_graph import padded_size


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
