"""Hydra composition of every job and preset, and a clear error (naming the key) for each bad value."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_dir

from batchgen.cli.main import CONF_DIR, to_config
from batchgen.config import Config, ConfigError, EngineConfig
from batchgen.core.block_manager import BlockManager
from batchgen.core.request import Request
from batchgen.core.scheduler import Scheduler
from batchgen.engine.model_worker import resolve_engine_config
from batchgen.sample.params import SamplingParams

JOBS = sorted(p.stem for p in (CONF_DIR / "job").glob("*.yaml"))
PRESETS = sorted(p.stem for p in (CONF_DIR / "preset").glob("*.yaml"))
MODELS = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))


def composed(*overrides: str) -> Config:
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        return to_config(compose("config", overrides=list(overrides)))


@pytest.mark.parametrize("job", [j for j in JOBS if j != "default"])
def test_every_job_composes_and_validates(job):
    config = composed(f"job={job}")
    assert config.job.name == job


def test_kv_cache_dtype_defaults_to_the_model_dtype_and_takes_fp8():
    assert composed("job=shakespeare").engine.kv_cache_dtype == "auto"
    assert composed("job=shakespeare", "engine.kv_cache_dtype=fp8").engine.kv_cache_dtype == "fp8"


def test_quantization_defaults_to_none_and_takes_fp8():
    assert composed("job=shakespeare").model.quantization is None
    assert composed("job=shakespeare", "model.quantization=fp8").model.quantization == "fp8"
    with pytest.raises(ConfigError, match="model.quantization='awq' is invalid: allowed values are fp8"):
        composed("job=shakespeare", "model.quantization=awq")


def test_parallel_compile_defaults_to_on_and_turns_off():
    assert composed("job=shakespeare").engine.parallel_compile is True
    assert composed("job=shakespeare", "engine.parallel_compile=false").engine.parallel_compile is False


def test_engine_options_compose_into_a_frozen_engine_config():
    engine = composed("job=shakespeare", "engine.max_num_seqs=4", "engine.cuda_graph.capture_sizes=[2,1]").engine
    assert (engine.max_num_seqs, engine.cuda_graph_sizes, engine.wanted_backlog) == (4, (1, 2), 8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        engine.max_num_seqs = 8  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        engine.cuda_graph.capture_sizes = None  # type: ignore[misc]


def test_engine_config_is_resolved_for_the_model_and_device():
    model, cpu = SimpleNamespace(max_position_embeddings=128), torch.device("cpu")
    resolved = resolve_engine_config(EngineConfig(), model, cpu)
    assert (resolved.max_model_len, resolved.attention_backend) == (128, "torch")
    assert resolve_engine_config(EngineConfig(max_model_len=64), model, cpu).max_model_len == 64
    with pytest.raises(ValueError, match="engine.max_model_len=256 is invalid"):
        resolve_engine_config(EngineConfig(max_model_len=256), model, cpu)
    with pytest.raises(ValueError, match="engine.attention_backend='triton' needs a CUDA device"):
        resolve_engine_config(EngineConfig(attention_backend="triton"), model, cpu)
    # A config that names no positions (some architectures on the generic path) needs engine.max_model_len.
    with pytest.raises(ValueError, match="engine.max_model_len is not set and the model's config names no"):
        resolve_engine_config(EngineConfig(), SimpleNamespace(), cpu)
    assert resolve_engine_config(EngineConfig(max_model_len=32), SimpleNamespace(), cpu).max_model_len == 32


def test_one_prefill_step_of_the_shakespeare_job_admits_a_full_batch_of_short_rows():
    # Many short rows (real_jobs' many_rows): the token budget must not split their admission over several steps.
    engine = composed("job=shakespeare", "engine.max_num_seqs=512").engine
    resolved = resolve_engine_config(engine, SimpleNamespace(max_position_embeddings=256), torch.device("cpu"))
    scheduler = Scheduler(resolved, BlockManager(num_blocks=4096, block_size=resolved.block_size))
    for request_id in range(1024):  # 32-token prompts, each its own (no prefix shared)
        prompt = [request_id % 60, request_id // 60, *[1] * 30]
        scheduler.add_request(Request(request_id, prompt, SamplingParams(max_tokens=16)))
    step = scheduler.schedule()
    assert (step.kind, step.num_seqs) == ("prefill", 512)


def test_default_job_asks_for_data_and_model():
    with pytest.raises(ConfigError, match="data.path"):
        composed()


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_composes(preset):
    config = composed("job=shakespeare", f"preset={preset}")
    assert config.sampling.temperature == 0 and config.sampling.ignore_eos
    assert config.sampling.truncate_prompt_tokens > 0 and config.sampling.max_tokens > 0


def test_presets_reproduce_the_post_configurations():
    expected = {"smoke_test": (4, 8), "medium_generation": (8, 32), "long_generation": (8, 48),
                "heavy_prompt": (32, 16), "near_context_limit": (4, 56),
                **{f"gen_length_{n}": (8, n) for n in range(8, 57, 8)}}  # the post's generation-length sweep
    assert set(PRESETS) == set(expected)
    for preset, (prompt_tokens, new_tokens) in expected.items():
        sampling = composed("job=shakespeare", f"preset={preset}").sampling
        assert (sampling.truncate_prompt_tokens, sampling.max_tokens) == (prompt_tokens, new_tokens)


def test_sweeps_name_existing_presets_and_keys():
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        seed = compose("config", overrides=["job=shakespeare", "+sweep=seed_table"], return_hydra_config=True)
        batch = compose("config", overrides=["job=shakespeare", "+sweep=batch_size"], return_hydra_config=True)
    params = seed.hydra.sweeper.params
    assert set(params["preset"].split(",")) == set(PRESETS)
    assert params["engine.enforce_eager"] == "true,false"
    assert batch.hydra.sweeper.params["engine.max_num_seqs"] == "1,4,16,64,256"


@pytest.mark.parametrize("model", [m for m in MODELS if m != "custom"])
def test_model_configs_compose(model):
    config = composed("job=shakespeare", f"model={model}")
    assert config.model.path or config.model.hf_config


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("data.format=xml", "data.format"),
        ("data.on_error=ignore", "data.on_error"),
        ("data.path=/no/such/prompts.jsonl", "data.path"),
        ("sampling.max_tokens=0", "sampling.max_tokens"),
        ("sampling.max_tokens=-3", "sampling.max_tokens"),
        ("sampling.temperature=-0.5", "sampling.temperature"),
        ("sampling.top_p=0", "sampling.top_p"),
        ("sampling.top_p=1.5", "sampling.top_p"),
        ("sampling.min_p=2", "sampling.min_p"),
        ("engine.block_size=12", "engine.block_size"),
        ("engine.cuda_graph.capture_sizes=[1,0,8]", "engine.cuda_graph.capture_sizes"),
        ("engine.cuda_graph.max_capture_size=-1", "engine.cuda_graph.max_capture_size"),
        ("engine.max_num_seqs=0", "engine.max_num_seqs"),
        ("engine.gpu_memory_utilization=1.5", "engine.gpu_memory_utilization"),
        ("engine.device=tpu", "engine.device"),
        ("engine.attention_backend=flash", "engine.attention_backend"),
        ("engine.kv_cache_dtype=int8", "engine.kv_cache_dtype"),
        ("model.dtype=int8", "model.dtype"),
        ("model.load_format=gguf", "model.load_format"),
        ("model.path=/no/such/model", "model.path"),
        ("job.flush_rows=0", "job.flush_rows"),
        ("engine.cpu_threads=0", "engine.cpu_threads"),
        ("job.task=summarize", "job.task"),
        ("model.pooling=max", "model.pooling"),
        ("model.quantization=int4", "model.quantization"),
    ],
)
def test_invalid_values_name_the_key(override, key):
    with pytest.raises(ConfigError) as error:
        composed("job=shakespeare", override)
    assert key in str(error.value)


def test_only_the_local_runner_runs_tasks_other_than_generate():
    with pytest.raises(ConfigError, match="job.task"):
        composed("job=shakespeare", "job.task=embed", "runner=ray")


def test_wrong_type_names_the_key():
    with pytest.raises(Exception, match="engine.block_size"):
        composed("job=shakespeare", "engine.block_size=big")
