"""The PDL embedding lookup (`embedding_triton`) against F.embedding, and the `Embedding` layer that uses it.

Runs on CUDA; without a GPU, `TRITON_INTERPRET=1 pytest tests/test_embedding_triton.py` runs it through Triton's CPU
interpreter (it needs numpy<2.4).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from triton_support import DEVICE, TRITON_MARKS  # noqa: E402

from batchgen.layers import embedding_triton  # noqa: E402
from batchgen.layers.embedding import Embedding  # noqa: E402
from batchgen.layers.triton_layers import use_triton_layers  # noqa: E402

pytestmark = TRITON_MARKS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_tokens", "vocab", "dim"), [(1, 1000, 1024), (9, 65, 128), (300, 50, 100)], ids=str)
def test_lookup_matches_torch(num_tokens: int, vocab: int, dim: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(num_tokens * dim)
    weight = torch.randn(vocab, dim, generator=gen).to(dtype).to(DEVICE)
    ids = torch.randint(0, vocab, (num_tokens,), generator=gen).to(DEVICE)
    ids[-1] = vocab - 1  # the last row

    rows = embedding_triton.embedding(ids, weight)

    assert torch.equal(rows.cpu(), F.embedding(ids.cpu(), weight.cpu()))


def test_layer_takes_the_kernel_for_one_dimensional_ids_only(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    kernel = embedding_triton.embedding
    monkeypatch.setattr(embedding_triton, "embedding", lambda ids, weight: calls.append(ids.shape) or kernel(ids,
                                                                                                           weight))
    layer = Embedding(50, 16).to(DEVICE)
    ids = torch.tensor([[3, 1], [4, 1]], device=DEVICE)
    expected = F.embedding(ids, layer.weight)
    use_triton_layers(torch.nn.ModuleList([layer]), gemv=False)
    assert torch.equal(layer(ids[0]), expected[0]) and not calls  # left to torch without gemv
    layer.use_triton(DEVICE)
    assert torch.equal(layer(ids[0]), expected[0]) and calls == [(2,)]
    assert torch.equal(layer(ids), expected) and calls == [(2,)]  # 2-D ids: torch's
