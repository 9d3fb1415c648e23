"""The engine's torch intra-op threads: one with a GPU, the CPU's shared among the machine's ranks."""

import torch

from batchgen.worker.host_threads import intra_op_threads

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_a_requested_count_wins(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert intra_op_threads(3, CPU) == 3
    assert intra_op_threads(3, CUDA) == 3


def test_one_thread_with_a_gpu():
    assert intra_op_threads(None, CUDA) == 1


def test_a_lone_cpu_process_keeps_torchs_default(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert intra_op_threads(None, CPU) is None


def test_cpu_ranks_of_one_machine_share_its_threads(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    assert intra_op_threads(None, CPU) == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    assert intra_op_threads(None, CPU) == 1
