"""The job's configuration as plain dataclasses, and its validation.

cli.py registers these schemas with Hydra; everything below it receives a validated `Config`.
Every check raises `ConfigError` naming the offending key and what is allowed, before any model loads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from batchgen.models.gguf_file import GGUF_SUFFIX, UnsupportedGGUF, is_gguf_path, validate_gguf
from batchgen.models.hub import is_hub_id
from batchgen.sample.params import SamplingParams

DATA_FORMATS = ("auto", "jsonl", "parquet", "arrow", "hf_disk", "hf", "openai_batch")
OUTPUT_FORMATS = ("auto", "parquet", "openai_batch")
ERROR_POLICIES = ("fail", "skip")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
MODEL_IMPLS = ("auto", "native", "transformers")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
KV_CACHE_DTYPES = ("auto", "fp8")
QUANTIZATIONS = ("fp8",)
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
EMPTY_POLICIES = ("warn", "fail")
RUNNERS = ("local", "ray")
TASKS = ("generate", "score", "embed", "classify")
POOLING_METHODS = ("last", "mean", "cls")
SHARD_BY = ("work", "index")
MAX_CAPTURE_SIZE = 512  # the largest default CUDA-graph bucket


class ConfigError(ValueError):
    """An invalid configuration value; the message names the key."""


@dataclass
class ModelConfig:
    # a Hugging Face checkpoint directory, a GGUF file (or a directory holding one), or a Hub id (org/name[@revision])
    path: str | None = None
    tokenizer: str | None = None  # defaults to `path`; None with dummy weights means token-id prompts only
    load_format: str = "auto"  # auto | safetensors | dummy (random weights from hf_config)
    hf_config: dict[str, Any] | None = None  # config.json values, for dummy weights without a checkpoint
    dtype: str = "auto"  # auto: the checkpoint's dtype on CUDA, float32 on CPU
    served_model_name: str | None = None  # the name OpenAI Batch responses carry; None: the Hub id or the dir's name
    # native: batchgen's own modules | transformers: transformers' modules with batchgen's paged KV cache and attention
    # | auto: native where batchgen implements the architecture, else transformers
    impl: str = "auto"
    # job.task=embed: how a prompt's final hidden states become one vector: last | mean | cls. None: the checkpoint's
    # sentence-transformers pooling (1_Pooling/config.json) when it has one, else last.
    pooling: str | None = None
    normalize: bool = True  # job.task=embed: L2-normalize each embedding
    # fp8: quantize the decoder's linear layers of a bf16/fp16 checkpoint to float8_e4m3fn at load, one scale per
    # output channel (vLLM's quantization="fp8"). None: the checkpoint as it is (an fp8 checkpoint loads as fp8).
    quantization: str | None = None


@dataclass(frozen=True)
class CudaGraphConfig:
    capture_sizes: list[int] | None = None  # None: 1, 2, 4, then steps of 8 up to max_capture_size
    max_capture_size: int | None = None  # None: max_num_seqs, at most 512
    # True: the start captures the buckets that are powers of two and the largest, each other bucket is captured at
    # its CAPTURE_AFTER_USES-th decode step (batchgen/worker/cuda_graph.py), the steps before replaying the next
    # captured bucket up. False: every bucket at the start.
    lazy_capture: bool = True


@dataclass(frozen=True)
class EngineConfig:
    device: str = "auto"  # auto | cpu | cuda
    max_num_seqs: int = 256
    # None: 16384 on a GPU of 70 GiB or more (vLLM's offline default there: fewer, fuller eager prefill steps), else
    # 8192
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None  # None: the model's max_position_embeddings (more with yarn/dynamic RoPE)
    block_size: int = 16
    num_gpu_blocks_override: int | None = None  # fixes the number of KV blocks (tests force a small cache)
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_space_gib: float = 1.0  # the KV-cache budget on CPU
    cpu_threads: int | None = None  # torch intra-op threads; None: 1 with a GPU, else torch's default over local ranks
    enforce_eager: bool = False
    mixed_prefill_decode: bool = False  # False: a step is all prefill or all decode (decode steps replay graphs)
    async_scheduling: bool = True  # schedule and stage step N+1 while the device runs step N
    # A prefill step interrupts running decodes only to admit at least this many waiting rows (fewer when fewer
    # wait) or prompt tokens that fill max_num_batched_tokens: each eager prefill step costs about the same launch
    # overhead however few rows it admits. None: max_num_seqs // 8 (at least 1). Mixed steps ignore it.
    min_admit_rows: int | None = None
    attention_backend: str = "auto"  # auto: triton on CUDA, torch on CPU
    # auto: the model's dtype | fp8: float8_e4m3fn with scale 1.0 (vLLM's kv_cache_dtype="fp8" without calibrated
    # scales): half the KV bytes of bf16 to read per decode step, twice the blocks in the same memory
    kv_cache_dtype: str = "auto"
    # On CUDA, torch.compile the small elementwise layers (norms, rotary, activation) instead of running their Triton
    # kernels: opt-in, for comparison; compiling costs seconds of every fresh process.
    torch_compile: bool = False
    # On CUDA, a start that meets a Triton kernel missing from the disk cache (a fresh machine) compiles the start's
    # kernels in parallel processes first (batchgen/worker/compile_ahead.py) instead of one by one at first launch
    parallel_compile: bool = True
    enable_prefix_caching: bool = True  # reuse the KV of cached full blocks of earlier prompts (vLLM v1's default)
    # Triton decode steps whose rows all start with the same KV blocks read that shared prefix once for the batch
    cascade_attention: bool = True
    seed: int = 0
    logprobs_mode: str = "raw_logprobs"  # raw_logprobs | processed_logprobs (after penalties, temperature, filters)
    data_parallel_size: int = 1  # N > 1: start N processes, one shard each on its own GPU (cuda:rank) or the CPU
    # With data parallelism on GPUs: this many ranks share each GPU (rank r on cuda:(r // ranks_per_gpu)), each with
    # gpu_memory_utilization / ranks_per_gpu of it. For a small model whose job is bound by one process's Python (many
    # short rows), as several engines keep one GPU busier than one can
    ranks_per_gpu: int = 1
    # N > 1: split the model over N ranks (processes this one starts, each with its shard on its own GPU, rank r of
    # data-parallel rank d on cuda:(d * N + r)), so that a model larger than one GPU runs
    tensor_parallel_size: int = 1
    # With tensor_parallel_size > 1 on GPUs of one host with peer access: the decode graphs' all-reduces of small
    # tensors write straight into the other ranks' mapped buffers (one kernel) instead of going through NCCL (vLLM's
    # disable_custom_all_reduce, inverted)
    custom_all_reduce: bool = True
    cuda_graph: CudaGraphConfig = field(default_factory=CudaGraphConfig)

    @property
    def cuda_graph_sizes(self) -> tuple[int, ...]:
        """The CUDA-graph buckets, ascending: engine.cuda_graph.capture_sizes, else vLLM's 1, 2, 4, then steps of 8
        up to max_capture_size (default: max_num_seqs, at most MAX_CAPTURE_SIZE)."""
        if self.cuda_graph.capture_sizes:
            return tuple(sorted(set(self.cuda_graph.capture_sizes)))
        limit = min(self.cuda_graph.max_capture_size or self.max_num_seqs, MAX_CAPTURE_SIZE)
        sizes = [s for s in (1, 2, 4) if s <= limit] + list(range(8, limit + 1, 8))
        return tuple(sizes if sizes[-1] == limit else [*sizes, limit])

    @property
    def max_step_rows(self) -> int:  # a step's device buffers hold a CUDA-graph bucket's padding rows too
        return max(self.max_num_seqs, self.cuda_graph_sizes[-1])

    @property
    def admit_rows(self) -> int:
        return self.min_admit_rows or max(1, self.max_num_seqs // 8)

    @property
    def wanted_backlog(self) -> int:  # requests kept waiting (two batches): the scheduler always has rows to admit
        return 2 * self.max_num_seqs


@dataclass
class DataConfig:
    path: str = ""  # file or directory
    format: str = "auto"  # auto | jsonl | parquet | arrow | hf_disk | hf
    prompt_field: str = "prompt"
    id_field: str | None = None  # None: the row index (as a string) is the id
    messages_field: str = "messages"  # chat rows, rendered with the tokenizer's chat template
    token_ids_field: str = "prompt_token_ids"  # an optional pre-tokenized prompt
    split: str = "train"  # for hf and hf_disk DatasetDicts
    on_error: str = "fail"  # fail: stop before generating | skip: record the row as an error and go on
    limit: int | None = None  # read only the first N rows
    on_empty: str = "warn"  # an input without rows: warn (and write empty outputs) | fail
    check_model: bool = False  # openai_batch: a line whose body.model is not the loaded model is an error line
    num_shards: int = 1  # K > 1: this run takes only shard shard_index of the rows (see shard_by)
    shard_index: int = 0
    # work: each row, in input order, goes to the shard with the least estimated work so far (prompt tokens +
    # n * max_tokens), so shards finish together | index: row i goes to shard i % num_shards
    shard_by: str = "work"


@dataclass
class JobConfig:
    name: str = "default"
    # Continue the run directory given by hydra.run.dir, skipping finished rows: false | true | force (also when
    # the configuration changed in a way that alters outputs). Any: OmegaConf has no bool-or-str type.
    resume: Any = False
    # Finished rows go to a new part file every flush_rows rows or flush_seconds, whichever comes first (a crash loses
    # only the rows since the last part). Each part costs a Parquet write, two fsyncs and a read when the parts are
    # merged: short rows, which finish thousands a second, are best written in large parts.
    flush_rows: int = 4096
    flush_seconds: float = 10.0
    log_every_seconds: float = 10.0
    progress: bool = True
    # auto: openai_batch for OpenAI Batch input, else parquet. openai_batch adds results.jsonl to the Parquet files.
    output_format: str = "auto"
    profile_steps: int = 0  # >0: kernel timelines of this many decode steps (and a prefill) in kernels.parquet
    # generate: completions | score: log-likelihoods of continuations given contexts | embed: pooled embeddings |
    # classify: a sequence-classification (or reward) model's label probabilities
    task: str = "generate"


@dataclass
class RunnerConfig:
    name: str = "local"  # local (this process; torchrun ranks) | ray (Ray Data actors, one engine each)
    num_replicas: int = 1  # ray: the number of actors
    batch_size: int = 256  # ray: rows per map_batches call
    # ray: rows the driver hands Ray at once. Each window starts its actors (engines) anew: larger windows load the
    # model less often and hold more prompts in memory.
    window_rows: int = 32768


@dataclass
class Config:
    job: JobConfig = field(default_factory=JobConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sampling: SamplingParams = field(default_factory=SamplingParams)  # job-wide defaults; rows may override
    runner: RunnerConfig = field(default_factory=RunnerConfig)


def _require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} is invalid: {allowed}")


def _one_of(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    _require(value in allowed, key, value, f"allowed values are {', '.join(allowed)}")


def _positive(key: str, value: int | None, optional: bool = False) -> None:
    if optional and value is None:
        return
    _require(isinstance(value, int) and value > 0, key, value, "must be a positive integer")


def validate_model(model: ModelConfig) -> None:
    _one_of("model.load_format", model.load_format, LOAD_FORMATS)
    _one_of("model.dtype", model.dtype, DTYPES)
    if model.pooling is not None:
        _one_of("model.pooling", model.pooling, POOLING_METHODS)
    if model.quantization is not None:
        _one_of("model.quantization", model.quantization, QUANTIZATIONS)
    _require(isinstance(model.normalize, bool), "model.normalize", model.normalize, "must be true or false")
    _one_of("model.impl", model.impl, MODEL_IMPLS)
    if model.load_format == "dummy":
        _require(model.path is not None or model.hf_config is not None, "model.hf_config", None,
                 "dummy weights need model.path (a config.json) or model.hf_config")
    else:
        _require(bool(model.path), "model.path", model.path,
                 "set it to a Hugging Face checkpoint directory or a GGUF file")
        _require(os.path.isdir(model.path) or (os.path.isfile(model.path) and model.path.endswith(GGUF_SUFFIX))
                 or is_hub_id(model.path), "model.path", model.path,
                 "no such directory or GGUF file, nor a Hugging Face Hub id (org/name or org/name@revision)")
    if is_gguf_path(model.path):
        _require(model.impl != "transformers", "model.impl", model.impl,
                 "a GGUF file runs on batchgen's native modules only (model.impl=auto or native)")
        try:
            validate_gguf(model.path, own_tokenizer=model.tokenizer is None)
        except UnsupportedGGUF as error:
            raise ConfigError(f"model.path: {error}") from None
    if model.tokenizer is not None:
        _require(os.path.isdir(model.tokenizer) or is_hub_id(model.tokenizer), "model.tokenizer", model.tokenizer,
                 "no such directory, nor a Hugging Face Hub id")


def validate_engine(engine: EngineConfig) -> None:
    _one_of("engine.device", engine.device, DEVICES)
    _one_of("engine.attention_backend", engine.attention_backend, ATTENTION_BACKENDS)
    _one_of("engine.kv_cache_dtype", engine.kv_cache_dtype, KV_CACHE_DTYPES)
    _one_of("engine.logprobs_mode", engine.logprobs_mode, LOGPROBS_MODES)
    _positive("engine.max_num_seqs", engine.max_num_seqs)
    _positive("engine.max_num_batched_tokens", engine.max_num_batched_tokens, optional=True)
    _positive("engine.max_model_len", engine.max_model_len, optional=True)
    _positive("engine.num_gpu_blocks_override", engine.num_gpu_blocks_override, optional=True)
    _positive("engine.cpu_threads", engine.cpu_threads, optional=True)
    _positive("engine.data_parallel_size", engine.data_parallel_size)
    _positive("engine.tensor_parallel_size", engine.tensor_parallel_size)
    _positive("engine.ranks_per_gpu", engine.ranks_per_gpu)
    _require(engine.ranks_per_gpu == 1 or engine.tensor_parallel_size == 1, "engine.ranks_per_gpu",
             engine.ranks_per_gpu, "ranks share a GPU only without tensor parallelism (engine.tensor_parallel_size=1)")
    _positive("engine.min_admit_rows", engine.min_admit_rows, optional=True)
    bs = engine.block_size
    _require(isinstance(bs, int) and bs > 0 and bs & (bs - 1) == 0, "engine.block_size", bs,
             "must be a power of two")
    _require(0 < engine.gpu_memory_utilization <= 1, "engine.gpu_memory_utilization",
             engine.gpu_memory_utilization, "must be in (0, 1]")
    _require(engine.cpu_kv_cache_space_gib > 0, "engine.cpu_kv_cache_space_gib", engine.cpu_kv_cache_space_gib,
             "must be positive")
    sizes = engine.cuda_graph.capture_sizes
    if sizes is not None:
        _require(len(sizes) > 0 and all(isinstance(s, int) and s > 0 for s in sizes),
                 "engine.cuda_graph.capture_sizes", sizes, "must be a non-empty list of positive integers")
    _positive("engine.cuda_graph.max_capture_size", engine.cuda_graph.max_capture_size, optional=True)


def validate_data(data: DataConfig) -> None:
    _one_of("data.format", data.format, DATA_FORMATS)
    _one_of("data.on_error", data.on_error, ERROR_POLICIES)
    _one_of("data.on_empty", data.on_empty, EMPTY_POLICIES)
    _require(bool(data.path), "data.path", data.path, "set it to a prompts file or dataset directory")
    _require(os.path.exists(data.path), "data.path", data.path, "no such file or directory")
    _require(bool(data.prompt_field), "data.prompt_field", data.prompt_field, "must be a field name")
    _positive("data.limit", data.limit, optional=True)
    _positive("data.num_shards", data.num_shards)
    _one_of("data.shard_by", data.shard_by, SHARD_BY)
    _require(isinstance(data.shard_index, int) and 0 <= data.shard_index < data.num_shards, "data.shard_index",
             data.shard_index, f"must be in [0, data.num_shards={data.num_shards})")


def validate_job(job: JobConfig) -> None:
    if isinstance(job.resume, str) and job.resume.lower() in ("true", "false"):
        job.resume = job.resume.lower() == "true"
    _require(isinstance(job.resume, bool) or job.resume == "force", "job.resume", job.resume,
             "allowed values are false, true, force")
    _positive("job.flush_rows", job.flush_rows)
    _one_of("job.output_format", job.output_format, OUTPUT_FORMATS)
    _one_of("job.task", job.task, TASKS)
    _require(job.flush_seconds > 0, "job.flush_seconds", job.flush_seconds, "must be positive")
    _require(job.log_every_seconds > 0, "job.log_every_seconds", job.log_every_seconds, "must be positive")
    _require(isinstance(job.profile_steps, int) and job.profile_steps >= 0, "job.profile_steps", job.profile_steps,
             "must be a non-negative integer")


def validate_runner(config: Config) -> None:
    runner = config.runner
    _one_of("runner.name", runner.name, RUNNERS)
    _positive("runner.num_replicas", runner.num_replicas)
    _positive("runner.batch_size", runner.batch_size)
    _positive("runner.window_rows", runner.window_rows)
    parallel = [key for key, on in (("engine.data_parallel_size", config.engine.data_parallel_size > 1),
                                    ("data.num_shards", config.data.num_shards > 1),
                                    ("runner.name=ray", runner.name == "ray")) if on]
    _require(len(parallel) <= 1, parallel[-1] if parallel else "runner", None,
             f"choose one way to split the rows, not {' and '.join(parallel)}")
    _require(runner.name == "local" or config.job.task == "generate", "job.task", config.job.task,
             "runner=ray runs job.task=generate only; score, embed and classify run with runner=local")
    _require(runner.name == "local" or config.engine.tensor_parallel_size == 1, "engine.tensor_parallel_size",
             config.engine.tensor_parallel_size, "runner=ray runs one GPU an actor; tensor parallelism runs with "
             "runner=local")


def validate(config: Config) -> Config:
    validate_job(config.job)
    validate_data(config.data)
    validate_engine(config.engine)
    validate_model(config.model)
    validate_runner(config)
    return config
