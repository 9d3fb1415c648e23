"""bench_fused: the fused Triton GEMVs vs the kernels they replace, on the Qwen3-0.6B layer shapes (CUDA only).

- add + RMSNorm into qkv_proj and gate_up_proj: the engine's compiled add_rms_norm kernel + small_m_linear, vs
  add_rms_norm_linear (one launch);
- SiLU-and-mul into gate_up_proj (after its add + RMSNorm): add_rms_norm_linear + the engine's Triton silu_and_mul
  kernel, vs add_rms_norm_linear(silu_and_mul=True).

Timed like bench_linear: one CUDA graph of --calls back-to-back calls, each on the next of several weight copies that
do not fit in L2 together; microseconds per call = median over --replays replays / calls. The per-step saving counts
each fusion's calls in one decode step (28 layers). The switches that turn the fusions off in the engine are
FUSE_ADD_RMS_NORM and FUSE_SILU_AND_MUL in batchgen/layers/fused.py.

Usage: python -m benchmarks.bench_fused [--ms 1] [--calls 100] [--replays 10] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import torch

from batchgen.layers import elementwise_triton
from batchgen.layers.compiled import compiled
from batchgen.layers.linear_triton import MAX_M, add_rms_norm_linear, small_m_linear
from batchgen.layers.norms import add_rms_norm
from benchmarks.bench_linear import decoder_linears, graph_ms_per_call, weight_copies
from benchmarks.common import QWEN3, add_out_argument, environment, markdown_table, save_json

EPS = 1e-6
GraphFn = Callable[[torch.Tensor], Any]  # called with one weight copy


def _hidden_rows(m: int, k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fresh (m, k) hidden and residual rows, and a norm weight."""
    hidden, residual = torch.randn(m, k, device="cuda", dtype=dtype), torch.randn(m, k, device="cuda", dtype=dtype)
    return hidden, residual, torch.rand(k, device="cuda", dtype=dtype) + 0.5


def norm_pair(m: int, k: int, dtype: torch.dtype) -> tuple[GraphFn, GraphFn]:
    """(unfused, fused) add + RMSNorm + linear."""
    hidden, residual, norm_weight = _hidden_rows(m, k, dtype)
    add_norm = compiled(add_rms_norm)

    def unfused(weight: torch.Tensor) -> torch.Tensor:
        normed, _ = add_norm(hidden, residual, norm_weight, EPS)
        return small_m_linear(normed, weight)

    def fused(weight: torch.Tensor) -> torch.Tensor:
        return add_rms_norm_linear(hidden, residual, norm_weight, EPS, weight)[0]

    return unfused, fused


def silu_pair(m: int, k: int, dtype: torch.dtype) -> tuple[GraphFn, GraphFn]:
    """(unfused, fused) SiLU-and-mul after the add + RMSNorm + gate/up linear."""
    hidden, residual, norm_weight = _hidden_rows(m, k, dtype)

    def unfused(weight: torch.Tensor) -> torch.Tensor:
        gate_up, _ = add_rms_norm_linear(hidden, residual, norm_weight, EPS, weight)
        return elementwise_triton.silu_and_mul(gate_up)

    def fused(weight: torch.Tensor) -> torch.Tensor:
        return add_rms_norm_linear(hidden, residual, norm_weight, EPS, weight, silu_and_mul=True)[0]

    return unfused, fused


FUSIONS = {  # fusion: (layers it applies to, the (unfused, fused) pair builder)
    "add+RMSNorm": (("qkv_proj", "gate_up_proj"), norm_pair),
    "SiLU-and-mul": (("gate_up_proj",), silu_pair),
}


def check(unfused: GraphFn, fused: GraphFn, weight: torch.Tensor) -> None:
    expected = unfused(weight).float()
    scale = max(float(expected.abs().max()), 1.0)
    torch.testing.assert_close(fused(weight).float(), expected, atol=1e-2 * scale, rtol=1e-2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ms", type=int, nargs="*", default=[1], help=f"token counts, 1..{MAX_M}")
    parser.add_argument("--calls", type=int, default=100, help="back-to-back calls in one CUDA graph")
    parser.add_argument("--replays", type=int, default=10, help="timed graph replays (median)")
    parser.add_argument("--rotate-mib", type=int, default=512, help="total size of the weight copies per layer")
    add_out_argument(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_fused needs a CUDA device")
    if not all(1 <= m <= MAX_M for m in args.ms):
        sys.exit(f"token counts must be in 1..{MAX_M}")
    dtype = torch.bfloat16
    torch.manual_seed(0)
    shapes = decoder_linears(QWEN3)

    results = []
    for fusion, (layers, make_pair) in FUSIONS.items():
        for layer in layers:
            n, k, per_step = shapes[layer]
            weights = [copy.values for copy in weight_copies(n, k, "bfloat16", args.rotate_mib * 2**20)]
            for m in args.ms:
                unfused, fused = make_pair(m, k, dtype)
                check(unfused, fused, weights[0])
                unfused_ms = graph_ms_per_call(unfused, weights, args.calls, args.replays)
                fused_ms = graph_ms_per_call(fused, weights, args.calls, args.replays)
                results.append({"fusion": fusion, "layer": layer, "n": n, "k": k, "m": m, "per_step": per_step,
                                "unfused_ms": unfused_ms, "fused_ms": fused_ms})
                print(f"done {fusion} {layer} m={m}", file=sys.stderr, flush=True)
            del weights
            torch.cuda.empty_cache()

    env = environment()
    save_json(args.out, "bench_fused", {
        "environment": env, "dtype": "bfloat16", "calls_per_graph": args.calls, "replays": args.replays,
        "rotate_bytes": args.rotate_mib * 2**20, "results": results,
        "notes": "ms per call inside a CUDA graph of back-to-back calls over weight copies that do not fit in L2; "
                 "unfused = the engine's torch.compile'd elementwise kernel + the Triton GEMV",
    })
    print(f"\n## bench_fused ({env['device']}, bf16; {args.calls} calls per graph, median of {args.replays} replays)\n")
    headers = ["fusion", "layer", "N", "K", "M", "unfused us", "fused us", "speedup", "per step", "saved us/step"]
    print(markdown_table(headers, [
        [r["fusion"], r["layer"], r["n"], r["k"], r["m"], r["unfused_ms"] * 1000, r["fused_ms"] * 1000,
         r["unfused_ms"] / r["fused_ms"], r["per_step"], (r["unfused_ms"] - r["fused_ms"]) * 1000 * r["per_step"]]
        for r in results
    ]))


if __name__ == "__main__":
    main()
