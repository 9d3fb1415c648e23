"""Graph replay against the eager forward on the same decode step (GPU tests)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from batchgen import LLM, SamplingParams
from batchgen.worker.step_inputs import build_step_inputs

T = TypeVar("T")


def capture_graph(launch: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T]:
    """launch() run once on a side stream (its kernels compile outside the capture), then captured into a graph;
    returns the graph and what the captured launch returned (the tensors each replay rewrites)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        launch()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = launch()
    return graph, outputs


def first_decode_logits(llm: LLM, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Queues the prompts (greedy, 4 tokens), runs their prefill, and returns the first pure-decode step's logits as
    its bucket's graph replay gives them and as the eager forward does, (len(prompts), vocab) each; the requests are
    finished after, so the engine is empty for the next call."""
    engine, runner = llm.engine, llm.engine.runner
    for i, prompt in enumerate(prompts):
        engine.add_request(i, None, prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while True:
        step = engine.scheduler.schedule()
        if step.kind == "decode":
            break
        launched = runner.launch(step)
        engine.scheduler.advance(step)
        engine.scheduler.commit(step, runner.collect(launched).sampled_token_ids)
    num_seqs = len(prompts)
    with torch.inference_mode():
        inputs = build_step_inputs(step, runner.config.block_size, runner.block_tables, runner.block_table_width)
        graph_logits = runner.graphs.replay(inputs, runner.graphs.padded_size(num_seqs)).logits[:num_seqs].clone()
        eager_logits = runner._eager_forward(inputs, *runner._to_device(inputs))[1]
    for request in list(step.requests):
        engine.scheduler.finish_request(request, "length")
    return graph_logits, eager_logits
