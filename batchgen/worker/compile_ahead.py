"""A fresh machine's Triton kernels compiled ahead of the engine's start, in parallel processes.

Triton compiles a kernel at its first launch, in the launching process and holding the GIL: a fresh start would
compile its dozens of kernels one after the other, on one core, in its KV-sizing forward and CUDA-graph warm-ups
(what that cost: benchmarks/RESULTS.md, cold_start). Compiled kernels land in Triton's disk cache (TRITON_CACHE_DIR),
keyed by source, specialization, options and target only, so any process may compile them for the engine:

1. The start's phases (the KV-sizing forward, the graph captures) run watched: the first launch whose kernel is not
   in the disk cache stops the phase (`MissingKernel`) before compiling it. A warm start pays nothing more.
2. A dry run of the rest of the start: its forwards run with every Triton launch skipped and recorded instead
   (Triton's `jit_cache_hook`), torch ops on garbage, nothing captured; the specializations, deduplicated.
3. Those not in the disk cache are compiled by compile processes (batchgen/worker/compile_pool.py;
   `JITFunction.preload`, one per core but one, at most 16), with their launchers where Triton compiles those too
   (`build_launcher`), and the phase runs again: each first launch then loads its kernel from disk. When the cache
   was empty at the start (a fresh machine), the processes were started ahead, as the job began or while the model
   loads, and each kernel goes to them as the dry run records it: they compile while it goes on.

Anything unexpected (another Triton without these hooks, a dry run or a worker that fails) loses only the speed-up:
one line in the log, and the kernels compile at their first launch as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from batchgen.worker.compile_pool import (
    PRELOAD_ERRORS,
    CompilePool,
    KernelSpec,
    WorkerSetup,
    cache_holds_no_kernel,
    compile_processes,
    compiles_ahead,
    kernel_of,
    missing_triton_api,
    settle,
    settled_kernel,
    take_started,
    worker_setup,
)

if TYPE_CHECKING:
    from batchgen.config import EngineConfig

log = logging.getLogger(__name__)

T = TypeVar("T")
# What a dry run raises when Triton's internals differ from 3.6's and 3.8's, or a forward fails on garbage
DRY_RUN_ERRORS = (RuntimeError, AttributeError, KeyError, IndexError, TypeError, ValueError, ImportError)


class MissingKernel(Exception):
    """A launch met a kernel that is not in Triton's disk cache (only inside `stop_at_missing_kernel`)."""


# -- the phases, watched ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def on_disk_miss(miss: Callable[[str], None]) -> Iterator[None]:
    """Inside, `miss(kernel name)` runs where Triton looks a kernel up in its disk cache (through
    knobs.cache.manager_class) and does not find it, before it compiles it; a hit loads as usual."""
    from triton import knobs
    from triton.runtime.cache import FileCacheManager

    class OnMiss(knobs.cache.manager_class or FileCacheManager):
        def get_group(self, filename: str) -> dict[str, str] | None:
            group = super().get_group(filename)
            if group is None:
                miss(filename.removesuffix(".json"))
            return group

    with knobs.cache.scope():
        knobs.cache.manager_class = OnMiss
        yield


def stop_at_missing_kernel() -> contextlib.AbstractContextManager[None]:
    """Inside, a Triton compile whose kernel is not in the disk cache raises MissingKernel instead of compiling (in
    a CUDA-graph capture it compiles: a capture is never left half done)."""

    def stop(name: str) -> None:
        if not (torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()):
            raise MissingKernel(name)

    return on_disk_miss(stop)


_settled: set[int] = set()  # ids of the JIT functions this process has settled (settle_loaded_kernels, keyed)


def settle_loaded_kernels() -> None:
    """Settles the cache key of every Triton kernel in batchgen's modules loaded so far, so that this process looks
    each one up by the key compile processes store it under. Unsettled, Triton 3.6's key of the embedding kernel
    differed, and every warm start's first phase missed a kernel that was on disk and ran the whole start's dry run
    for nothing."""
    from triton.runtime.jit import JITFunction

    for name, module in list(sys.modules.items()):
        if not name.startswith("batchgen.") or module is None:
            continue
        for kernel in list(vars(module).values()):
            if isinstance(kernel, JITFunction):
                _settle_once(kernel)


def _settle_once(kernel: Any) -> None:
    if id(kernel) not in _settled:
        settle(kernel)
        _settled.add(id(kernel))


def keyed(spec: KernelSpec) -> KernelSpec:
    """The spec under the key this process will look its kernel up by, which a compile process stores it under."""
    kernel = kernel_of(spec)
    _settle_once(kernel)
    return dataclasses.replace(spec, source_key=kernel.cache_key)


def missing_on_disk(specs: Iterable[KernelSpec]) -> tuple[list[KernelSpec], list[str]]:
    """The specs that Triton's disk cache lacks, each under this process's key (`keyed`), and one line for each
    that cannot be looked up (kernel, error)."""
    missing, failed = [], []
    for spec in specs:
        try:
            spec = keyed(spec)
            if not on_disk(spec):
                missing.append(spec)
        except PRELOAD_ERRORS as error:
            failed.append(f"{spec.name}: {type(error).__name__}: {error}")
    return missing, failed


def on_disk(spec: KernelSpec) -> bool:
    """Whether the spec is in Triton's disk cache; loaded into the kernel's in-memory cache when it is, where the
    engine's first launch finds it."""
    kernel = settled_kernel(spec)
    try:
        with stop_at_missing_kernel():
            kernel.preload(spec.data)
    except MissingKernel:
        return False
    return True


# -- the dry run -----------------------------------------------------------------------------------------------


class _NoLaunch:
    """A recorded specialization's in-memory cache entry during a dry run: Triton's launch path calls these and
    launches nothing, so the kernel's later dry launches cost the binder and this, not Triton's compile path."""

    function = None
    packed_metadata = None

    def launch_metadata(self, *args: object) -> None:
        return None

    def run(self, *args: object) -> None:
        return None


_NO_LAUNCH = _NoLaunch()


class _DryRunCaches:
    """Every JIT function's in-memory caches during a dry run, each empty at first. Set on the JITFunction class, a
    data descriptor takes precedence over each function's own caches, which stay untouched in its __dict__ and are
    seen again once the descriptor goes: this reaches every JIT function, those Triton keeps no list of (3.6) too."""

    def __init__(self) -> None:
        self.caches: dict[int, tuple[Any, defaultdict]] = {}  # by id(function): the function, kept alive, and its own

    def __get__(self, function: Any, owner: type | None = None) -> Any:
        if function is None:
            return self
        entry = self.caches.get(id(function))
        if entry is None:
            entry = self.caches[id(function)] = (function, defaultdict(function.create_binder))
        return entry[1]

    def __set__(self, function: Any, caches: defaultdict) -> None:
        """A JIT function made during the dry run keeps the caches its __init__ makes for after it."""
        function.__dict__["device_caches"] = caches


@contextlib.contextmanager
def dry_launches(on_record: Callable[[KernelSpec], None] | None = None) -> Iterator[dict[KernelSpec, None]]:
    """Inside, no Triton kernel launches: each first launch of a specialization is recorded (in the yielded dict,
    in launch order, and passed to on_record) and skipped. Every JIT function starts from an empty in-memory cache,
    so one this process compiled earlier is skipped too: a kernel must never run on what a skipped one left
    unwritten."""
    from triton import knobs
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    specs: dict[KernelSpec, None] = {}

    def record(*, fn: Any, compile: dict[str, Any], **_: Any) -> bool:
        # The target from the driver, as Triton 3.6's specialization data has none
        target = json.dumps(dataclasses.asdict(driver.active.get_current_target()))
        spec = KernelSpec(fn.module, fn.name, compile["specialization_data"], target)
        if spec not in specs:
            specs[spec] = None
            if on_record is not None:
                on_record(spec)
        fn.jit_function.device_caches[compile["device"]][0][compile["key"]] = _NO_LAUNCH  # a dry run's cache
        return True  # Triton neither compiles nor launches

    previous_hook = knobs.runtime.jit_cache_hook
    try:
        JITFunction.device_caches = _DryRunCaches()
        knobs.runtime.jit_cache_hook = record
        yield specs
    finally:
        knobs.runtime.jit_cache_hook = previous_hook
        del JITFunction.device_caches


# -- one engine start ------------------------------------------------------------------------------------------


class CompileAhead:
    """One engine start's compile ahead: `run` each phase through it, then `close` it."""

    def __init__(self, setup: WorkerSetup | None, processes: int = 0, pool: CompilePool | None = None):
        """setup None: off, each phase just runs. pool: processes started ahead of the first phase, if any."""
        self.setup = setup
        self.processes = processes
        self.pool = pool
        self.info: dict[str, Any] = {}  # what it did, for the engine's info (summary.json)
        self.missed: list[str] | None = None  # after a parallel compile, the kernels its dry run missed

    @classmethod
    def begin(cls, config: EngineConfig, device: torch.device, tensor_parallel_size: int) -> CompileAhead:
        """Off unless on one CUDA device that compiles ahead (`compiles_ahead`), with at least two processes to
        spare.

        When the Triton cache is empty (a fresh machine: the first phase will stop at once), the processes are up
        already (started as the job began, `start_ahead`) or start now, while the model loads; otherwise a phase's stop
        starts as many as its kernels need, so that a warm start never pays for them (importing torch in each costs
        seconds of CPU)."""
        started = take_started()
        ahead = cls._begin(config, device, tensor_parallel_size, started)
        if started is not None and ahead.pool is not started:
            started.close()
        return ahead

    @classmethod
    def _begin(cls, config: EngineConfig, device: torch.device, tensor_parallel_size: int,
               started: CompilePool | None) -> CompileAhead:
        if device.type != "cuda" or not compiles_ahead(config, tensor_parallel_size):
            return cls(None)
        reason = missing_triton_api()
        if reason is not None:
            log.info("Parallel Triton compile unavailable (%s): kernels compile on first launch", reason)
            return cls(None)
        processes = compile_processes()
        if processes < 2:
            return cls(None)
        setup = worker_setup()
        if not cache_holds_no_kernel():
            return cls(setup, processes)
        if started is not None:
            ahead = cls(setup, processes, started)
            ahead.info["parallel_compile_started_ahead"] = True  # as the job began
            return ahead
        try:
            return cls(setup, processes, CompilePool(processes, setup))
        except OSError as error:  # they start at a phase's stop instead
            log.warning("Parallel Triton compile: its processes did not start ahead (%s)", error)
            return cls(setup, processes)

    def run(self, phase: Callable[[], T], dry_run: Callable[[], None]) -> T:
        """phase's result. Should it meet a kernel that is not in the disk cache, what dry_run launches (the forwards
        of the phase and of the phases after it) is compiled in parallel first and the phase runs again. Once per
        start: after that, whatever is still missing compiles at its first launch."""
        if self.setup is not None:
            settle_loaded_kernels()
            with contextlib.suppress(MissingKernel), stop_at_missing_kernel():
                return phase()
            # It stopped; its frames (and their tensors) went with the exception, before the dry run allocates its own.
            self._compile(dry_run, self.setup)
            self.setup = None
            self.missed = []
        if self.missed is None:
            return phase()
        with on_disk_miss(self._note_missed):
            return phase()

    def _note_missed(self, name: str) -> None:
        """A kernel the start's dry run did not launch (or that its compile left out), compiled now, alone."""
        self.missed.append(name)
        self.info["parallel_compile_missed_kernels"] = self.missed
        log.info("Triton kernel %s was not compiled ahead: it compiles at its first launch", name)

    def _compile(self, dry_run: Callable[[], None], setup: WorkerSetup) -> None:
        """Compiles what dry_run launches and the disk cache lacks; the processes end with it (once per start)."""
        try:
            self._compile_in_processes(dry_run, setup)
        finally:
            self.close()

    def _compile_in_processes(self, dry_run: Callable[[], None], setup: WorkerSetup) -> None:
        # Processes started with the start found the cache empty: every kernel the dry run records is missing, and
        # goes to them at once, so that they compile while the dry run goes on.
        pool = self.pool
        start = time.perf_counter()
        try:
            with dry_launches(None if pool is None else lambda spec: pool.submit(keyed(spec))) as recorded:
                dry_run()
        except DRY_RUN_ERRORS as error:
            log.warning("Parallel Triton compile skipped: its dry run of the engine's start failed (%s: %s); "
                        "kernels compile on first launch", type(error).__name__, error)
            return
        dry_run_seconds = time.perf_counter() - start
        start = time.perf_counter()
        failed, submitted = [], len(recorded)
        if pool is None:
            missing, failed = missing_on_disk(recorded)
            if not missing:
                self.info.update(parallel_compile_dry_run_seconds=dry_run_seconds)
                log.info("Parallel Triton compile: the start's dry run (%.2f s) found every kernel on disk",
                         dry_run_seconds)
                if failed:
                    log.warning("Parallel Triton compile: %d kernels cannot be compiled ahead, the first: %s",
                                len(failed), failed[0])
                return
            try:
                pool = self.pool = CompilePool(min(self.processes, len(missing)), setup)
            except OSError as error:
                log.warning("Parallel Triton compile skipped: its processes did not start (%s); kernels compile on "
                            "first launch", error)
                return
            submitted = len(missing)
            outcome = pool.compile(missing)
        else:  # every recorded kernel went to the processes as the dry run recorded it
            outcome = pool.finish()
        seconds = time.perf_counter() - start
        processes = pool.processes
        self.info.update(parallel_compile_kernels=outcome.compiled, parallel_compile_processes=processes,
                         parallel_compile_seconds=seconds, parallel_compile_dry_run_seconds=dry_run_seconds,
                         parallel_compile_busy_seconds=outcome.busy_seconds,
                         parallel_compile_startup_wait_seconds=outcome.startup_wait_seconds)
        if outcome.longest is not None:
            self.info["parallel_compile_longest_kernel"] = {"name": outcome.longest[0], "seconds": outcome.longest[1]}
        if outcome.stopped is not None:
            log.warning("Parallel Triton compile stopped (%s) after %d of %d kernels; the rest compile on first "
                        "launch", outcome.stopped, outcome.compiled, submitted)
            return
        failed += outcome.failed
        log.info("Compiled %d Triton kernels in %d processes in %.2f s after the start's dry run (%.2f s); %.1f s of "
                 "compiling in all, the longest %s (%.2f s); the first kernel waited %.2f s for the processes' "
                 "start-up%s", outcome.compiled, processes, seconds, dry_run_seconds, outcome.busy_seconds,
                 *(outcome.longest or ("none", 0.0)), outcome.startup_wait_seconds,
                 f"; {len(failed)} failed and compile on first launch, the first: {failed[0]}" if failed else "")

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
