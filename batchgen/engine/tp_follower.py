"""A tensor-parallel follower: `python -m batchgen.engine.tp_follower`, started by rank 0 (batchgen/tp/ranks.py) with
its FollowerSpec on stdin.

It builds its shard of the model as rank 0 builds its own (engine/model_worker.py), then runs every step rank 0
sends, with ModelRunner.launch on the step rebuilt from the message (batchgen/tp/steps.py), until rank 0 says stop.
Stop signals are rank 0's to handle (a terminal's Ctrl-C reaches every process of the group; rank 0 stops its
followers itself); a follower whose rank 0 has gone away exits.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import threading
import time

import torch

from batchgen.engine.model_worker import ModelWorker
from batchgen.layers.tensor_parallel import TensorParallel
from batchgen.tp.group import ControlChannel, RankGroup, connect_store, joined_key
from batchgen.tp.peer_memory import peer_rows
from batchgen.tp.ranks import FollowerSpec
from batchgen.tp.steps import StepMessage, StepMirror
from batchgen.worker.model_runner import LaunchedStep

PARENT_POLL_SECONDS = 1.0
PARENT_EXIT_SECONDS = 3.0


def exit_with_parent(parent: int) -> None:
    """Ends this process once rank 0's process is gone (this process is then someone else's child): rank 0 may die
    where its connections stay open (a stopped process), or after it aborted the groups."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_SECONDS)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def follow(worker: ModelWorker, channel: ControlChannel, mirror: StepMirror) -> None:
    """Runs rank 0's steps until it sends None; each launched step is collected after the next one is launched, as
    rank 0's engine does with async scheduling."""
    in_flight: LaunchedStep | None = None
    while (message := pickle.loads(channel.receive())) is not None:
        assert isinstance(message, StepMessage)
        worker.release(mirror.released(message))
        step = mirror.step(message)
        if message.pooling:
            launched = worker.runner.launch_pooling(step, worker.pooler)
        else:
            launched = worker.runner.launch(step)
        if in_flight is not None:
            worker.runner.collect(in_flight)
        in_flight = launched


def main() -> None:
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    parent = os.getppid()
    exit_with_parent(parent)
    spec: FollowerSpec = pickle.load(sys.stdin.buffer)
    logging.basicConfig(level=logging.WARNING, format=f"[tensor-parallel rank {spec.rank}] %(levelname)s %(message)s")
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = connect_store(spec.port, spec.size)
    store.set(joined_key(spec.rank), "1")
    group = RankGroup.create(store, spec.rank, spec.size, device, peer_rows(spec.engine_config))
    mirror = StepMirror()
    try:
        worker = ModelWorker(spec.model_config, spec.engine_config, spec.task, device, spec.kv_demand,
                             bitmask_provider=mirror.step_bitmask,
                             tp=TensorParallel(spec.rank, spec.size, group.collectives),
                             agree_min=group.control.agree_min)
        follow(worker, group.control, mirror)
    except RuntimeError:
        if rank_0_alive(parent):
            raise
        sys.exit(1)  # rank 0 went away mid-collective: it reports what happened
    # The communicators and the CUDA state end with the process: a follower that tore its groups down first did
    # not exit within ranks.EXIT_SECONDS on two H100s. Rank 0 releases its side once this process is gone.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def rank_0_alive(parent: int) -> bool:
    """Whether rank 0's process is still this one's parent, a moment after a collective failed (its connections
    close as it exits, before this process is given another parent)."""
    deadline = time.monotonic() + PARENT_EXIT_SECONDS
    while os.getppid() == parent and time.monotonic() < deadline:
        time.sleep(PARENT_POLL_SECONDS / 10)
    return os.getppid() == parent


if __name__ == "__main__":
    main()
