"""Which GPUs a job's ranks take: whether the engine runs on CUDA, the check that a job's GPUs exist, each
data-parallel rank's device. torch is imported by the calls, not by this module: the parent of spawned ranks
(data_parallel.py) imports it, starts its ranks, and checks while they start up."""

from __future__ import annotations

import logging
import math
import os

from batchgen.config import Config, ConfigError, EngineConfig

log = logging.getLogger(__name__)


def runs_on_cuda(config: Config) -> bool:
    import torch

    return config.engine.device != "cpu" and torch.cuda.is_available()


def check_gpus(config: Config) -> None:
    """On CUDA each rank takes a GPU, or a share of one (engine.ranks_per_gpu): data-parallel ranks
    (engine.data_parallel_size, or torchrun's on this host) times tensor-parallel ranks of each."""
    engine = config.engine
    if not runs_on_cuda(config):
        return
    data_parallel = engine.data_parallel_size if engine.data_parallel_size > 1 else int(
        os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if engine.ranks_per_gpu > data_parallel:
        raise ConfigError(f"engine.ranks_per_gpu={engine.ranks_per_gpu}: more than the {data_parallel} data-parallel "
                          f"rank(s) (engine.data_parallel_size) that would share a GPU")
    import torch

    needed = math.ceil(data_parallel / engine.ranks_per_gpu) * engine.tensor_parallel_size
    present = torch.cuda.device_count()
    shared = f" at {engine.ranks_per_gpu} a GPU" if engine.ranks_per_gpu > 1 else ""
    if needed > present:
        raise ConfigError(f"engine.data_parallel_size={data_parallel} x engine.tensor_parallel_size="
                          f"{engine.tensor_parallel_size}{shared} needs {needed} GPUs; this machine has {present}")
    if shared and engine.data_parallel_size > 1:  # said once, by the parent of the ranks
        log.info("%d data-parallel ranks%s on %d GPU(s), each with 1/%d of engine.gpu_memory_utilization",
                 data_parallel, shared, needed, engine.ranks_per_gpu)


def rank_device(local_rank: int, engine: EngineConfig) -> int:
    """The GPU of a data-parallel rank: engine.ranks_per_gpu consecutive ranks share one; each rank's tensor-parallel
    ranks take the GPUs after its own."""
    return local_rank // engine.ranks_per_gpu * engine.tensor_parallel_size
