"""Compile ahead on Triton itself, without a GPU: Triton builds for an sm_90 target here (tests/helpers/
triton_cpu_target.py), so its dry run, its disk-cache lookups and its compile processes run as they do on one."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import types
from collections import defaultdict
from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton", reason="compile ahead runs where Triton does (torch's CPU build has none)")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter compiles nothing")

from batchgen.config import EngineConfig, ModelConfig  # noqa: E402
from batchgen.layers.activation import SiluAndMul  # noqa: E402
from batchgen.layers.embedding import Embedding  # noqa: E402
from batchgen.layers.linear import Linear  # noqa: E402
from batchgen.layers.norms import RMSNorm  # noqa: E402
from batchgen.models.loader import load_hf_config, load_model  # noqa: E402
from batchgen.worker import compile_ahead, compile_pool  # noqa: E402
from batchgen.worker.compile_ahead import (  # noqa: E402
    CompileAhead,
    MissingKernel,
    dry_launches,
    on_disk,
    stop_at_missing_kernel,
)
from batchgen.worker.compile_pool import (  # noqa: E402
    CompilePool,
    KernelSpec,
    PoolOutcome,
    WorkerSetup,
    settled_kernel,
)
from batchgen.worker.model_runner import ModelRunner  # noqa: E402
from tests.helpers.common import REPO  # noqa: E402
from tests.helpers.triton_cpu_target import cpu_target, scale, scale_kernel  # noqa: E402


@pytest.fixture(autouse=True)
def empty_cache_for_sm90(tmp_path, monkeypatch):
    """Empty Triton caches, on disk and in memory, and Triton building for sm_90 in this process."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setattr(scale_kernel, "device_caches", defaultdict(scale_kernel.create_binder))
    with cpu_target():
        yield


def kernels_on_disk(tmp_path) -> list[str]:
    return sorted(path.name for path in (tmp_path / "triton").glob("*/scale_kernel.json"))


def recorded(launch) -> list[KernelSpec]:
    with dry_launches() as specs:
        launch()
    return list(specs)


def test_a_dry_run_records_each_specialization_once_and_launches_nothing(tmp_path):
    x, out = torch.ones(100), torch.zeros(100)

    def launches() -> None:
        for _ in range(3):
            scale(x, 2.0, out=out)
        scale(x, 2.0, out=out, block=128)  # another constexpr: another specialization

    specs = recorded(launches)
    assert [spec.name for spec in specs] == ["scale_kernel", "scale_kernel"]
    assert {spec.module for spec in specs} == {"tests.helpers.triton_cpu_target"}
    assert [json.loads(spec.data)["constant_vals"][-1] for spec in specs] == [64, 128]
    # The target the compile processes build for, from the driver (Triton 3.6 writes none into the data)
    assert {spec.target for spec in specs} == {json.dumps({"backend": "cuda", "arch": 90, "warp_size": 32})}
    assert (out == 0).all()  # no kernel ran
    assert kernels_on_disk(tmp_path) == []  # none compiled


def test_a_kernel_this_process_compiled_is_skipped_in_a_dry_run_and_kept_after_it():
    x, out = torch.ones(100), torch.zeros(100)
    (spec,) = recorded(lambda: scale(x, 2.0, out=out))
    scale_kernel.preload(spec.data)  # in memory now: outside a dry run its launch would run it (and fail here)
    caches = scale_kernel.device_caches
    assert recorded(lambda: scale(x, 2.0, out=out)) == [spec]
    assert scale_kernel.device_caches is caches and len(caches[0][0]) == 1


def test_a_watched_launch_stops_at_a_kernel_missing_from_the_disk_cache(tmp_path):
    x, out = torch.ones(100), torch.zeros(100)
    (spec,) = recorded(lambda: scale(x, 2.0, out=out))
    with pytest.raises(MissingKernel, match="scale_kernel"), stop_at_missing_kernel():
        scale(x, 2.0, out=out)
    assert kernels_on_disk(tmp_path) == [] and not on_disk(spec)
    scale_kernel.preload(spec.data)  # compiles it into the disk cache
    assert on_disk(spec)


@pytest.mark.parametrize("compiled_launchers", [True, False], ids=["triton_3_6", "triton_3_8"])
def test_a_compile_process_builds_the_kernels_launcher_where_triton_compiles_launchers(monkeypatch, tmp_path,
                                                                                       compiled_launchers):
    """Triton 3.6 compiles a C launcher for each kernel signature at the kernel's first launch (its CUDA backend's
    make_launcher); a compile process builds it with the kernel. 3.8 has no such step."""
    from triton.backends.nvidia import driver as cuda_driver

    built = []
    monkeypatch.setattr(cuda_driver, "CudaLauncher", lambda src, metadata: built.append((src, metadata)))
    if compiled_launchers:
        monkeypatch.setattr(cuda_driver, "make_launcher", lambda *args: "", raising=False)
    else:
        monkeypatch.delattr(cuda_driver, "make_launcher", raising=False)
    x, out = torch.ones(100), torch.zeros(100)
    (spec,) = recorded(lambda: scale(x, 2.0, out=out))
    assert compile_pool._preload(spec, for_gpu=True) is None
    assert on_disk(spec)
    if compiled_launchers:
        ((src, metadata),) = built
        assert src.fn.__name__ == "scale_kernel" and metadata.name == "scale_kernel"
    else:
        assert built == []


def test_the_compile_processes_parent_keys_tritons_own_files_once_before_it_forks_them():
    """Every compile's cache key starts with a hash of Triton's own files (its library among them): the processes'
    parent computes it once, while the engine still loads, and the processes it forks inherit it. Here the engine
    ends before sending a spec: both processes exit at their first message, and so does their parent."""
    script = """
import triton.runtime.cache as cache
from multiprocessing import Pipe
from batchgen.worker.compile_pool import supervise

computed = cache.triton_key
def triton_key():
    print("keyed", flush=True)
    return computed()
cache.triton_key = triton_key
pipes = [Pipe() for _ in range(2)]
for engine_end, _ in pipes:
    engine_end.close()
supervise([process_end.fileno() for _, process_end in pipes], for_gpu=True)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert (done.returncode, done.stdout) == (0, "keyed\n"), done.stderr


def test_a_compile_process_stores_a_kernel_under_the_engines_key_of_its_source(monkeypatch, tmp_path):
    """Triton 3.6 folds into a kernel's key what its process keyed before, so a compile process could settle on
    another key than the engine's, whose launch then compiled the kernel again: the spec carries the engine's."""
    from triton.backends.nvidia import driver as cuda_driver

    monkeypatch.setattr(cuda_driver, "CudaLauncher", lambda src, metadata: None)  # its C compile needs libcuda
    x, out = torch.ones(100), torch.zeros(100)
    (spec,) = recorded(lambda: scale(x, 2.0, out=out))
    monkeypatch.setattr(scale_kernel, "hash", "the engine's key")
    assert compile_pool._preload(replace(spec, source_key="the engine's key"), for_gpu=True) is None
    assert on_disk(replace(spec, source_key="the engine's key"))
    monkeypatch.setattr(scale_kernel, "hash", None)  # keyed as a fresh process keys it: another entry
    assert not on_disk(spec)


class RecordingPool:
    """A pool that compiles nothing: what was submitted, and when."""

    processes = 2

    def __init__(self) -> None:
        self.events: list = []

    def submit(self, spec: KernelSpec) -> None:
        self.events.append(spec)

    def finish(self) -> PoolOutcome:
        self.events.append("finish")
        return PoolOutcome(sum(isinstance(event, KernelSpec) for event in self.events), [], None)

    def compile(self, specs: list[KernelSpec]) -> PoolOutcome:
        self.events.extend(specs)
        return self.finish()

    def close(self) -> None:
        pass


@pytest.mark.parametrize("fresh", [True, False])
def test_the_specs_go_to_the_processes_under_the_engines_key_as_the_dry_run_records_them(monkeypatch, fresh):
    """A pool started with the start (an empty cache) gets each kernel while the dry run goes on; otherwise the
    missing ones go after it, once looked up on disk."""
    x, out = torch.ones(100), torch.zeros(100)
    pool = RecordingPool()

    def dry_run() -> None:
        scale(x, 2.0, out=out)
        pool.events.append("second launch")
        scale(x, 2.0, out=out, block=128)

    monkeypatch.setattr(compile_ahead, "CompilePool", lambda processes, setup: pool)  # started after the dry run
    ahead = CompileAhead(WorkerSetup({}), processes=2, pool=pool if fresh else None)
    ahead._compile(dry_run, ahead.setup)
    first, second = [event for event in pool.events if isinstance(event, KernelSpec)]
    order = ["spec", "second launch", "spec", "finish"] if fresh else ["second launch", "spec", "spec", "finish"]
    assert [event if isinstance(event, str) else "spec" for event in pool.events] == order
    assert first.source_key == second.source_key == scale_kernel.cache_key and first.source_key
    assert ahead.info["parallel_compile_kernels"] == 2


def test_a_kernels_cache_key_is_the_same_whichever_function_this_process_keyed_first(monkeypatch):
    """The engine looks up what the compile processes built by this key; Triton 3.6 left out the PDL constants
    wait_for_previous reads when the kernel was keyed before it."""
    from batchgen.layers import elementwise_triton, pdl

    kernel, called = elementwise_triton._add_rms_norm_kernel, pdl.wait_for_previous
    spec = KernelSpec(kernel.module, "_add_rms_norm_kernel", data="", target="")

    def keyed(first) -> str:
        for function in (kernel, called):  # as in a fresh process
            monkeypatch.setattr(function, "hash", None)
            monkeypatch.setattr(function, "used_global_vals", {})
        first.cache_key  # noqa: B018 (keyed first)
        return settled_kernel(spec).cache_key

    assert keyed(called) == keyed(kernel)


@pytest.mark.slow
def test_a_stopped_phase_has_its_kernels_compiled_in_processes_and_runs_again(tmp_path, caplog):
    """The phase here is a launch's compile path (preload: a launch itself would fail without a GPU); the processes
    build for the sm_90 target the launch recorded, as they would for the engine's GPU."""
    x, out = torch.ones(100), torch.zeros(100)
    (spec,) = recorded(lambda: scale(x, 2.0, out=out))
    runs = []

    def phase() -> str:
        runs.append(kernels_on_disk(tmp_path))
        scale_kernel.preload(spec.data)
        return "done"

    ahead = CompileAhead(WorkerSetup({"TRITON_CACHE_DIR": str(tmp_path / "triton")}), processes=2)
    with caplog.at_level(logging.INFO, logger=compile_ahead.__name__):
        assert ahead.run(phase, lambda: scale(x, 2.0, out=out)) == "done"
    assert runs == [[], ["scale_kernel.json"]]  # stopped before compiling; then found it on disk
    assert ahead.info["parallel_compile_kernels"] == 1 and ahead.info["parallel_compile_processes"] == 1
    assert ahead.pool is None
    assert [r.getMessage().split(" in ")[0] for r in caplog.records] == ["Compiled 1 Triton kernels"]


def test_a_dry_run_that_fails_leaves_the_kernels_to_their_first_launch(tmp_path, caplog):
    def dry_run() -> None:
        raise RuntimeError("a forward failed on garbage")

    attempts = []

    def phase() -> int:
        attempts.append(1)
        if len(attempts) == 1:
            raise MissingKernel("scale_kernel")
        return len(attempts)

    ahead = CompileAhead(WorkerSetup({}, None), processes=2)
    with caplog.at_level(logging.INFO, logger=compile_ahead.__name__):
        assert ahead.run(phase, dry_run) == 2
    assert ahead.pool is None and ahead.info == {}
    assert [r.getMessage() for r in caplog.records] == [
        "Parallel Triton compile skipped: its dry run of the engine's start failed (RuntimeError: a forward failed "
        "on garbage); kernels compile on first launch"]


@pytest.mark.parametrize("fresh", [True, False])
def test_the_processes_start_with_the_engine_only_on_a_fresh_machine(tmp_path, monkeypatch, fresh):
    """An empty Triton cache: the first phase will stop, so they start up while the model loads; otherwise only a
    phase that stops starts them (a warm start never does)."""
    monkeypatch.setattr(compile_ahead, "compile_processes", lambda: 2)
    if not fresh:
        put_kernel_file(tmp_path)
    ahead = CompileAhead.begin(EngineConfig(), torch.device("cuda"), 1)
    try:
        assert ahead.setup.env["TRITON_CACHE_DIR"] == str(tmp_path / "triton") and ahead.setup.for_gpu
        assert (ahead.pool is not None and ahead.pool.processes == 2) if fresh else ahead.pool is None
    finally:
        ahead.close()
    assert ahead.pool is None


def test_processes_the_job_started_on_a_fresh_machine_are_the_engines(monkeypatch):
    """Started as the job began; the engine takes them instead of starting its own, once."""
    for module in (compile_pool, compile_ahead):
        monkeypatch.setattr(module, "compile_processes", lambda: 2)
    compile_pool.start_ahead(EngineConfig())
    started = compile_pool._started
    assert started is not None and started.processes == 2
    ahead = CompileAhead.begin(EngineConfig(), torch.device("cuda"), 1)
    try:
        assert ahead.pool is started and compile_pool.take_started() is None
        assert ahead.info == {"parallel_compile_started_ahead": True}
    finally:
        ahead.close()


def test_the_job_starts_no_process_where_the_cache_has_kernels(tmp_path, monkeypatch):
    monkeypatch.setattr(compile_pool, "compile_processes", lambda: 2)
    put_kernel_file(tmp_path)
    compile_pool.start_ahead(EngineConfig())
    assert compile_pool.take_started() is None


def put_kernel_file(tmp_path, name: str = "scale_kernel.json") -> None:
    entry = tmp_path / "triton" / "an entry"
    entry.mkdir(parents=True, exist_ok=True)
    (entry / name).write_text("{}")


@pytest.mark.parametrize(("files", "holds_no_kernel"), [
    ((), True),
    (("cuda_utils.cpython-312-x86_64-linux-gnu.so",), True),  # the driver's helper module, built on a thread
    (("cuda_utils.cpython-312-x86_64-linux-gnu.so", "tmp.pid_7_x/"), True),  # and a write in progress
    (("__triton_launcher.so", "scale_kernel.json"), False),
    (("scale_kernel.cubin",), False),
])
def test_a_cache_of_helper_modules_alone_holds_no_kernel(tmp_path, files, holds_no_kernel):
    """What the job's start on a thread (the CUDA driver's helper module) writes leaves the machine fresh."""
    cache = tmp_path / "triton"
    assert compile_pool.cache_holds_no_kernel()  # not there yet
    cache.mkdir()
    for index, name in enumerate(files):
        path = cache / f"key{index}" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir() if name.endswith("/") else path.write_bytes(b"x")
    assert compile_pool.cache_holds_no_kernel() == holds_no_kernel


@pytest.mark.slow
def test_a_models_graph_warm_ups_run_dry_and_their_kernels_compile_in_processes(tiny_model_dir, tmp_path):
    """A tiny Qwen3's warm-up forwards of every bucket with batchgen's Triton layers on (those that take CPU inputs):
    nothing launches (a launch would fail here), and each kernel they record compiles in the processes and is then
    found on disk, as the engine's first launches find them."""
    config = ModelConfig(path=str(tiny_model_dir("Qwen3ForCausalLM")))
    model = load_model(config, load_hf_config(config), torch.bfloat16, torch.device("cpu"), "generate")
    for layer in model.modules():
        if isinstance(layer, (Linear, Embedding, RMSNorm, SiluAndMul)):
            layer.use_triton("cpu")
    engine = EngineConfig(max_num_seqs=48, max_model_len=64, max_num_batched_tokens=64, attention_backend="triton")
    runner = ModelRunner(engine, model, torch.device("cpu"), torch.bfloat16)
    with dry_launches() as recorded:
        runner.warm_up_graphs(None, start_buckets=True)
        from_start_buckets = set(recorded)
        runner.warm_up_graphs(None, start_buckets=False)
    specs = list(recorded)
    assert from_start_buckets == set(specs)  # the other buckets' warm-ups (24, 40, ...) launch nothing new
    assert {"_embedding_kernel", "_add_rms_norm_kernel", "_decode_kernel", "_greedy_chunk_kernel"} <= {
        spec.name for spec in specs}
    assert runner.kv_cache is None and kernels_on_disk(tmp_path) == []
    pool = CompilePool(2, WorkerSetup({"TRITON_CACHE_DIR": str(tmp_path / "triton")}))
    try:
        assert pool.compile(specs) == PoolOutcome(compiled=len(specs), failed=[], stopped=None)
    finally:
        pool.close()
    assert all(on_disk(spec) for spec in specs)


def test_the_warm_up_step_runs_dry_over_a_scratch_cache_and_records_the_prefill_kernels(tiny_model_dir):
    """compile_ahead's dry run of the start includes the warm-up step (before the KV cache exists): its prefill
    attention is recorded, nothing launches, and the scratch cache is unbound again."""
    config = ModelConfig(path=str(tiny_model_dir("Qwen3ForCausalLM")))
    model = load_model(config, load_hf_config(config), torch.bfloat16, torch.device("cpu"), "generate")
    engine = EngineConfig(max_num_seqs=16, max_model_len=64, max_num_batched_tokens=64, attention_backend="triton")
    runner = ModelRunner(engine, model, torch.device("cpu"), torch.bfloat16)
    with dry_launches() as recorded:
        runner.warm_up_step()
    assert "_prefill_kernel" in {spec.name for spec in recorded}
    assert runner.kv_cache is None


def test_a_loaded_kernel_keyed_out_of_order_is_looked_up_by_its_settled_key(monkeypatch):
    """settle_loaded_kernels recomputes the key of each kernel in batchgen's loaded modules: one keyed before the
    functions it calls (Triton 3.6) then has the key a compile process stores it under."""
    settled = scale_kernel.cache_key
    module = types.ModuleType("batchgen.kernels_under_test")
    module.scale_kernel = scale_kernel
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(compile_ahead, "_settled", set())
    monkeypatch.setattr(scale_kernel, "hash", "keyed before its callees")
    compile_ahead.settle_loaded_kernels()
    assert scale_kernel.cache_key == settled
