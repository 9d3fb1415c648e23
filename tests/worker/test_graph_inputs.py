"""The CUDA graphs' static inputs (`GraphCaptureBuffers`): one byte buffer that each step fills in its bucket's
layout with one copy (run on CPU here: the layout and the padding, not the copy's asynchrony)."""

from __future__ import annotations

import numpy as np
import torch

from batchgen.worker.cuda_graph import GraphCaptureBuffers
from batchgen.worker.step_inputs import StepInputs

WIDTH = 6


def _decode_inputs(n: int, seed: int) -> StepInputs:
    rng = np.random.default_rng(seed)
    pending = rng.integers(-1, 4, n).astype(np.int64)
    return StepInputs(
        input_ids=rng.integers(0, 1000, n).astype(np.int64),
        positions=rng.integers(1, 500, n).astype(np.int64),
        slot_mapping=rng.integers(0, 9000, n).astype(np.int64),
        seq_lens=rng.integers(2, 501, n).astype(np.int32),
        query_start_loc=np.arange(n + 1, dtype=np.int32),
        block_tables=rng.integers(1, 600, (n, WIDTH)).astype(np.int32),
        sample_rows=list(range(n)), sample_token_index=np.arange(n, dtype=np.int64),
        pending_rows=pending, max_query_len=1, max_seq_len=500,
    )


def test_each_bucket_reads_its_step_and_padding_rows() -> None:
    buffers = GraphCaptureBuffers(24, WIDTH, block_size=16, device=torch.device("cpu"))
    for n, size in [(3, 8), (1, 1), (13, 16), (2, 2), (24, 24)]:  # layouts of different buckets overlap
        inputs = _decode_inputs(n, seed=n)
        greedy = np.arange(n) % 3 == 0 if n > 2 else None  # None: every row greedy
        buffers.load(inputs, size, greedy)
        views = buffers.views(size)
        assert all(view.shape[0] == size for view in views)
        assert views.block_tables.shape == (size, WIDTH) and views.block_tables.dtype == torch.int32
        for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "pending_rows", "block_tables"):
            assert np.array_equal(getattr(views, name)[:n].numpy(), getattr(inputs, name)), name
        assert views.argmax_rows[:n].tolist() == ([1] * n if greedy is None else greedy.astype(int).tolist())
        padding = {"input_ids": 0, "positions": 0, "slot_mapping": -1, "seq_lens": 0, "pending_rows": -1,
                   "argmax_rows": 0, "block_tables": 0}
        for name, value in padding.items():
            assert (getattr(views, name)[n:] == value).all(), name
        # 64-byte aligned in every bucket, so no bucket compiles its own variant of a Triton kernel
        assert all(view.data_ptr() % 64 == 0 for view in views)


def test_a_step_without_pending_tokens_gets_none_pending() -> None:
    buffers = GraphCaptureBuffers(8, WIDTH, block_size=16, device=torch.device("cpu"))
    inputs = _decode_inputs(4, seed=1)
    inputs.pending_rows = None
    buffers.load(inputs, 4)
    assert (buffers.views(4).pending_rows == -1).all()


def test_clear_leaves_padding_rows_only() -> None:
    buffers = GraphCaptureBuffers(16, WIDTH, block_size=16, device=torch.device("cpu"))
    buffers.load(_decode_inputs(16, seed=2), 16)
    buffers.clear(8)  # a capture of bucket 8 while bucket 16's step is staged
    views = buffers.views(8)
    assert (views.slot_mapping == -1).all() and (views.pending_rows == -1).all()
    assert (views.seq_lens == 0).all() and (views.block_tables == 0).all() and (views.input_ids == 0).all()
    assert (views.argmax_rows == 0).all()
