"""A batch job: read prompts, run them through the engine, write completions, steps and a summary."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from batchgen.config import Config, ConfigError
from batchgen.engine.detokenizer import Detokenizer
from batchgen.engine.llm_engine import LLMEngine
from batchgen.engine.step_profiler import StepProfiler
from batchgen.io.openai_batch import model_name
from batchgen.io.openai_results import openai_results_wanted, write_openai_results
from batchgen.io.readers import PromptRow, read_prompts
from batchgen.io.writers import CompletionWriter, StepWriter, write_json_atomic, write_kernels
from batchgen.outputs import RequestOutput
from batchgen.progress import Progress
from batchgen.runners.shards import shard_rows
from batchgen.summary import summarize, versions

log = logging.getLogger(__name__)

SUMMARY_FILE = "summary.json"
KERNELS_FILE = "kernels.parquet"
STEP_FLUSH_ROWS = 4096


def completion_record(row: PromptRow, output: RequestOutput | None = None) -> dict[str, Any]:
    """One completions.parquet row; without an output, the row's own input error."""
    if output is None:
        return {"index": row.index, "id": row.id, "prompt": row.prompt, "finish_reason": "error", "error": row.error,
                "sample_index": 0}
    return {
        "index": row.index, "sample_index": output.sample_index, "id": row.id, "prompt": row.prompt,
        "completion": output.text, "num_cached_tokens": output.num_cached_tokens,
        "prompt_token_ids": output.prompt_token_ids, "output_token_ids": output.token_ids,
        "num_prompt_tokens": len(output.prompt_token_ids), "num_output_tokens": len(output.token_ids),
        "finish_reason": output.finish_reason, "error": output.error,
        "ttft_ms": output.ttft_ms, "tpot_ms": output.tpot_ms, "latency_ms": output.latency_ms,
    }


class Job:
    def __init__(self, config: Config, run_dir: Path):
        self.config = config
        self.run_dir = Path(run_dir)
        # Input problems surface here, before the model loads.
        self.openai_results = openai_results_wanted(config)
        self.detokenizer = Detokenizer.load(config.model)
        rows = read_prompts(config.data, self.detokenizer.tokenizer if self.detokenizer else None,
                            model_name(config.model))
        self.num_input_rows = len(rows)
        self.rows = shard_rows(rows, config.data.num_shards, config.data.shard_index)
        existing = [p.name for p in (self.run_dir / CompletionWriter.FILE_NAME,
                                     self.run_dir / "completions.parts") if p.exists()]
        if existing and not config.job.resume:
            raise ConfigError(f"job.resume=false but {self.run_dir} already holds results ({', '.join(existing)}); "
                              "pass job.resume=true with hydra.run.dir set to it to continue, or use a new run dir")
        metadata = {"config": asdict(config), "versions": versions()}
        self.metadata = metadata
        self.completions = CompletionWriter(self.run_dir, metadata, config.job.flush_rows, config.job.flush_seconds)
        # Steps come many per row and matter less than completions: they flush on time, or every STEP_FLUSH_ROWS.
        self.steps = StepWriter(self.run_dir, metadata, STEP_FLUSH_ROWS, config.job.flush_seconds)
        written = self.completions.finished_samples()
        # A row is done when all its samples are; a resumed row generates only the samples it lacks.
        num_samples = {row.index: self._num_samples(row) for row in self.rows}
        self.missing_samples = {row.index: [i for i in range(num_samples[row.index])
                                            if i not in written.get(row.index, ())] for row in self.rows}
        self.total_samples = sum(num_samples.values())
        self.pending = [row for row in self.rows if self.missing_samples[row.index]]
        # A killed attempt may have flushed no steps, so a resume counts as at least attempt 1.
        self.attempt = max(self.steps.next_attempt(), 1 if written else 0)
        if written:
            log.info("Resuming %s (attempt %d): %d of %d rows already done", self.run_dir, self.attempt,
                     len(self.rows) - len(self.pending), len(self.rows))

    def _num_samples(self, row: PromptRow) -> int:
        """Completion rows the input row yields: sampling.n, or 1 for a row that is an error."""
        if row.error is not None:
            return 1
        try:
            return self.config.sampling.with_overrides(row.overrides).n
        except ValueError:
            return 1

    def run(self) -> dict[str, Any]:
        start = time.perf_counter()
        rows_by_index = {row.index: row for row in self.pending}
        missing = sum(len(samples) for samples in self.missing_samples.values())
        self.progress = Progress(self.total_samples, self.total_samples - missing, self.config.job)
        engine = None
        try:
            for row in self.pending:
                if row.error is not None:
                    self._write_error_row(row)
            engine = LLMEngine(self.config.model, self.config.engine, self.detokenizer)
            if self.config.job.profile_steps:
                engine.profiler = StepProfiler(self.config.job.profile_steps, engine.device)
            rows = iter([row for row in self.pending if row.error is None])
            rows_left = True
            while rows_left or engine.has_unfinished_requests:
                if rows_left:
                    rows_left = self._add_requests(engine, rows)
                finished, step = engine.step()
                if step is not None:
                    self.steps.write({**asdict(step), "attempt": self.attempt})
                for output in finished:
                    self.completions.write(completion_record(rows_by_index[output.request_id], output))
                self.progress.update(finished)
        except BaseException:
            self.completions.flush()
            self.steps.flush()
            log.error("Job stopped; finished rows are in %s (resume with job.resume=true)", self.run_dir)
            raise
        finally:
            self.progress.close()
            if engine is not None:
                if engine.profiler is not None:
                    write_kernels(self.run_dir / KERNELS_FILE, engine.profiler.rows, self.metadata)
                engine.close()
        wall = time.perf_counter() - start
        summary = summarize(self.completions.close(), self.steps.close(), self.attempt, wall,
                            (self.progress.prompt_tokens, self.progress.output_tokens),
                            engine.info, asdict(self.config))
        write_json_atomic(self.run_dir / SUMMARY_FILE, summary)
        if self.openai_results:
            write_openai_results(self.config, self.run_dir)
        log.info("Done: %d rows in %.1f s -> %s", len(self.rows), wall, self.run_dir)
        return summary

    def _write_error_row(self, row: PromptRow) -> None:
        self.completions.write(completion_record(row))
        self.progress.update([], errors=1)

    def _add_requests(self, engine: LLMEngine, rows: Iterator[PromptRow]) -> bool:
        """Adds rows until about two batches wait (rows are read lazily); returns whether rows are left."""
        backlog = 2 * self.config.engine.max_num_seqs
        while engine.num_waiting < backlog:
            row = next(rows, None)
            if row is None:
                return False
            try:
                params = self.config.sampling.with_overrides(row.overrides)
            except ValueError as exc:
                row.error = f"row {row.index}: {exc}"
                self._write_error_row(row)
            else:
                engine.add_request(row.index, row.prompt, row.prompt_token_ids, params,
                                   self.missing_samples[row.index])
        return True


def run(config: Config, run_dir: Path) -> dict[str, Any]:
    return Job(config, run_dir).run()
