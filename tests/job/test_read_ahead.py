"""A job's input read ahead, on a thread from the config's check (batchgen/job/read_ahead.py): the rows and their
parameters are those a job reads at its start; a read that fails raises its error where the job is taken; the jobs
that read their own share (Ray, data-parallel and torchrun ranks) do not read ahead."""

from __future__ import annotations

import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from batchgen.config import Config, DataConfig, EngineConfig, JobConfig, ModelConfig, RunnerConfig
from batchgen.io.errors import InputError
from batchgen.job import process_clock
from batchgen.job.read_ahead import ReadAhead
from batchgen.job.run import Job, run_job
from batchgen.sample.params import SamplingParams

MODEL_DIR = Path(__file__).resolve().parents[2] / "jobs" / "shakespeare" / "model"


def job_config(prompts: Path, **data: object) -> Config:
    return Config(job=JobConfig(progress=False), model=ModelConfig(path=str(MODEL_DIR)),
                  engine=EngineConfig(device="cpu", max_num_seqs=4, max_model_len=128),
                  data=DataConfig(path=str(prompts), id_field="id", **data),
                  sampling=SamplingParams(max_tokens=3, seed=0))


def write_rows(path: Path, rows: list[str]) -> Path:
    path.write_text("".join(row + "\n" for row in rows))
    return path


ROWS = ['{"id": "a", "prompt": "ROMEO:"}', '{"id": "b", "prompt": "JULIET:", "max_tokens": 2}',
        '{"id": "c", "prompt_token_ids": [5, 6, 7]}', '{"id": "d", "prompt": ""}']


def test_a_job_read_ahead_reads_what_a_job_reads_at_its_start(tmp_path: Path) -> None:
    config = job_config(write_rows(tmp_path / "in.jsonl", ROWS), on_error="skip")
    ahead = ReadAhead.start(config, tmp_path / "run")
    assert ahead is not None
    read_ahead, at_start = ahead.job(config, tmp_path / "run"), Job(config, tmp_path / "run")
    assert [asdict(row) for row in read_ahead.rows] == [asdict(row) for row in at_start.rows]
    assert read_ahead.params == at_start.params and read_ahead.num_input_rows == at_start.num_input_rows == 4
    assert read_ahead.rows[3].error is not None  # the empty prompt: an error row, as at the start


def test_a_job_read_ahead_counts_only_its_wait_as_its_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The job starts where it is taken: the start-up's phases end there, and its read_input phase is the wait for
    the read, no longer than the read itself (read_ahead_seconds)."""
    clock = process_clock.StartupClock(time.perf_counter(), None)
    monkeypatch.setattr(process_clock, "_clock", clock)
    config = job_config(write_rows(tmp_path / "in.jsonl", ROWS[:3]))
    ahead = ReadAhead(config, tmp_path / "run")
    process_clock.mark("engine_imports")
    job = ahead.job(config, tmp_path / "run")
    assert list(job.startup_phases) == ["engine_imports", "launch"]
    assert 0 <= job.read_seconds <= job.read_ahead_seconds
    summary = job.run()
    attempt = summary["this_attempt"]
    assert attempt["read_ahead_seconds"] == job.read_ahead_seconds and summary["rows"] == 3
    assert attempt["time_seconds"]["read_input"] == job.read_seconds


def test_a_failed_read_raises_where_the_job_is_taken(tmp_path: Path) -> None:
    config = job_config(write_rows(tmp_path / "in.jsonl", ROWS), on_error="fail")
    ahead = ReadAhead(config, tmp_path / "run")
    with pytest.raises(InputError, match="line 4: field 'prompt' is empty"):
        run_job(config, tmp_path / "run", ahead=ahead)
    assert not (tmp_path / "run" / "completions.parquet").exists()


def test_a_read_for_another_config_or_directory_is_not_taken(tmp_path: Path) -> None:
    config = job_config(write_rows(tmp_path / "in.jsonl", ROWS[:2]))
    ahead = ReadAhead(config, tmp_path / "run")
    assert ahead.job(replace(config, sampling=SamplingParams(max_tokens=5)), tmp_path / "run") is None
    assert ahead.job(config, tmp_path / "elsewhere") is None
    assert ahead.job(config, tmp_path / "run") is not None


@pytest.mark.parametrize("change", ["ray", "data_parallel", "torchrun_rank"])
def test_jobs_that_read_their_own_share_do_not_read_ahead(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         change: str) -> None:
    config = job_config(write_rows(tmp_path / "in.jsonl", ROWS[:2]))
    if change == "ray":
        config = replace(config, runner=RunnerConfig(name="ray"))
    elif change == "data_parallel":
        config = replace(config, engine=replace(config.engine, data_parallel_size=2))
    else:
        monkeypatch.setenv("WORLD_SIZE", "2")
    assert ReadAhead.start(config, tmp_path / "run") is None


def test_a_sharded_job_reads_ahead_into_its_shard_directory(tmp_path: Path) -> None:
    config = job_config(write_rows(tmp_path / "in.jsonl", ROWS[:3]), num_shards=2, shard_index=1)
    ahead = ReadAhead.start(config, tmp_path / "run")
    job = ahead.job(config, tmp_path / "run" / "shard-00001-of-00002")
    assert job is not None and [row.id for row in job.rows] == ["b"]
