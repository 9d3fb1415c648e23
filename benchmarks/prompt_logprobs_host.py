"""The host's part of a scoring job's prompt logprobs, without a model: from each step's host copies of the scored
positions to completions.parquet, at the real_jobs `scoring` workload's size (64 rows of 4,000 prompt tokens, steps
of 8,192 scored positions, one alternative: 255,936 positions).

- attach_s: moving each step's values onto its requests (`attach_logprobs`), summed over the steps.
- write_s: the finished outputs through `completion_values` into a CompletionWriter, closed (completions.parquet).
- us_per_position: both, per scored position.
Each is the median of --repeats runs.

Two cases: no tokenizer (the real_jobs model: every text null), and a stand-in tokenizer whose decode is a format
string, so the texts' lookups are timed without a tokenizer's own cost.

Usage: python -m benchmarks.prompt_logprobs_host [--rows N] [--prompt-tokens N] [--step-positions N] [--repeats N]
                                                [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from batchgen.core.prompt_logprobs import PromptLogprobs
from batchgen.core.request import Request
from batchgen.core.scheduler import SchedulerOutput
from batchgen.engine.detokenizer import Detokenizer
from batchgen.engine.logprob_entries import PromptLogprobEntries, TokenTexts
from batchgen.engine.outputs import RequestOutput
from batchgen.engine.request_logprobs import attach_logprobs
from batchgen.io.prompt_rows import PromptRow
from batchgen.io.writers import CompletionWriter
from batchgen.job.run import completion_values
from batchgen.sample.logprobs import PromptLogprobRows, ScoredRange
from batchgen.sample.params import SamplingParams
from batchgen.worker.model_runner import StepResult
from benchmarks.common import add_out_argument, environment, markdown_table, save_json

VOCAB = 151_936


class FormatTokenizer:
    """decode([id]) -> "<id>": a tokenizer that costs nothing, so only the lookups are timed."""

    def decode(self, token_ids: list[int]) -> str:
        return f"<{token_ids[0]}>"


def scoring_steps(requests: list[Request], step_positions: int) -> list[tuple[SchedulerOutput, StepResult]]:
    """The steps of a scoring job whose steps each score step_positions prompt positions (the last fewer), with
    random values as their host copies."""
    rng = np.random.default_rng(0)
    work = [(request, position) for request in requests for position in range(1, request.num_prompt_tokens)]
    steps = []
    for begin in range(0, len(work), step_positions):
        chunk = work[begin:begin + step_positions]
        step_requests: list[Request] = []
        ranges: list[ScoredRange] = []
        for request, position in chunk:
            if not step_requests or step_requests[-1] is not request:
                step_requests.append(request)
                ranges.append(ScoredRange(len(step_requests) - 1, position, 0))
            ranges[-1] = ScoredRange(ranges[-1].row, ranges[-1].start, ranges[-1].count + 1)
        count = len(chunk)
        rows = PromptLogprobRows(ranges, -rng.random(count, dtype=np.float32), rng.integers(1, 100, count),
                                 rng.integers(0, VOCAB, (count, 1)), -rng.random((count, 1), dtype=np.float32))
        step = SchedulerOutput(step_requests, [r.count for r in ranges], [], count, 0)
        steps.append((step, StepResult([-1] * len(step_requests), 0, 0, 0, 0, None, False, prompt_logprobs=rows)))
    return steps


def measure(rows: int, prompt_tokens: int, step_positions: int, texts: TokenTexts) -> dict[str, Any]:
    rng = np.random.default_rng(1)
    params = SamplingParams(max_tokens=0, prompt_logprobs=1)
    requests = [Request(index, rng.integers(0, 10_000, prompt_tokens).tolist(), params) for index in range(rows)]
    for request in requests:
        request.prompt_logprobs = PromptLogprobs(request.prompt_array, 1, params.prompt_logprobs)
    steps = scoring_steps(requests, step_positions)
    start = time.perf_counter()
    for step, result in steps:
        attach_logprobs(step, result, texts)
    attach_s = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as directory:
        start = time.perf_counter()
        writer = CompletionWriter(Path(directory), {})
        for request in requests:
            output = RequestOutput(request.request_id, None, request.prompt_token_ids, None, [], "length",
                                   prompt_logprobs=PromptLogprobEntries(request.prompt_logprobs, texts))
            writer.write_values(completion_values(PromptRow(request.request_id, str(request.request_id), None,
                                                      request.prompt_token_ids, {}), output))
        writer.close()
        write_s = time.perf_counter() - start
    positions = rows * (prompt_tokens - 1)
    return {"positions": positions, "steps": len(steps), "attach_s": attach_s, "write_s": write_s,
            "us_per_position": (attach_s + write_s) / positions * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=4_000)
    parser.add_argument("--step-positions", type=int, default=8_192)
    parser.add_argument("--repeats", type=int, default=3)
    add_out_argument(parser)
    args = parser.parse_args()
    cases = {"no tokenizer": TokenTexts(None), "cached texts": TokenTexts(Detokenizer(FormatTokenizer()))}
    measure(2, 16, 8, TokenTexts(None))  # the first Parquet read back imports pandas: not the path's own cost
    results = {}
    for name, texts in cases.items():
        runs = [measure(args.rows, args.prompt_tokens, args.step_positions, texts) for _ in range(args.repeats)]
        results[name] = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    save_json(args.out, "prompt_logprobs_host", {"environment": environment(), "settings": vars(args) | {
        "out": str(args.out)}, "results": results})
    print(markdown_table(["case", "positions", "steps", "attach_s", "write_s", "us_per_position"],
                         [[name, r["positions"], r["steps"], r["attach_s"], r["write_s"], r["us_per_position"]]
                          for name, r in results.items()]))


if __name__ == "__main__":
    main()
