"""On CUDA: sampling inside the decode graph gives the eager pipeline's tokens and the old sampler's, for mixed
greedy, sampled, penalized, guided and logprobs rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from batchgen import LLM, SamplingParams
from batchgen.sample.graph import SamplerGraphs
from batchgen.sample.sampler import run_sampler
from batchgen.sample.state import SamplingState
from tests.helpers import reference_sampler
from tests.sample.test_sampling_pipeline import (
    VOCAB,
    logits_for,
    make_requests,
    mixed_params,
    penalized_params,
    step_batch,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHAKESPEARE = Path(__file__).resolve().parents[2] / "jobs" / "shakespeare" / "model"
PROMPTS = ["ROMEO:\n", "JULIET:\nO ", "First Citizen:\nWe ", "KING HENRY:\n", "GLOUCESTER:\n", "Nurse:\n"] * 3


def row_params(i: int) -> SamplingParams:
    kinds = [dict(temperature=0), dict(temperature=0.8, top_k=40), dict(temperature=0.9, top_p=0.9, min_p=0.05),
             dict(temperature=0, repetition_penalty=1.3), dict(temperature=0.7, frequency_penalty=0.5,
                                                               presence_penalty=0.3, logit_bias={5: 2.0}),
             dict(temperature=0.8, logprobs=3, min_tokens=8)]
    return SamplingParams(max_tokens=40, seed=i, ignore_eos=True, **kinds[i % len(kinds)])


def guided_every_third(requests) -> np.ndarray | None:
    """Every third request (by id) may only produce lowercase letters and spaces (a hand-made bitmask)."""
    mask = np.full((len(requests), 3), -1, dtype=np.int32)
    for row, request in enumerate(requests):
        if request.request_id % 3 == 0:
            mask[row] = 0
            for token in ALLOWED:
                mask[row, token // 32] |= np.int32(np.uint32(1 << (token % 32)).view(np.int32))
    return mask


ALLOWED: list[int] = []


def run(enforce_eager: bool, guided: bool) -> list:
    # float32, as the other graph-vs-eager tests: the forward's kernels differ between the modes, not its precision.
    llm = LLM(str(SHAKESPEARE), dtype="float32", max_num_seqs=16, enforce_eager=enforce_eager,
              cuda_graph_capture_sizes=[1, 4, 8, 16])
    try:
        if guided:
            ALLOWED[:] = [llm.engine.detokenizer.encode(c)[0] for c in "abcdefghijklmnopqrstuvwxyz "]
            llm.engine.runner.bitmask_provider = guided_every_third
        outputs = llm.generate(PROMPTS, [row_params(i) for i in range(len(PROMPTS))], use_tqdm=False)
        graphs = llm.engine.runner.sampler_graphs
        captured = 0 if graphs is None else len(graphs.graphs)
    finally:
        llm.close()
    return outputs, captured


@pytest.mark.parametrize("guided", [False, True], ids=["plain", "bitmask"])
def test_graph_sampling_equals_eager(guided):
    eager, _ = run(enforce_eager=True, guided=guided)
    graphed, captured = run(enforce_eager=False, guided=guided)
    assert captured > 0, "the sampled decode steps should have run the sampler graph"
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
    for g, e in zip(graphed, eager, strict=True):
        if e.logprobs is not None:
            assert [x["top"][0]["token_id"] for x in g.logprobs] == [x["top"][0]["token_id"] for x in e.logprobs]
            assert np.allclose([x["logprob"] for x in g.logprobs], [x["logprob"] for x in e.logprobs], atol=1e-3)
    if guided:
        for output in graphed[::3]:
            assert set(output.token_ids) <= set(ALLOWED)


@pytest.mark.parametrize("penalties", [False, True], ids=["plain", "penalized"])
def test_captured_sampler_equals_eager_and_the_old_sampler(penalties):
    rows, size, device = 11, 16, torch.device("cuda")
    params = penalized_params(rows) if penalties else mixed_params(rows)
    results = []
    for graphed in (False, True):
        requests = make_requests([SamplingParams(**vars(p)) for p in params])
        state = SamplingState(VOCAB, device) if penalties else None
        pending_ids = torch.zeros(size, dtype=torch.int64, device=device)
        graphs = SamplerGraphs(size, VOCAB, pending_ids, device)
        logits = torch.zeros(size, VOCAB, device=device)
        tokens = []
        for step in range(4):
            sampling = step_batch(requests, state)
            logits[:rows] = logits_for(rows, seed=step).to(device)
            if graphed:
                ids = graphs.run(sampling, size, logits, state).token_ids.clone()
                assert graphs.graphs and torch.equal(pending_ids[:rows], ids)
            else:
                ids = run_sampler(logits[:rows], sampling.to_device(device, state)).token_ids
            if not penalties:
                used = [r.sampling_params for r in requests]
                old = reference_sampler.sample(logits[:rows].cpu(), reference_sampler.SamplingTensors.from_params(
                    used, [p.seed for p in used], [r.num_tokens for r in requests], "cpu"))
                assert torch.equal(ids.cpu(), old)
            tokens.append(ids.tolist())
            for request, token in zip(requests, ids.tolist(), strict=True):
                request.output_token_ids.append(token)
        results.append(tokens)
    assert results[0] == results[1]


def test_a_capture_first_waits_for_the_device_through_the_given_wait():
    """A sampler graph is captured between steps: its wait for the device goes through the engine's (rank 0 of
    tensor parallelism watches its followers there), not a synchronize that a dead follower would never end."""
    rows, size, device = 5, 8, torch.device("cuda")
    waits = []
    graphs = SamplerGraphs(size, VOCAB, torch.zeros(size, dtype=torch.int64, device=device), device,
                           wait_for_device=lambda: waits.append(torch.cuda.current_stream().query()))
    logits = torch.zeros(size, VOCAB, device=device)
    logits[:rows] = logits_for(rows, seed=0).to(device)
    requests = make_requests(mixed_params(rows))
    graphs.run(step_batch(requests, None), size, logits, None)
    graphs.run(step_batch(requests, None), size, logits, None)
    assert len(waits) == 1 and len(graphs.graphs) == 1  # once, for the one capture
