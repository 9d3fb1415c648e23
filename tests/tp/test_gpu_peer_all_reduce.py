"""On two GPUs: the decode graphs' all-reduce through the ranks' mapped buffers (batchgen/tp/peer_memory.py) sums
as NCCL does, bit for bit, on both ranks, over many replays of a graph whose calls reuse the same rows' slots with
other shapes and dtypes in between; what the buffers do not take (outside a capture, rows past them, rows that are
not whole 32-bit words) stays NCCL's, in the same graph."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from batchgen.tp.group import RankGroup, connect_store, serve_store

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]

PEER_ROWS = 16
# (rows, width, dtype, through the mapped buffers) of the all-reduces one graph runs, in order
CALLS = [(1, 4096, torch.bfloat16, True), (3, 4096, torch.bfloat16, True), (1, 4096, torch.bfloat16, True),
         (8, 64, torch.float32, True), (5, 33, torch.float16, False),  # 33 halves: not whole words
         (8, 8192, torch.bfloat16, True), (2, 8320, torch.bfloat16, False),  # a row past its slot's 16 KiB
         (40, 256, torch.float32, False), (16, 4096, torch.float16, True)]  # 40 rows: past PEER_ROWS
REPLAYS = 25
REPLAY_SECONDS = 60  # a replay not done by then is waiting for the other rank's words forever


def _inputs(rank: int, replay: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * replay + rank)
    return [torch.randn(rows, width, generator=generator).to(dtype) for rows, width, dtype, _ in CALLS]


def _finish(replay: int) -> None:
    done = torch.cuda.Event()
    done.record()
    deadline = time.monotonic() + REPLAY_SECONDS
    while not done.query():
        assert time.monotonic() < deadline, f"replay {replay} still waits after {REPLAY_SECONDS} s"


def _rank(rank: int, port: int, out: Path) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    group = RankGroup.create(connect_store(port, 2), rank, 2, device, peer_rows=PEER_ROWS)
    collectives = group.collectives
    assert collectives.peer is not None, "the two GPUs could not map each other's buffers"

    static = [x.to(device) for x in _inputs(rank, 0)]
    for x in static:  # eager: NCCL, the mapped buffers untouched
        collectives.all_reduce(x.clone())
    torch.cuda.synchronize()
    assert int(collectives.peer.counts.sum()) == 0
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # NCCL's warm-up on a side stream, as the engine's capture does
        for x in static:
            collectives.all_reduce(x.clone())
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for x in static:
            collectives.all_reduce(x)
    results = []
    for replay in range(REPLAYS):
        inputs = [x.to(device) for x in _inputs(rank, replay)]
        for x, value in zip(static, inputs, strict=True):
            x.copy_(value)
        graph.replay()
        _finish(replay)
        for value in inputs:
            collectives.all_reduce(value)  # NCCL, eager: the reference
        torch.cuda.synchronize()
        results.append([(x.cpu(), value.cpu()) for x, value in zip(static, inputs, strict=True)])
    torch.save({"results": results, "counts": collectives.peer.counts.cpu()}, out / f"rank{rank}.pt")
    # As a follower ends (batchgen/engine/tp_follower.py): without the interpreter's teardown, which did not return
    # with an NCCL group that graphs captured
    os._exit(0)


def test_mapped_buffer_all_reduce_equals_nccl_on_both_ranks(tmp_path: Path):
    store = serve_store(2)  # the ranks' rendezvous, served here as rank 0's engine serves its followers'
    mp.start_processes(_rank, args=(store.port, tmp_path), nprocs=2, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for replay in range(REPLAYS):
        for call, (rows, width, dtype, _) in enumerate(CALLS):
            mine, nccl = ranks[0]["results"][replay][call]
            theirs, _ = ranks[1]["results"][replay][call]
            assert mine.shape == (rows, width) and mine.dtype == dtype
            assert torch.equal(mine, nccl), f"replay {replay}, call {call}: not NCCL's sum"
            assert torch.equal(mine, theirs), f"replay {replay}, call {call}: the ranks' sums differ"
    expected = torch.zeros(PEER_ROWS, dtype=torch.int32)  # each replay's calls of each row, through the buffers
    for rows, _, _, mapped in CALLS:
        if mapped:
            expected[:rows] += REPLAYS
    assert torch.equal(ranks[0]["counts"], expected) and torch.equal(ranks[1]["counts"], expected)
