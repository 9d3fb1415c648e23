"""The PDL embedding lookup (`embedding_triton`) against F.embedding, with pending tokens too, and the `Embedding`
layer that uses it.

Runs on CUDA; without a GPU,
`TRITON_INTERPRET=1 pytest tests/layers/test_embedding_triton.py` runs it through Triton's CPU
interpreter (it needs numpy<2.4).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="Triton kernels need triton (torch's CPU build has none)")

from batchgen.layers import embedding_triton  # noqa: E402
from batchgen.layers.embedding import Embedding, InputIdsWithPending  # noqa: E402
from batchgen.layers.triton_layers import use_triton_layers  # noqa: E402
from tests.helpers.triton_support import DEVICE, TRITON_MARKS  # noqa: E402

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


def pending_tokens(num_tokens: int, vocab: int, gen: torch.Generator) -> InputIdsWithPending:
    ids = torch.randint(0, vocab, (num_tokens,), generator=gen)
    pending_ids = torch.randint(0, vocab, (8,), generator=gen)
    pending_rows = torch.randint(-1, 8, (num_tokens,), generator=gen)
    pending_rows[0], pending_rows[-1] = -1, 7  # a token of its own (unless it is the only one), and one pending
    return InputIdsWithPending(*(t.to(DEVICE) for t in (ids, pending_rows, pending_ids)))


@pytest.mark.parametrize("num_tokens", [1, 9, 300])
def test_pending_tokens_come_from_the_sampled_ids(num_tokens: int) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    weight = torch.randn(1000, 128, generator=gen).to(torch.bfloat16).to(DEVICE)
    pending = pending_tokens(num_tokens, 1000, gen)

    rows = embedding_triton.embedding(pending.ids, weight, pending.pending_rows, pending.pending_ids)

    filled = pending.filled().cpu()
    assert filled[-1] == pending.pending_ids[7].item() and (num_tokens == 1 or filled[0] == pending.ids[0].item())
    pending_rows = pending.pending_rows.cpu()
    assert torch.equal(filled, torch.where(pending_rows >= 0, pending.pending_ids.cpu()[pending_rows],
                                           pending.ids.cpu()))
    assert torch.equal(rows.cpu(), F.embedding(filled, weight.cpu()))


def test_layer_looks_pending_tokens_up_with_the_kernel_or_fills_them_for_torch() -> None:
    gen = torch.Generator().manual_seed(0)
    layer = Embedding(50, 16).to(DEVICE)
    pending = pending_tokens(12, 50, gen)
    expected = F.embedding(pending.filled(), layer.weight)
    assert torch.equal(layer(pending), expected)  # torch's lookup of the filled ids
    layer.use_triton(DEVICE)
    assert torch.equal(layer(pending), expected)
