"""bench_linear: the Triton small-M linear kernel vs cuBLAS (F.linear) on a model's projections (CUDA only).

For each layer shape (qkv, o, gate_up, down, lm_head of a conf/model shape, bf16; or with --model shakespeare the
main job's tiny GPT-2 projections, c_attn, attn/mlp c_proj, c_fc, lm_head, in float32) and M in 1, 2, 4, 8 tokens:
one CUDA graph holds --calls back-to-back calls, as a decode step's graph does, each on the next of several copies of
the weight, so that (like many layers in a row) no call finds its weight in L2. Time per call = median over
--replays replays (CUDA events) / calls. GB/s = (weight + x + output bytes) / time. The decode-step sum is the
linears of one decode step at M=1. --sweep times alternatives to default_config's (BLOCK_N, BLOCK_K, num_warps).
Each call is the plain projection: in a decode step the engine's qkv and gate/up launches also add the residual and
normalize x first (`add_rms_norm_linear`), with other launch parameters at M=1 (`linear_triton.one_row_config`); a
decode step's chain of both kinds is `bench_gemv_chain`.

--dtype fp8: the weights are float8_e4m3fn with one scale per row, as model.quantization=fp8 loads them (the lm_head
stays in bf16 there, so it is left out); x is bf16, M runs 1 to 256 by default. Three kernels side by side: the
engine's _scaled_mm path (x quantized per row, layers/fp8.scaled_mm_linear) in the "cuBLAS" columns, the one-row
GEMV (M <= 8) and the weight-only fp8 GEMM (layers/fp8_gemm_triton.py, fp8_small_m_config's tiles), each also in
TB/s of fp8 weight bytes. --sweep then also times the GEMM's tiles (row, channel and K tiles, split-K, operand
order) at --gemm-sweep-ms (default 2 to 256): on Llama-3.1-8B's shapes some 2,600 launches and 110 compiles, which
one device command may need to split with --layers and --gemm-sweep-ms.

Usage: python -m benchmarks.bench_linear [--model qwen3_0_6b|llama3_1_8b|shakespeare] [--dtype fp8]
       [--ms 1 2 4 8] [--calls 100] [--replays 10] [--sweep] [--sweep-ms 1 4] [--gemm-sweep-ms 2 64] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any, NamedTuple, TypeVar

import torch
import torch.nn.functional as F
import triton

from batchgen.layers.fp8 import dequantize, fp8_kernel, quantize_per_channel, scaled_mm_linear
from batchgen.layers.fp8_gemm_triton import (
    GpuLimits,
    SmallMGemmConfig,
    block_m_for,
    fp8_small_m_config,
    fp8_small_m_gemm,
    gpu_limits,
    split_k_for,
    stages_that_fit,
)
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
FP8_GEMM_SWEEP_MS = [2, 4, 8, 16, 32, 64, 128, 256]  # decode batches, up to past FP8_GEMM_MAX_ROWS
WeightT = TypeVar("WeightT")


class Weight(NamedTuple):
    values: torch.Tensor  # (N, K): the model's dtype, or float8_e4m3fn
    scale: torch.Tensor | None  # (N,) float32 for an fp8 weight


def random_weight(n: int, k: int, dtype: str) -> Weight:
    """An (n, k) weight scaled like a trained layer's, in `dtype` (FP8: with its per-row scales)."""
    weight = torch.randn(n, k, device="cuda").mul_(k**-0.5)
    return Weight(*quantize_per_channel(weight)) if dtype == FP8 else Weight(weight.to(getattr(torch, dtype)), None)


def weight_copies(n: int, k: int, dtype: str, rotate_bytes: int) -> list[Weight]:
    """Enough (n, k) weights (at least 2) to add up to rotate_bytes: cycling through them keeps each out of L2."""
    element_size = 1 if dtype == FP8 else getattr(torch, dtype).itemsize
    count = max(2, -(-rotate_bytes // (n * k * element_size)))
    return [random_weight(n, k, dtype) for _ in range(count)]


def x_dtype(dtype: str) -> torch.dtype:
    return torch.bfloat16 if dtype == FP8 else getattr(torch, dtype)


def triton_call(x: torch.Tensor, weight: Weight, config: LinearConfig | None = None) -> torch.Tensor:
    return small_m_linear(x, weight.values, config=config, weight_scale=weight.scale)


def gemm_call(x: torch.Tensor, weight: Weight, config: SmallMGemmConfig | None = None) -> torch.Tensor:
    return fp8_small_m_gemm(x, weight.values, weight.scale, config=config)


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


def check(x: torch.Tensor, weight: Weight, call: Callable[[torch.Tensor, Weight], torch.Tensor] = triton_call) -> None:
    """call(x, weight) against F.linear in float32 on the (dequantized) weight."""
    dense = weight.values.float() if weight.scale is None else dequantize(weight.values, weight.scale, torch.float32)
    expected = F.linear(x.float(), dense)
    scale = max(float(expected.abs().max()), 1.0)
    torch.testing.assert_close(call(x, weight).float(), expected, atol=1e-2 * scale, rtol=1e-2)


def timed_or_error(row: dict[str, Any], x: torch.Tensor, weights: Sequence[Weight],
                   call: Callable[[torch.Tensor, Weight], torch.Tensor], args: argparse.Namespace) -> dict[str, Any]:
    """row with "ms" (per call) once call's result checks out, or "error" for a config that fails."""
    try:
        check(x, weights[0], call)
        row["ms"] = graph_ms_per_call(lambda w: call(x, w), weights, args.calls, args.replays)
    except Exception as error:  # a config the GPU cannot run (out of resources) is a result, not a crash
        row["error"] = f"{type(error).__name__}: {error}"[:200]
    return row


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
                rows.append(timed_or_error(row, x, weights, lambda x, w, c=config: triton_call(x, w, c), args))
            print(f"swept {name} m={m}", file=sys.stderr, flush=True)
        del weights
        torch.cuda.empty_cache()
    return rows


def gemm_sweep_configs(m: int, n: int, k: int, limits: GpuLimits) -> list[SmallMGemmConfig]:
    """The fp8 GEMM's tiles for m rows: row tiles of 16 up to the one covering m (at most 64), 32 to 128 channels,
    64 to 256 features a step, both operand orders; no split-K, the split fp8_small_m_config would give the tile and
    twice that; 4 warps (8 for tiles of 64 x 128), as many stages as fit."""
    configs = []
    for row_tile in (16, 32, 64):
        if row_tile > block_m_for(m):
            continue
        for block_n in (32, 64, 128):
            for block_k in (64, 128, 256):
                k_steps = triton.cdiv(k, block_k)
                split = split_k_for(triton.cdiv(m, row_tile) * triton.cdiv(n, block_n), k_steps, limits.sm_count)
                for split_k in sorted({1, split, 2 * split if k_steps >= 4 * split else split}):
                    for weight_first in (True, False):
                        stages = stages_that_fit(row_tile, block_n, block_k, 2, weight_first,
                                                 limits.shared_memory_bytes)
                        num_warps = 8 if row_tile * block_n >= 64 * 128 else 4
                        configs.append(SmallMGemmConfig(row_tile, block_n, block_k, split_k, num_warps, stages,
                                                        weight_first))
    return configs


def run_gemm_sweep(shapes: dict[str, tuple[int, int, int]], args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    limits = gpu_limits(torch.device("cuda"))
    for name, (n, k, _) in shapes.items():
        weights = weight_copies(n, k, FP8, args.rotate_mib * 2**20)
        for m in args.gemm_sweep_ms:
            default = fp8_small_m_config(m, n, k, 2, limits)
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            for config in gemm_sweep_configs(m, n, k, limits):
                row: dict[str, Any] = {"layer": name, "n": n, "k": k, "m": m, **asdict(config),
                                       "default": config == default}
                row = timed_or_error(row, x, weights, lambda x, w, c=config: gemm_call(x, w, c), args)
                if "ms" in row:
                    row["weight_tbs"] = n * k / row["ms"] / 1e9
                rows.append(row)
            print(f"swept the fp8 GEMM on {name} m={m}", file=sys.stderr, flush=True)
        del weights
        torch.cuda.empty_cache()
    return rows


def fastest_and_default(rows: list[dict[str, Any]], top: int) -> list[tuple[dict[str, Any], float]]:
    """Per (layer, M), in the rows' order: the `top` fastest timed rows and the default one, each with the fastest's
    ms."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["layer"], row["m"]), []).append(row)
    shown = []
    for group in groups.values():
        timed = sorted((r for r in group if "ms" in r), key=lambda r: r["ms"])
        shown += [(r, timed[0]["ms"]) for r in timed[:top] + [r for r in timed[top:] if r["default"]]]
    return shown


def sweep_table(rows: list[dict[str, Any]], top: int) -> str:
    """Per (layer, M): the `top` fastest configs and the default one; microseconds and time / the fastest's."""
    lines = [(r["layer"], r["m"], r["block_n"], r["block_k"], r["num_warps"], "yes" if r["default"] else "",
              r["ms"] * 1000, r["ms"] / best) for r, best in fastest_and_default(rows, top)]
    return markdown_table(["layer", "M", "BLOCK_N", "BLOCK_K", "warps", "default", "us", "vs best"], lines)


def gemm_sweep_table(rows: list[dict[str, Any]], top: int) -> str:
    """Per (layer, M): the `top` fastest GEMM configs and the default one; microseconds, TB/s of fp8 weight bytes
    and time / the fastest's."""
    lines = [(r["layer"], r["m"], r["block_m"], r["block_n"], r["block_k"], r["split_k"], r["num_warps"],
              r["num_stages"], "yes" if r["weight_first"] else "", "yes" if r["default"] else "", r["ms"] * 1000,
              r["weight_tbs"], r["ms"] / best) for r, best in fastest_and_default(rows, top)]
    return markdown_table(["layer", "M", "BLOCK_M", "BLOCK_N", "BLOCK_K", "split", "warps", "stages", "weight first",
                           "default", "us", "weight TB/s", "vs best"], lines)


def engine_path(m: int, n: int, k: int, dtype: str, cap: int | None) -> str:
    """Which kernel the engine's decode step takes for this launch."""
    if dtype == FP8:
        return fp8_kernel(m).value
    return "triton" if beats_cublas(m, n, k, getattr(torch, dtype).itemsize, cap) else "cuBLAS"


def fp8_table(results: list[dict[str, Any]]) -> str:
    """The three fp8 kernels per (layer, M): microseconds and TB/s of fp8 weight bytes."""
    headers = ["layer", "N", "K", "M", "_scaled_mm us", "GEMV us", "GEMM us", "GEMM tile (M, N, K, split)",
               "_scaled_mm TB/s", "GEMV TB/s", "GEMM TB/s", "GEMM vs _scaled_mm", "engine uses"]

    def weight_tbs(r: dict[str, Any], ms: float | None) -> float | None:
        return None if ms is None else r["n"] * r["k"] / ms / 1e9

    c = "gemm_config"
    return markdown_table(headers, [
        [r["layer"], r["n"], r["k"], r["m"], r["cublas_ms"] * 1000,
         None if r["triton_ms"] is None else r["triton_ms"] * 1000, r["gemm_ms"] * 1000,
         f"({r[c]['block_m']}, {r[c]['block_n']}, {r[c]['block_k']}, {r[c]['split_k']})",
         weight_tbs(r, r["cublas_ms"]), weight_tbs(r, r["triton_ms"]), weight_tbs(r, r["gemm_ms"]),
         r["cublas_ms"] / r["gemm_ms"], r["engine_path"]] for r in results
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ms", type=int, nargs="*", default=None,
                        help=f"token counts: 1..{MAX_M} (default 1, 2, 4, 8); with --dtype fp8 any (default 1 to 256, "
                             f"the GEMV timed up to {MAX_M})")
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
    parser.add_argument("--gemm-sweep-ms", type=int, nargs="*", default=FP8_GEMM_SWEEP_MS,
                        help="token counts the fp8 GEMM's sweep times (--dtype fp8)")
    parser.add_argument("--top", type=int, default=3, help="sweep configs shown per layer and M")
    add_out_argument(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_linear needs a CUDA device")
    args.dtype = args.dtype or ("float32" if args.model == SHAKESPEARE else "bfloat16")
    fp8 = args.dtype == FP8
    args.ms = args.ms or ([1, *FP8_GEMM_SWEEP_MS] if fp8 else [1, 2, 4, 8])
    if not all(1 <= m <= MAX_M for m in [*args.sweep_ms, *([] if fp8 else args.ms)]):
        sys.exit(f"--ms and --sweep-ms must be in 1..{MAX_M}")
    if not all(m >= 1 for m in [*args.ms, *args.gemm_sweep_ms]):
        sys.exit("token counts must be at least 1")
    shapes = shakespeare_linears() if args.model == SHAKESPEARE else decoder_linears(args.model)
    shapes = {name: shape for name, shape in shapes.items()
              if (args.layers is None or name in args.layers) and not (args.dtype == FP8 and name == "lm_head")}
    torch.manual_seed(0)
    bandwidth = copy_bandwidth_gbs()

    results = []
    cap = launch_thread_cap(torch.device("cuda"))
    limits = gpu_limits(torch.device("cuda"))
    for name, (n, k, per_step) in shapes.items():
        weights = weight_copies(n, k, args.dtype, args.rotate_mib * 2**20)
        element_size = weights[0].values.element_size()
        for m in args.ms:
            x = torch.randn(m, k, device="cuda").to(x_dtype(args.dtype))
            gb = (n * k * element_size + (m * k + m * n) * x.element_size()) / 1e9
            cublas_ms = graph_ms_per_call(lambda w, x=x: library_call(x, w), weights, args.calls, args.replays)
            result: dict[str, Any] = {"layer": name, "n": n, "k": k, "m": m, "per_step": per_step,
                                      "config": None, "cublas_ms": cublas_ms, "triton_ms": None,
                                      "cublas_gbs": gb / cublas_ms * 1e3, "triton_gbs": None,
                                      "engine_path": engine_path(m, n, k, args.dtype, cap)}
            if m <= MAX_M:
                check(x, weights[0])
                triton_ms = graph_ms_per_call(lambda w, x=x: triton_call(x, w), weights, args.calls, args.replays)
                result.update(config=default_config(n, k, element_size, cap, block_m(m))._asdict(),
                              triton_ms=triton_ms, triton_gbs=gb / triton_ms * 1e3)
            if fp8:
                check(x, weights[0], gemm_call)
                result["gemm_config"] = asdict(fp8_small_m_config(m, n, k, x.element_size(), limits))
                result["gemm_ms"] = graph_ms_per_call(lambda w, x=x: gemm_call(x, w), weights, args.calls,
                                                      args.replays)
                result["gemm_gbs"] = gb / result["gemm_ms"] * 1e3
            results.append(result)
            print(f"done {name} m={m}", file=sys.stderr, flush=True)
        del weights
        torch.cuda.empty_cache()
    step = [r for r in results if r["m"] == 1]
    decode_step = {"linears": sum(r["per_step"] for r in step),
                   "cublas_ms": sum(r["per_step"] * r["cublas_ms"] for r in step),
                   "triton_ms": sum(r["per_step"] * r["triton_ms"] for r in step)} if step else None
    sweep = run_sweep(shapes, args) if args.sweep else []
    gemm_sweep = run_gemm_sweep(shapes, args) if args.sweep and fp8 else []

    env = environment()
    name = "bench_linear" + f"_{args.model}" * (args.model != QWEN3) + "_fp8_weights" * (args.dtype == FP8)
    save_json(args.out, name, {
        "environment": env, "model": args.model, "dtype": args.dtype, "calls_per_graph": args.calls,
        "replays": args.replays, "rotate_bytes": args.rotate_mib * 2**20, "copy_bandwidth_gbs": bandwidth,
        "results": results, "decode_step_m1": decode_step, "sweep": sweep, "gemm_sweep": gemm_sweep,
        "notes": "ms per call inside a CUDA graph of back-to-back calls over weight copies that do not fit in L2; "
                 "GB/s counts weight + x + output bytes, the GEMM sweep's TB/s fp8 weight bytes alone; copy "
                 "bandwidth counts bytes read + written",
    })
    if sweep:
        print(f"\n## bench_linear sweep ({env['device']}, {args.dtype}; fastest {args.top} and the default)\n")
        print(sweep_table(sweep, args.top))
    if gemm_sweep:
        print(f"\n## bench_linear fp8 GEMM sweep ({env['device']}; fastest {args.top} and the default)\n")
        print(gemm_sweep_table(gemm_sweep, args.top))
    print(f"\n## bench_linear ({env['device']}, {args.dtype}; {args.calls} calls per graph, median of {args.replays} "
          f"replays; copy bandwidth {bandwidth:.0f} GB/s)\n")
    if fp8:
        print(fp8_table(results))
    else:
        headers = ["layer", "N", "K", "M", "BLOCK_N", "BLOCK_K", "warps", "cuBLAS us", "Triton us", "cuBLAS GB/s",
                   "Triton GB/s", "speedup", "engine uses"]
        print(markdown_table(headers, [
            [r["layer"], r["n"], r["k"], r["m"], *r["config"].values(), r["cublas_ms"] * 1000,
             r["triton_ms"] * 1000, r["cublas_gbs"], r["triton_gbs"], r["cublas_ms"] / r["triton_ms"],
             r["engine_path"]] for r in results
        ]))
    if decode_step:
        print(f"\nOne decode step's {decode_step['linears']} linears at M=1: cuBLAS {decode_step['cublas_ms']:.3f} ms, "
              f"Triton {decode_step['triton_ms']:.3f} ms")


if __name__ == "__main__":
    main()
