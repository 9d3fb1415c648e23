"""bench_gemv_chain: a decode step's projections at batch 1 as the engine chains them, in one CUDA graph (CUDA only).

Every layer of a dense conf/model shape in turn (each with weights of its own, as in a model: no layer finds its
weights in L2): qkv_proj with the residual add and RMSNorm fused in, o_proj, gate_up_proj with the add, RMSNorm and
SiLU-and-mul fused in, down_proj; then the lm_head (in the model's dtype, as fp8 checkpoints keep it). No attention:
o_proj reads the first columns of qkv's output. The launches are the engine's (`linear_triton.default_config`) and
take PDL as in a decode graph. bench_linear times each projection alone and unfused; here a fused launch pays its
norm, and each kernel starts beside the one before it, as in a decode step.

Reports the whole chain's microseconds (median of --replays replays), the floor of its weight bytes at the measured
copy bandwidth, and each projection's microseconds a call (a graph of that projection's calls over every layer).
--sweep also times each projection under other launches (weight rows a program, K step in features, warps: each
thread requesting 4 to 32 16-byte vectors of weight a step) and the whole chain with each projection's fastest,
alternated with the engine's.

Usage: python -m benchmarks.bench_gemv_chain [--model qwen3_0_6b] [--dtype bfloat16|fp8] [--sweep] [--replays 30]
                                             [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import torch
import triton

from batchgen.layers.linear_triton import LinearConfig, add_rms_norm_linear, small_m_linear
from benchmarks.bench_linear import FP8, decoder_linears, graph_ms_per_call, random_weight, x_dtype
from benchmarks.common import QWEN3, add_out_argument, copy_bandwidth_gbs, environment, markdown_table, save_json

EPS = 1e-6
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
FUSED_NORM = ("qkv_proj", "gate_up_proj")  # the engine's add_rms_norm_linear launches
Configs = dict[str, LinearConfig | None]  # by projection; None: the engine's launch


def build_layers(shapes: dict[str, tuple[int, int, int]], dtype: str) -> list[dict[str, Any]]:
    """Each layer's weights (bench_linear's Weight: values, per-row scales or None) and its two norm weights."""
    hidden = shapes["qkv_proj"][1]
    return [{**{name: random_weight(*shapes[name][:2], dtype) for name in PROJECTIONS},
             "norms": [torch.rand(hidden, device="cuda", dtype=x_dtype(dtype)) + 0.5 for _ in range(2)]}
            for _ in range(shapes["qkv_proj"][2])]


def project(name: str, layer: dict[str, Any], x: torch.Tensor, residual: torch.Tensor,
            config: LinearConfig | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One projection as the engine launches it: (output, the residual after it)."""
    weight, scale = layer[name]
    if name in FUSED_NORM:
        norm = layer["norms"][FUSED_NORM.index(name)]
        return add_rms_norm_linear(x, residual, norm, EPS, weight, config=config,
                                   silu_and_mul=name == "gate_up_proj", weight_scale=scale)
    return small_m_linear(x, weight, config=config, weight_scale=scale), residual


def graph_us(fn: Callable[[], Any], replays: int) -> float:
    """Microseconds of one replay of a CUDA graph of fn (median of replays), fn compiled outside the capture."""
    return 1000 * graph_ms_per_call(lambda _: fn(), [None], calls=1, replays=replays)


def chain_us(layers: list[dict[str, Any]], lm_head: torch.Tensor, configs: Configs, replays: int) -> float:
    hidden = layers[0]["norms"][0].shape[0]
    o_inputs = layers[0]["o_proj"].values.shape[1]
    dtype = lm_head.dtype
    x0, residual0 = (torch.randn(1, hidden, device="cuda", dtype=dtype) for _ in range(2))

    def step() -> None:
        x, residual = x0, residual0
        for layer in layers:
            qkv, residual = project("qkv_proj", layer, x, residual, configs.get("qkv_proj"))
            x, _ = project("o_proj", layer, qkv[:, :o_inputs], residual, configs.get("o_proj"))
            gated, residual = project("gate_up_proj", layer, x, residual, configs.get("gate_up_proj"))
            x, _ = project("down_proj", layer, gated, residual, configs.get("down_proj"))
        small_m_linear(x, lm_head)

    return graph_us(step, replays)


def projection_us(layers: list[dict[str, Any]], name: str, config: LinearConfig | None, replays: int) -> float:
    """Microseconds a call of one projection, in a graph of its calls over every layer."""
    k = layers[0][name].values.shape[1]
    dtype = layers[0]["norms"][0].dtype
    x, residual = (torch.randn(1, k, device="cuda", dtype=dtype) for _ in range(2))
    return graph_us(lambda: [project(name, layer, x, residual, config) for layer in layers], replays) / len(layers)


def sweep_configs(k: int, element_size: int) -> list[LinearConfig]:
    """Weight rows 1..16 a program, K steps of 1,024 features up to all of K (at most 4,096), 1..8 warps: those
    where each thread requests 4 to 32 16-byte vectors of weight a step."""
    configs = []
    for block_k in (1024, 2048, 4096):
        if block_k > max(1024, triton.next_power_of_2(k)):
            continue
        for block_n in (1, 2, 4, 8, 16):
            for num_warps in (1, 2, 4, 8):
                loads = block_n * block_k * element_size // (16 * 32 * num_warps)
                if 4 <= loads <= 32:
                    configs.append(LinearConfig(block_n, min(block_k, triton.next_power_of_2(k)), num_warps))
    return sorted(set(configs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=QWEN3, help=f"a dense conf/model shape (default {QWEN3})")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", FP8], default="bfloat16",
                        help="the weights' dtype; fp8: fp8 projections with per-row scales, bf16 x and lm_head")
    parser.add_argument("--sweep", action="store_true", help="also time other launches of each projection")
    parser.add_argument("--replays", type=int, default=30, help="timed graph replays (median)")
    add_out_argument(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gemv_chain needs a CUDA device")
    torch.manual_seed(0)
    shapes = decoder_linears(args.model)
    layers = build_layers(shapes, args.dtype)
    n_lm, k_lm, _ = shapes["lm_head"]
    lm_head = torch.randn(n_lm, k_lm, device="cuda").mul_(k_lm**-0.5).to(x_dtype(args.dtype))  # never fp8
    bandwidth = copy_bandwidth_gbs()
    weight_bytes = sum(layer[name].values.nbytes for layer in layers for name in PROJECTIONS) + lm_head.nbytes
    result: dict[str, Any] = {
        "environment": environment(), "model": args.model, "dtype": args.dtype, "copy_bandwidth_gbs": bandwidth,
        "weight_bytes": weight_bytes, "floor_us": weight_bytes / bandwidth / 1e3,
        "chain_us": chain_us(layers, lm_head, {}, args.replays), "projections": [],
    }
    for name in PROJECTIONS:
        n, k, _ = shapes[name]
        element_size = layers[0][name].values.element_size()
        candidates: list[LinearConfig | None] = [None, *(sweep_configs(k, element_size) if args.sweep else [])]
        for config in candidates:
            us = projection_us(layers, name, config, args.replays)
            result["projections"].append({
                "projection": name, "n": n, "k": k, "config": None if config is None else config._asdict(),
                "us": us, "tbs": n * k * element_size / us / 1e6})
        print(f"timed {name}", file=sys.stderr, flush=True)
    if args.sweep:
        fastest = {name: min((p for p in result["projections"] if p["projection"] == name), key=lambda p: p["us"])
                   for name in PROJECTIONS}
        configs = {name: None if p["config"] is None else LinearConfig(**p["config"]) for name, p in fastest.items()}
        result["fastest_configs"] = {name: p["config"] for name, p in fastest.items()}
        result["chain_alternated_us"] = [(chain_us(layers, lm_head, {}, args.replays),
                                          chain_us(layers, lm_head, configs, args.replays)) for _ in range(2)]
    save_json(args.out, f"bench_gemv_chain_{args.model}_{args.dtype}", result)

    env = result["environment"]
    print(f"\n## bench_gemv_chain ({args.model}, {args.dtype}, {env['device']}; copy {bandwidth:.0f} GB/s)\n")
    print(f"The chain and lm_head, the engine's launches: {result['chain_us']:.1f} us a step; floor of its "
          f"{weight_bytes / 1e9:.2f} GB of weights at the copy bandwidth {result['floor_us']:.1f} us")
    if args.sweep:
        print("Alternated, the engine's launches / each projection's fastest: " + ", ".join(
            f"{engine:.1f} / {fastest:.1f}" for engine, fastest in result["chain_alternated_us"]) + " us")
    shown = []  # per projection: the engine's launch, then the fastest three others
    for name in PROJECTIONS:
        timed = sorted((p for p in result["projections"] if p["projection"] == name), key=lambda p: p["us"])
        shown += [p for p in timed if p["config"] is None] + [p for p in timed if p["config"] is not None][:3]
    print(markdown_table(["projection", "N", "K", "launch (rows, K step, warps)", "us a call", "TB/s"], [
        [p["projection"], p["n"], p["k"], "engine's" if p["config"] is None else tuple(p["config"].values()),
         p["us"], p["tbs"]] for p in shown]))


if __name__ == "__main__":
    main()
