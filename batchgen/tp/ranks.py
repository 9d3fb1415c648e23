"""Rank 0's side of engine.tensor_parallel_size=N: starts followers 1..N-1 (one process each, `python -m
batchgen.engine.tp_follower`, on cuda:(d + r) where rank 0 runs on cuda:d, or the CPU), builds the groups with them,
sends them each step, and stops them at close.

A watchdog thread polls the followers' processes. A follower that exits while the engine runs is a failure: the
watchdog aborts the groups, so that rank 0 never waits on it (an NCCL collective with a dead peer waits forever; a
gloo one fails at once), and the engine raises FollowerExited naming the rank. A follower exits by itself when rank
0's process goes away (batchgen/engine/tp_follower.py).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

import batchgen
from batchgen.config import EngineConfig, ModelConfig
from batchgen.core.kv_sizing import KVDemand
from batchgen.core.scheduler import SchedulerOutput
from batchgen.layers.tensor_parallel import TensorParallel
from batchgen.tp.errors import FollowerExited
from batchgen.tp.group import RankGroup, joined_key, nccl_environment, serve_store
from batchgen.tp.peer_memory import peer_rows
from batchgen.tp.steps import StepSender
from batchgen.worker.model_runner import BitmaskProvider

log = logging.getLogger(__name__)

FOLLOWER_MODULE = "batchgen.engine.tp_follower"  # a follower's main (started by name: the engine imports this module)
POLL_SECONDS = 0.05
EXIT_SECONDS = 10.0  # a follower asked to stop gets this long before it is killed
FAILURE_WAIT_SECONDS = 10.0  # after a failed collective, how long to wait for the follower's exit to show


@dataclass(frozen=True)
class FollowerSpec:
    """What a follower is started with (pickled to its stdin)."""

    rank: int
    size: int
    port: int  # rank 0's rendezvous store
    device: str
    model_config: ModelConfig
    engine_config: EngineConfig
    task: str
    # The job's rows, as rank 0 has them: every rank captures the same CUDA graphs (their collectives pair up).
    kv_demand: KVDemand | None


def follower_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: cuda:(d + r) where rank 0 uses cuda:d; the CPU for every rank on CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index if device.index is not None else torch.cuda.current_device()) + rank)


def check_devices(device: torch.device, size: int) -> None:
    """Raises naming engine.tensor_parallel_size when the GPUs from rank 0's on are too few."""
    if device.type != "cuda":
        return
    last = follower_device(device, size - 1).index
    if last >= torch.cuda.device_count():
        raise ValueError(f"engine.tensor_parallel_size={size} needs cuda:{last - size + 1}..cuda:{last}; this machine "
                         f"has {torch.cuda.device_count()} GPUs")


def describe_exit(code: int) -> str:
    if code < 0:
        return f"on signal {signal.Signals(-code).name}"
    return f"with exit code {code}"


class Followers:
    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig, task: str,
                 kv_demand: KVDemand | None, device: torch.device, bitmask_provider: BitmaskProvider | None):
        """Starts the followers and builds the groups with them; returns once every follower has joined (each then
        loads its shard while rank 0 loads its own)."""
        size = engine_config.tensor_parallel_size
        check_devices(device, size)
        self.size = size
        self.failure: FollowerExited | None = None
        self._closing = False
        self.group: RankGroup | None = None
        store = serve_store(size)
        self.processes = [self._start(FollowerSpec(rank, size, store.port, str(follower_device(device, rank)),
                                                   model_config, engine_config, task, kv_demand))
                          for rank in range(1, size)]
        atexit.register(self.close, graceful=False)  # an engine never closed
        self._watchdog = threading.Thread(target=self._watch, name="tp-watchdog", daemon=True)
        self._watchdog.start()
        with self.failures():
            self._wait_until_joined(store)
            self.group = RankGroup.create(store, 0, size, device, peer_rows(engine_config))
        self.store = store  # the followers' connections to it stay open while they run
        self.sender = StepSender(self.group.control, bitmask_provider)
        self.tensor_parallel = TensorParallel(0, size, self.group.collectives)

    @staticmethod
    def _start(spec: FollowerSpec) -> subprocess.Popen:
        env = dict(os.environ)
        # The follower imports this batchgen, wherever it was imported from.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(batchgen.__file__).resolve().parents[1]),
                                                          env.get("PYTHONPATH")]))
        nccl_environment(env)
        process = subprocess.Popen([sys.executable, "-m", FOLLOWER_MODULE], stdin=subprocess.PIPE, env=env)
        process.stdin.write(pickle.dumps(spec))
        process.stdin.close()
        return process

    def _wait_until_joined(self, store: torch.distributed.Store) -> None:
        waiting = list(range(1, self.size))
        while waiting:
            self.check()
            waiting = [rank for rank in waiting if not store.check([joined_key(rank)])]
            time.sleep(POLL_SECONDS if waiting else 0)

    def _exited(self) -> FollowerExited | None:
        for rank, process in enumerate(self.processes, start=1):
            code = process.poll()
            if code is not None:
                return FollowerExited(f"tensor-parallel rank {rank} of {self.size} (pid {process.pid}) exited "
                                      f"{describe_exit(code)}")
        return None

    def _watch(self) -> None:
        while not self._closing:
            failure = self._exited()
            if failure is not None and not self._closing:
                self.failure = failure
                if self.group is not None:
                    self.group.abort()
                return
            time.sleep(POLL_SECONDS)

    def died(self) -> bool:
        """Whether a follower has exited while the engine ran (before close stopped it)."""
        return self.failure is not None or (not self._closing and self._exited() is not None)

    def check(self) -> None:
        """Raises the failure the watchdog saw, if any."""
        if self.failure is not None:
            raise self.failure

    @contextlib.contextmanager
    def failures(self) -> Iterator[None]:
        """Turns a collective that failed because a follower exited into that follower's FollowerExited; checks for
        one after the body too (an aborted NCCL collective may return without an error)."""
        try:
            yield
        except RuntimeError as error:
            deadline = time.monotonic() + FAILURE_WAIT_SECONDS
            while (failure := self.failure or self._exited()) is None and time.monotonic() < deadline:
                time.sleep(POLL_SECONDS)
            if failure is None or isinstance(error, FollowerExited):
                raise
            raise failure from None
        self.check()

    def wait_for_step(self, done: torch.cuda.Event) -> None:
        """Waits for a step's event, raising the failure the watchdog saw: a step whose NCCL collective waits for
        a dead follower never completes, so a blocking synchronize would never return."""
        while not done.query():
            self.check()
            time.sleep(0)  # lets the watchdog thread run

    def send(self, step: SchedulerOutput, pooling: bool = False) -> None:
        self.sender.send(step, pooling)

    def close(self, graceful: bool = True) -> None:
        """Stops the followers. graceful: between steps, they are asked to, and killed when they do not exit in
        time; else killed at once (an engine that stopped while starting or mid-step, whose followers may wait in a
        collective that rank 0 will not join)."""
        if self._closing:
            return
        self._closing = True
        atexit.unregister(self.close)
        stopped = False
        if graceful and self.group is not None and self.failure is None and all(p.poll() is None
                                                                                 for p in self.processes):
            with contextlib.suppress(RuntimeError):  # a follower that just died: the others are killed below
                self.sender.stop()
                stopped = True
        deadline = time.monotonic() + (EXIT_SECONDS if graceful else 0.0)
        for process in self.processes:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                if graceful:
                    log.warning("tensor-parallel follower pid %d did not stop: killing it", process.pid)
                process.kill()
                process.wait()
        if stopped:
            with contextlib.suppress(RuntimeError):
                self.group.shutdown()  # the followers have exited: nothing runs on the groups any more
        elif self.group is not None and self.failure is None:
            # Killed, not stopped (the watchdog aborted the groups after a failure): nobody answers rank 0's side of
            # the groups any more, whose teardown at the process's exit could wait for them. (An engine start that
            # failed on both ranks left rank 0's process waiting at exit on two H200s.)
            with contextlib.suppress(RuntimeError):
                self.group.abort()
