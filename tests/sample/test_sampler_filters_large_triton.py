"""The sort-free filters of large vocabularies keep what torch's sort keeps, with the same filtered logits, and the
draw after them picks the same tokens: top-k, top-p and min-p alone and together, tokens tied at a cut, -inf logits,
filters that keep everything, greedy rows, bf16 and float32 logits."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="Triton kernels need triton (torch's CPU build has none)")

from batchgen.sample.params import SamplingParams  # noqa: E402
from tests.helpers.triton_support import DEVICE, ON_GPU, TRITON_MARKS  # noqa: E402

pytestmark = TRITON_MARKS

ROWS = 8
FILTERS = {"top_k": ("top_k",), "top_p": ("top_p",), "top_k+top_p": ("top_k", "top_p"), "min_p": ("min_p",),
           "all": ("top_k", "top_p", "min_p")}


def row_values(values: list, dtype: torch.dtype, rows: int = ROWS) -> torch.Tensor:
    return torch.tensor([values[i % len(values)] for i in range(rows)], dtype=dtype)


def inverse(temperatures: torch.Tensor) -> torch.Tensor:
    """1 / temperature, 1 for greedy rows (as SamplingBatch computes it)."""
    return 1.0 / torch.where(temperatures == 0, 1.0, temperatures)


def filter_tensors(vocab: int, names: tuple[str, ...], rows: int = ROWS) -> list[torch.Tensor | None]:
    tensors = {
        # 0: off; more than the vocabulary; 1,000: a cut among many candidates.
        "top_k": row_values([40, 0, 1, 5, vocab + 10, 3, 1000], torch.int64, rows),
        "top_p": row_values([0.87, 1.0, 0.52, 0.06, 0.99, 0.3], torch.float32, rows),  # 1: off
        "min_p": row_values([0.05, 0.0, 0.2, 0.5, 0.01], torch.float32, rows),  # 0: off
    }
    return [tensors[name] if name in names else None for name in tensors]


def torch_filters(logits, inv_temperatures, top_ks, top_ps, min_ps) -> torch.Tensor:
    """The reference: sampler's sort-based filters on CPU."""
    from batchgen.sample.sampler import _apply_min_p, _apply_top_k_top_p

    filtered = logits.cpu().float() * inv_temperatures.cpu().unsqueeze(1)
    if top_ks is not None or top_ps is not None:
        filtered = _apply_top_k_top_p(filtered, None if top_ks is None else top_ks.cpu(),
                                      None if top_ps is None else top_ps.cpu())
    if min_ps is not None:
        filtered = _apply_min_p(filtered, min_ps.cpu())
    return filtered


def torch_draw(filtered, temperatures, seeds, positions, greedy_ids) -> torch.Tensor:
    from batchgen.sample.sampler import _row_keys, _uniform

    gumbel = _uniform(_row_keys(seeds, positions), filtered.shape[1]).log_().neg_().log_()
    return torch.where(temperatures == 0, greedy_ids, (filtered - gumbel).argmax(dim=-1))


def check_against_torch(logits: torch.Tensor, temperatures: torch.Tensor, top_ks, top_ps, min_ps) -> torch.Tensor:
    """Filters and draws logits (B, V) on DEVICE and with torch's sort on CPU, asserts both equal; -> filtered."""
    from batchgen.sample.draw_triton import seeded_draw
    from batchgen.sample.filters_large_triton import filter_large_vocab

    rows = len(logits)
    inv_temperatures = inverse(temperatures)
    seeds = torch.arange(rows, dtype=torch.int64) * 2**40 + 3
    positions = torch.arange(rows, dtype=torch.int64) * 17
    greedy_ids = logits.float().argmax(dim=-1)
    expected = torch_filters(logits, inv_temperatures, top_ks, top_ps, min_ps)
    expected_ids = torch_draw(expected, temperatures, seeds, positions, greedy_ids)

    def on_device(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else tensor.to(DEVICE)

    device_args = [on_device(t) for t in (logits, temperatures, inv_temperatures, seeds, positions, greedy_ids)]
    logits_d, temperatures_d, inv_temperatures_d, seeds_d, positions_d, greedy_ids_d = device_args
    filtered = filter_large_vocab(logits_d, inv_temperatures_d, on_device(top_ks), on_device(top_ps),
                                  on_device(min_ps), greedy_ids_d)
    ids = seeded_draw(filtered, temperatures_d, inv_temperatures_d, seeds_d, positions_d, greedy_ids_d, scale=False)

    assert torch.equal(filtered.cpu(), expected)
    assert torch.equal(ids.cpu(), expected_ids)
    return expected


def random_logits(vocab: int, ties: bool, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if ties:  # few distinct values: many tokens tie at each cut
        logits = torch.randint(-6, 6, (ROWS, vocab), generator=gen).float()
    else:
        logits = torch.randn(ROWS, vocab, generator=gen) * 3
    logits[::4, ::3] = float("-inf")  # masked tokens (a bitmask's)
    allowed = torch.randperm(vocab, generator=gen)[:30]
    # A guided row: 30 tokens allowed, fewer than its top-k of 40.
    logits[0] = torch.full((vocab,), float("-inf")).index_copy_(0, allowed, logits[0, allowed])
    return logits


TEMPERATURES = [0.8, 0.0, 1.0, 1.7, 0.5]  # 0: a greedy row


@pytest.mark.parametrize("filters", list(FILTERS))
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "tied"])
def test_filters_equal_torch(ties, filters):
    vocab = 5000
    logits = random_logits(vocab, ties, seed=vocab + ties)
    expected = check_against_torch(logits, row_values(TEMPERATURES, torch.float32),
                                   *filter_tensors(vocab, FILTERS[filters]))
    assert (expected[torch.isfinite(logits)] == float("-inf")).any()  # a filter cut something


@pytest.mark.parametrize("ties", [False, True], ids=["bf16", "integers"])
def test_filters_equal_torch_bf16(ties):
    """40,000 logits a row, 40 chunks. The rows are peaked (low temperatures): torch's float32 softmax over a flat
    row of this size rounds its top-p masses by more than the probability of the tokens at the cut."""
    vocab = 40_000
    logits = torch.randn(ROWS, vocab, generator=torch.Generator().manual_seed(vocab)) * 3
    if ties:  # a few tokens on each integer near the max
        logits = logits.round()
    logits[::4, ::3] = float("-inf")
    temperatures = row_values([0.5, 0.0, 0.6, 0.7], torch.float32)
    check_against_torch(logits.to(torch.bfloat16), temperatures, *filter_tensors(vocab, FILTERS["all"]))


@pytest.mark.parametrize("chunk", [4096, 2048])
def test_chunk_sizes(monkeypatch, chunk):
    """The chunks of larger batches (the tests above run 1,024 logits a program)."""
    from batchgen.sample import filters_large_triton

    monkeypatch.setattr(filters_large_triton, "_CHUNKS", (chunk,))
    vocab = 7000
    logits = torch.randn(ROWS, vocab, generator=torch.Generator().manual_seed(1)) * 2
    check_against_torch(logits, row_values(TEMPERATURES, torch.float32), *filter_tensors(vocab, FILTERS["all"]))


def test_equal_logits_keep_the_first_by_index():
    """One key for the whole row: every cut falls among ties."""
    rows, vocab = 3, 5000
    logits = torch.zeros(rows, vocab)
    top_ks = torch.tensor([7, 0, 4000])
    top_ps = torch.tensor([1.0, 0.5 + 0.3 / vocab, 0.25 + 0.3 / 4000])  # off the multiples of a token's probability
    expected = check_against_torch(logits, torch.ones(rows), top_ks, top_ps, None)
    assert torch.isfinite(expected).sum(dim=1).tolist() == [7, 2501, 1001]


def test_cuts_far_below_the_max():
    """Logits spread over more than the bins span: the cuts lie in the far bin, among most of the row."""
    rows, vocab = 4, 6000
    logits = torch.linspace(0, -300, vocab).repeat(rows, 1)
    logits[:, ::2] -= 0.5  # distinct from their neighbours, not sorted by index
    top_ks = torch.tensor([vocab - 5, 4000, 0, 4500])
    min_ps = torch.tensor([0.0, 0.0, 1e-30, 0.0])
    check_against_torch(logits, torch.ones(rows), top_ks, None, min_ps)


def test_the_two_zeros_tie_at_a_cut():
    vocab = 5000
    logits = torch.full((2, vocab), -1.0)
    logits[:, :10] = 1.0
    logits[:, 10:30:2], logits[:, 11:30:2] = -0.0, 0.0  # top-k 20 cuts the zeros: the first ten by index stay
    expected = check_against_torch(logits, torch.ones(2), torch.full((2,), 20), None, None)
    assert torch.isfinite(expected[:, :20]).all() and not torch.isfinite(expected[:, 20:]).any()


@pytest.mark.parametrize("min_rows", [1, ROWS + 1], ids=["sort-free", "torch sort"])
def test_draw_dispatch_equals_the_torch_draw(monkeypatch, min_rows):
    """sampler._draw_cuda with a large vocabulary (sort-free from LARGE_VOCAB_FILTERS_MIN_ROWS rows) samples what
    the torch draw samples."""
    from batchgen.sample import sampler
    from batchgen.sample.batch import SamplingBatch

    monkeypatch.setattr(sampler, "LARGE_VOCAB_FILTERS_MIN_ROWS", min_rows)
    vocab = 5000
    logits = torch.randn(ROWS, vocab, generator=torch.Generator().manual_seed(5)) * 3
    params = [SamplingParams(temperature=[0.7, 0.0, 1.0][i % 3], top_k=[0, 20, 50][i % 3], top_p=[0.95, 1.0][i % 2],
                             min_p=[0.0, 0.1][i % 2], seed=i) for i in range(ROWS)]
    tensors = SamplingBatch.prepare(params, list(range(ROWS))).to_device("cpu")
    expected = sampler._draw(logits, tensors, None)

    def on_device(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else tensor.to(DEVICE)

    device_tensors = type(tensors)(**{name: on_device(getattr(tensors, name)) for name in (
        "temperature", "inv_temperature", "top_k", "top_p", "min_p", "seed", "position")})
    output = sampler._draw_cuda(logits.to(DEVICE), device_tensors, logits.argmax(dim=-1).to(DEVICE), True)

    assert torch.equal(output.filtered.cpu(), expected.filtered)
    assert torch.equal(output.token_ids.cpu(), expected.token_ids)


QWEN_VOCAB = 151_936


def top_p_between_tokens(logits: torch.Tensor, inv_temperatures: torch.Tensor, top_ks: torch.Tensor | None,
                         ranks: torch.Tensor) -> torch.Tensor:
    """Per row, the top-p halfway between the exact masses (float64, after top-k) ranked above its tokens at ranks r
    and r + 1, which keeps r + 1 tokens."""
    x = (logits.float() * inv_temperatures.unsqueeze(1)).double()
    sorted_x = x.sort(dim=1, descending=True, stable=True).values
    if top_ks is not None:
        k = torch.where(top_ks > 0, top_ks, x.shape[1]).unsqueeze(1)
        sorted_x.masked_fill_(torch.arange(x.shape[1]) >= k, float("-inf"))
    probs = sorted_x.softmax(dim=1)
    above = probs.cumsum(dim=1) - probs
    return ((above.gather(1, ranks.unsqueeze(1)) + above.gather(1, ranks.unsqueeze(1) + 1)) / 2).squeeze(1).float()


@pytest.mark.skipif(not ON_GPU, reason="Qwen's vocabulary on the GPU (the interpreter takes minutes)")
@pytest.mark.parametrize("filters", list(FILTERS))
def test_qwen_vocabulary_on_the_gpu(filters):
    """151,936 bf16 logits a row. torch's float32 softmax over so many logits is off by up to about 3e-5, more than
    the masses above some tokens lie from a round p: each row's p lies halfway between two tokens' exact masses."""
    rows = 64
    logits = (torch.randn(rows, QWEN_VOCAB, generator=torch.Generator().manual_seed(0)) * 3).to(torch.bfloat16)
    logits[::5, ::7] = float("-inf")
    temperatures = row_values([0.6, 0.7, 0.5, 0.8], torch.float32, rows)
    top_ks, top_ps, min_ps = filter_tensors(QWEN_VOCAB, FILTERS[filters], rows)
    if top_ps is not None:
        top_ps = top_p_between_tokens(logits, inverse(temperatures), top_ks, row_values([0, 2, 10, 40], torch.int64,
                                                                                        rows))
        top_ps[1::5] = 1.0  # off
    check_against_torch(logits, temperatures, top_ks, top_ps, min_ps)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_qwen_vocabulary_in_a_cuda_graph():
    from batchgen.sample.filters_large_triton import filter_large_vocab

    rows = 8
    logits = (torch.randn(rows, QWEN_VOCAB, device="cuda") * 3).to(torch.bfloat16)
    inv_temperatures = torch.full((rows,), 1 / 0.6, device="cuda")
    top_ks, top_ps, min_ps = (t.cuda() for t in filter_tensors(QWEN_VOCAB, FILTERS["all"], rows))
    greedy_ids = logits.argmax(dim=-1)
    args = (logits, inv_temperatures, top_ks, top_ps, min_ps, greedy_ids)
    eager = filter_large_vocab(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = filter_large_vocab(*args)
    logits.copy_((torch.randn(rows, QWEN_VOCAB, device="cuda") * 3).to(torch.bfloat16))  # new data, same buffers
    greedy_ids.copy_(logits.argmax(dim=-1))
    graph.replay()

    assert torch.equal(captured, filter_large_vocab(*args))
    assert not torch.equal(captured, eager)
