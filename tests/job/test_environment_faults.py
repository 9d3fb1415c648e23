"""Faults of the machine around the job, in real subprocesses: a checkpoint directory batchgen cannot load, a second
job on a run directory, an output directory that cannot be written, a full disk. Each is one line naming the path or
key, with the exit code docs/reliability.md gives, and leaves nothing a rerun or a resume trips over."""

from __future__ import annotations

import ctypes
import errno
import io
import json
import os
import resource
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
from batchgen.io.atomic import LOCK_FILE, DirectoryInUse, DirectoryLock, write_atomically
from batchgen.job.exits import EXIT_BAD_CONFIG_OR_INPUT, EXIT_ENVIRONMENT, remove_unstarted_run_dir
from batchgen.models.hf_config import ARCHITECTURES, SAFETENSORS_INDEX, check_checkpoint

REPO = Path(__file__).resolve().parents[2]
SHAKESPEARE_MODEL = REPO / "jobs" / "shakespeare" / "model"
TIMING_COLUMNS = ["ttft_ms", "tpot_ms", "latency_ms"]
SMALL_JOB = ["job=shakespeare", "preset=smoke_test", "data.limit=2"]
PR_CAPBSET_DROP = 24
CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH = 1, 2


def batchgen(run_dir: Path, *overrides: str, wait: bool = True, preexec_fn=None
             ) -> subprocess.CompletedProcess | subprocess.Popen:
    command = [sys.executable, "-m", "batchgen", f"hydra.run.dir={run_dir}", "engine.device=cpu",
               "job.progress=false", *overrides]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if not wait:
        return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
                          preexec_fn=preexec_fn)


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
    weights = (SHAKESPEARE_MODEL / "model.safetensors").read_bytes()
    if kind == "truncated":  # an interrupted download
        (directory / "model.safetensors").write_bytes(weights[:-1000])
    if kind == "lfs_pointer":  # a clone without git-lfs
        (directory / "model.safetensors").write_text(
            f"version https://git-lfs.github.com/spec/v1\noid sha256:{'0' * 64}\nsize {len(weights)}\n")
    if kind == "not_safetensors":
        (directory / "model.safetensors").write_text("<html>rate limited</html>")
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize(("kind", "named"), [
    ("empty", "no config.json"),
    ("config_only", "no model.safetensors or model.safetensors.index.json"),
    ("bert", "architecture BertModel is not supported"),
    ("truncated", "model.safetensors is incomplete"),
    ("lfs_pointer", "model.safetensors is a Git LFS pointer"),
    ("not_safetensors", "model.safetensors is not a safetensors file"),
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
    # The same checkpoint with a shard cut short: named with its expected size.
    shutil.copy(sharded / shard, broken / shard)
    whole = (broken / shard).read_bytes()
    (broken / shard).write_bytes(whole[:len(whole) // 2])
    with pytest.raises(ConfigError, match=f"{shard} is incomplete, {len(whole) // 2} of its {len(whole)} bytes"):
        check_checkpoint(ModelConfig(path=str(broken)), None)
    # Dummy weights from model.hf_config alone: the model type's defaults (Llama: 2048 positions) apply.
    check_checkpoint(ModelConfig(load_format="dummy", hf_config={"model_type": "llama"}), 2048)
    with pytest.raises(ConfigError, match="engine.max_model_len=4096"):
        check_checkpoint(ModelConfig(load_format="dummy", hf_config={"model_type": "llama"}), 4096)
    with pytest.raises(ConfigError, match="model.hf_config: architecture .*model_type 'bert'"):
        check_checkpoint(ModelConfig(load_format="dummy", hf_config={"model_type": "bert"}), None)


def test_every_architecture_check_checkpoint_accepts_has_a_model_class():
    from batchgen.models.hf_config import CLASSIFIERS, DECODERS
    from batchgen.models.registry import CLASSIFIER_REGISTRY, DECODER_REGISTRY, MODEL_REGISTRY

    assert set(ARCHITECTURES.values()) == set(MODEL_REGISTRY)
    assert set(CLASSIFIERS) == set(CLASSIFIER_REGISTRY)
    assert set(DECODERS) == set(DECODER_REGISTRY)


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


def test_a_failed_write_names_its_file_and_leaves_no_tmp_file(tmp_path):
    target = tmp_path / "part-000003.parquet"

    def fill_the_disk(file: io.BufferedWriter) -> None:
        file.write(b"half a part")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(OSError, match="No space left on device") as raised:
        write_atomically(target, fill_the_disk)
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(target)
    assert list(tmp_path.iterdir()) == []


def without_file_permission_override() -> None:
    """Root writes anywhere, whatever the mode bits; without these capabilities (dropped before exec) root too
    is refused by a read-only directory, as any other user is."""
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
        if libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory no process of the test may write in, and what a child process must run under to be bound by
    it (root must shed its capabilities to be)."""
    directory = tmp_path / "read-only"
    directory.mkdir()
    directory.chmod(0o555)
    preexec_fn = without_file_permission_override if os.geteuid() == 0 else None
    if preexec_fn is not None:
        probe = subprocess.run(["touch", str(directory / "probe")], preexec_fn=preexec_fn, capture_output=True)
        if probe.returncode == 0:
            pytest.skip("this root cannot shed CAP_DAC_OVERRIDE, so no directory is read-only to it")
    yield directory, preexec_fn
    directory.chmod(0o755)


@pytest.mark.parametrize("where", ["the run dir itself", "a run dir to be made in it"])
def test_a_read_only_output_dir_is_one_line_and_exit_3(read_only_dir, where):
    directory, preexec_fn = read_only_dir
    run_dir = directory if where == "the run dir itself" else directory / "run"
    result = batchgen(run_dir, *SMALL_JOB, preexec_fn=preexec_fn)
    assert result.returncode == EXIT_ENVIRONMENT
    assert_one_line(result, f"hydra.run.dir={run_dir} cannot be written: Permission denied (EACCES): {run_dir}")
    assert list(directory.iterdir()) == []


def test_an_output_path_through_a_file_is_a_configuration_error(tmp_path):
    (tmp_path / "a-file").write_text("")
    result = batchgen(tmp_path / "a-file" / "run", *SMALL_JOB)
    assert result.returncode == EXIT_BAD_CONFIG_OR_INPUT
    assert_one_line(result, f"hydra.run.dir={tmp_path / 'a-file' / 'run'} cannot be written", "ENOTDIR")


def part_size(completions: Path, rows: slice) -> int:
    """The size of a part file holding these rows of a finished run's completions (same schema and metadata)."""
    table = pq.read_table(completions)
    buffer = io.BytesIO()
    pq.write_table(table.slice(rows.start, rows.stop - rows.start), buffer)
    return len(buffer.getvalue())


def test_a_full_disk_keeps_the_flushed_rows_and_the_resume_gives_the_uninterrupted_rows(tmp_path):
    """The disk fills while rows are written: a file-size limit on the job's process (RLIMIT_FSIZE, with SIGXFSZ
    ignored, so that a write beyond it fails with EFBIG as a write to a full disk fails with ENOSPC) that the
    parts of 4 short rows fit under and the parts of 4 long rows do not."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": "ROMEO:", "max_tokens": 4 if row < 8 else 200}) + "\n"
                               for row in range(16)))
    overrides = ["job=shakespeare", f"data.path={prompts}", "data.id_field=null", "engine.max_num_seqs=4",
                 "job.flush_rows=4", "job.flush_seconds=3600"]  # parts of 4 rows, in the order the rows finish
    reference = batchgen(tmp_path / "reference", *overrides)
    assert reference.returncode == 0, reference.stdout + reference.stderr
    reference_completions = tmp_path / "reference" / "completions.parquet"
    short_part, long_part = part_size(reference_completions, slice(0, 4)), part_size(reference_completions,
                                                                                       slice(8, 12))
    assert short_part < long_part
    limit = (short_part + long_part) // 2

    def full_disk() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    run_dir = tmp_path / "full"
    result = batchgen(run_dir, *overrides, preexec_fn=full_disk)
    assert result.returncode == EXIT_ENVIRONMENT, result.stdout + result.stderr
    line = assert_one_line(result, f"File too large (EFBIG): {run_dir / 'completions.parts'}")
    assert line.endswith(f"resume with: python -m batchgen engine.device=cpu job.progress=false {' '.join(overrides)} "
                         f"hydra.run.dir={run_dir} job.resume=true")
    assert not list(run_dir.rglob("*.tmp"))
    kept = pq.read_table(run_dir / "completions.parts").column("index").to_pylist()
    assert sorted(kept) == list(range(8))  # the short rows' two parts

    resumed = batchgen(run_dir, *overrides, "job.resume=true")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert (pq.read_table(run_dir / "completions.parquet").drop_columns(TIMING_COLUMNS).to_pylist()
            == pq.read_table(reference_completions).drop_columns(TIMING_COLUMNS).to_pylist())
    assert json.loads((run_dir / "summary.json").read_text())["this_attempt"]["rows"] == 8
