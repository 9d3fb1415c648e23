"""The model on its device, ready to run steps: its weights (a tensor-parallel rank's shard of them), the model
runner, the KV cache and the CUDA graphs. The engine builds one, and so does each tensor-parallel follower
(engine/tp_follower.py), the same way: the ranks' forwards of the memory profile and of the graph captures run
together, since their collectives pair up."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from batchgen.config import EngineConfig, ModelConfig
from batchgen.core.kv_sizing import KVBlockChoice, KVDemand, choose_num_blocks, job_block_limit, kv_budget_bytes
from batchgen.core.request import Request
from batchgen.layers import attention_torch
from batchgen.layers.compiled import compile_small_layers
from batchgen.layers.tensor_parallel import SINGLE, TensorParallel
from batchgen.layers.triton_layers import use_triton_layers
from batchgen.models.hf_config import max_positions
from batchgen.models.loader import load_hf_config, load_model, resolve_dtype
from batchgen.models.pooling_config import checkpoint_pooling
from batchgen.models.registry import check_task
from batchgen.worker.compile_ahead import CompileAhead
from batchgen.worker.cuda_graph import CAPTURE_AFTER_USES
from batchgen.worker.host_memory import keep_freed_memory
from batchgen.worker.host_threads import intra_op_threads
from batchgen.worker.model_runner import BitmaskProvider, ModelRunner
from batchgen.worker.pooling import Pooler
from batchgen.worker.triton_start import wait_for_triton_start

log = logging.getLogger(__name__)

POOLING_TASKS = ("embed", "classify")
LARGE_GPU_BYTES = 70 * 2**30  # from here on, a step of 16,384 tokens is the default (default_batched_tokens)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("engine.device='cuda' but no CUDA device is available; use engine.device=cpu or auto")
    return torch.device(name)


def resolve_engine_config(config: EngineConfig, hf_config: Any, device: torch.device) -> EngineConfig:
    """The config as it applies to this model and device: max_model_len, attention_backend and
    max_num_batched_tokens set."""
    backend = config.attention_backend
    if backend == "auto":
        backend = "triton" if device.type == "cuda" else "torch"
    elif backend == "triton" and device.type != "cuda":
        raise ValueError("engine.attention_backend='triton' needs a CUDA device; allowed on CPU: torch, auto")
    limit = max_positions(hf_config)
    max_model_len = config.max_model_len or limit
    if max_model_len is None:
        raise ValueError("engine.max_model_len is not set and the model's config names no max_position_embeddings: "
                         "set engine.max_model_len")
    if limit is not None and max_model_len > limit:
        raise ValueError(f"engine.max_model_len={max_model_len} is invalid: the model supports at most {limit} "
                         "positions")
    return replace(config, max_model_len=max_model_len, attention_backend=backend,
                   max_num_batched_tokens=config.max_num_batched_tokens or default_batched_tokens(device))


def default_batched_tokens(device: torch.device) -> int:
    if device.type == "cuda" and torch.cuda.get_device_properties(device).total_memory >= LARGE_GPU_BYTES:
        return 16384
    return 8192


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    return attention_torch.FP8_DTYPE if name == "fp8" else model_dtype


def check_kv_cache_dtype_supported(kv_cache_dtype: torch.dtype, backend: str, device: torch.device) -> None:
    """Triton's fp8e4nv (float8_e4m3fn) needs compute capability 8.9 (Ada, Hopper) or newer; the torch path
    converts fp8 on any device."""
    if kv_cache_dtype != attention_torch.FP8_DTYPE or backend != "triton":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        raise ValueError(f"engine.kv_cache_dtype='fp8' with the Triton attention needs a GPU of compute capability "
                         f"8.9 or newer, this one has {capability[0]}.{capability[1]}; use engine.kv_cache_dtype=auto "
                         "or engine.attention_backend=torch")


def agree_alone(value: int) -> int:
    """One rank agrees with itself."""
    return value


class ModelWorker:
    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig, task: str, device: torch.device,
                 kv_demand: KVDemand | None = None, bitmask_provider: BitmaskProvider | None = None,
                 tp: TensorParallel = SINGLE, agree_min: Callable[[int], int] = agree_alone):
        """kv_demand: the job's rows, when known: the KV cache is sized to them. tp: this rank's place among the
        tensor-parallel ranks; agree_min: the smallest of the ranks' values (each rank sizes its KV cache, and all
        take the smallest number of blocks)."""
        self.task = task
        self.device = device
        threads = intra_op_threads(engine_config.cpu_threads, device, engine_config.tensor_parallel_size)
        if threads is not None:
            torch.set_num_threads(threads)
        if device.type == "cpu":
            keep_freed_memory()
        hf_config = load_hf_config(model_config)
        check_task(task, hf_config, model_config.impl)
        self.hf_config = hf_config
        self.dtype = resolve_dtype(model_config.dtype, hf_config, device)

        # Begun before the load: on a fresh machine its compile processes start up while the model loads. A start
        # that fails drops it, which closes their pipes, and they exit.
        compile_ahead = CompileAhead.begin(engine_config, device, tp.size)
        start = time.perf_counter()
        model = load_model(model_config, hf_config, self.dtype, device, task, tp)
        wait_for_triton_start()  # started as the job began: the first kernel comes next
        if not model.cuda_graphs and not engine_config.enforce_eager:
            engine_config = replace(engine_config, enforce_eager=True)
            if device.type == "cuda":
                log.info("CUDA graphs off: transformers' modules run eagerly (model.impl=%s)", model.impl)
        self.config = resolve_engine_config(engine_config, hf_config, device)
        backend = self.config.attention_backend
        compile_layers = device.type == "cuda" and engine_config.torch_compile
        if compile_layers:
            compile_small_layers(model)  # compiles lazily, at the memory-profiling run below
        kv_cache_dtype = resolve_kv_cache_dtype(engine_config.kv_cache_dtype, self.dtype)
        check_kv_cache_dtype_supported(kv_cache_dtype, backend, device)
        if backend == "triton":
            use_triton_layers(model, gemv=not engine_config.enforce_eager, elementwise=not compile_layers)
        self.info: dict[str, Any] = {"load_seconds": time.perf_counter() - start, "task": task,
                                     "model_impl": model.impl}
        self.runner = ModelRunner(self.config, model, device, kv_cache_dtype, bitmask_provider)
        self.pooler = self._pooler(model_config, model) if task in POOLING_TASKS else None
        start = time.perf_counter()
        captures = device.type == "cuda" and not engine_config.enforce_eager and self.pooler is None
        decoding = None if kv_demand is None else kv_demand.num_decoding
        graphs = captures and decoding != 0
        # on CUDA, a forward that measures the activations' peak
        kv_choice = compile_ahead.run(lambda: self._num_kv_blocks(kv_demand),
                                      lambda: self._start_forwards(graphs, decoding, kv_demand))
        self.num_blocks = agree_min(kv_choice.num_blocks)
        self.runner.allocate_kv_cache(self.num_blocks)
        block_size = self.config.block_size
        reason = kv_choice.reason if self.num_blocks == kv_choice.num_blocks else "another tensor-parallel rank's"
        self.info.update(
            kv_sizing_seconds=time.perf_counter() - start,
            device=str(torch.cuda.get_device_name(device)) if device.type == "cuda" else "cpu",
            dtype=str(self.dtype).removeprefix("torch."),
            kv_cache_dtype=str(kv_cache_dtype).removeprefix("torch."),
            max_model_len=self.config.max_model_len,
            kv_blocks=self.num_blocks,
            kv_blocks_reason=reason,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            kv_capacity_tokens=self.num_blocks * block_size,
            kv_cache_bytes=self.num_blocks * self.runner.kv_block_bytes,
        )
        log.info("KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB, %s): %s", self.num_blocks, block_size,
                 self.num_blocks * block_size, self.info["kv_cache_bytes"] / 2**30, self.info["kv_cache_dtype"],
                 reason)
        if captures and not graphs:
            log.info("CUDA graphs not captured: no row of the job takes a decode step (max_tokens <= 1)")
        if graphs:
            compile_ahead.run(lambda: self._capture_graphs(decoding),
                              lambda: self._start_forwards(graphs, decoding, kv_demand, profile=False))
        if device.type == "cuda":
            compile_ahead.run(lambda: self._warm_up_step(kv_demand),
                              lambda: self._start_forwards(False, decoding, kv_demand, profile=False))
        compile_ahead.close()
        self.info.update(compile_ahead.info)

    def _pooler(self, model_config: ModelConfig, model: torch.nn.Module) -> Pooler:
        hidden_size = self.hf_config.hidden_size
        if self.task == "classify":
            self.info.update(pooling="last non-pad token")
            return Pooler("last", hidden_size, self.device, head=model.compute_logits,
                          pad_token_id=getattr(self.hf_config, "pad_token_id", None))
        method = model_config.pooling or checkpoint_pooling(model_config.path) or "last"
        self.info.update(pooling=method, normalize=model_config.normalize)
        return Pooler(method, hidden_size, self.device, normalize=model_config.normalize)

    def _num_kv_blocks(self, demand: KVDemand | None) -> KVBlockChoice:
        cfg = self.config
        if cfg.num_gpu_blocks_override is not None:
            return KVBlockChoice(cfg.num_gpu_blocks_override, "engine.num_gpu_blocks_override")
        block_bytes = self.runner.kv_block_bytes
        if self.device.type == "cpu":
            budget = max(1, int(cfg.cpu_kv_cache_space_gib * 2**30) // block_bytes)
            limit = job_block_limit(cfg.max_num_seqs, cfg.max_model_len, cfg.block_size, demand)
            return choose_num_blocks(budget, f"engine.cpu_kv_cache_space_gib={cfg.cpu_kv_cache_space_gib}", limit)
        peak = self.runner.profile_peak_bytes(scores_logits=self.pooler is None)
        # After the profile: a job's demand may still be coming (its prompts tokenized meanwhile).
        limit = job_block_limit(cfg.max_num_seqs, cfg.max_model_len, cfg.block_size, demand)
        total = torch.cuda.get_device_properties(self.device).total_memory
        available = kv_budget_bytes(total, cfg.gpu_memory_utilization, cfg.ranks_per_gpu, peak)
        budget = f"engine.gpu_memory_utilization={cfg.gpu_memory_utilization}" + (
            f" over engine.ranks_per_gpu={cfg.ranks_per_gpu}" if cfg.ranks_per_gpu > 1 else "")
        if available < block_bytes:
            raise ValueError(f"{budget}: no memory left for the KV cache (model and activations peak at "
                             f"{peak / 2**30:.2f} GiB of {total / 2**30:.1f})")
        return choose_num_blocks(available // block_bytes, budget, limit)

    def _start_forwards(self, graphs: bool, max_rows: int | None, demand: KVDemand | None,
                        profile: bool = True) -> None:
        """The start's forwards on the device from a phase on, run once more for compile_ahead's dry run: each CUDA
        graph's warm-up forward (graphs), the KV-sizing profile's (profile), the warm-up steps. Ordered so that the
        dry run meets every kernel early, as each then compiles while it goes on: the start buckets' graphs first,
        though their phase comes later (they launch nearly all of the start's kernels), then the prefill steps', then
        the other buckets' graphs, which rarely launch one more."""
        if graphs:
            self.runner.warm_up_graphs(max_rows, start_buckets=True)
        if profile:
            self.runner.profile_peak_bytes(scores_logits=self.pooler is None)
        self.runner.warm_up_step(self.pooler, self._warm_up_contexts(demand))
        if graphs:
            self.runner.warm_up_graphs(max_rows, start_buckets=False)

    def _warm_up_contexts(self, demand: KVDemand | None) -> list[int]:
        """The longer prefill steps that the warm-up adds for the attention's other launch configurations
        (prefill_warm_up_contexts), those that the job's sequences can reach."""
        longest = self.config.max_model_len if demand is None else demand.longest(self.config.max_model_len)
        head_dim = self.runner.attention_layers[0].head_dim
        contexts = self.runner.attention_ops.prefill_warm_up_contexts(head_dim, self.dtype, self.device)
        return [context for context in contexts if context <= longest]

    def _warm_up_step(self, demand: KVDemand | None) -> None:
        start = time.perf_counter()
        self.runner.warm_up_step(self.pooler, self._warm_up_contexts(demand))
        self.info.update(warm_up_seconds=time.perf_counter() - start)
        log.info("Warm-up step (the first launch of each prefill kernel) in %.2f s", self.info["warm_up_seconds"])

    def _capture_graphs(self, max_rows: int | None) -> None:
        stats = self.runner.capture_graphs(max_rows)
        self.info.update(cuda_graph_sizes=stats.sizes, cuda_graph_capture_seconds=stats.seconds,
                         cuda_graph_pool_bytes=stats.pool_bytes,
                         cuda_graph_capture_seconds_per_size={str(k): v for k, v in stats.seconds_per_size.items()},
                         cuda_graph_deferred_sizes=stats.deferred,
                         # filled as the job's steps capture deferred buckets (the summary is written at the end)
                         cuda_graph_deferred_capture_seconds=self.runner.graphs.deferred_seconds)
        log.info("Captured %d CUDA graphs (batch sizes %s) in %.2f s, pool %.1f MiB%s", len(stats.sizes),
                 stats.sizes, stats.seconds, stats.pool_bytes / 2**20,
                 f"; {len(stats.deferred)} other buckets are captured at their {CAPTURE_AFTER_USES}th step "
                 "(engine.cuda_graph.lazy_capture)" if stats.deferred else "")

    def release(self, requests: list[Request]) -> None:
        """Forget finished requests' rows: block tables, sampling state and pooling."""
        self.runner.release(requests)
        if self.pooler is not None:
            self.pooler.release(requests)
