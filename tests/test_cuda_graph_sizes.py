"""Capture-size lists and the size -> padded bucket lookup (no GPU needed)."""

from batchgen.worker.cuda_graph import default_capture_sizes, padded_size


def test_default_capture_sizes_follow_vllm():
    assert default_capture_sizes(256) == [1, 2, 4] + list(range(8, 257, 8))
    assert default_capture_sizes(1024)[-1] == 512
    assert default_capture_sizes(6) == [1, 2, 4, 6]
    assert default_capture_sizes(256, max_capture_size=16) == [1, 2, 4, 8, 16]


def test_padded_size_is_the_smallest_bucket_that_holds_the_batch():
    sizes = [1, 2, 4, 8, 16]
    assert [padded_size(sizes, n) for n in range(1, 18)] == [1, 2, 4, 4, 8, 8, 8, 8] + [16] * 8 + [None]
