"""A row's own host work outside the scheduler and the step inputs, on the many_rows rows (windows of 8-32 characters
of the play text, the Shakespeare model on CPU, max_tokens 16), in one process and without a forward:
- add: the rows into the engine as the job adds them (LLMEngine.add_requests, in chunks of --chunk rows), the
  scheduler's enqueue included;
- output: each finished request's RequestOutput (LLMEngine._output: its text decoded, its timings), the requests
  given 16 output tokens each;
- write: each output's completions row (completion_values) through a CompletionWriter flushing 4,096-row parts;
- progress: Progress.update over 500-row steps.
Microseconds per row of the thread's CPU time, the best and the median of --repeats passes, each under the engine
loop's collector thresholds.

Usage: python -m benchmarks.row_path_host [--rows N] [--repeats N] [--chunk N] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from batchgen.config import Config, JobConfig
from batchgen.core.request import RequestStatus
from batchgen.engine.collector import rare_collections
from batchgen.engine.llm_engine import LLMEngine
from batchgen.io.readers import PromptRow
from batchgen.io.writers import CompletionWriter
from batchgen.job.progress import Progress
from batchgen.job.run import completion_values
from batchgen.sample.params import SamplingParams
from benchmarks.common import (
    add_out_argument,
    build_engine,
    environment,
    load_model_config,
    markdown_table,
    save_json,
    text_windows,
)

PARTS = ("add", "output", "write", "progress")
MAX_TOKENS = 16
STEP_ROWS = 500  # finished rows per progress update: about one many_rows step's


def one_pass(engine: LLMEngine, rows: list[PromptRow], params: SamplingParams, chunk: int) -> dict[str, float]:
    """Seconds of thread CPU time of each of PARTS over the rows."""
    clock = time.thread_time
    seconds = {}
    start = clock()
    for first in range(0, len(rows), chunk):
        engine.add_requests([(row.index, row.prompt, row.prompt_token_ids, params, None)
                             for row in rows[first:first + chunk]])
    seconds["add"] = clock() - start
    requests = list(engine.scheduler.waiting)
    engine.scheduler.waiting.clear()
    now = time.perf_counter()
    for request in requests:  # finished as a step would leave them
        request.output_token_ids = [(request.request_id * 7 + j) % 60 + 1 for j in range(MAX_TOKENS)]
        request.first_token_time, request.finish_time = now, now + 0.01
        request.finish_reason, request.status = "length", RequestStatus.FINISHED
    start = clock()
    outputs = [engine._output(request) for request in requests]
    seconds["output"] = clock() - start
    rows_by_index = {row.index: row for row in rows}
    with tempfile.TemporaryDirectory(prefix="batchgen_row_path_") as tmp:
        writer = CompletionWriter(Path(tmp), {"config": asdict(Config())}, JobConfig().flush_rows)
        start = clock()
        for output in outputs:
            writer.write_values(completion_values(rows_by_index[output.request_id], output))
        writer.flush()
        seconds["write"] = clock() - start
    progress = Progress(len(rows), 0, JobConfig(progress=False))
    start = clock()
    for first in range(0, len(outputs), STEP_ROWS):
        progress.update(outputs[first:first + STEP_ROWS])
    seconds["progress"] = clock() - start
    progress.close()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunk", type=int, default=1024, help="rows per add_requests call")
    add_out_argument(parser)
    args = parser.parse_args()
    engine = build_engine(load_model_config("shakespeare"), device="cpu", max_num_seqs=512)
    texts = text_windows(args.rows, (8, 32))
    token_ids = engine.detokenizer.encode_batch(texts)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_k=40)
    passes = []
    for _ in range(args.repeats):
        rows = [PromptRow(i, f"s{i:06d}", text, list(ids), {})
                for i, (text, ids) in enumerate(zip(texts, token_ids, strict=True))]
        with rare_collections():
            passes.append(one_pass(engine, rows, params, args.chunk))
    us = {part: [1e6 * seconds[part] / args.rows for seconds in passes] for part in PARTS}
    summary = {part: {"best": min(values), "median": statistics.median(values), "all": values}
               for part, values in us.items()}
    save_json(args.out, "row_path_host", {"environment": environment(), "rows": args.rows, "chunk": args.chunk,
                                          "us_per_row": summary})
    print(f"\n## A row's host work outside the scheduler: {args.rows} many_rows rows, us per row (thread CPU time)\n")
    print(markdown_table(["part", "best", "median"], [[part, summary[part]["best"], summary[part]["median"]]
                                                      for part in PARTS]))


if __name__ == "__main__":
    main()
