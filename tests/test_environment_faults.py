"""Faults of the machine around the job, in real subprocesses: a checkpoint directory batchgen cannot load, a second
job on a run directory. Each is one line naming the path or key, with a documented exit code, and leaves nothing a
rerun or a resume trips over."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchgen.config import ConfigError, ModelConfig
from batchgen.exits import EXIT_BAD_CONFIG_OR_INPUT, remove_unstarted_run_dir
from batchgen.io.atomic import LOCK_FILE, DirectoryInUse, DirectoryLock
from batchgen.models.hf_config import ARCHITECTURES, SAFETENSORS_INDEX, check_checkpoint

REPO = Path(__file__).resolve().parent.parent
SHAKESPEARE_MODEL = REPO / "jobs" / "shakespeare" / "model"
SMALL_JOB = ["job=shakespeare", "preset=smoke_test", "data.limit=2"]


def batchgen(run_dir: Path, *overrides: str, wait: bool = True) -> subprocess.CompletedProcess | subprocess.Popen:
    command = [sys.executable, "-m", "batchgen", f"hydra.run.dir={run_dir}", "engine.device=cpu",
               "job.progress=false", *overrides]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if not wait:
        return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


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


def test_a_second_job_on_a_run_dir_exits_2_naming_the_holder(tmp_path):
    """A resume started twice, or a SLURM requeue while the first job still runs: the second stops at once, writing
    nothing, and the first goes on (here: until SIGTERM stops it, flushing its rows)."""
    overrides = ["job=shakespeare", "engine.max_num_seqs=4", "job.flush_rows=1"]  # 600 rows, minutes on a CPU
    first = batchgen(tmp_path, *overrides, wait=False)
    try:
        parts = tmp_path / "completions.parts"
        while not any(parts.glob("part-*.parquet")):  # the first job is generating
            assert first.poll() is None, first.stdout.read()
            time.sleep(0.05)
        second = batchgen(tmp_path, *overrides, "job.resume=true")
        assert first.poll() is None, "the first job ended before the second tried: the test proves nothing"
        assert second.returncode == EXIT_BAD_CONFIG_OR_INPUT, second.stdout + second.stderr
        assert_one_line(second, f"{tmp_path} is in use", f"pid {first.pid} on host {socket.gethostname()}")
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=600)
    assert first.returncode == 128 + signal.SIGTERM, first.stdout.read()
    indices = pq.read_table(parts).column("index").to_pylist()
    assert len(indices) == len(set(indices)) > 0  # every row written once: only the first job wrote


def hold_lock_in_child(directory: Path) -> subprocess.Popen:
    code = ("import sys, time\nfrom pathlib import Path\nfrom batchgen.io.atomic import DirectoryLock\n"
            "DirectoryLock(Path(sys.argv[1])).acquire()\nprint('locked', flush=True)\ntime.sleep(600)\n")
    child = subprocess.Popen([sys.executable, "-c", code, str(directory)], cwd=REPO, stdout=subprocess.PIPE,
                             text=True)
    assert child.stdout.readline() == "locked\n"
    return child


def test_the_lock_is_per_directory_and_dies_with_its_holder(tmp_path):
    """A shard locks its own directory, so the shards of one run go on side by side; a kill -9 frees the lock."""
    shard_0, shard_1 = tmp_path / "shard-00000-of-00002", tmp_path / "shard-00001-of-00002"
    holder = hold_lock_in_child(shard_0)
    try:
        with pytest.raises(DirectoryInUse, match=f"{shard_0} is in use by another job \\(pid {holder.pid} on host"):
            DirectoryLock(shard_0).acquire()
        with DirectoryLock(shard_1), DirectoryLock(tmp_path):
            pass
        remove_unstarted_run_dir(shard_0)  # holds only the lock file, but a job holds that: it stays
        assert (shard_0 / LOCK_FILE).exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with DirectoryLock(shard_0):
        pass
    remove_unstarted_run_dir(shard_0)
    assert not shard_0.exists()
