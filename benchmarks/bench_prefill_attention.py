"""Prefill attention, the Triton paged kernel vs torch's SDPA (flash / memory-efficient, and cuDNN's) on the same
queries, keys and values laid out contiguously (CUDA only).

Run from the repo root: python -m benchmarks.bench_prefill_attention [--sweep] [--kv-cache-dtype fp8]
                                                                     [--models ...] [--cases ...] [--baseline TREE]
                                                                     [--out DIR]
Head shapes of conf/model (Qwen3-0.6B: 16 query heads, 8 kv heads, head_dim 128; Llama-3.1-8B: 32, 8, 128), bf16,
block size 16, every sequence's blocks scattered over the cache. Cases: classify's step (16 prompts of 1,000 tokens
from an empty cache), scoring's (4 x 4,000), a chat mix's (40 x 400) and a chunked-prefill step (2,048 queries at the
end of an 8,000-token context). The reference gets the cache's K/V gathered per sequence and repeated for every
query head (bf16; an fp8 cache's values exactly), causal from the bottom right, and must agree within bf16 tolerance.
TFLOP/s counts the causal FLOPs: 4 * head_dim * query heads * the keys each query sees, summed. Times are
triton.testing.do_bench medians (L2 flushed before every call).
cuDNN's kernel (SDPA's CUDNN_ATTENTION, where this torch and GPU have it) is timed beside, on the same contiguous
layout: the best dense prefill attention at hand, so its column shows what the paged kernel leaves. It runs the
cases whose queries cover the whole context (its causal mask is aligned top left); the others show none.
--baseline TREE times TREE's batchgen/layers/attention_triton.py (another checkout: `git archive <commit> | tar -x -C
TREE`) on the same inputs, beside this tree's.
--sweep times every launch configuration (block_m 64/128, block_n 32/64/128, warps 4/8, stages 2/3/4) on each
model and case, and per model the one with the least slowdown against each case's best (geometric mean), next to
that of prefill_config's picks (one per case: it picks by the context).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import itertools
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right
from torch.nn.functional import scaled_dot_product_attention
from triton.runtime.errors import OutOfResources
from triton.testing import do_bench

from batchgen.engine.model_worker import resolve_kv_cache_dtype
from batchgen.layers import attention_triton
from batchgen.layers.attention_triton import PrefillConfig
from benchmarks.common import (
    LLAMA31_8B,
    QWEN3,
    add_kv_cache_dtype_argument,
    add_out_argument,
    environment,
    load_model_config,
    markdown_table,
    save_json,
)

DTYPE, BLOCK_SIZE = torch.bfloat16, 16
SWEEP_BLOCK_M, SWEEP_BLOCK_N, SWEEP_WARPS, SWEEP_STAGES = (64, 128), (32, 64, 128), (4, 8), (2, 3, 4)


@dataclass(frozen=True)
class HeadShape:
    model: str  # conf/model name
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class Case:
    name: str
    num_seqs: int
    query_len: int  # this step's tokens of each sequence
    context_len: int  # each sequence's tokens after the step, the query's included

    @property
    def causal_keys(self) -> int:
        """Keys seen by all queries of one sequence and head: each query sees the cached context and itself."""
        cached = self.context_len - self.query_len
        return self.num_seqs * (self.query_len * cached + self.query_len * (self.query_len + 1) // 2)


CASES = {case.name: case for case in (
    Case("classify", 16, 1000, 1000),
    Case("scoring", 4, 4000, 4000),
    Case("chat", 40, 400, 400),
    Case("chunked", 1, 2048, 8000),
)}  # fmt: skip


def head_shape(model: str) -> HeadShape:
    hf = load_model_config(model).hf_config
    num_heads = hf["num_attention_heads"]
    return HeadShape(model, num_heads, hf.get("num_key_value_heads", num_heads),
                     hf.get("head_dim", hf["hidden_size"] // num_heads))


@dataclass(frozen=True)
class PrefillInputs:
    q: torch.Tensor  # (T, H, D)
    k_cache: torch.Tensor  # (NB, BS, KVH, D)
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # (B, M) int32
    query_start_loc: torch.Tensor  # (B + 1,) int32
    seq_lens: torch.Tensor  # (B,) int32
    case: Case

    def triton_fn(self, config: PrefillConfig | None = None,
                  kernels: ModuleType = attention_triton) -> Callable[[], torch.Tensor]:
        """`kernels`.prefill_attention on these inputs; `config` (this tree's kernels only) overrides its launch."""
        options = {} if config is None else {"config": config}
        return functools.partial(
            kernels.prefill_attention, self.q, self.k_cache, self.v_cache, self.block_tables,
            self.query_start_loc, self.seq_lens, self.q.shape[-1] ** -0.5, self.case.query_len,
            self.case.context_len, **options,
        )  # fmt: skip

    @functools.cached_property
    def contiguous(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, H, L, D) and k, v (B, H, S, D): every sequence's cache rows gathered, each kv head repeated for its
        query heads, in the queries' dtype; gathered once for every reference kernel."""
        batch, query_len, context_len = self.case.num_seqs, self.case.query_len, self.case.context_len
        num_heads, head_dim = self.q.shape[1:]
        group = num_heads // self.k_cache.shape[2]
        blocks = self.block_tables.long()

        def gather(cache: torch.Tensor) -> torch.Tensor:
            rows = cache[blocks].flatten(1, 2)[:, :context_len]  # (B, S, KVH, D)
            return rows.to(self.q.dtype).transpose(1, 2).repeat_interleave(group, dim=1).contiguous()

        q = self.q.view(batch, query_len, num_heads, head_dim).transpose(1, 2).contiguous()
        return q, gather(self.k_cache), gather(self.v_cache)


def prefill_inputs(shape: HeadShape, case: Case, cache_dtype: torch.dtype, seed: int = 0) -> PrefillInputs:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks_per_seq = -(-case.context_len // BLOCK_SIZE)
    num_blocks = case.num_seqs * blocks_per_seq
    cache_shape = (num_blocks, BLOCK_SIZE, shape.num_kv_heads, shape.head_dim)
    k_cache, v_cache = (torch.randn(cache_shape, generator=gen, dtype=DTYPE, device="cuda").to(cache_dtype)
                        for _ in range(2))
    block_tables = torch.randperm(num_blocks, generator=gen, device="cuda").to(torch.int32)
    q = torch.randn(case.num_seqs * case.query_len, shape.num_heads, shape.head_dim, generator=gen, dtype=DTYPE,
                    device="cuda")
    query_start_loc = torch.arange(0, case.num_seqs + 1, dtype=torch.int32, device="cuda") * case.query_len
    seq_lens = torch.full((case.num_seqs,), case.context_len, dtype=torch.int32, device="cuda")
    return PrefillInputs(q, k_cache, v_cache, block_tables.view(case.num_seqs, blocks_per_seq), query_start_loc,
                         seq_lens, case)


def sdpa_fn(inputs: PrefillInputs) -> Callable[[], torch.Tensor]:
    """torch's SDPA on the contiguous layout, flash or memory-efficient kernels only: (B, H, L, D)."""
    q, k, v = inputs.contiguous
    case = inputs.case
    mask = None if case.query_len == case.context_len else causal_lower_right(case.query_len, case.context_len)

    def run() -> torch.Tensor:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            return scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                                scale=q.shape[-1] ** -0.5)

    return run


def cudnn_fn(inputs: PrefillInputs) -> Callable[[], torch.Tensor] | None:
    """cuDNN's SDPA on the contiguous layout, or None where it cannot run the case (queries after a cached context,
    or no cuDNN attention in this torch or on this GPU)."""
    case = inputs.case
    if case.query_len != case.context_len:
        return None
    q, k, v = inputs.contiguous

    def run() -> torch.Tensor:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return scaled_dot_product_attention(q, k, v, is_causal=True, scale=q.shape[-1] ** -0.5)

    try:
        run()
    except RuntimeError as error:  # SDPA finds no kernel it may use
        print(f"no cuDNN attention for {case.name}: {str(error).splitlines()[0]}", file=sys.stderr)
        return None
    return run


def tflops(shape: HeadShape, case: Case, ms: float) -> float:
    return 4 * shape.head_dim * shape.num_heads * case.causal_keys / (ms * 1e-3) / 1e12


def median_ms(fn: Callable[[], torch.Tensor]) -> float:
    return do_bench(fn, return_mode="median")


def assert_matches(out: torch.Tensor, expected: torch.Tensor) -> None:
    """Our (T, H, D) output against SDPA's (B, H, L, D), within bf16 tolerance."""
    torch.testing.assert_close(out.float(), expected.transpose(1, 2).flatten(0, 1).float(), atol=2e-2, rtol=2e-2)


def load_baseline(tree: Path) -> ModuleType:
    """TREE's batchgen/layers/attention_triton.py as a module of its own (its imports resolve in this tree)."""
    spec = importlib.util.spec_from_file_location("baseline_attention_triton",
                                                  tree / "batchgen" / "layers" / "attention_triton.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there while the class is made
    spec.loader.exec_module(module)
    return module


def compare(shapes: list[HeadShape], cases: list[Case], cache_dtype: torch.dtype,
            baseline: ModuleType | None) -> list[dict]:
    rows = []
    for shape, case in itertools.product(shapes, cases):
        inputs = prefill_inputs(shape, case, cache_dtype)
        ours, reference = inputs.triton_fn(), sdpa_fn(inputs)
        assert_matches(ours(), reference())
        triton_ms, sdpa_ms = median_ms(ours), median_ms(reference)
        config = default_config(shape, case)
        row = {"model": shape.model, "case": case.name, "seqs": case.num_seqs, "queries": case.query_len,
               "context": case.context_len, "config": asdict(config), "triton_ms": triton_ms, "sdpa_ms": sdpa_ms,
               "triton_tflops": tflops(shape, case, triton_ms), "sdpa_tflops": tflops(shape, case, sdpa_ms),
               "sdpa_over_triton": sdpa_ms / triton_ms, "cudnn_ms": None, "cudnn_over_triton": None,
               "baseline_ms": None}
        cudnn = cudnn_fn(inputs)
        if cudnn is not None:
            assert_matches(ours(), cudnn())
            row["cudnn_ms"] = median_ms(cudnn)
            row["cudnn_over_triton"] = row["cudnn_ms"] / triton_ms
        if baseline is not None:
            before = inputs.triton_fn(kernels=baseline)
            assert_matches(before(), reference())
            row["baseline_ms"] = median_ms(before)
        rows.append(row)
        print(f"{shape.model} {case.name}: triton {triton_ms:.3f} ms, sdpa {sdpa_ms:.3f} ms", file=sys.stderr)
        del inputs, ours, reference, cudnn
        torch.cuda.empty_cache()
    return rows


def default_config(shape: HeadShape, case: Case) -> PrefillConfig:
    """prefill_config's launch for the case on this GPU."""
    return attention_triton.prefill_config(shape.head_dim, DTYPE, shape.num_heads // shape.num_kv_heads,
                                           case.context_len, torch.device("cuda"))


def sweep_configs() -> list[PrefillConfig]:
    return [PrefillConfig(*values) for values in
            itertools.product(SWEEP_BLOCK_M, SWEEP_BLOCK_N, SWEEP_WARPS, SWEEP_STAGES)]


def sweep(shapes: list[HeadShape], cases: list[Case], cache_dtype: torch.dtype) -> tuple[list[dict], list[dict]]:
    """Every configuration's median ms on every (model, case), and per model the configuration whose geometric
    mean of ms / the case's best ms is least, beside prefill_config's."""
    timings = []
    for shape, case in itertools.product(shapes, cases):
        inputs = prefill_inputs(shape, case, cache_dtype)
        expected = sdpa_fn(inputs)()
        for config in sweep_configs():
            fn = inputs.triton_fn(config)
            try:
                assert_matches(fn(), expected)
            except OutOfResources as error:  # shared memory or registers
                print(f"skip {shape.model} {case.name} {config}: {error}", file=sys.stderr)
                continue
            timings.append({"model": shape.model, "case": case.name, **asdict(config), "ms": median_ms(fn)})
        print(f"swept {shape.model} {case.name}", file=sys.stderr)
        del inputs, expected
        torch.cuda.empty_cache()

    summary = []
    for shape in shapes:
        ms = {(t["case"], PrefillConfig(t["block_m"], t["block_n"], t["num_warps"], t["num_stages"])): t["ms"]
              for t in timings if t["model"] == shape.model}
        best = {case.name: min(value for (name, _), value in ms.items() if name == case.name) for case in cases}
        slowdowns: dict[PrefillConfig, list[float]] = {}
        for (name, config), value in ms.items():
            slowdowns.setdefault(config, []).append(value / best[name])
        # A configuration that failed on some case is no candidate.
        geomean = {c: statistics.geometric_mean(s) for c, s in slowdowns.items() if len(s) == len(cases)}
        winner = min(geomean, key=geomean.get)
        # prefill_config picks per case (by its context): the slowdown of its picks against each case's best.
        picked = {case.name: default_config(shape, case) for case in cases}
        picked_slowdowns = [ms[name, config] / best[name] for name, config in picked.items() if (name, config) in ms]
        summary.append({"model": shape.model, "head_dim": shape.head_dim, "best": asdict(winner),
                        "best_slowdown": geomean[winner],
                        "default": {name: asdict(config) for name, config in picked.items()},
                        "default_slowdown": statistics.geometric_mean(picked_slowdowns)
                        if len(picked_slowdowns) == len(cases) else None})
    return timings, summary


def config_label(config: dict) -> str:
    return f"{config['block_m']}/{config['block_n']}/{config['num_warps']}w/{config['num_stages']}s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=[QWEN3, LLAMA31_8B], help="conf/model names (head shapes)")
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--sweep", action="store_true", help="time every launch configuration")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="another checkout whose prefill kernel to time beside this tree's")
    add_kv_cache_dtype_argument(parser)
    add_out_argument(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_prefill_attention needs a CUDA device")
    cache_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, DTYPE)
    shapes = [head_shape(model) for model in args.models]
    cases = [CASES[name] for name in args.cases]
    suffix = "_fp8" if args.kv_cache_dtype == "fp8" else ""
    title = f"on {torch.cuda.get_device_name()}, {DTYPE} queries, {cache_dtype} cache, block size {BLOCK_SIZE}"

    if args.sweep:
        timings, summary = sweep(shapes, cases, cache_dtype)
        save_json(args.out, "sweep_prefill_attention" + suffix,
                  {"environment": environment(), "kv_cache_dtype": str(cache_dtype), "timings": timings,
                   "summary": summary})
        table = markdown_table(
            ["model", "best block_m/block_n/warps/stages", "its slowdown", "prefill_config's", "its slowdown"],
            [[s["model"], config_label(s["best"]), s["best_slowdown"],
              ", ".join(f"{case} {config_label(config)}" for case, config in s["default"].items()),
              s["default_slowdown"]] for s in summary])
        print(f"\n## sweep_prefill_attention {title} (slowdown: geometric mean over the cases of ms / the case's "
              f"best)\n\n{table}")
        return

    rows = compare(shapes, cases, cache_dtype, load_baseline(args.baseline) if args.baseline else None)
    save_json(args.out, "bench_prefill_attention" + suffix,
              {"environment": environment(), "kv_cache_dtype": str(cache_dtype),
               "baseline": str(args.baseline) if args.baseline else None, "rows": rows})
    table = markdown_table(
        ["model", "case", "seqs x queries / context", "config", "triton ms", "sdpa ms", "triton TFLOP/s",
         "sdpa TFLOP/s", "sdpa / triton", "cudnn ms", "cudnn / triton", "baseline ms"],
        [[r["model"], r["case"], f"{r['seqs']} x {r['queries']} / {r['context']}", config_label(r["config"]),
          r["triton_ms"], r["sdpa_ms"], r["triton_tflops"], r["sdpa_tflops"], r["sdpa_over_triton"],
          r["cudnn_ms"], r["cudnn_over_triton"], r["baseline_ms"]] for r in rows])
    print(f"\n## bench_prefill_attention {title}\n\n{table}")


if __name__ == "__main__":
    main()
