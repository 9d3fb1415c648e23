"""Shared benchmark helpers: drive the engine, summarise its steps, describe the machine, write results."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
import yaml
from torch import nn
from transformers import GenerationConfig

from batchgen.config import (
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    EngineConfig,
    ModelConfig,
    validate_engine,
    validate_model,
)
from batchgen.engine.llm_engine import LLMEngine, StepRecord
from batchgen.engine.outputs import RequestOutput
from batchgen.job.summary import TIME_COLUMNS
from batchgen.layers.moe import StackedExperts
from batchgen.sample.params import SamplingParams

REPO = Path(__file__).resolve().parents[1]
Request = tuple[list[int], SamplingParams]
QWEN3 = "qwen3_0_6b"
LLAMA31_8B = "llama3_1_8b"
SHAKESPEARE = "shakespeare"  # the main job's model
SHAKESPEARE_TEXT = REPO / "jobs" / "shakespeare" / "tinyshakespeare.txt"
# A Qwen3 small enough for a CPU smoke test; the vocabulary still holds the benchmarks' prompt ids (< 10001).
TINY_QWEN3 = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=10240, max_position_embeddings=4096,
                  bos_token_id=10238, eos_token_id=10239)
TINY_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)  # --tiny's experts, on TINY_QWEN3
NANOVLLM_NUM_SEQS = 256


def add_out_argument(parser: argparse.ArgumentParser) -> None:
    default = Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO / "benchmarks" / "out"
    parser.add_argument("--out", type=Path, default=default, help="directory for the JSON results (default: $OUT)")


def add_kv_cache_dtype_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                        help="engine.kv_cache_dtype: auto (the model's dtype) or fp8 (float8_e4m3fn)")


def add_quantization_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                        help="model.quantization: fp8 quantizes the decoder's linear and expert layers at load (per "
                             "channel); results are named with _fp8_weights")


def cuda_available() -> bool:
    return torch.cuda.is_available()


def synchronize() -> None:
    if cuda_available():
        torch.cuda.synchronize()


def load_model_config(name: str) -> ModelConfig:
    """conf/model/<name>.yaml as a ModelConfig; Hydra's ${repo:} in paths becomes the repository root."""
    data = yaml.safe_load((REPO / "conf" / "model" / f"{name}.yaml").read_text())
    for key in ("path", "tokenizer"):
        if isinstance(data.get(key), str):
            data[key] = data[key].replace("${repo:}", str(REPO))
    return ModelConfig(**data)


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=QWEN3,
                        help=f"conf/model/<name>.yaml: a shape with dummy weights (default {QWEN3}, or e.g. "
                             "qwen3_30b_a3b)")


def add_tensor_parallel_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="split the model over N ranks (engine.tensor_parallel_size): N GPUs, or CPU processes")
    parser.add_argument("--no-custom-all-reduce", action="store_true",
                        help="the decode graphs' all-reduces on NCCL too (engine.custom_all_reduce=false)")


def tensor_parallel_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options of add_tensor_parallel_argument's arguments."""
    return {"tensor_parallel_size": args.tensor_parallel_size, "custom_all_reduce": not args.no_custom_all_reduce}


def tensor_parallel_suffix(args: argparse.Namespace) -> str:
    """The results file's name part for a tensor-parallel run ("" for one rank)."""
    if args.tensor_parallel_size == 1:
        return ""
    return f"_tp{args.tensor_parallel_size}" + ("_nccl" if args.no_custom_all_reduce else "")


def benchmark_model_config(name: str, tiny: bool = False, quantization: str | None = None) -> ModelConfig:
    """conf/model/<name>.yaml, or with --tiny a two-layer model of its family (a mixture of experts keeps a few
    small experts); `quantization`: model.quantization."""
    config = load_model_config(name)
    if tiny:
        moe = TINY_MOE if "num_experts" in config.hf_config else {}
        config.hf_config = {**config.hf_config, **TINY_QWEN3, **moe}
    config.quantization = quantization
    return config


def qwen3_model_config(tiny: bool = False) -> ModelConfig:
    """The Qwen3-0.6B shape with dummy bf16 weights, or with --tiny a two-layer model of the same family."""
    return benchmark_model_config(QWEN3, tiny)


def random_prompt(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10000) for _ in range(length)]


def nanovllm_requests(num_seqs: int = NANOVLLM_NUM_SEQS, total: int = NANOVLLM_NUM_SEQS) -> list[Request]:
    """nano-vllm's bench.py draws, in its order (all prompts, then all sampling params); the first num_seqs.
    `total` scales the workload: that many draws of each (nano-vllm's own: 256)."""
    if not 0 < num_seqs <= total:
        raise ValueError(f"num_seqs={num_seqs} must be in [1, {total}]")
    rng = random.Random(0)  # the same stream as nano-vllm's random.seed(0) and module-level randint
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(total)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=rng.randint(100, 1024))
              for _ in range(total)]
    return list(zip(prompts, params, strict=True))[:num_seqs]


def build_engine(model_config: ModelConfig, **engine_options: Any) -> LLMEngine:
    engine_config = EngineConfig(**engine_options)
    validate_model(model_config)
    validate_engine(engine_config)
    return LLMEngine(model_config, engine_config)


def run_engine(engine: LLMEngine, requests: Sequence[Request]) -> tuple[list[RequestOutput], list[StepRecord], float]:
    """Add every request, step until all finish; outputs in request order, the step rows and the wall seconds."""
    synchronize()
    start = time.perf_counter()
    for request_id, (prompt_token_ids, params) in enumerate(requests):
        engine.add_request(request_id, None, prompt_token_ids, params)
    outputs: list[RequestOutput] = []
    records: list[StepRecord] = []
    while engine.has_unfinished_requests:
        finished, record = engine.step()
        outputs += finished
        if record is not None:
            records.append(record)
    synchronize()
    wall = time.perf_counter() - start
    errors = [o.error for o in outputs if o.finish_reason == "error"]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, the first with: {errors[0]}")
    return sorted(outputs, key=lambda o: o.request_id), records, wall


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def decode_medians(records: Sequence[StepRecord]) -> dict[str, float | int | None]:
    """Median step and forward ms over the decode steps (the per-token cost once the prompt is in the cache)."""
    decode = [r for r in records if r.kind == "decode"]
    return {
        "decode_steps": len(decode),
        "decode_step_ms": median([r.step_ms for r in decode]),
        "decode_forward_ms": median([r.forward_ms for r in decode]),
        "decode_cuda_graph_steps": sum(r.cuda_graph for r in decode),
    }


def step_breakdown(records: Sequence[StepRecord]) -> list[dict[str, Any]]:
    """Per (kind, cuda_graph): the number of steps, median batch and tokens, and the median of each timing."""
    groups: dict[tuple[str, bool], list[StepRecord]] = {}
    for record in records:
        groups.setdefault((record.kind, record.cuda_graph), []).append(record)
    rows = []
    for (kind, graph), group in sorted(groups.items()):
        row: dict[str, Any] = {"kind": kind, "cuda_graph": graph, "steps": len(group),
                               "num_seqs": median([r.num_seqs for r in group]),
                               "num_tokens": median([r.num_tokens for r in group])}
        row.update({name: median([getattr(r, name) for r in group]) for name in TIME_COLUMNS})
        rows.append(row)
    return rows


def step_counts(records: Sequence[StepRecord]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for record in records:
        counts[record.kind] = counts.get(record.kind, 0) + 1
    return counts


def records_as_dicts(records: Sequence[StepRecord]) -> list[dict[str, Any]]:
    return [asdict(r) for r in records]


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}" if abs(value) >= 100 else f"{value:.3f}"
    return str(value).replace("|", "\\|")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def breakdown_table(rows: Sequence[dict[str, Any]]) -> str:
    headers = ["kind", "cuda_graph", "steps", "num_seqs", "num_tokens", *TIME_COLUMNS]
    return markdown_table(headers, [[row[h] for h in headers] for row in rows])


def _git_commit() -> str | None:
    """$BATCHGEN_GIT_COMMIT if set (a copied working tree may carry stale or no git metadata), else HEAD."""
    if os.environ.get("BATCHGEN_GIT_COMMIT"):
        return os.environ["BATCHGEN_GIT_COMMIT"]
    try:
        result = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def environment() -> dict[str, Any]:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "device": torch.cuda.get_device_name() if cuda_available() else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "git_commit": _git_commit(),
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def time_ms(fn: Callable[[], Any]) -> float:
    """Milliseconds fn takes on the device: CUDA events on GPU, a host clock after the call on CPU."""
    if cuda_available():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    start_s = time.perf_counter()
    fn()
    return (time.perf_counter() - start_s) * 1000


def copy_bandwidth_gbs(num_bytes: int = 2**30, repeats: int = 20) -> float:
    """Device-to-device copy bandwidth in GB/s (1e9), counting the bytes read plus the bytes written."""
    device = "cuda" if cuda_available() else "cpu"
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    synchronize()
    ms = statistics.median(time_ms(lambda: dst.copy_(src)) for _ in range(repeats))
    return 2 * num_bytes / (ms / 1000) / 1e9


def hf_generate_ms_per_token(model: nn.Module, prompt_ids: list[int], new_tokens: int,
                             repeats: int) -> dict[str, Any]:
    """transformers `generate` at batch 1, greedy, exactly new_tokens (EOS held off by min_new_tokens):
    wall ms per new token with the prefill included, median of repeats after one short warm-up."""
    input_ids = torch.tensor([prompt_ids], device=model.device)
    attention_mask = torch.ones_like(input_ids)

    def generate(n: int) -> int:
        config = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                  eos_token_id=model.config.eos_token_id, pad_token_id=model.config.eos_token_id)
        with torch.inference_mode():
            out = model.generate(input_ids, attention_mask=attention_mask, generation_config=config)
        return out.shape[1] - input_ids.shape[1]

    generate(min(new_tokens, 16))
    runs = []
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        generated = generate(new_tokens)
        synchronize()
        if generated != new_tokens:
            raise RuntimeError(f"generate returned {generated} tokens, expected {new_tokens}")
        runs.append((time.perf_counter() - start) * 1000 / new_tokens)
    return {"prompt_tokens": len(prompt_ids), "new_tokens": new_tokens, "repeats": repeats,
            "ms_per_token": statistics.median(runs), "ms_per_token_runs": runs,
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "attn_implementation": model.config._attn_implementation}


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters; tied weights count once (nn.Module.parameters() deduplicates them)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def expected_active_experts(num_experts: int, top_k: int, rows: int) -> float:
    """How many of a layer's experts `rows` tokens route to, expected under uniform routing: each expert is missed
    by a token with probability 1 - top_k / num_experts. Exactly top_k for one row."""
    return num_experts * (1 - (1 - top_k / num_experts) ** rows)


def decode_read_bytes(model: nn.Module, rows: int) -> float:
    """The weight bytes a decode step of `rows` tokens must read, from its active parameters: every parameter, but
    of an input embedding that the lm_head does not share only the rows' own rows, and of a mixture of experts only
    the experts the rows route to (`expected_active_experts`). For a dense model with tied embeddings: all of them."""
    total = float(weight_bytes(model))
    lm_head = getattr(model, "lm_head", None)
    for module in model.modules():
        if isinstance(module, nn.Embedding) and (lm_head is None or module.weight is not lm_head.weight):
            total -= module.weight.nbytes - min(rows, module.weight.shape[0]) * module.weight[0].nbytes
        elif isinstance(module, StackedExperts):
            expert_bytes = (module.gate_up_proj.nbytes + module.down_proj.nbytes) / module.num_experts
            active = expected_active_experts(module.num_experts, module.top_k, rows)
            total -= (module.num_experts - active) * expert_bytes
    return total


def save_json(out_dir: Path, name: str, obj: Any) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    return path


def text_windows(rows: int, chars: tuple[int, int], seed: int = 0) -> list[str]:
    """Windows of the play text starting anywhere, their lengths uniform over an inclusive range."""
    text = SHAKESPEARE_TEXT.read_text()
    rng = np.random.default_rng(seed)
    lengths = rng.integers(chars[0], chars[1] + 1, rows)
    starts = rng.integers(0, len(text) - chars[1], rows)
    return [text[start:start + length] for start, length in zip(starts, lengths, strict=True)]
