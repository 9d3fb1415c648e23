"""The job's own work per row outside the engine, on the many_rows rows (`benchmarks/real_jobs.py many_rows`: JSONL rows
of 8-32 characters of the play text, the Shakespeare tokenizer), in one process and without a model:
- read: iter_prompts over the file and each row's sampling parameters (the job's reading, Job._read_shard);
- tokenize: the prompts in the job's batched calls (Job._tokenize);
- write: each row's completions values (completion_values, with a 16-token completion) written through a
  CompletionWriter that flushes parts every job.flush_rows rows, as the job's loop does;
- merge: closing the writer (the job's finish: the parts merged into completions.parquet).
With --token-rows N, also the classify rows (`benchmarks/real_jobs.py classify`: JSONL rows of 1,000 prompt token ids):
- read token ids: the same reading (iter_prompts and each row's sampling parameters) over N such rows.
With --job-phases, also the job's own phases before the engine loop on the many_rows rows, as a job runs them (its
garbage-collection settings, torch already imported as the package versions need it):
- job read_input: Job() (reading the rows, each row's parameters, the shard split);
- job open_outputs: Job._open_run_dir (checking the run dir, opening the writers, each row's samples to generate);
- job tokenize: Job._kv_demand (tokenizing the rows and the KV cache's demand: inside the engine's start).

Microseconds per row of CPU time and of wall time; the job's defaults (job.flush_rows) are the tree's own.

Usage: python -m benchmarks.job_io [--rows N] [--token-rows N] [--job-phases] [--out DIR]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from batchgen.config import Config, DataConfig, JobConfig
from batchgen.engine.collector import rare_collections
from batchgen.engine.detokenizer import Detokenizer
from batchgen.engine.outputs import RequestOutput
from batchgen.io.readers import PromptRow, iter_prompts
from batchgen.io.writers import CompletionWriter
from batchgen.job.row_work import TOKENIZE_CHUNK_ROWS
from batchgen.job.run import Job, completion_values
from batchgen.sample.params import SamplingParams, row_params
from benchmarks.common import add_out_argument, environment, load_model_config, markdown_table, save_json
from benchmarks.real_jobs import TINY_WORKLOADS, WORKLOADS, TokenRows, write_text_rows, write_token_rows

PARTS = ("read", "tokenize", "write", "merge")
JOB_PHASES = ("job read_input", "job open_outputs", "job tokenize")
SHAPE = TINY_WORKLOADS["many_rows"].rows  # the many_rows rows: 8-32 characters, max_tokens 16
MAX_TOKENS = SHAPE.max_tokens
TOKEN_SHAPE = WORKLOADS["classify"].rows  # the classify rows: 1,000 prompt token ids, max_tokens 1
assert isinstance(TOKEN_SHAPE, TokenRows)


def timed(seconds: dict[str, tuple[float, float]], part: str, fn: Callable[[], Any]) -> Any:
    """fn(); its (CPU, wall) seconds into seconds[part]."""
    cpu, wall = time.process_time(), time.perf_counter()
    result = fn()
    seconds[part] = (time.process_time() - cpu, time.perf_counter() - wall)
    return result


def read_rows(data: DataConfig, tokenizer: Any, defaults: SamplingParams) -> list[PromptRow]:
    """The job's reading of a file: its rows and each row's sampling parameters."""
    rows = list(iter_prompts(data, tokenizer))
    for row in rows:
        row_params(defaults, row.overrides, row.index)
    return rows


def read_token_rows(directory: Path, num_rows: int, tokenizer: Any) -> tuple[float, float]:
    """(CPU, wall) seconds of reading num_rows classify rows."""
    input_path = directory / "token_rows.jsonl"
    write_token_rows(input_path, replace(TOKEN_SHAPE, rows=num_rows))
    data = DataConfig(path=str(input_path), id_field="id")
    seconds: dict[str, tuple[float, float]] = {}
    timed(seconds, "read", lambda: read_rows(data, tokenizer, SamplingParams(max_tokens=TOKEN_SHAPE.max_tokens[0])))
    return seconds["read"]


def job_phases(directory: Path, num_rows: int) -> dict[str, tuple[float, float]]:
    """(CPU, wall) seconds of each of JOB_PHASES over num_rows many_rows rows."""
    import torch  # noqa: F401  (the run dir's metadata imports it: not the job's own work)

    input_path = directory / "job_input.jsonl"
    write_text_rows(input_path, replace(SHAPE, rows=num_rows))
    config = Config(model=load_model_config("shakespeare"), data=DataConfig(path=str(input_path), id_field="id"),
                    sampling=SamplingParams(max_tokens=MAX_TOKENS))
    seconds: dict[str, tuple[float, float]] = {}
    job = timed(seconds, "job read_input", lambda: Job(config, directory / "job_run"))
    timed(seconds, "job open_outputs", job._open_run_dir)
    timed(seconds, "job tokenize", lambda: job._kv_demand([row for row in job.pending if row.error is None]))
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--token-rows", type=int, default=0, help="classify rows to read too (0: none)")
    parser.add_argument("--job-phases", action="store_true", help="time the job's phases before its engine loop too")
    add_out_argument(parser)
    args = parser.parse_args()
    detokenizer = Detokenizer.load(load_model_config("shakespeare"))
    defaults = SamplingParams(max_tokens=MAX_TOKENS)
    seconds: dict[str, tuple[float, float]] = {}
    if args.job_phases:  # first: a job's process holds no other rows, which the collector would go over too
        with tempfile.TemporaryDirectory(prefix="batchgen_job_io_") as tmp:
            seconds.update(job_phases(Path(tmp), args.rows))
    with tempfile.TemporaryDirectory(prefix="batchgen_job_io_") as tmp, rare_collections():
        input_path = Path(tmp) / "input.jsonl"
        write_text_rows(input_path, replace(SHAPE, rows=args.rows))
        data = DataConfig(path=str(input_path), id_field="id")

        rows = timed(seconds, "read", lambda: read_rows(data, detokenizer.tokenizer, defaults))
        prompts = [row.prompt for row in rows]
        token_ids = timed(seconds, "tokenize", lambda: [
            ids for start in range(0, len(prompts), TOKENIZE_CHUNK_ROWS)
            for ids in detokenizer.encode_batch(prompts[start:start + TOKENIZE_CHUNK_ROWS])])
        outputs = [RequestOutput(request_id=row.index, prompt=row.prompt, prompt_token_ids=ids, text="x" * MAX_TOKENS,
                                 token_ids=list(range(MAX_TOKENS)), finish_reason="length", ttft_ms=1.0, tpot_ms=1.0,
                                 latency_ms=2.0) for row, ids in zip(rows, token_ids, strict=True)]
        run_dir = Path(tmp) / "run"
        writer = CompletionWriter(run_dir, {"config": asdict(Config())}, JobConfig().flush_rows)

        def write() -> None:
            for row, output in zip(rows, outputs, strict=True):
                writer.write_values(completion_values(row, output))

        timed(seconds, "write", write)
        timed(seconds, "merge", writer.close)
        shutil.rmtree(run_dir)
        token_seconds = read_token_rows(Path(tmp), args.token_rows, detokenizer.tokenizer) if args.token_rows else None
    per_row = {part: {"cpu_us": 1e6 * cpu / args.rows, "wall_us": 1e6 * wall / args.rows}
               for part, (cpu, wall) in seconds.items()}
    token_per_row = None if token_seconds is None else {
        "cpu_us": 1e6 * token_seconds[0] / args.token_rows, "wall_us": 1e6 * token_seconds[1] / args.token_rows}
    save_json(args.out, "job_io", {"environment": environment(), "rows": args.rows,
                                   "flush_rows": JobConfig().flush_rows, "us_per_row": per_row,
                                   "token_rows": args.token_rows, "token_ids_per_row": TOKEN_SHAPE.prompt_tokens[0],
                                   "token_rows_read_us_per_row": token_per_row})
    print(f"\n## The job's work outside the engine: {args.rows} many_rows rows, us per row "
          f"(job.flush_rows={JobConfig().flush_rows})\n")
    print(markdown_table(["part", "cpu_us", "wall_us"],
                         [[part, per_row[part]["cpu_us"], per_row[part]["wall_us"]]
                          for part in (*PARTS, *JOB_PHASES) if part in per_row]))
    if token_per_row is not None:
        print(f"\n## Reading {args.token_rows} classify rows ({TOKEN_SHAPE.prompt_tokens[0]} prompt token ids each), "
              "us per row\n")
        print(markdown_table(["part", "cpu_us", "wall_us"],
                             [["read token ids", token_per_row["cpu_us"], token_per_row["wall_us"]]]))


if __name__ == "__main__":
    main()
