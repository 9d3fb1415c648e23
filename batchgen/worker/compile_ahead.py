"""A fresh machine's Triton kernels compiled ahead of the engine's start, in parallel processes.

Triton compiles a kernel at its first launch, in the launching process and holding the GIL: a fresh start of the
Qwen3-0.6B shape took 27 s, nearly all of it compiling 49 kernels one after the other (about 0.5 s each, on one core)
in its KV-sizing forward and CUDA-graph warm-ups. Compiled kernels land in Triton's disk cache (TRITON_CACHE_DIR),
keyed by source, specialization, options and target only, so any process may compile them for the engine:

1. The start's phases (the KV-sizing forward, the graph captures) run watched: the first launch whose kernel is not
   in the disk cache stops the phase (`MissingKernel`) before compiling it. A warm start pays nothing more.
2. A dry run of the rest of the start: its forwards run with every Triton launch skipped and recorded instead
   (Triton's `jit_cache_hook`), torch ops on garbage, nothing captured; the specializations, deduplicated.
3. Those not in the disk cache are compiled by compile processes (`JITFunction.preload`; one per core but one, at
   most 16, started while the model loads when the cache is empty), with their launchers where Triton compiles those
   too (`build_launcher`), and the phase runs again: each first launch then loads its kernel from disk.

Anything unexpected (another Triton without these hooks, a dry run or a worker that fails) loses only the speed-up:
one line in the log, and the kernels compile at their first launch as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing import Pipe
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any, TypeVar

import torch

if TYPE_CHECKING:
    from triton.backends.compiler import GPUTarget

    from batchgen.config import EngineConfig

log = logging.getLogger(__name__)

T = TypeVar("T")
MAX_PROCESSES = 16
COMPILE_TIMEOUT_SECONDS = 300.0  # a whole start's kernels on two processes take well under a minute
ENDED = "a compile process ended"
# What a dry run or a preload raises when Triton's internals differ from 3.6's and 3.8's, or a forward fails on
# garbage
DRY_RUN_ERRORS = (RuntimeError, AttributeError, KeyError, IndexError, TypeError, ValueError, ImportError)
PRELOAD_ERRORS = (RuntimeError, AttributeError, KeyError, TypeError, ValueError, ImportError, OSError)


class MissingKernel(Exception):
    """A launch met a kernel that is not in Triton's disk cache (only inside `stop_at_missing_kernel`)."""


@dataclass(frozen=True)
class KernelSpec:
    """One specialization of one kernel, as Triton's jit_cache_hook describes it."""

    module: str  # the module that defines the kernel
    name: str  # the kernel's name in it
    data: str  # Triton's specialization_data (JSON): what JITFunction.preload compiles
    target: str  # the GPUTarget it was launched for (JSON of its fields): what the compile processes build for
    # The engine's cache key of the kernel's source, under which a compile process stores it ("": its own settled
    # key). Triton 3.6 folds into a kernel's key what called functions this process has keyed so far, so a compile
    # process, which keyed others before, can reach another key than the engine's even settled: the engine then
    # missed the entry and compiled the kernel again, alone.
    source_key: str = ""


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


def settle(kernel: Any) -> None:
    """Computes the JIT function's source cache key again until it stops changing. Triton 3.6 adds the global
    constants a called function reads to its caller's key before it computes them (3.8 after), so a key depended on
    which kernels this process keyed first: settled, every called function's are in (the key 3.8 computes)."""
    key = kernel.cache_key
    kernel.hash = None
    while kernel.cache_key != key:
        key = kernel.cache_key
        kernel.hash = None


def kernel_of(spec: KernelSpec) -> Any:
    """The spec's JIT function, as it is in this process."""
    return getattr(importlib.import_module(spec.module), spec.name)


def settled_kernel(spec: KernelSpec) -> Any:
    """The spec's JIT function, its cache key the spec's source_key where it has one, else settled (`settle`)."""
    kernel = kernel_of(spec)
    if spec.source_key:
        kernel.hash = spec.source_key
    else:
        settle(kernel)
    return kernel


_settled: set[int] = set()  # ids of the JIT functions settle_loaded_kernels has settled in this process


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
            if isinstance(kernel, JITFunction) and id(kernel) not in _settled:
                settle(kernel)
                _settled.add(id(kernel))


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
def dry_launches() -> Iterator[dict[KernelSpec, None]]:
    """Inside, no Triton kernel launches: each first launch of a specialization is recorded (in the yielded dict,
    in launch order) and skipped. Every JIT function starts from an empty in-memory cache, so one this process
    compiled earlier is skipped too: a kernel must never run on what a skipped one left unwritten."""
    from triton import knobs
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    specs: dict[KernelSpec, None] = {}

    def record(*, fn: Any, compile: dict[str, Any], **_: Any) -> bool:
        # The target from the driver, as Triton 3.6's specialization data has none
        target = json.dumps(dataclasses.asdict(driver.active.get_current_target()))
        specs.setdefault(KernelSpec(fn.module, fn.name, compile["specialization_data"], target))
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


# -- the compile processes ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerSetup:
    env: dict[str, str]  # on top of the engine's: the Triton cache and the variables Triton keys it by
    # Build each spec for the GPU target it names (False: the tests' stand-in kernels, which are not Triton's)
    for_gpu: bool = True


@dataclass
class PoolOutcome:
    compiled: int
    failed: list[str]  # one line each: kernel, error
    stopped: str | None  # why the pool stopped before the end, or None


def _preload(spec: KernelSpec, for_gpu: bool) -> str | None:
    """Compiles the spec into the disk cache: None, or what went wrong, in one line."""
    try:
        if for_gpu:
            from triton.backends.compiler import GPUTarget
            from triton.runtime.driver import driver

            driver.set_active(TargetDriver(GPUTarget(**json.loads(spec.target))))
            kernel = settled_kernel(spec)
        else:
            kernel = kernel_of(spec)
        compiled = kernel.preload(spec.data)
        if for_gpu:
            build_launcher(compiled)
    except (*PRELOAD_ERRORS, subprocess.CalledProcessError) as error:
        return f"{spec.name}: {type(error).__name__}: {error}"
    return None


def build_launcher(compiled: Any) -> None:
    """Where Triton's launcher of a kernel is C code compiled for its signature (3.6: the CUDA backend's
    `make_launcher`), the engine's first launch of the kernel runs the C compiler, in its own process, one kernel after
    another (about half a second each). Built here instead, it lands in the disk cache and that launch loads it. Triton
    3.8 launches without compiled launchers: nothing to do."""
    from triton.backends.nvidia import driver as cuda_driver

    if hasattr(cuda_driver, "make_launcher"):
        cuda_driver.CudaLauncher(compiled.src, compiled.metadata)


class TargetDriver:
    """Triton's driver in a compile process: what Triton's compile path asks of one (JITFunction.preload), answered
    without touching a GPU, so that the process makes no CUDA context and takes no GPU memory. The target is the one
    the engine's launch recorded in the spec."""

    def __init__(self, target: GPUTarget):
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return self.target


def serve(conn: Connection, for_gpu: bool) -> None:
    """A compile process: compiles each spec the engine sends and answers, until the engine closes the pipe."""
    if for_gpu:
        importlib.import_module("triton")  # while the engine still loads (torch is imported with this module)
    while True:
        try:
            spec = conn.recv()
        except EOFError:  # the engine closed the pipe, or ended
            os._exit(0)  # nothing to flush: its compiles are in the disk cache; a torch process's teardown only costs
        conn.send(_preload(spec, for_gpu))


class CompilePool:
    """Compile processes, each fed one spec at a time. Plain subprocesses (`python -m` this module), not
    multiprocessing's: spawned children import the parent's __main__, which runs a script without a main guard
    again."""

    def __init__(self, processes: int, setup: WorkerSetup):
        # What the engine imports from, its own sys.path included (tests add the repository's root there); no
        # warnings, which the engine shows once and each process would repeat.
        env = {**os.environ, **setup.env, "PYTHONPATH": os.pathsep.join(path or os.getcwd() for path in sys.path),
               "PYTHONWARNINGS": "ignore"}
        self.workers: list[tuple[subprocess.Popen, Connection]] = []
        try:
            for _ in range(processes):
                conn, child_conn = Pipe()
                command = [sys.executable, "-m", __name__, str(child_conn.fileno()), str(int(setup.for_gpu))]
                # A session of their own: a Ctrl-C stops the engine, whose pipes closing then ends them, rather than
                # each of them with a traceback.
                process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, start_new_session=True,
                                           pass_fds=(child_conn.fileno(),))
                child_conn.close()
                self.workers.append((process, conn))
        except OSError:
            self.close()
            raise

    def compile(self, specs: list[KernelSpec], timeout: float = COMPILE_TIMEOUT_SECONDS) -> PoolOutcome:
        """Compiles the specs on the processes; stops at the first process that ends (it crashed) or at timeout."""
        todo = list(reversed(specs))
        conns = [conn for _, conn in self.workers]
        idle, busy = list(conns), set()
        outcome = PoolOutcome(0, [], None)
        deadline = time.monotonic() + timeout
        try:
            while todo or busy:
                while todo and idle:
                    conn = idle.pop()
                    conn.send(todo.pop())
                    busy.add(conn)
                ready = wait(conns, timeout=max(0.0, deadline - time.monotonic()))
                if not ready:
                    outcome.stopped = f"not done after {timeout:.0f} s"
                    return outcome
                if not busy.issuperset(ready):  # an idle process's pipe turns readable only when it ends
                    outcome.stopped = ENDED
                    return outcome
                for conn in ready:
                    error = conn.recv()
                    busy.remove(conn)
                    idle.append(conn)
                    if error is None:
                        outcome.compiled += 1
                    else:
                        outcome.failed.append(error)
        except (EOFError, ConnectionError):  # its end closed (ConnectionResetError with a spec left unread)
            outcome.stopped = ENDED
        return outcome

    def close(self) -> None:
        """Ends the processes, busy ones (after a stop) and ones still starting up too: a compile cut short leaves no
        cache entry (Triton writes an entry's index file last)."""
        for process, conn in self.workers:
            conn.close()
            process.kill()
            process.wait()
        self.workers = []


# -- one engine start ------------------------------------------------------------------------------------------


def key_triton_in_background() -> threading.Thread:
    """Starts hashing Triton's own files on a thread: every process computes that part of the kernels' cache keys
    once, at its first kernel (about 0.4 s on an H200's host), and on the thread most of it (hashlib's) runs beside
    the job's reading of its input, without the GIL."""
    thread = threading.Thread(target=_key_triton, name="triton-key", daemon=True)
    thread.start()
    return thread


def _key_triton() -> None:
    try:
        from triton.runtime.cache import triton_key  # Triton 3.6 and 3.8 keep it here
    except ImportError:  # no Triton (torch's CPU build), or one that keys elsewhere: its first kernel pays it
        return
    triton_key()


def compile_processes() -> int:
    """Worker processes for one engine: the cores this process may use, shared among the machine's local ranks
    (LOCAL_WORLD_SIZE, as data-parallel ranks set it), less one for the engine itself; at most MAX_PROCESSES."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(MAX_PROCESSES, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1")) - 1)


def missing_triton_api() -> str | None:
    """What this Triton lacks of what compile ahead uses, or None (Triton 3.6 and 3.8 have it all)."""
    import triton

    if not hasattr(getattr(getattr(triton, "knobs", None), "runtime", None), "jit_cache_hook"):
        return f"Triton {triton.__version__} has no knobs.runtime.jit_cache_hook"
    from triton.runtime import jit

    if not hasattr(jit.JITFunction, "preload"):
        return f"Triton {triton.__version__} has no JITFunction.preload"
    if not hasattr(triton._C.libtriton, "get_cache_invalidating_env_vars"):
        return f"Triton {triton.__version__} does not list the variables its cache keys depend on"
    return None


def worker_setup() -> WorkerSetup:
    """What a compile process needs to build what the engine's launches will look up: the Triton cache and the
    variables Triton keys it by."""
    from triton import knobs
    from triton._C.libtriton import get_cache_invalidating_env_vars

    return WorkerSetup({**get_cache_invalidating_env_vars(), "TRITON_CACHE_DIR": knobs.cache.dir})


def _cache_is_empty() -> bool:
    from triton import knobs

    try:
        with os.scandir(knobs.cache.dir) as entries:
            return next(entries, None) is None
    except FileNotFoundError:
        return True


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
        """Off unless engine.parallel_compile on one CUDA device (tensor-parallel ranks' forwards pair collectives,
        which a phase that one rank stops alone would leave waiting; torch.compile's kernels are Inductor's own),
        with at least two processes to spare.

        The processes start now, while the model loads, only when the Triton cache is empty (a fresh machine: the
        first phase will stop at once); otherwise at a phase's stop, as many as its kernels need, so that a warm
        start never pays for them (importing torch in each costs seconds of CPU)."""
        if not config.parallel_compile or device.type != "cuda" or tensor_parallel_size > 1 or config.torch_compile:
            return cls(None)
        reason = missing_triton_api()
        if reason is not None:
            log.info("Parallel Triton compile unavailable (%s): kernels compile on first launch", reason)
            return cls(None)
        processes = compile_processes()
        if processes < 2:
            return cls(None)
        setup = worker_setup()
        if not _cache_is_empty():
            return cls(setup, processes)
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
        start = time.perf_counter()
        try:
            with dry_launches() as recorded:
                dry_run()
        except DRY_RUN_ERRORS as error:
            log.warning("Parallel Triton compile skipped: its dry run of the engine's start failed (%s: %s); "
                        "kernels compile on first launch", type(error).__name__, error)
            return
        dry_run_seconds = time.perf_counter() - start
        missing, failed = [], []
        for spec in recorded:
            try:
                if not on_disk(spec):
                    missing.append(spec)
            except PRELOAD_ERRORS as error:
                failed.append(f"{spec.name}: {type(error).__name__}: {error}")
        if not missing:
            self.info.update(parallel_compile_dry_run_seconds=dry_run_seconds)
            log.info("Parallel Triton compile: the start's dry run (%.2f s) found every kernel on disk",
                     dry_run_seconds)
            if failed:
                log.warning("Parallel Triton compile: %d kernels cannot be compiled ahead, the first: %s", len(failed),
                            failed[0])
            return
        # Each under the key this process will look it up by (on_disk settled it)
        missing = [dataclasses.replace(spec, source_key=kernel_of(spec).cache_key) for spec in missing]
        start = time.perf_counter()
        try:
            self.pool = self.pool or CompilePool(min(self.processes, len(missing)), setup)
        except OSError as error:
            log.warning("Parallel Triton compile skipped: its processes did not start (%s); kernels compile on "
                        "first launch", error)
            return
        processes = len(self.pool.workers)
        outcome = self.pool.compile(missing)
        seconds = time.perf_counter() - start
        self.info.update(parallel_compile_kernels=outcome.compiled, parallel_compile_processes=processes,
                         parallel_compile_seconds=seconds, parallel_compile_dry_run_seconds=dry_run_seconds)
        if outcome.stopped is not None:
            log.warning("Parallel Triton compile stopped (%s) after %d of %d kernels; the rest compile on first "
                        "launch", outcome.stopped, outcome.compiled, len(missing))
            return
        failed += outcome.failed
        log.info("Compiled %d Triton kernels in %d processes in %.2f s (dry run of the start %.2f s)%s",
                 outcome.compiled, processes, seconds, dry_run_seconds,
                 f"; {len(failed)} failed and compile on first launch, the first: {failed[0]}" if failed else "")

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None


if __name__ == "__main__":  # a compile process: python -m batchgen.worker.compile_ahead FD FOR_GPU
    serve(Connection(int(sys.argv[1])), sys.argv[2] == "1")
