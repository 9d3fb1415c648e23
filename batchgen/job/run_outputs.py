"""One attempt's outputs in a run directory: its writers, opened for a new run or a resume, and at the end the final
Parquet files, summary.json and (for OpenAI Batch input) results.jsonl. The local job and the Ray driver both write
through it, so both leave the same run directory."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import pyarrow as pa

from batchgen.config import Config
from batchgen.io.openai_results import openai_results_wanted, write_openai_results
from batchgen.io.schema import STEPS_SCHEMA
from batchgen.io.writers import CompletionWriter, StepWriter, write_json_atomic
from batchgen.job.summary import AttemptStats, summarize, versions

SUMMARY_FILE = "summary.json"
STEP_FLUSH_ROWS = 4096


class RunOutputs:
    def __init__(self, config: Config, run_dir: Path, forced: dict[str, Any] | None,
                 steps_schema: pa.Schema = STEPS_SCHEMA):
        """forced: what a job.resume=force resume overrode (check_run_dir), recorded in the metadata and summary."""
        self.config, self.run_dir, self.forced = config, Path(run_dir), forced
        self.metadata: dict[str, Any] = {"config": asdict(config), "versions": versions()}
        if forced is not None:
            self.metadata["resume_forced"] = forced
        self.completions = CompletionWriter(self.run_dir, self.metadata, config.job.flush_rows,
                                            config.job.flush_seconds)
        # Steps come many per row and matter less than completions: they flush on time, or every STEP_FLUSH_ROWS.
        self.steps = StepWriter(self.run_dir, self.metadata, STEP_FLUSH_ROWS, config.job.flush_seconds, steps_schema)
        self.written = self.completions.finished_samples()  # {row index: sample indices} earlier attempts wrote
        # A killed attempt may have flushed no steps, so a resume counts as at least attempt 1.
        self.attempt = max(self.steps.next_attempt(), 1 if self.written else 0)

    def flush(self) -> None:
        self.completions.flush()
        self.steps.flush()

    def close(self) -> tuple[Path, Path]:
        """The writers' final completions.parquet and steps.parquet."""
        return self.completions.close(), self.steps.close()

    def write_summary(self, files: tuple[Path, Path], stats: AttemptStats, engine_info: dict[str, Any]
                      ) -> dict[str, Any]:
        """summary.json from the closed files, then results.jsonl for OpenAI Batch input; returns the summary."""
        summary = summarize(*files, stats, engine_info, asdict(self.config))
        if self.forced is not None:
            summary["resume_forced"] = self.forced
        write_json_atomic(self.run_dir / SUMMARY_FILE, summary)
        if openai_results_wanted(self.config):
            write_openai_results(self.config, self.run_dir)
        return summary
