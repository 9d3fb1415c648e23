"""A batch job: read prompts, run them through the engine, write completions, steps and a summary."""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import asdict
from itertools import pairwise
from operator import attrgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from batchgen.config import Config, ConfigError
from batchgen.core.kv_sizing import KVDemand
from batchgen.engine.collector import rare_collections
from batchgen.engine.logprob_entries import PromptLogprobEntries
from batchgen.engine.outputs import RequestOutput
from batchgen.io.atomic import DirectoryLock
from batchgen.io.errors import InputError
from batchgen.io.logprob_arrays import LogprobArrays
from batchgen.io.openai_results import openai_results_wanted, write_openai_results
from batchgen.io.readers import PromptRow
from batchgen.io.schema import COMPLETIONS_SCHEMA
from batchgen.io.shard_split import ShardSplit, SplitMismatch
from batchgen.io.writers import CompletionWriter, import_pandas_in_background, write_kernels
from batchgen.job.exits import is_environment_fault, process_ends_with_job
from batchgen.job.process_clock import take_startup
from batchgen.job.progress import Progress
from batchgen.job.resume_check import check_resume
from batchgen.job.row_work import open_input, read_shard
from batchgen.job.run_outputs import SUMMARY_FILE, RunOutputs
from batchgen.job.stop_signals import JobStopped, StopRequested, StopSignals, run_stoppable
from batchgen.job.summary import AttemptStats
from batchgen.tp.errors import FollowerExited

if TYPE_CHECKING:
    from batchgen.engine.llm_engine import LLMEngine, NewRow

log = logging.getLogger(__name__)

# Waits for the shard of every input row as a data-parallel parent weighed them; None where it did not.
GivenSplit = Callable[[], Sequence[int] | None]

KERNELS_FILE = "kernels.parquet"


TASK_COLUMNS = ("continuation_logprob", "continuation_num_tokens", "continuation_is_greedy", "embedding", "logits",
                "probs", "label", "score")  # RequestOutput fields of the score, embed and classify tasks
_task_values = attrgetter(*TASK_COLUMNS)  # in one call: a row's values are built per finished row
COMPLETION_COLUMNS = tuple(COMPLETIONS_SCHEMA.names)  # the order of completion_values' values
# An input error row's values after its error: no timings, sample 0, nothing generated.
_ERROR_ROW_TAIL = (None, None, None, 0, *(None,) * (len(COMPLETION_COLUMNS) - 14))


def completion_values(row: PromptRow, output: RequestOutput | None = None) -> tuple[Any, ...]:
    """One completions.parquet row as its values in COMPLETION_COLUMNS' order (CompletionWriter.write_values: no dict
    per row); without an output, the row's own input error."""
    if output is None:
        return (row.index, row.id, row.text, None, None, None, None, None, "error", row.error, *_ERROR_ROW_TAIL)
    prompt_token_ids, token_ids = output.prompt_token_ids, output.token_ids
    prompt_ids_value = prompt_token_ids if output.prompt_array is None else output.prompt_array  # see records_table
    return (row.index, row.id, row.text, output.text, prompt_ids_value, token_ids, len(prompt_token_ids),
            len(token_ids), output.finish_reason, output.error, output.ttft_ms, output.tpot_ms, output.latency_ms,
            output.sample_index, output.num_cached_tokens, output.logprobs,
            prompt_logprobs_value(output.prompt_logprobs), *_task_values(output))


def prompt_logprobs_value(entries: Sequence[dict | None] | None) -> pa.Array | Sequence[dict | None] | None:
    """The prompt_logprobs column's value: built from the engine's arrays, or as given (the Ray runner's outputs
    arrive as JSON lists)."""
    if entries is None or not isinstance(entries, PromptLogprobEntries):  # an ABC's isinstance is slow: most are None
        return entries
    scored, texts = entries.scored, entries.texts
    return LogprobArrays(scored.first, scored.token_ids, texts.texts(scored.token_ids), scored.logprobs,
                         scored.ranks, scored.top_ids, texts.texts(scored.top_ids), scored.top_logprobs).to_arrow()


def check_run_dir(config: Config, run_dir: Path) -> dict[str, Any] | None:
    """Refuses a run dir that holds results unless job.resume is set, and a resume whose output-altering
    configuration changed unless it is "force" (check_resume); returns what a forced resume overrode."""
    existing = [p.name for p in (run_dir / CompletionWriter.FILE_NAME, run_dir / "completions.parts") if p.exists()]
    if existing and not config.job.resume:
        raise ConfigError(f"job.resume=false but {run_dir} already holds results ({', '.join(existing)}); "
                          "pass job.resume=true with hydra.run.dir set to it to continue, or use a new run dir")
    forced = check_resume(run_dir, asdict(config), config.job.resume)
    if forced is not None:
        log.warning("job.resume=force: resuming despite changes that alter outputs: %s", forced["differences"])
    return forced


class Job:
    def __init__(self, config: Config, run_dir: Path, given_split: GivenSplit | None = None):
        """given_split: a data-parallel rank's wait for the split its parent weighed (`_read_shard`)."""
        self.config = config
        self.task = config.job.task
        self.run_dir = Path(run_dir)
        read_start = time.perf_counter()
        self.startup_phases = take_startup(read_start)
        import_pandas_in_background()
        # Input problems surface here, before the model loads.
        self.openai_results = openai_results_wanted(config)
        self.work, rows = open_input(config)
        with rare_collections():  # a row is several objects: the default thresholds would go over the rows many times
            self.rows = self._read_shard(rows, given_split)
        self.read_seconds = time.perf_counter() - read_start
        if self.num_input_rows == 0:
            if config.data.on_empty == "fail":
                raise InputError(f"{config.data.path}: no rows to generate (data.on_empty=fail)")
            log.warning("%s has no rows: writing empty outputs (data.on_empty=fail makes this an error)",
                        config.data.path)

    def _open_run_dir(self) -> None:
        """Checks the run dir (check_run_dir) and opens its outputs, or finds the run already finished there."""
        forced = check_run_dir(self.config, self.run_dir)
        self.finished_summary = self._finished_summary()
        if self.finished_summary is not None:
            return
        self.outputs = RunOutputs(self.config, self.run_dir, forced)
        written = self.outputs.written
        # A row is done when all its samples are; a resumed row generates only the samples it lacks. Only rows that
        # earlier attempts wrote samples of are in missing_samples: every other row lacks all its samples.
        self.num_samples = {row.index: 1 if row.error is not None else self.params[row.index].n for row in self.rows}
        self.missing_samples = {index: [i for i in range(self.num_samples[index]) if i not in samples]
                                for index, samples in written.items() if index in self.num_samples}
        self.pending = [row for row in self.rows if self.missing_samples.get(row.index, True)]
        self.stats = AttemptStats(self.outputs.attempt, startup_phases=self.startup_phases,
                                  read_input_seconds=self.read_seconds)
        if written:
            log.info("Resuming %s (attempt %d): %d of %d rows already done", self.run_dir, self.stats.number,
                     len(self.rows) - len(self.pending), len(self.rows))

    def _read_shard(self, rows: Iterable[PromptRow], given_split: GivenSplit | None) -> list[PromptRow]:
        """This run's rows (row_work.read_shard): all of them, or its shard's (data.num_shards). Sets num_input_rows
        and split_digest, which the shard marker records, and `params`: each own row's sampling parameters. A
        data-parallel rank whose parent weighed the input for a split by work takes the parent's assignment (the
        one it would compute) instead of tokenizing every row itself."""
        data = self.config.data
        split = ShardSplit(data.num_shards, data.shard_by)
        given = given_split() if split.weighs and given_split is not None else None
        if given is not None:
            split = ShardSplit(data.num_shards, data.shard_by, given=given)
        try:
            shard = read_shard(rows, split, data.shard_index, self.work)
        except SplitMismatch as exc:
            raise InputError(f"{data.path}: {exc} (the parent's read of the input): did the input change while the "
                             "job read it?") from exc
        self.params = shard.params
        self.num_input_rows, self.split_digest = shard.num_input_rows, shard.split_digest
        return shard.rows

    def _samples_to_write(self, index: int) -> int:
        missing = self.missing_samples.get(index)
        return self.num_samples[index] if missing is None else len(missing)

    def _rows_done(self) -> int:
        return len(self.outputs.completions.finished_indices(self.num_samples.__getitem__))

    def _finished_summary(self) -> dict[str, Any] | None:
        """The summary of a run that already finished (final files, no parts, a summary), which a resume keeps."""
        summary_path = self.run_dir / SUMMARY_FILE
        finished = ((self.run_dir / CompletionWriter.FILE_NAME).exists() and summary_path.exists()
                    and not (self.run_dir / "completions.parts").exists())
        return json.loads(summary_path.read_text()) if finished else None

    def run(self, signals: StopSignals | None = None, wait_for_ranks: Callable[[], None] | None = None
            ) -> dict[str, Any]:
        """Generates the rows the run dir lacks, holding its lock from the first write to the last, so that a second
        job on the same directory stops at once (DirectoryInUse). wait_for_ranks: a data-parallel rank's start
        barrier, passed once the engine is ready, so that the ranks generate together (a run with nothing to generate
        never calls it)."""
        opening = time.perf_counter()
        with DirectoryLock(self.run_dir):
            self._open_run_dir()
            return self._generate(signals, wait_for_ranks, opening)

    def _generate(self, signals: StopSignals | None, wait_for_ranks: Callable[[], None] | None, opening: float
                  ) -> dict[str, Any]:
        """opening: when the run dir's check began (a perf_counter), so that opening the outputs is a phase."""
        if self.finished_summary is not None:
            log.info("Nothing to do: %s already holds all %d rows; its summary.json is kept", self.run_dir,
                     self.finished_summary["rows"])
            if self.openai_results:  # derived from the final completions, so it can always be written again
                write_openai_results(self.config, self.run_dir)
            return self.finished_summary
        from batchgen.engine.llm_engine import LLMEngine  # torch: once the inputs have been read
        from batchgen.engine.model_worker import resolve_device

        signals = signals or StopSignals()
        rows_by_index = {row.index: row for row in self.pending}
        total_samples = sum(self.num_samples.values())
        done = sum(self.num_samples[index] - len(samples) for index, samples in self.missing_samples.items())
        self.progress = Progress(total_samples, done, self.config.job)
        engine = profiler = None
        clock = self._lap("open_outputs_seconds", opening)
        try:
            rows_to_run = [row for row in self.pending if row.error is None]
            if self.config.job.profile_steps:
                from batchgen.worker.step_profiler import StepProfiler  # torch.profiler: only when asked for

                profiler = StepProfiler(self.config.job.profile_steps, resolve_device(self.config.engine.device))
            demand = self._kv_demand(rows_to_run)
            engine = LLMEngine(self.config.model, self.config.engine, self.work.detokenizer, demand, profiler,
                               self.task)
            demand.rows  # noqa: B018 (the rows' token ids are set: an engine that sized its cache otherwise never waited)
            clock = self._lap("engine_start_seconds", clock)
            self.stats.engine_ready_at = time.time()
            if wait_for_ranks is not None:
                wait_for_ranks()
                clock = self._lap("wait_for_ranks_seconds", clock)
            self.stats.generation_started_at = time.time()
            signals.deferred = True  # from here on rows are written: a signal stops the loop at its next step
            for row in self.pending:
                if row.error is not None:
                    self._write_error_row(row)
            rows = iter(rows_to_run)
            rows_left = True
            # The first step launches once the rows it can take are in; from then on the backlog grows by two steps'
            # rows a step, so that adding rows (a job's first hundreds at once took longer than a step) never keeps
            # the device waiting.
            max_rows = engine.config.max_num_seqs
            step_rows = first_step_rows([self.work.num_prompt_tokens(row, self.params[row.index])
                                         for row in rows_to_run[:max_rows]], engine.config.max_num_batched_tokens,
                                        max_rows)
            backlog = step_rows
            write_values = self.outputs.completions.write_values
            front = WrittenFront.of(rows_to_run, self._samples_to_write)
            returned = None  # when engine.step() last returned: the job's own work since then is job_ms
            with rare_collections() as collections:
                while (rows_left or engine.has_unfinished_requests) and signals.received is None:
                    if rows_left:
                        rows_left = self._add_requests(engine, rows, backlog)
                        backlog = min(backlog + 2 * step_rows, self.config.engine.wanted_backlog)
                    called = time.perf_counter()
                    finished, step = engine.step()
                    if step is not None:
                        job_ms = (called - returned) * 1000 if returned is not None else 0.0
                        self.outputs.steps.write({**vars(step), "attempt": self.stats.number, "job_ms": job_ms})
                    returned = time.perf_counter()
                    for output in finished:
                        write_values(completion_values(rows_by_index[output.request_id], output))
                        self._count(output)
                    if finished and front is not None:
                        front.written(finished)
                        self.outputs.completions.complete_below(front.first_unwritten())
                    self.progress.update(finished)
            clock = self._lap("engine_loop_seconds", clock)
            self.stats.engine_loop_collections = collections
            self.stats.generation_finished_at = time.time()
        except BaseException as exc:
            self._flush_after(exc)
            if isinstance(exc, StopRequested):
                raise JobStopped(exc.signum, self._rows_done(), len(self.rows)) from None
            if not is_environment_fault(exc) and not isinstance(exc, FollowerExited):  # the CLI's one line says it
                log.error("Job stopped; finished rows are in %s (resume with job.resume=true)", self.run_dir)
            raise
        finally:
            self.progress.close()
            if engine is not None:
                if profiler is not None:
                    write_kernels(self.run_dir / KERNELS_FILE, profiler.rows, self.outputs.metadata)
                engine.close(free_memory=not process_ends_with_job())
        if signals.received is not None:
            self.outputs.flush()
            raise JobStopped(signals.received, self._rows_done(), len(self.rows))
        clock = self._lap("engine_close_seconds", clock)
        files = self.outputs.close()
        self._lap("finish_seconds", clock)
        summary = self.outputs.write_summary(files, self.stats, engine.info)
        log.info("Done: %d rows (%d errors) in %.1f s -> %s", summary["rows"], summary["job"]["error_rows"],
                 self.stats.wall_seconds, self.run_dir)
        log.info("%s", self.stats.time_line())
        return summary

    def _flush_after(self, failure: BaseException) -> None:
        """Flushes the finished rows after `failure`. When it was a failed write (a full disk), the flush may fail the
        same way: the rows flushed before are kept, and `failure` is the one to report."""
        try:
            self.outputs.flush()
        except OSError:
            if not isinstance(failure, OSError):
                raise

    def _kv_demand(self, rows: list[PromptRow]) -> KVDemand:
        """The rows' prompt lengths and max_tokens, so that the KV cache is sized to the job, worked out on a thread
        while the engine loads (the tokenizer's batched calls, most of it, release the GIL); the number of decoding
        requests, which needs no prompt, at once. The thread is a daemon: a job whose engine fails to start does not
        wait for it to exit."""
        coming: Future = Future()

        def work_out() -> None:
            try:
                coming.set_result(self._kv_demand_rows(rows))
            except BaseException as exc:
                coming.set_exception(exc)

        threading.Thread(target=work_out, name="batchgen-kv-demand", daemon=True).start()
        num_decoding = sum(self.params[row.index].n for row in rows if self.params[row.index].max_tokens > 1)
        return KVDemand.coming(coming, num_decoding)

    def _kv_demand_rows(self, rows: list[PromptRow]) -> list[tuple[int, int]]:
        demand = []
        with rare_collections():  # a list of ids per row: the default thresholds would go over the rows many times
            self.work.tokenize(rows)
            for row in rows:
                params = self.params[row.index]
                num_prompt_tokens = self.work.num_prompt_tokens(row, params)
                demand.extend([(num_prompt_tokens, params.max_tokens)] * params.n)  # each sample holds its own blocks
        return demand

    def _lap(self, phase: str, since: float) -> float:
        now = time.perf_counter()
        setattr(self.stats, phase, now - since)
        return now

    def _count(self, output: RequestOutput) -> None:
        self.stats.rows += 1
        self.stats.prompt_tokens += output.num_prompt_tokens_run
        self.stats.output_tokens += len(output.token_ids)

    def _write_error_row(self, row: PromptRow) -> None:
        self.outputs.completions.write_values(completion_values(row))
        self.stats.rows += 1
        self.progress.update([], errors=1)

    def _add_requests(self, engine: LLMEngine, rows: Iterator[PromptRow], backlog: int) -> bool:
        """Adds rows until `backlog` samples wait (rows are read lazily); returns whether rows are left. A generate
        job's rows go in batches (LLMEngine.add_requests), each as many as the backlog has room for if all their
        samples queue; what rows finishing at once as errors leave free, the next batch fills."""
        if self.task != "generate":
            return self._add_rows_one_by_one(engine, rows, backlog)
        while (room := backlog - engine.num_waiting) > 0:
            batch: list[NewRow] = []
            num_samples = 0
            while num_samples < room:
                row = next(rows, None)
                if row is None:
                    engine.add_requests(batch)
                    return False
                params, missing = self.params[row.index], self.missing_samples.get(row.index)  # None: all n samples
                batch.append((row.index, row.prompt, row.prompt_token_ids, params, missing))
                num_samples += params.n if missing is None else len(missing)
            engine.add_requests(batch)
        return True

    def _add_rows_one_by_one(self, engine: LLMEngine, rows: Iterator[PromptRow], backlog: int) -> bool:
        """_add_requests for the score, embed and classify tasks."""
        while engine.num_waiting < backlog:
            row = next(rows, None)
            if row is None:
                return False
            if self.task == "score":
                self._add_score_request(engine, row)
            else:
                engine.add_pooling_request(row.index, row.prompt, row.prompt_token_ids)
        return True

    def _add_score_request(self, engine: LLMEngine, row: PromptRow) -> None:
        token_ids = self.work.score_token_ids(row)
        if token_ids is None:
            row.error = (f"row {row.index}: the model has no tokenizer: give context_token_ids and "
                         "continuation_token_ids instead of texts")
            self._write_error_row(row)
            return
        engine.add_score_request(row.index, *token_ids, row.text)


def first_step_rows(prompt_tokens: Sequence[int], max_tokens: int, max_rows: int) -> int:
    """How many of the leading rows, of these prompt lengths (RowWork.num_prompt_tokens), a first prefill step can
    take: their prompts fill max_tokens, or max_rows of them (at least one). A prompt of unknown length (0: a text
    without a tokenizer) counts as one token."""
    tokens = 0
    for count, length in enumerate(prompt_tokens[:max_rows], start=1):
        tokens += length or 1
        if tokens >= max_tokens:
            return count
    return max(1, min(len(prompt_tokens), max_rows))


class WrittenFront:
    """The first of a job's rows, in index order, with a sample still to write: every row below it is written, which
    lets the completions file grow in its final order while rows finish out of order (PartedParquetWriter)."""

    def __init__(self, indices: list[int], samples_to_write: Callable[[int], int]):
        self._indices = indices
        self._left = {index: samples_to_write(index) for index in indices}
        self._next = 0

    @classmethod
    def of(cls, rows: list[PromptRow], samples_to_write: Callable[[int], int]) -> WrittenFront | None:
        """None where the rows do not go in increasing index order."""
        indices = [row.index for row in rows]
        return cls(indices, samples_to_write) if all(a < b for a, b in pairwise(indices)) else None

    def written(self, outputs: list[RequestOutput]) -> None:
        left = self._left
        for output in outputs:
            left[output.request_id] -= 1

    def first_unwritten(self) -> float:
        """Its index; infinity once every row is written."""
        indices, left = self._indices, self._left
        while self._next < len(indices) and left[indices[self._next]] == 0:
            self._next += 1
        return indices[self._next] if self._next < len(indices) else math.inf


def run(config: Config, run_dir: Path) -> dict[str, Any]:
    return run_job(config, run_dir)[0]


def run_job(config: Config, run_dir: Path, wait_for_ranks: Callable[[], None] | None = None,
            given_split: GivenSplit | None = None) -> tuple[dict[str, Any], Job]:
    """Runs the job (see Job.run); returns its summary and the job. SIGTERM and SIGINT end it with JobStopped
    after every finished row is flushed."""
    def start(signals: StopSignals) -> tuple[dict[str, Any], Job]:
        job = Job(config, run_dir, given_split)
        return job.run(signals, wait_for_ranks), job

    return run_stoppable(start)
