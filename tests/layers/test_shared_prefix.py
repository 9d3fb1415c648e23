"""The shared KV prefix of a decode batch, computed on the device from its block tables (cascade attention)."""

from __future__ import annotations

import pytest
import torch

from batchgen.layers.shared_prefix import shared_prefix_len


def _tables(rows: list[list[int]], width: int = 6) -> torch.Tensor:
    table = torch.zeros(len(rows), width, dtype=torch.int32)
    for i, row in enumerate(rows):
        table[i, :len(row)] = torch.tensor(row, dtype=torch.int32)
    return table


@pytest.mark.parametrize(("rows", "seq_lens", "expected"), [
    ([[5, 6, 7], [5, 6, 9], [5, 6, 7]], [40, 40, 33], 32),  # a divergent third block in one row
    ([[5, 6, 7], [5, 6, 7], [5, 6, 7]], [40, 41, 35], 35),  # no more than the shortest context
    ([[5, 6, 7], [5, 6, 7], []], [40, 48, 0], 40),  # a padding row matches anything
    ([[5, 6, 7], [4, 6, 7]], [40, 40], 0),  # a later match does not count without the blocks before it
    ([[5, 6], [5, 6, 3]], [20, 47], 20),  # a row's zero columns past its blocks never widen the prefix
    ([[], [5, 6]], [0, 20], 0),  # row 0 padding: the kernel reads through row 0's table
    ([[5, 6, 7]], [40], 40),
], ids=str)
def test_shared_prefix_len(rows, seq_lens, expected) -> None:
    got = shared_prefix_len(_tables(rows), torch.tensor(seq_lens, dtype=torch.int32), block_size=16)
    assert got.dtype == torch.int32 and got.shape == (1,)
    assert got.item() == expected
