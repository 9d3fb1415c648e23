"""Faults of the machine around the job, in real subprocesses: a checkpoint directory batchgen cannot load. Each is
one line naming the path or key, with a documented exit code, and leaves nothing a rerun or a resume trips over."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchgen.config import ConfigError, ModelConfig
from batchgen.exits import EXIT_BAD_CONFIG_OR_INPUT
from batchgen.models.hf_config import ARCHITECTURES, SAFETENSORS_INDEX, check_checkpoint

REPO = Path(__file__).resolve().parent.parent
SHAKESPEARE_MODEL = REPO / "jobs" / "shakespeare" / "model"
SMALL_JOB = ["job=shakespeare", "preset=smoke_test", "data.limit=2"]


def batchgen(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "batchgen", f"hydra.run.dir={run_dir}", "engine.device=cpu",
               "job.progress=false", *overrides]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)


def assert_one_line(result: subprocess.CompletedProcess, *expected: str) -> str:
    """The one line of `result`'s output that says what went wrong (it names each of `expected`); no traceback."""
    output = result.stdout + result.stderr
    assert "Traceback" not in output, output
    lines = [line for line in output.splitlines() if all(text in line for text in expected)]
    assert len(lines) == 1, output
    assert len([line for line in output.splitlines() if "ERROR" in line or "Error" in line]) <= 1, output
    return lines[0]


def model_dir(tmp_path: Path, kind: str) -> Path:
    """A checkpoint directory the loader cannot load, of the given kind."""
    directory = tmp_path / kind
    if kind == "missing":
        return directory
    directory.mkdir()
    if kind == "empty":
        return directory
    config = json.loads((SHAKESPEARE_MODEL / "config.json").read_text())
    if kind == "bert":
        config.update(architectures=["BertModel"], model_type="bert")
        shutil.copy(SHAKESPEARE_MODEL / "model.safetensors", directory)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize(("kind", "named"), [
    ("empty", "no config.json"),
    ("config_only", "no model.safetensors or model.safetensors.index.json"),
    ("bert", "architecture BertModel is not supported"),
    ("missing", "no such directory"),
])
def test_a_bad_model_directory_is_a_configuration_error_that_leaves_no_run_dir(tmp_path, kind, named):
    directory = model_dir(tmp_path, kind)
    run_dir = tmp_path / "run"
    result = batchgen(run_dir, *SMALL_JOB, f"model.path={directory}")
    assert result.returncode == EXIT_BAD_CONFIG_OR_INPUT
    assert_one_line(result, "model.path", str(directory), named)
    assert not run_dir.exists()


def test_an_impossible_max_model_len_leaves_nothing_and_the_corrected_rerun_runs(tmp_path):
    run_dir = tmp_path / "run"
    result = batchgen(run_dir, *SMALL_JOB, "engine.max_model_len=1000000")
    assert result.returncode == EXIT_BAD_CONFIG_OR_INPUT
    assert_one_line(result, "engine.max_model_len=1000000", "at most 256 positions")
    assert not run_dir.exists()
    corrected = batchgen(run_dir, *SMALL_JOB, "engine.max_model_len=128")
    assert corrected.returncode == 0, corrected.stdout + corrected.stderr
    assert pq.read_table(run_dir / "completions.parquet").num_rows == 2


def test_check_checkpoint_reads_files_only(tmp_path, tiny_model_dir):
    sharded = tiny_model_dir("LlamaForCausalLM", sharded=True)
    check_checkpoint(ModelConfig(path=str(sharded)), 256)
    with pytest.raises(ConfigError, match="at most 256 positions"):
        check_checkpoint(ModelConfig(path=str(sharded)), 257)
    # The same checkpoint with one of its weight files gone.
    broken = tmp_path / "broken"
    shutil.copytree(sharded, broken)
    shard = sorted(set(json.loads((broken / SAFETENSORS_INDEX).read_text())["weight_map"].values()))[-1]
    (broken / shard).unlink()
    with pytest.raises(ConfigError, match=f"model.path={broken}: .* missing: {shard}"):
        check_checkpoint(ModelConfig(path=str(broken)), None)
    check_checkpoint(ModelConfig(path=str(broken), load_format="dummy"), None)  # dummy weights need config.json only
    # Dummy weights from model.hf_config alone: the model type's defaults (Llama: 2048 positions) apply.
    check_checkpoint(ModelConfig(load_format="dummy", hf_config={"model_type": "llama"}), 2048)
    with pytest.raises(ConfigError, match="engine.max_model_len=4096"):
        check_checkpoint(ModelConfig(load_format="dummy", hf_config={"model_type": "llama"}), 4096)
    with pytest.raises(ConfigError, match="model.hf_config: architecture .*model_type 'bert'"):
        check_checkpoint(ModelConfig(load_format="dummy", hf_config={"model_type": "bert"}), None)


def test_every_architecture_check_checkpoint_accepts_has_a_model_class():
    from batchgen.models.registry import MODEL_REGISTRY

    assert set(ARCHITECTURES.values()) == set(MODEL_REGISTRY)
