"""Compile ahead without Triton: its compile processes (with stand-in kernels), when it is off, and how a start
that meets a missing kernel goes on; on a GPU, a fresh start's job against the same job compiled serially."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import select
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from batchgen.config import Config, EngineConfig, RunnerConfig
from batchgen.engine.model_worker import ModelWorker
from batchgen.worker import compile_ahead, compile_pool
from batchgen.worker.compile_ahead import CompileAhead, MissingKernel
from batchgen.worker.compile_pool import CompilePool, KernelSpec, PoolOutcome, WorkerSetup
from tests.helpers.common import REPO, comparable

FAKES = "tests.helpers.fake_kernels"


def fake(name: str, path: Path) -> KernelSpec:
    return KernelSpec(FAKES, name, str(path), target="")  # no GPU target: they are built as they are


PLAIN = WorkerSetup({}, for_gpu=False)


def compiled(specs: list[KernelSpec], setup: WorkerSetup = PLAIN, processes: int = 2,
             timeout: float = 120.0) -> tuple[PoolOutcome, subprocess.Popen]:
    """The pool's outcome, and the process that forked its processes (closed: it exits only once they all have)."""
    pool = CompilePool(processes, setup)
    supervisor = pool.supervisor
    try:
        return pool.compile(specs, timeout), supervisor
    finally:
        pool.close()


def gone(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists()


def test_the_pool_compiles_every_spec_in_its_own_processes_with_the_engines_variables(tmp_path):
    setup = WorkerSetup({"BATCHGEN_TEST_VALUE": "from the engine"}, for_gpu=False)
    outcome, supervisor = compiled([fake("writes", tmp_path / str(i)) for i in range(5)], setup)
    assert outcome == PoolOutcome(compiled=5, failed=[], stopped=None)
    assert outcome.busy_seconds > 0 and outcome.longest[0] == "writes"  # what the compiles cost, for the log
    assert outcome.startup_wait_seconds > 0  # handed over as the processes started, the first spec waited for them
    written = [(tmp_path / str(i)).read_text().split(" ", 1) for i in range(5)]
    pids = {int(pid) for pid, _ in written}
    assert len(pids) <= 2 and not pids & {os.getpid(), supervisor.pid}  # in the processes forked for the pool
    assert {value for _, value in written} == {"from the engine"}
    assert supervisor.poll() is not None and all(map(gone, pids))


def test_a_spec_that_fails_to_compile_is_reported_and_the_others_compile(tmp_path):
    outcome, _ = compiled([fake("writes", tmp_path / "a"), fake("raises", tmp_path / "b"),
                           fake("writes", tmp_path / "c")])
    assert (outcome.compiled, outcome.stopped) == (2, None)
    assert outcome.failed == [f"raises: RuntimeError: cannot compile {tmp_path / 'b'}"]
    assert (tmp_path / "a").exists() and (tmp_path / "c").exists()


def test_a_process_that_crashes_stops_the_pool_and_none_is_left(tmp_path):
    outcome, supervisor = compiled([fake("crashes", tmp_path / "a")] + [fake("writes", tmp_path / str(i))
                                                                        for i in range(4)], processes=1)
    assert outcome.stopped == "a compile process ended"
    assert not (tmp_path / "0").exists()
    assert supervisor.poll() is not None


def test_a_pool_not_done_by_its_deadline_stops_and_its_processes_are_killed(tmp_path):
    outcome, supervisor = compiled([fake("hangs", tmp_path / "a")], processes=1, timeout=1.0)
    assert outcome == PoolOutcome(compiled=0, failed=[], stopped="not done after 1 s")
    assert supervisor.poll() is not None and gone(int((tmp_path / "a").read_text()))  # the busy one killed too


def test_specs_submitted_one_at_a_time_never_wait_for_a_compile(tmp_path):
    """The dry run hands each kernel over as it records it and goes on: a submit returns while every process is
    busy (here with a kernel that never finishes), and finish() waits."""
    pool = CompilePool(1, PLAIN)
    try:
        pool.submit(fake("hangs", tmp_path / "a"))
        pool.submit(fake("writes", tmp_path / "b"))  # queued behind it
        assert pool.finish(timeout=1.0) == PoolOutcome(compiled=0, failed=[], stopped="not done after 1 s")
    finally:
        pool.close()
    assert not (tmp_path / "b").exists()


def test_specs_submitted_while_others_compile_are_all_compiled(tmp_path):
    pool = CompilePool(2, PLAIN)
    try:
        for i in range(6):
            pool.submit(fake("writes", tmp_path / str(i)))
        assert pool.finish() == PoolOutcome(compiled=6, failed=[], stopped=None)
    finally:
        pool.close()
    assert sorted(path.name for path in tmp_path.iterdir()) == [str(i) for i in range(6)]


def test_a_process_takes_its_next_queued_spec_as_it_finishes_one_while_the_engine_calls_nothing(tmp_path):
    """The dry run hands kernels over only as it records them, at times seconds apart: between two, the pool's own
    thread keeps its processes busy. Here the second spec, queued behind the first on the one process, is compiled
    (written into a FIFO the test reads) while the test makes no call into the pool."""
    fifo = tmp_path / "second"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    keeps_open = os.open(fifo, os.O_WRONLY)  # so that the FIFO reads as readable only once data comes
    pool = CompilePool(1, PLAIN)
    try:
        pool.submit(fake("writes", tmp_path / "first"))
        pool.submit(fake("writes", fifo))
        readable, _, _ = select.select([reader], [], [], 120.0)
        assert readable, "the queued spec was not handed to the process that finished the first"
        assert os.read(reader, 100).split(b" ")[1] == b"None" and (tmp_path / "first").exists()
    finally:
        pool.close()
        os.close(keeps_open)
        os.close(reader)


def test_a_process_that_fails_to_start_stops_the_pool(tmp_path):
    no_python = WorkerSetup({"PYTHONIOENCODING": "no-such-encoding"}, for_gpu=False)  # Python cannot start
    outcome, _ = compiled([fake("writes", tmp_path / "a")], no_python)
    assert outcome.stopped == "a compile process ended" and not (tmp_path / "a").exists()


def test_the_dry_run_warms_the_start_buckets_then_runs_the_prefill_steps_then_warms_the_other_buckets():
    """The start's forwards as compile_ahead's dry run runs them: every kernel is met early, so that each compiles
    while the dry run goes on (the start buckets launch nearly all of them, the other buckets rarely one more)."""
    calls = []
    runner = types.SimpleNamespace(
        warm_up_graphs=lambda max_rows, start_buckets: calls.append(("graphs", max_rows, start_buckets)),
        profile_peak_bytes=lambda scores_logits: calls.append(("profile", scores_logits)),
        warm_up_step=lambda pooler, contexts: calls.append(("prefill", contexts)))
    worker = types.SimpleNamespace(runner=runner, pooler=None, _warm_up_contexts=lambda demand: [3072])
    ModelWorker._start_forwards(worker, graphs=True, max_rows=64, demand=None)
    assert calls == [("graphs", 64, True), ("profile", True), ("prefill", [3072]), ("graphs", 64, False)]
    calls.clear()
    ModelWorker._start_forwards(worker, graphs=False, max_rows=None, demand=None, profile=False)
    assert calls == [("prefill", [3072])]  # a job without decode steps, after the KV-sizing phase


@pytest.mark.parametrize("config, device, tensor_parallel_size", [
    (EngineConfig(), torch.device("cpu"), 1),
    (EngineConfig(parallel_compile=False), torch.device("cuda"), 1),
    (EngineConfig(), torch.device("cuda"), 2),
    (EngineConfig(torch_compile=True), torch.device("cuda"), 1),
])
def test_compile_ahead_is_off_where_it_does_not_apply(config, device, tensor_parallel_size):
    """Off, a phase just runs (no Triton is imported to find that out)."""
    ahead = CompileAhead.begin(config, device, tensor_parallel_size)
    calls = []
    assert ahead.run(lambda: calls.append("phase") or 7, lambda: calls.append("dry run")) == 7
    assert calls == ["phase"] and ahead.pool is None and ahead.info == {}


def test_a_triton_without_the_hook_turns_it_off_with_one_line(monkeypatch, caplog):
    old_triton = types.ModuleType("triton")
    old_triton.__version__ = "2.3.0"
    monkeypatch.setitem(sys.modules, "triton", old_triton)
    with caplog.at_level(logging.INFO, logger=compile_ahead.__name__):
        ahead = CompileAhead.begin(EngineConfig(), torch.device("cuda"), 1)
    assert ahead.setup is None and ahead.pool is None
    assert [record.getMessage() for record in caplog.records] == [
        "Parallel Triton compile unavailable (Triton 2.3.0 has no knobs.runtime.jit_cache_hook): kernels compile on "
        "first launch"]


def test_a_phase_that_meets_a_missing_kernel_runs_again_after_the_compile(monkeypatch, caplog):
    """Once per start: a later phase that meets a missing kernel compiles it at its launch."""
    compiles = []
    monkeypatch.setattr(CompileAhead, "_compile", lambda self, dry_run, setup: compiles.append(dry_run))
    watched = []
    monkeypatch.setattr(compile_ahead, "stop_at_missing_kernel", lambda: watched.append(1) or contextlib.nullcontext())
    attempts = []
    monkeypatch.setattr(compile_ahead, "settle_loaded_kernels", lambda: attempts.append("settle keys"))
    ahead = CompileAhead(PLAIN, processes=2)

    def profile() -> str:
        attempts.append("profile")
        if attempts.count("profile") == 1:
            raise MissingKernel("_embedding_kernel")
        return "profiled"

    noted = []

    @contextlib.contextmanager
    def on_disk_miss(note):  # each phase after the compile meets one kernel the compile lacks
        noted.append(note)
        note(f"kernel_{len(noted)}")
        yield

    monkeypatch.setattr(compile_ahead, "on_disk_miss", on_disk_miss)
    with caplog.at_level(logging.INFO, logger=compile_ahead.__name__):
        assert ahead.run(profile, dry_run=print) == "profiled"
    # the loaded kernels' keys settled before the watched phase looks any up
    assert attempts == ["settle keys", "profile", "profile"] and compiles == [print] and len(watched) == 1
    assert ahead.run(lambda: "captured", dry_run=len) == "captured"
    assert compiles == [print] and len(watched) == 1  # the capture ran unwatched, but noting what compiles
    assert ahead.info["parallel_compile_missed_kernels"] == ["kernel_1", "kernel_2"]
    assert caplog.records[0].getMessage() == ("Triton kernel kernel_1 was not compiled ahead: it compiles at its "
                                              "first launch")


def test_parallel_compile_processes_leave_a_core_to_the_engine(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert compile_pool.compile_processes() == 15
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # four data-parallel ranks on the machine
    assert compile_pool.compile_processes() == 3
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(128)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert compile_pool.compile_processes() == compile_pool.MAX_PROCESSES


@pytest.mark.parametrize("config", [
    EngineConfig(tensor_parallel_size=2), EngineConfig(parallel_compile=False), EngineConfig(torch_compile=True),
], ids=["tensor_parallel", "off", "torch_compile"])
def test_the_job_starts_no_compile_process_for_an_engine_that_would_not_use_them(monkeypatch, config):
    """Nor does it ask Triton to find that out."""
    monkeypatch.setattr(compile_pool, "missing_triton_api", lambda: pytest.fail("Triton asked"))
    compile_pool.start_ahead(config)
    assert compile_pool.take_started() is None


def test_the_job_starts_no_compile_process_without_triton(monkeypatch):
    """A torch without Triton beside it: nothing to compile ahead, and no import of Triton to find that out."""
    monkeypatch.setattr(compile_pool.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(compile_pool, "missing_triton_api", lambda: pytest.fail("Triton asked"))
    compile_pool.start_ahead(EngineConfig())
    assert compile_pool.take_started() is None


def test_an_engine_that_does_not_compile_ahead_ends_the_processes_started_for_it(monkeypatch):
    """A start that turns out not to compile ahead (here: on CPU) must not leave them running."""
    pool = CompilePool(1, PLAIN)
    supervisor = pool.supervisor
    monkeypatch.setattr(compile_pool, "_started", pool)
    ahead = CompileAhead.begin(EngineConfig(), torch.device("cpu"), 1)
    assert ahead.pool is None and pool.supervisor is None and compile_pool.take_started() is None
    assert supervisor.poll() is not None


@pytest.mark.parametrize(("config", "env", "starts"), [
    (Config(), {}, True),
    (Config(engine=EngineConfig(device="cpu")), {}, False),
    (Config(engine=EngineConfig(data_parallel_size=2)), {}, False),  # the parent runs no engine; each rank its own
    (Config(runner=RunnerConfig(name="ray")), {}, False),
    (Config(), {"CUDA_VISIBLE_DEVICES": ""}, False),
], ids=["gpu", "cpu", "data_parallel_parent", "ray", "no_visible_gpu"])
def test_the_command_line_starts_compile_processes_ahead_of_torch_only_for_a_local_gpu_engine(monkeypatch, config,
                                                                                              env, starts):
    monkeypatch.setattr(compile_pool.os.path, "exists", lambda path: path == "/dev/nvidiactl")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    asked = []
    monkeypatch.setattr(compile_pool, "start_ahead", asked.append)
    compile_pool.start_ahead_of_torch(config)
    assert asked == ([config.engine] if starts else [])


def test_processes_started_ahead_are_kept_for_the_job_and_closed_where_torch_finds_no_gpu(monkeypatch, tmp_path):
    """The command line's processes, started before torch could tell whether the engine runs on a GPU: the job's own
    start_ahead keeps them; launch() closes them where the engine runs on CPU after all."""
    from batchgen.runners import launch

    pool = CompilePool(1, PLAIN)
    supervisor = pool.supervisor
    monkeypatch.setattr(compile_pool, "_started", pool)
    monkeypatch.setattr(compile_pool.importlib.util, "find_spec", lambda name: object())  # Triton "is there"
    compile_pool.start_ahead(EngineConfig())
    assert compile_pool._started is pool and supervisor.poll() is None
    monkeypatch.setattr("batchgen.runners.local.run_local", lambda config, run_dir: {})  # launch's job, at call time
    launch.launch(Config(engine=EngineConfig(device="cpu")), tmp_path, [])
    assert compile_pool.take_started() is None and pool.supervisor is None and supervisor.wait(timeout=60) is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_fresh_start_compiles_in_processes_and_decodes_the_same_greedy_tokens(tmp_path):
    if compile_ahead.compile_processes() < 2:
        pytest.skip("fewer than three cores: compile ahead is off")

    def job(run: str, cache: str, *overrides: str) -> tuple[str, dict, list[dict]]:
        run_dir = tmp_path / run
        command = [sys.executable, "-m", "batchgen", f"hydra.run.dir={run_dir}", "engine.device=cuda",
                   "job=shakespeare", "data.limit=64", "sampling.temperature=0", "job.progress=false", *overrides]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TRITON_CACHE_DIR": str(tmp_path / cache)}
        result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout + result.stderr
        summary = json.loads((run_dir / "summary.json").read_text())
        return result.stdout + result.stderr, summary["engine"], comparable(run_dir / "completions.parquet")

    log, engine, rows = job("fresh", "cache")
    assert re.search(r"Compiled \d+ Triton kernels in \d+ processes in", log), log
    assert "compile on first launch" not in log, log  # every kernel, and its launcher where Triton builds one
    assert engine["parallel_compile_kernels"] > 0 and engine["parallel_compile_processes"] >= 2
    assert engine["parallel_compile_started_ahead"]  # as the job began: they started up while it read its input
    assert "parallel_compile_missed_kernels" not in engine  # every kernel found where the processes stored it
    serial_log, serial_engine, serial_rows = job("serial", "serial_cache", "engine.parallel_compile=false")
    assert "parallel_compile_kernels" not in serial_engine and "Triton kernels in" not in serial_log
    assert rows == serial_rows
    warm_log, warm_engine, warm_rows = job("warm", "cache")  # every kernel on disk: no dry run, nothing compiled
    assert not any(key.startswith("parallel_compile") for key in warm_engine), warm_engine
    assert "Triton kernels in" not in warm_log and "dry run" not in warm_log
    assert warm_rows == rows
