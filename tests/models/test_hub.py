"""Models by Hub id, against a local cache laid out as huggingface_hub's (models--org--name/snapshots/<commit>/...,
refs/<branch or tag>), offline: nothing here reaches the network."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import huggingface_hub
import pyarrow.parquet as pq
import pytest
from huggingface_hub import constants
from huggingface_hub.utils import filter_repo_objects

from batchgen.config import ConfigError, ModelConfig, validate_model
from batchgen.models import hub
from batchgen.models.hub import METADATA_PATTERNS, SINGLE_WEIGHTS, WEIGHT_INDEX, parse_hub_id, resolve_model
from tests.helpers.common import batchgen, write_lines

MAIN, TAGGED = "a" * 40, "b" * 40


def add_snapshot(cache: Path, repo_id: str, checkpoint: Path, commit: str, *refs: str) -> Path:
    """checkpoint's files as the snapshot `commit` of repo_id, which each ref (branch or tag) points to."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(checkpoint, snapshot)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def offline_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hub cache, with huggingface_hub offline (as HF_HUB_CACHE and HF_HUB_OFFLINE=1 set at its import)."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_hub_ids_parse_and_file_paths_do_not() -> None:
    assert parse_hub_id("Qwen/Qwen3-0.6B") == hub.HubId("Qwen/Qwen3-0.6B", None)
    assert parse_hub_id("gpt2@v1.0") == hub.HubId("gpt2", "v1.0")
    assert str(parse_hub_id(f"org/name@{MAIN}")) == f"org/name@{MAIN}"
    for path in ("/models/qwen", "./qwen", "~/qwen", "a/b/c", "org/name@", "org--x/name", "../name"):
        assert parse_hub_id(path) is None, path


def test_id_resolves_to_its_cached_snapshot(offline_cache: Path, tiny_model_dir: Callable[..., Path]) -> None:
    snapshot = add_snapshot(offline_cache, "org/tiny", tiny_model_dir("LlamaForCausalLM"), MAIN, "main")
    model = ModelConfig(path="org/tiny", impl="native")
    validate_model(model)  # an id passes validation before it is resolved
    resolved = resolve_model(model)
    assert Path(resolved.path) == snapshot
    assert resolved.served_model_name == "org/tiny"  # not the snapshot directory's commit hash
    assert resolved.impl == "native" and resolved.tokenizer is None


def test_revision_picks_a_tag_or_a_commit(offline_cache: Path, tiny_model_dir: Callable[..., Path]) -> None:
    main = add_snapshot(offline_cache, "org/tiny", tiny_model_dir("LlamaForCausalLM"), MAIN, "main")
    tagged = add_snapshot(offline_cache, "org/tiny", tiny_model_dir("GPT2LMHeadModel"), TAGGED, "v1")
    assert Path(resolve_model(ModelConfig(path="org/tiny@v1")).path) == tagged
    assert Path(resolve_model(ModelConfig(path=f"org/tiny@{MAIN}")).path) == main
    assert resolve_model(ModelConfig(path="org/tiny@v1")).served_model_name == "org/tiny"


def test_a_cache_miss_offline_is_one_line_naming_model_path(offline_cache: Path,
                                                           tiny_model_dir: Callable[..., Path]) -> None:
    with pytest.raises(ConfigError) as error:
        resolve_model(ModelConfig(path="org/missing"))
    message = str(error.value)
    assert message.startswith("model.path=org/missing: no such local directory, and org/missing is not in the "
                              f"Hugging Face cache {offline_cache}")
    assert "HF_HUB_OFFLINE=1" in message and "\n" not in message
    add_snapshot(offline_cache, "org/tiny", tiny_model_dir("LlamaForCausalLM"), MAIN, "main")
    with pytest.raises(ConfigError, match="^model.path=org/tiny@v2: no such local directory, and org/tiny@v2 is not"):
        resolve_model(ModelConfig(path="org/tiny@v2"))


def test_a_local_directory_wins_over_the_id(offline_cache: Path, tiny_model_dir: Callable[..., Path],
                                           tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    add_snapshot(offline_cache, "org/tiny", tiny_model_dir("LlamaForCausalLM"), MAIN, "main")
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_model_dir("GPT2LMHeadModel"), tmp_path / "org" / "tiny")
    model = ModelConfig(path="org/tiny")
    assert resolve_model(model) == model


def test_downloads_only_what_the_loader_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """First the config, tokenizer and weights index; then the shards the index names, at the same commit."""
    snapshot = tmp_path / "snapshots" / MAIN
    snapshot.mkdir(parents=True)
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    (snapshot / WEIGHT_INDEX).write_text(json.dumps({"weight_map": {"a": shards[0], "b": shards[1], "c": shards[0]}}))
    calls = []

    def snapshot_download(repo_id: str, revision: str | None, allow_patterns: list[str],
                          local_files_only: bool) -> str:
        calls.append((repo_id, revision, allow_patterns))
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert resolve_model(ModelConfig(path="org/sharded@v1")).path == str(snapshot)
    assert calls == [("org/sharded", "v1", [*METADATA_PATTERNS, WEIGHT_INDEX, SINGLE_WEIGHTS]),
                     ("org/sharded", MAIN, shards)]
    repo_files = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json", "chat_template.jinja", "model.safetensors", WEIGHT_INDEX, *shards,
                  "pytorch_model.bin", "consolidated.safetensors", "original/consolidated.00.pth", "model.gguf",
                  "README.md", ".gitattributes", "onnx/model.onnx"]
    first = set(filter_repo_objects(repo_files, allow_patterns=calls[0][2]))
    assert first == {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                     "special_tokens_map.json", "chat_template.jinja", "model.safetensors", WEIGHT_INDEX}
    calls.clear()
    resolve_model(ModelConfig(path="org/sharded", load_format="dummy"))  # random weights: no weights downloaded
    assert calls == [("org/sharded", None, METADATA_PATTERNS)]


def test_job_by_hub_id_offline_runs_resumes_and_names_a_miss(tmp_path: Path, tiny_model_dir: Callable[..., Path],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole job through `python -m batchgen` with HF_HOME's cache and HF_HUB_OFFLINE=1: a model without a native
    implementation, by id; the resumed run finds the same snapshot; a miss exits 2 with one line."""
    add_snapshot(tmp_path / "hf" / "hub", "org/neox", tiny_model_dir("GPTNeoXForCausalLM"), MAIN, "main")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    prompts = write_lines(tmp_path / "prompts.jsonl",
                          [json.dumps({"prompt_token_ids": [1 + i, 2, 3]}) for i in range(3)])
    overrides = ["model.path=org/neox", f"data.path={prompts}", "sampling.max_tokens=4"]
    run_dir = tmp_path / "run"
    first = batchgen(run_dir, *overrides)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "GPTNeoXForCausalLM runs on transformers' modules" in first.stdout + first.stderr
    rows = pq.read_table(run_dir / "completions.parquet").to_pylist()
    assert [len(row["output_token_ids"]) for row in rows] == [4, 4, 4]
    again = batchgen(run_dir, *overrides, "job.resume=true")
    assert again.returncode == 0 and "Nothing to do" in again.stdout + again.stderr, again.stdout + again.stderr
    missing = batchgen(tmp_path / "missing", "model.path=org/other", f"data.path={prompts}")
    assert missing.returncode == 2
    errors = [line for line in (missing.stdout + missing.stderr).splitlines() if "model.path=org/other" in line]
    assert len(errors) == 1 and "HF_HUB_OFFLINE=1" in errors[0], missing.stdout + missing.stderr
