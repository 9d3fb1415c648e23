"""All-reduce latency inside CUDA graphs on two GPUs: the tensor-parallel group's all-reduce through the ranks'
mapped buffers (batchgen/tp/peer_memory.py, what decode graphs use) against NCCL's, for a decode step's tensors
(rows x hidden, bf16). 64 back-to-back calls captured in one graph, replayed; microseconds a call, the median of 20
replays.

Run from the repo root: python -m benchmarks.bench_all_reduce [--hidden 4096] [--rows 1 8 64 256]
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any

import torch
import torch.multiprocessing as mp

from batchgen.tp.group import RankGroup, connect_store, serve_store
from benchmarks.common import add_out_argument, environment, markdown_table, save_json

CALLS = 64


def _time_graph(calls, x: torch.Tensor) -> float:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            calls(x)
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(20):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / CALLS)
    return statistics.median(times)


def _rank(rank: int, port: int, hidden: int, rows_list: list[int], results: Any) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    group = RankGroup.create(connect_store(port, 2), rank, 2, device, peer_rows=max(rows_list))
    collectives, peer = group.collectives, group.collectives.peer
    rows_out = []
    for rows in rows_list:
        x = torch.full((rows, hidden), 1.0 / 64, dtype=torch.bfloat16, device=device)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            collectives.all_reduce(x)
        torch.cuda.synchronize()
        mapped = _time_graph(collectives.all_reduce, x) if peer is not None else None
        collectives.peer = None
        nccl = _time_graph(collectives.all_reduce, x)
        collectives.peer = peer
        rows_out.append({"rows": rows, "bytes": x.numel() * 2, "mapped_us": mapped, "nccl_us": nccl})
    if rank == 0:
        results.put(rows_out)
    os._exit(0)  # as a follower ends: the interpreter's teardown may not return with NCCL groups graphs captured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256])
    add_out_argument(parser)
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit("bench_all_reduce needs two CUDA devices")
    store = serve_store(2)  # the ranks' rendezvous, served here as rank 0's engine serves its followers'
    results = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_rank, args=(store.port, args.hidden, args.rows, results), nprocs=2, start_method="spawn")
    rows = results.get()
    save_json(args.out, f"bench_all_reduce_{args.hidden}", {"environment": environment(), "hidden": args.hidden,
                                                             "calls": CALLS, "results": rows})
    print(f"\n## bench_all_reduce ({environment()['device']}, two GPUs, hidden {args.hidden}, bf16, {CALLS} calls in "
          "a graph, microseconds a call)\n")
    headers = ["rows", "bytes", "mapped_us", "nccl_us"]
    print(markdown_table(headers, [[row[h] for h in headers] for row in rows]))


if __name__ == "__main__":
    main()
