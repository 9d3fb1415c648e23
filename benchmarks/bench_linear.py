"""bench_linear: the Triton small-M linear kernel vs cuBLAS (F.linear) on a model's projections (CUDA only).

For each layer shape (qkv, o, gate_up, down, lm_head of a conf/model shape, bf16; or with --model shakespeare the
main job's tiny GPT-2 projections, c_attn, attn/mlp c_proj, c_fc, lm_head, in float32) and M in 1, 2, 4, 8 tokens:
one CUDA graph holds --calls back-to-back calls, as a decode step's graph does, each on the next of several copies of
the weight, so that (like many layers in a row) no call finds its weight in L2. Time per call = median over
--replays replays (CUDA events) / calls. GB/s = (weight + x + output bytes) / time. The decode-step sum is the
linears of one decode step at M=1. --sweep times alternatives to default_config's (BLOCK_N, BLOCK_K, num_warps).

--dtype fp8: the weights are float8_e4m3fn with one scale per row, as model.quantization=fp8 loads them (the lm_head
stays in bf16 there, so it is left out); x is bf16, and the kernel is compared with the engine's other fp8 path,
x quantized per row and torch._scaled_mm (layers/fp8.scaled_mm_linear), in the "cuBLAS" columns.

Usage: python -m benchmarks.bench_linear [--model qwen3_0_6b|llama3_1_8b|shakespeare] [--dtype fp8]
       [--ms 1 2 4 8] [--calls 100] [--replays 10] [--sweep] [--sweep-ms 1 4] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import torch
import torch.nn.functional as F
import triton

from batchgen.layers.fp8 import dequantize, fp8_runs_triton, quantize_per_channel, scaled_mm_linear
from batchgen.layers.linear_triton import (
    MAX_M,
    LinearConfig,
    beats_cublas,
    block_m,
    default_config,
    launch_thread_cap,
    small_m_linear,
)
from batchgen.models.hf_config import read_hf_config
from benchmarks.common import (
    QWEN3,
    SHAKESPEARE,
    add_out_argument,
    copy_bandwidth_gbs,
    environment,
    load_model_config,
    markdown_table,
    save_json,
    time_ms,
)


def decoder_linears(model: str) -> dict[str, tuple[int, int, int]]:
    """name: (N, K, calls per decode step) of every linear layer of a dense conf/model shape (Qwen3, Llama)."""
    c = load_model_config(model).hf_config
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    q_size, kv_size = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    layers, hidden = c["num_hidden_layers"], c["hidden_size"]
    return {
        "qkv_proj": (q_size + 2 * kv_size, hidden, layers),
        "o_proj": (hidden, q_size, layers),
        "gate_up_proj": (2 * c["intermediate_size"], hidden, layers),
        "down_proj": (hidden, c["intermediate_size"], layers),
        "lm_head": (c["vocab_size"], hidden, 1),
    }


def shakespeare_linears() -> dict[str, tuple[int, int, int]]:
    """name: (N, K, calls per decode step) of every linear layer of the main job's GPT-2."""
    c = read_hf_config(load_model_config(SHAKESPEARE).path)
    hidden, layers = c.hidden_size, c.num_hidden_layers
    inner = c.n_inner or 4 * hidden
    return {
        "c_attn": (3 * hidden, hidden, layers),
        "attn.c_proj": (hidden, hidden, layers),
        "c_fc": (inner, hidden, layers),
        "mlp.c_proj": (hidden, inner, layers),
        "lm_head": (c.vocab_size, hidden, 1),
    }


FP8 = "fp8"
WeightT = TypeVar("WeightT")


class Weight(NamedTuple):
    values: torch.Tensor  # (N, K): the model's dtype, or float8_e4m3fn
    scale: torch.Tensor | None  # (N,) float32 for an fp8 weight


def weight_copies(n: int, k: int, dtype: str, rotate_bytes: int) -> list[Weight]:
    """Enough (n, k) weights (at least 2) to add up to rotate_bytes: cycling through them keeps each out of L2."""
    element_size = 1 if dtype == FP8 else getattr(torch, dtype).itemsize
    count = max(2, -(-rotate_bytes // (n * k * element_size)))
    copies = []
    for _ in range(count):
        weight = torch.randn(n, k, device="cuda").mul_(k**-0.5)
        copies.append(Weight(*quantize_per_channel(weight)) if dtype == FP8
                      else Weight(weight.to(getattr(torch, dtype)), None))
    return copies


def x_dtype(dtype: str) -> torch.dtype:
    return torch.bfloat16 if dtype == FP8 else getattr(torch, dtype)


def triton_call(x: torch.Tensor, weight: Weight, config: LinearConfig | None = None) -> torch.Tensor:
    return small_m_linear(x, weight.values, config=config, weight_scale=weight.scale)


def library_call(x: torch.Tensor, weight: Weight) -> torch.Tensor:
    """What the engine runs where the kernel does not: cuBLAS, or for fp8 the per-row quantized _scaled_mm."""
    if weight.scale is None:
        return F.linear(x, weight.values)
    return scaled_mm_linear(x, weight.values, weight.scale, None)


def graph_ms_per_call(fn: Callable[[WeightT], torch.Tensor], weights: Sequence[WeightT], calls: int,
                      replays: int) -> float:
    """ms per call of fn(weight): median over replays of one CUDA graph of `calls` calls cycling through weights."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(weights[0])  # compiles the kernel / sets up cuBLAS outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(weights[i % len(weights)])
    graph.replay()
    torch.cuda.synchronize()
    ms = statistics.median(time_ms(graph.replay) for _ in range(replays)) / calls
    del graph
    return ms


def check(x: torch.Tensor, weight: Weight, config: LinearConfig | None = None) -> None:
    dense = weight.values.float() if weight.scale is None else dequantize(weight.values, weight.scale, torch.float32)
    expected = F.linear(x.float(), dense)
    scale = max(float(expected.abs().max()), 1.0)
    torch.testing.assert_close(triton_call(x, weight, config).float(), expected, atol=1e-2 * scale, rtol=1e-2)


# The most fp32 products (row tile x BLOCK_N x BLOCK_K) a thread of a swept multi-row config holds: past it a tile
# spills (linear_triton.MAX_TILE_PER_THREAD) and is not worth a compile.
SWEEP_MAX_PRODUCTS = 512


def sweep_configs(n: int, k: int, element_size: int, m: int = 1) -> list[LinearConfig]:
    """BLOCK_N of 1..16, BLOCK_K of K (rounded up to a power of two, at most 8 KB of a row) down to an eighth of it,
    1..8 warps: those where each thread loads 1 to 8 16-byte vectors of weight per step and, for several rows,
    holds at most SWEEP_MAX_PRODUCTS products."""
    k_pow2 = triton.next_power_of_2(k)
    configs = []
    for block_k in sorted({min(k_pow2 >> shift, 8192 // element_size) for shift in (0, 1, 2, 3)}):
        for block_n in (1, 2, 4, 8, 16):
            for num_warps in (1, 2, 4, 8):
                loads = block_n * block_k * element_size // (16 * 32 * num_warps)
                products = block_m(m) * block_n * block_k // (32 * num_warps)
                if 1 <= loads <= 8 and (m == 1 or products <= SWEEP_MAX_PRODUCTS):
                    configs.append(LinearConfig(block_n, block_k, num_warps))
    return configs


def run_sweep(shapes: dict[str, tuple[int, int, int]], args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for name, (n, k, _) in shapes.items():
        weights = weight_copies(n, k, args.dtype, args.rotate_mib * 2**20)
        element_size = weights[0].values.element_size()
        for m in args.sweep_ms:
            default = default_config(n, k, element_size, launch_thread_cap(torch.device("cuda")), block_m(m))
            x = torch.randn(m, k, device="cuda").to(x_dtype(args.dtype))
            for config in sweep_configs(n, k, element_size, m):
                row: dict[str, Any] = {"layer": name, "n": n, "k": k, "m": m, **config._asdict(),
                                       "default": config == default}
                try:
                    check(x, weights[0], config)
                    row["ms"] = graph_ms_per_call(lambda w, x=x, c=config: triton_call(x, w, c), weights,
                                                  args.calls, args.replays)
                except Exception as error:  # a config the GPU cannot run (out of resources) is a result, not a crash
                    row["error"] = f"{type(error).__name__}: {error}"[:200]
                rows.append(row)
            print(f"swept {name} m={m}", file=sys.stderr, flush=True)
        del weights
        torch.cuda.empty_cache()
    return rows


def sweep_table(rows: list[dict[str, Any]], top: int) -> str:
    """Per (layer, M): the `top` fastest configs and the default one; microseconds and time / the fastest's."""
    lines = []
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["layer"], row["m"]), []).append(row)
    for (name, m), group in groups.items():
        timed = sorted((r for r in group if "ms" in r), key=lambda r: r["ms"])
        shown = timed[:top] + [r for r in timed[top:] if r["default"]]
        lines += [(name, m, r["block_n"], r["block_k"], r["num_warps"], "yes" if r["default"] else "",
                   r["ms"] * 1000, r["ms"] / timed[0]["ms"]) for r in shown]
    return markdown_table(["layer", "M", "BLOCK_N", "BLOCK_K", "warps", "default", "us", "vs best"], lines)


def engine_path(m: int, n: int, k: int, dtype: str, cap: int | None) -> str:
    """Which of the two the engine's decode step takes for this launch."""
    if dtype == FP8:
        return "triton" if fp8_runs_triton(m) else "_scaled_mm"
    return "triton" if beats_cublas(m, n, k, getattr(torch, dtype).itemsize, cap) else "cuBLAS"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ms", type=int, nargs="*", default=[1, 2, 4, 8], help=f"token counts, 1..{MAX_M}")
    parser.add_argument("--layers", nargs="*", default=None, help="layer names (default: all of the model's)")
    parser.add_argument("--model", default=QWEN3,
                        help=f"whose layer shapes: a conf/model name of a dense model (default {QWEN3}), or "
                             f"{SHAKESPEARE} (the main job's GPT-2)")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32", FP8], default=None,
                        help="default: the model's (bfloat16, the main job's float32); fp8: fp8 weights, bf16 x")
    parser.add_argument("--calls", type=int, default=100, help="back-to-back calls in one CUDA graph")
    parser.add_argument("--replays", type=int, default=10, help="timed graph replays (median)")
    parser.add_argument("--rotate-mib", type=int, default=512, help="total size of the weight copies per layer")
    parser.add_argument("--sweep", action="store_true", help="also time the alternatives to the default config")
    parser.add_argument("--sweep-ms", type=int, nargs="*", default=[1], help="token counts the sweep times")
    parser.add_argument("--top", type=int, default=3, help="sweep configs shown per layer and M")
    add_out_argument(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_linear needs a CUDA device")
    if not all(1 <= m <= MAX_M for m in [*args.ms, *args.sweep_ms]):
        sys.exit(f"token counts must be in 1..{MAX_M}")
    args.dtype = args.dtype or ("float32" if args.model == SHAKESPEARE else "bfloat16")
    shapes = shakespeare_linears() if args.model == SHAKESPEARE else decoder_linears(args.model)
    shapes = {name: shape for name, shape in shapes.items()
              if (args.layers is None or name in args.layers) and not (args.dtype == FP8 and name == "lm_head")}
    torch.manual_seed(0)
    bandwidth = copy_bandwidth_gbs()

    results = []
    for name, (n, k, per_step) in shapes.items():
        weights = weight_copies(n, k, args.dtype, args.rotate_mib * 2**20)
        element_size = weights[0].values.element_size()
        for m in args.ms:
            cap = launch_thread_cap(torch.device("cuda"))
            config = default_config(n, k, element_size, cap, block_m(m))
            x = torch.randn(m, k, device="cuda").to(x_dtype(args.dtype))
            check(x, weights[0])
            cublas_ms = graph_ms_per_call(lambda w, x=x: library_call(x, w), weights, args.calls, args.replays)
            triton_ms = graph_ms_per_call(lambda w, x=x: triton_call(x, w), weights, args.calls, args.replays)
            gb = (n * k * element_size + (m * k + m * n) * x.element_size()) / 1e9
            results.append({"layer": name, "n": n, "k": k, "m": m, "per_step": per_step, "config": config._asdict(),
                            "cublas_ms": cublas_ms, "triton_ms": triton_ms, "cublas_gbs": gb / cublas_ms * 1e3,
                            "triton_gbs": gb / triton_ms * 1e3,
                            "engine_path": engine_path(m, n, k, args.dtype, cap)})
            print(f"done {name} m={m}", file=sys.stderr, flush=True)
        del weights
        torch.cuda.empty_cache()
    step = [r for r in results if r["m"] == 1]
    decode_step = {"linears": sum(r["per_step"] for r in step),
                   "cublas_ms": sum(r["per_step"] * r["cublas_ms"] for r in step),
                   "triton_ms": sum(r["per_step"] * r["triton_ms"] for r in step)} if step else None
    sweep = run_sweep(shapes, args) if args.sweep else []

    env = environment()
    name = "bench_linear" + f"_{args.model}" * (args.model != QWEN3) + "_fp8_weights" * (args.dtype == FP8)
    save_json(args.out, name, {
        "environment": env, "model": args.model, "dtype": args.dtype, "calls_per_graph": args.calls,
        "replays": args.replays, "rotate_bytes": args.rotate_mib * 2**20, "copy_bandwidth_gbs": bandwidth,
        "results": results, "decode_step_m1": decode_step, "sweep": sweep,
        "notes": "ms per call inside a CUDA graph of back-to-back calls over weight copies that do not fit in L2; "
                 "GB/s counts weight + x + output bytes; copy bandwidth counts bytes read + written",
    })
    if sweep:
        print(f"\n## bench_linear sweep ({env['device']}, {args.dtype}; fastest {args.top} and the default)\n")
        print(sweep_table(sweep, args.top))
    print(f"\n## bench_linear ({env['device']}, {args.dtype}; {args.calls} calls per graph, median of {args.replays} "
          f"replays; copy bandwidth {bandwidth:.0f} GB/s)\n")
    headers = ["layer", "N", "K", "M", "BLOCK_N", "BLOCK_K", "warps", "cuBLAS us", "Triton us", "cuBLAS GB/s",
               "Triton GB/s", "speedup", "engine uses"]
    print(markdown_table(headers, [
        [r["layer"], r["n"], r["k"], r["m"], *r["config"].values(), r["cublas_ms"] * 1000, r["triton_ms"] * 1000,
         r["cublas_gbs"], r["triton_gbs"], r["cublas_ms"] / r["triton_ms"], r["engine_path"]] for r in results
    ]))
    if decode_step:
        print(f"\nOne decode step's {decode_step['linears']} linears at M=1: cuBLAS {decode_step['cublas_ms']:.3f} ms, "
              f"Triton {decode_step['triton_ms']:.3f} ms")


if __name__ == "__main__":
    main()
