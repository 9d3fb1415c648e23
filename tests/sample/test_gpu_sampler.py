"""On CUDA the sampler's draw is a Triton kernel; it must pick what the torch path picks for the same seeds."""

import pytest
import torch

from batchgen.sample.params import SamplingParams
from tests.sample.test_sampler import sample, tensors_for

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("filters", [{}, {"top_k": 50}, {"top_p": 0.9}, {"min_p": 0.05}])
def test_cuda_draw_equals_cpu_draw(filters):
    rows, vocab = 64, 50_000
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(1)) * 4
    params = [SamplingParams(temperature=0.5 + (i % 4) * 0.25, **filters) for i in range(rows)]
    seeds, positions = list(range(1000, 1000 + rows)), list(range(rows))
    on_cpu = sample(logits, tensors_for(params, seeds, positions))
    on_gpu = sample(logits.cuda(), tensors_for(params, seeds, positions, device="cuda"))
    assert torch.equal(on_cpu, on_gpu.cpu())
