"""What a resumed run may change: the configuration a run started with is kept in its directory, and a resume
whose configuration differs in any key that alters outputs is refused, naming the keys.

OUTPUT_NEUTRAL_KEYS is the one allow-list. Any other key, including every key added later, counts as altering
outputs until it is listed here.
"""

from __future__ import annotations

import json
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from batchgen.config import ConfigError
from batchgen.io.schema import read_metadata
from batchgen.io.writers import CompletionWriter, write_json_atomic

RUN_CONFIG_FILE = "config.json"

# Keys whose value changes how fast or how often things happen, never which rows are written or what they hold.
# A trailing ".*" covers a whole group.
OUTPUT_NEUTRAL_KEYS = (
    "job.name",
    "job.resume",
    "job.flush_rows",
    "job.flush_seconds",
    "job.log_every_seconds",
    "job.progress",
    "job.profile_steps",
    "engine.device",
    "engine.max_num_seqs",
    "engine.max_num_batched_tokens",
    "engine.enforce_eager",
    "engine.async_scheduling",
    "engine.mixed_prefill_decode",
    "engine.min_admit_rows",
    "engine.cuda_graph.*",
    "engine.gpu_memory_utilization",
    "engine.num_gpu_blocks_override",
    "engine.cpu_kv_cache_space_gib",
    "engine.cpu_threads",
    "engine.torch_compile",
    "engine.parallel_compile",
    "engine.attention_backend",
    "model.impl",  # the same model on other modules and kernels, as engine.attention_backend (docs/models.md)
    "engine.enable_prefix_caching",
    "engine.cascade_attention",
    "engine.data_parallel_size",
    "engine.ranks_per_gpu",
    "engine.tensor_parallel_size",  # the same model split over GPUs: sums in another order, as another kernel's
    "engine.custom_all_reduce",  # the ranks' partial sums added in another order
    "runner.*",
)


def flatten(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists and scalars are leaves."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def alters_outputs(key: str) -> bool:
    return not any(fnmatchcase(key, pattern) for pattern in OUTPUT_NEUTRAL_KEYS)


def output_differences(started: dict[str, Any], current: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{dotted key: (started value, current value)} for each output-altering key that differs; a key present in
    only one of them (a key added since) differs unless it is neutral."""
    before, after = flatten(started), flatten(current)
    missing = object()
    differences = {}
    for key in sorted(before.keys() | after.keys()):
        old, new = before.get(key, missing), after.get(key, missing)
        if old != new and alters_outputs(key):
            differences[key] = (None if old is missing else old, None if new is missing else new)
    return differences


def started_config(run_dir: Path) -> dict[str, Any] | None:
    """The configuration the run in `run_dir` started with: its config.json, else (a run from before config.json)
    the config in its completions' Parquet metadata; None for a run that has not started."""
    stored = run_dir / RUN_CONFIG_FILE
    if stored.exists():
        return json.loads(stored.read_text())["config"]
    final = run_dir / CompletionWriter.FILE_NAME
    parts = sorted((run_dir / "completions.parts").glob("part-*.parquet"))
    for path in [final, *parts]:
        if path.exists():
            return read_metadata(path).get("config")
    return None


def check_resume(run_dir: Path, config: dict[str, Any], resume: bool | str) -> dict[str, Any] | None:
    """Records `config` at a run's first start; on a resume compares it with the started one. Raises ConfigError
    naming every differing key unless `resume` is "force"; returns what a forced resume overrode (None if nothing):
    {"started_config": ..., "differences": {key: [started, current]}}."""
    started = started_config(run_dir)
    if started is None:
        run_dir.mkdir(parents=True, exist_ok=True)  # Hydra makes it; the Python API and tests may not
        write_json_atomic(run_dir / RUN_CONFIG_FILE, {"config": config})
        return None
    differences = output_differences(started, config)
    if not differences:
        return None
    listed = ", ".join(f"{key}: {old!r} -> {new!r}" for key, (old, new) in differences.items())
    if resume != "force":
        raise ConfigError(
            f"{run_dir} was started with another configuration, and these keys change outputs: {listed}. "
            "Resume with the values it started with, use a new run directory, or pass job.resume=force to mix "
            "outputs of both configurations"
        )
    return {"started_config": started, "differences": {key: list(pair) for key, pair in differences.items()}}
