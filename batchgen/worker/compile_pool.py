"""The compile processes: subprocesses that compile Triton kernels into its disk cache, one spec at a time, for an
engine start's compile ahead (batchgen/worker/compile_ahead.py), forked by one parent that imports torch and Triton
for all of them. On a fresh machine the job starts them as it begins (`start_ahead`), so that those imports (seconds)
run while it reads its input and loads the model.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing import Pipe
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from triton.backends.compiler import GPUTarget

    from batchgen.config import Config, EngineConfig

MAX_PROCESSES = 16
COMPILE_TIMEOUT_SECONDS = 300.0  # a whole start's kernels on two processes take well under a minute
ENDED = "a compile process ended"
READY = "ready"  # a process's first message: its imports are done, it takes specs
PRELOAD_ERRORS = (RuntimeError, AttributeError, KeyError, TypeError, ValueError, ImportError, OSError)


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
    # What the compiles cost: the processes' seconds in all, and the longest kernel's (name, seconds)
    busy_seconds: float = field(default=0.0, compare=False)
    longest: tuple[str, float] | None = field(default=None, compare=False)
    # How long the first spec handed over waited for the processes' start-up (their imports): until the last was ready
    startup_wait_seconds: float = field(default=0.0, compare=False)


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


def supervise(fds: list[int], for_gpu: bool) -> None:
    """The compile processes' parent: imports what every compile needs once, then forks one compile process for each
    pipe and waits for them. Each process forked from it takes specs at once, where fifteen processes importing torch
    and Triton side by side were ready well into the start's dry run (benchmarks/RESULTS.md). A SIGTERM (the pool's
    close) kills them, busy ones too; it exits once they all have."""
    if for_gpu:  # before the first spec arrives: the engine is still starting
        importlib.import_module("torch")  # the kernels' modules import it
        importlib.import_module("triton")
        # The part of every compile's cache key that hashes Triton's own files (its 400 MB library among them), once
        # for every process.
        with contextlib.suppress(ImportError):  # Triton 3.6 and 3.8 keep it here
            from triton.runtime.cache import triton_key

            triton_key()
    # Both signals wait for sigwaitinfo below: a child is killed only before this loop reaps it (its pid not reused)
    signals = {signal.SIGTERM, signal.SIGCHLD}
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    live: set[int] = set()
    for index, fd in enumerate(fds):
        pid = os.fork()
        if pid == 0:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)
            for other in fds[index + 1:]:  # the earlier ones are closed here already
                os.close(other)
            serve(Connection(fd), for_gpu)
        live.add(pid)
        os.close(fd)
    while live:
        if signal.sigwaitinfo(signals).si_signo == signal.SIGTERM:
            for pid in live:
                os.kill(pid, signal.SIGKILL)
        while live and (pid := os.waitpid(-1, os.WNOHANG)[0]):
            live.discard(pid)
    os._exit(0)


def serve(conn: Connection, for_gpu: bool) -> NoReturn:
    """A compile process: compiles each spec the engine sends and answers, until the engine closes the pipe."""
    try:
        conn.send(READY)
        while True:
            spec = conn.recv()
            start = time.perf_counter()
            error = _preload(spec, for_gpu)
            conn.send((error, time.perf_counter() - start))
    except (EOFError, ConnectionError):  # the engine closed the pipe, or ended
        pass
    os._exit(0)  # nothing to flush: its compiles are in the disk cache; a torch process's teardown only costs


class CompilePool:
    """Compile processes, each fed one spec at a time, forked by one process that imports torch and Triton for them
    (`supervise`). It is a plain subprocess (`python -m` this module), not multiprocessing's: spawned children import
    the parent's __main__, which runs a script without a main guard again.

    A thread of the pool's own takes each answer as it comes and hands the process its next queued spec: the engine's
    thread hands specs over only as its dry run records them (most of them in its first moments, the rest seconds
    apart), which left a process that finished one idle until the next was recorded.
    """

    def __init__(self, processes: int, setup: WorkerSetup):
        # What the engine imports from, its own sys.path included (tests add the repository's root there); no
        # warnings, which the engine shows once and each process would repeat.
        env = {**os.environ, **setup.env, "PYTHONPATH": os.pathsep.join(path or os.getcwd() for path in sys.path),
               "PYTHONWARNINGS": "ignore"}
        pipes = [Pipe() for _ in range(processes)]
        self._conns = [conn for conn, _ in pipes]
        fds = [child_conn.fileno() for _, child_conn in pipes]
        command = [sys.executable, "-m", __name__, ",".join(map(str, fds)), str(int(setup.for_gpu))]
        try:
            # A session of its own: a Ctrl-C stops the engine, whose pipes closing then ends the processes, rather
            # than each of them with a traceback.
            self.supervisor: subprocess.Popen | None = subprocess.Popen(
                command, env=env, stdin=subprocess.DEVNULL, start_new_session=True, pass_fds=fds)
        except OSError:
            for conn, child_conn in pipes:
                conn.close()
                child_conn.close()
            raise
        for _, child_conn in pipes:
            child_conn.close()
        self._idle: list[Connection] = list(self._conns)
        self._busy: dict[Connection, str] = {}  # a busy process's pipe: the kernel it compiles
        self._starting = set(self._conns)  # the processes not ready yet (a spec may already wait in their pipes)
        self._first_sent: float | None = None  # when the first spec was handed over
        self._todo: deque[KernelSpec] = deque()
        self.outcome = PoolOutcome(0, [], None)
        self._changed = threading.Condition()  # guards the above; notified as answers come in
        self._wake, self._waker = Pipe(duplex=False)  # what ends the feeder's wait when the pool closes
        self._feeder: threading.Thread | None = threading.Thread(target=self._feed, name="batchgen-compile-feeder",
                                                                 daemon=True)
        self._feeder.start()

    @property
    def processes(self) -> int:
        return len(self._conns)

    def submit(self, spec: KernelSpec) -> None:
        """Queues a spec and hands queued specs to idle processes; never waits. After a process ended, nothing is
        sent."""
        with self._changed:
            self._todo.append(spec)
            self._send()

    def compile(self, specs: list[KernelSpec], timeout: float = COMPILE_TIMEOUT_SECONDS) -> PoolOutcome:
        with self._changed:
            self._todo.extend(specs)
            self._send()
        return self.finish(timeout)

    def finish(self, timeout: float = COMPILE_TIMEOUT_SECONDS) -> PoolOutcome:
        """Waits until every spec submitted is compiled; stops at the first process that ends (it crashed) or at
        timeout."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while self.outcome.stopped is None and (self._todo or self._busy):
                left = deadline - time.monotonic()
                if left <= 0:
                    self.outcome.stopped = f"not done after {timeout:.0f} s"
                    break
                self._changed.wait(left)
        return self.outcome

    def _feed(self) -> None:
        """The feeder thread: takes the answers as they come, hands out queued specs; ends with the pool, or at
        the first process that ends."""
        watched = [*self._conns, self._wake]
        while True:
            ready = wait(watched)
            with self._changed:
                if self._wake in ready:
                    return
                self._take(ready)
                self._send()
                self._changed.notify_all()
                if self.outcome.stopped is not None:
                    return

    def _send(self) -> None:
        try:
            while self.outcome.stopped is None and self._todo and self._idle:
                conn, spec = self._idle.pop(), self._todo.popleft()
                conn.send(spec)
                self._busy[conn] = spec.name
                if self._first_sent is None:
                    self._first_sent = time.perf_counter()
        except ConnectionError:  # its process ended
            self.outcome.stopped = ENDED

    def _take(self, ready: list) -> None:
        """The answers of the processes whose pipes are readable."""
        if self.outcome.stopped is not None or not ready:
            return
        # A process neither starting nor busy has nothing to say: its pipe turns readable only when it ends
        if not set(ready) <= self._busy.keys() | self._starting:
            self.outcome.stopped = ENDED
            return
        outcome = self.outcome
        try:
            for conn in ready:
                if conn in self._starting:  # its first message: READY
                    conn.recv()
                    self._starting.remove(conn)
                    if not self._starting and self._first_sent is not None:
                        outcome.startup_wait_seconds = time.perf_counter() - self._first_sent
                    continue
                error, seconds = conn.recv()
                name = self._busy.pop(conn)
                self._idle.append(conn)
                if error is None:
                    outcome.compiled += 1
                else:
                    outcome.failed.append(error)
                outcome.busy_seconds += seconds
                if outcome.longest is None or seconds > outcome.longest[1]:
                    outcome.longest = (name, seconds)
        except (EOFError, ConnectionError):  # its end closed (ConnectionResetError with a spec left unread)
            self.outcome.stopped = ENDED

    def close(self) -> None:
        """Ends the feeder, then the processes, busy ones (after a stop) and ones still starting up too: a compile
        cut short leaves no cache entry (Triton writes an entry's index file last)."""
        if self._feeder is not None:
            self._waker.send_bytes(b"")
            self._feeder.join()
            self._feeder = None
            self._waker.close()
            self._wake.close()
        if self.supervisor is not None:
            for conn in self._conns:
                conn.close()
            self.supervisor.terminate()  # it kills the processes it forked and waits for them
            self.supervisor.wait()
            self.supervisor = None


# -- whether and how many --------------------------------------------------------------------------------------


def compiles_ahead(engine: EngineConfig, tensor_parallel_size: int) -> bool:
    """Whether an engine on a CUDA GPU compiles ahead: engine.parallel_compile, not tensor-parallel (its ranks'
    forwards pair collectives, which a phase that one rank stops alone would leave waiting), not torch.compile's
    (Inductor's kernels are its own)."""
    return engine.parallel_compile and tensor_parallel_size == 1 and not engine.torch_compile


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


def cache_holds_no_kernel() -> bool:
    """Whether Triton's disk cache holds no compiled kernel (a fresh machine's). It may hold C helper modules (`.so`
    files): the CUDA driver's, which the job builds on a thread as it begins (`start_triton_in_background`), and the
    kernels' launchers, which are built with kernels."""
    from triton import knobs

    try:
        with os.scandir(knobs.cache.dir) as entries:
            return all(_holds_only_modules(entry) for entry in entries)
    except FileNotFoundError:
        return True


def _holds_only_modules(entry: os.DirEntry) -> bool:
    """A cache entry (a folder of one key's files) that holds no file but `.so` modules. A folder inside it is a
    write in progress (FileCacheManager.put's), not a file yet."""
    if not entry.is_dir():
        return entry.name.endswith(".so")
    try:
        with os.scandir(entry.path) as files:
            return all(file.name.endswith(".so") for file in files if file.is_file())
    except FileNotFoundError:
        return True


# -- started ahead by the job ----------------------------------------------------------------------------------

_started: CompilePool | None = None  # for this process's engine, which takes it (take_started)


def start_ahead(engine: EngineConfig) -> None:
    """Starts the compile processes now, as the job begins on a CUDA GPU, where its engine will compile ahead on a
    Triton cache without kernels (a fresh machine): their parent's imports of torch and Triton then run while the job
    reads its input and loads the model. The engine takes them (`take_started`), or closes them if it does not compile
    ahead after all. Processes started and not taken yet are kept (the command line's, started before its import of
    torch: `start_ahead_of_torch`)."""
    global _started
    wanted = compiles_ahead(engine, engine.tensor_parallel_size) and importlib.util.find_spec("triton") is not None
    if _started is not None and wanted:
        return
    close_started()  # a multirun's previous job did not start its engine, or this job's engine will not take them
    if not wanted:
        return
    processes = compile_processes()
    if processes < 2 or missing_triton_api() is not None or not cache_holds_no_kernel():
        return
    with contextlib.suppress(OSError):  # then the engine starts them as it loads
        _started = CompilePool(processes, worker_setup())


def start_ahead_of_torch(config: Config) -> None:
    """start_ahead for the command line, before it imports torch, where its job will likely run an engine on an
    NVIDIA GPU: the config says so, and the driver's device node is there (torch, which would tell, is not imported
    yet). The processes' parent then imports torch and Triton beside this process's own import of torch, not after
    it. launch() closes them where no CUDA GPU runs the engine after all."""
    engine = config.engine
    if (config.runner.name == "ray" or engine.data_parallel_size > 1 or engine.device == "cpu"
            or os.environ.get("CUDA_VISIBLE_DEVICES", "0").strip() in ("", "-1")
            or not os.path.exists("/dev/nvidiactl")):
        return
    start_ahead(engine)


def close_started() -> None:
    """Closes the processes start_ahead started, if no engine took them."""
    global _started
    if _started is not None:
        _started.close()
        _started = None


def take_started() -> CompilePool | None:
    """The processes start_ahead started, handed over once."""
    global _started
    pool, _started = _started, None
    return pool


if __name__ == "__main__":  # the compile processes: python -m batchgen.worker.compile_pool FD,FD,... FOR_GPU
    supervise([int(fd) for fd in sys.argv[1].split(",")], sys.argv[2] == "1")
