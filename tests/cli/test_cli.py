"""The command line as a user meets it: the README's test command, --help and --version, exit codes, unknown keys."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from batchgen.cli.main import CONF_DIR, to_config
from batchgen.config import ConfigError

REPO = Path(__file__).resolve().parents[2]


# The shipped job on two rows, on CPU: what the probes below run through the command line.
SMOKE_JOB = ["job=shakespeare", "preset=smoke_test", "data.limit=2", "engine.device=cpu", "job.progress=false"]


def batchgen(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchgen", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def run_probe(probe: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -c PROBE` from the repository's root."""
    return subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_the_readme_test_command_collects_every_test():
    """`pytest` as written in the README, from the repository root, with a fresh user's environment."""
    pytest_command = shutil.which("pytest")
    if pytest_command is None:
        pytest.skip("no pytest executable on PATH")
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    result = subprocess.run([pytest_command, "--collect-only", "-q", "-p", "no:cacheprovider"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "tests/engine/test_engine_greedy.py" in result.stdout


def test_help_is_batchgens_own():
    result = batchgen("--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"batchgen {version('batchgen')}: ")
    assert "python -m batchgen job=shakespeare" in result.stdout and "Hydra" not in result.stdout.splitlines()[0]
    for group in ("job", "model", "engine", "data", "preset"):
        assert f"  {group} " in result.stdout
    assert "smoke_test" in result.stdout and "qwen3_0_6b" in result.stdout


def test_version_is_batchgens_and_imports_no_torch():
    assert batchgen("--version").stdout.strip() == f"batchgen {version('batchgen')}"
    probe = ("import sys; sys.argv = ['batchgen', '--version']\n"
             "from batchgen.__main__ import main; main()\n"
             "print('torch' in sys.modules, 'hydra' in sys.modules)")
    result = run_probe(probe, timeout=60)
    assert result.stdout.splitlines()[-1] == "False False", result.stdout + result.stderr


def test_console_script_and_python_m_run_the_same_function():
    """pyproject's `batchgen` script and `python -m batchgen` start through one function, so they behave alike."""
    tomllib = pytest.importorskip("tomllib")
    from batchgen.__main__ import main as python_m_main

    target = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]["batchgen"]
    module_name, function_name = target.split(":")
    assert getattr(importlib.import_module(module_name), function_name) is python_m_main
    # The console script as pip writes it.
    script = f"import sys; from {module_name} import {function_name}; sys.exit({function_name}())"
    by_script = subprocess.run([sys.executable, "-c", script, "--version"], cwd=REPO, capture_output=True, text=True,
                               timeout=60)
    by_module = batchgen("--version")
    assert by_script.returncode == by_module.returncode == 0, by_script.stderr + by_module.stderr
    assert by_script.stdout == by_module.stdout == f"batchgen {version('batchgen')}\n"


def test_job_starts_with_the_imported_modules_frozen_out_of_garbage_collection(tmp_path):
    """A full collection over torch's objects takes about 0.2 s, at the engine's close and in Python's own passes."""
    probe = (f"import sys; sys.argv = ['batchgen', 'job=shakespeare', 'hydra.run.dir={tmp_path}']\n"
             "import gc, batchgen.runners.local as local\n"  # the job itself: called after the engine's imports
             "local.run_local = lambda *args: print('frozen objects:', gc.get_freeze_count()) or sys.exit(0)\n"
             "from batchgen.__main__ import main; main()")
    result = run_probe(probe, timeout=120)
    frozen = [line for line in result.stdout.splitlines() if line.startswith("frozen objects:")]
    assert frozen and int(frozen[0].split(":")[1]) > 100_000, result.stdout + result.stderr


def test_a_multiruns_next_job_leaves_what_the_previous_job_imported_collectable(tmp_path):
    """What a job imports stays collectable after the next job of a multirun starts, for a process that ends by
    SystemExit (a failed job), whose interpreter tears down: frozen out of garbage collection, Triton's import-time
    objects outlived the interpreter, and nanobind listed them as leaked."""
    probe = ("import os, sys, types\n"
             f"sys.argv = ['batchgen', '-m', *{SMOKE_JOB!r}, 'engine.seed=1,2', 'hydra.sweep.dir={tmp_path}']\n"
             "import batchgen.runners.local as local\n"
             "class Collected:\n"
             "    def __del__(self, write=os.write):\n"
             "        write(2, b'collected at exit\\n')\n"
             "run_job = local.run_local\n"
             "def job_importing_a_module(*args):\n"
             "    if 'imported_by_the_job' not in sys.modules:  # like triton, first imported by the first job\n"
             "        module = sys.modules['imported_by_the_job'] = types.ModuleType('imported_by_the_job')\n"
             "        module.cycle = [Collected()]\n"
             "        module.cycle.append(module.cycle)\n"
             "    return run_job(*args)\n"
             "local.run_local = job_importing_a_module\n"
             "from batchgen.cli.main import main; main()")  # returns, then the interpreter ends as SystemExit would
    result = run_probe(probe)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "1" / "completions.parquet").exists()
    assert result.stderr.splitlines()[-1:] == ["collected at exit"], result.stderr[-3000:]


def test_a_finished_job_runs_the_exit_handlers_and_skips_the_teardown(tmp_path):
    """After its jobs finish, the command runs the exit handlers (the log's flush among them) and ends without the
    interpreter's teardown: nothing is finalized, nothing after main() runs, the exit status is 0."""
    probe = ("import atexit, os, sys\n"
             f"sys.argv = ['batchgen', *{SMOKE_JOB!r}, 'hydra.run.dir={tmp_path}']\n"
             "class Finalized:\n"
             "    def __del__(self, write=os.write):\n"
             "        write(2, b'finalized\\n')\n"
             "kept = Finalized()\n"
             "atexit.register(print, 'exit handler ran')  # buffered: printed only if stdout is flushed after it\n"
             "from batchgen.__main__ import main; main()\n"
             "print('after main')")
    result = run_probe(probe)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-1] == "exit handler ran", result.stdout[-3000:]
    assert "after main" not in result.stdout and "finalized" not in result.stderr, result.stderr[-3000:]
    assert (tmp_path / "completions.parquet").exists() and (tmp_path / "summary.json").exists()
    log_text = next(tmp_path.glob("*.log")).read_text()
    assert "Time to the final files" in log_text, log_text[-2000:]


@pytest.mark.parametrize("multirun", [False, True], ids=["single_run", "multirun"])
def test_only_a_multiruns_jobs_free_their_engines_memory(tmp_path, multirun):
    """A single run's process ends after its job: the engine's close leaves the memory (a full garbage collection, the
    device's cached blocks) to the process's end. A multirun's next job needs it freed."""
    sweep = ["-m", "engine.seed=1,2", f"hydra.sweep.dir={tmp_path}"] if multirun else [f"hydra.run.dir={tmp_path}"]
    probe = ("import sys\n"
             f"sys.argv = ['batchgen', *{sweep!r}, *{SMOKE_JOB!r}]\n"
             "from batchgen.engine.llm_engine import LLMEngine\n"
             "close = LLMEngine.close\n"
             "def reported_close(self, free_memory=True):\n"
             "    print('engine closed, memory freed:', free_memory)\n"
             "    close(self, free_memory)\n"
             "LLMEngine.close = reported_close\n"
             "from batchgen.__main__ import main; main()")
    result = run_probe(probe)
    assert result.returncode == 0, result.stderr[-3000:]
    closes = [line for line in result.stdout.splitlines() if line.startswith("engine closed")]
    assert closes == [f"engine closed, memory freed: {multirun}"] * (2 if multirun else 1), result.stdout[-3000:]


@pytest.mark.gpu
def test_a_gpu_multirun_exits_without_nanobind_leak_reports(tmp_path):
    """Two graph-mode jobs in one process compile and capture Triton kernels; at exit nothing of Triton is left
    alive for nanobind (Triton's bindings from 3.8 on) to report as leaked."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    result = batchgen("-m", "job=shakespeare", "preset=smoke_test", "data.limit=8", "engine.device=cuda",
                      "engine.enforce_eager=false", "job.progress=false", "engine.seed=1,2",
                      f"hydra.sweep.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "1" / "completions.parquet").exists()
    assert "leaked" not in result.stderr, result.stderr[-3000:]


@pytest.mark.parametrize(
    ("overrides", "key", "nearest"),
    [
        (["+engine.max_num_seqz=4"], "engine.max_num_seqz", "engine.max_num_seqs"),
        (["+job.foo=1"], "job.foo", None),
        (["++data.bar=2"], "data.bar", "data.path"),
        (["+sampling.temprature=0.5"], "sampling.temprature", "sampling.temperature"),
        (["+engine.cuda_graph.sizes=[1]"], "engine.cuda_graph.sizes", "engine.cuda_graph.capture_sizes"),
        (["+sampling.max_num_seqs=4"], "sampling.max_num_seqs", "engine.max_num_seqs"),  # in the wrong group
        (["+zzz=1"], "zzz", None),
    ],
)
def test_unknown_keys_fail_however_they_arrive(overrides, key, nearest):
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        cfg = compose("config", overrides=["job=shakespeare", *overrides])
    with pytest.raises(ConfigError, match=f"{key} is not a configuration key") as raised:
        to_config(cfg)
    group = key.rpartition(".")[0]
    if group == "engine":
        assert "max_num_seqs" in str(raised.value)  # the keys the group does know
    guess = f"did you mean {nearest}?"
    assert (guess in str(raised.value)) if nearest else ("did you mean" not in str(raised.value))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("sampling.temprature=0", "sampling.temprature is not a configuration key: did you mean sampling.temperature?"),
        ("temperature=0", "temperature is not a configuration key: did you mean sampling.temperature?"),
        ("engine.cuda_graph.sizes=[1]", "did you mean engine.cuda_graph.capture_sizes?"),
    ],
)
def test_an_unknown_key_without_plus_names_the_nearest_key_not_plus_key(tmp_path, override, message):
    """Hydra's own message suggests `+key=value`, which batchgen refuses as well."""
    run_dir = tmp_path / "run"
    result = batchgen(f"hydra.run.dir={run_dir}", "job=shakespeare", override)
    assert result.returncode == 2
    [line] = (result.stdout + result.stderr).splitlines()
    assert message in line and "+" not in line
    assert not run_dir.exists()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["job=no_such_job"], "Could not find 'job/no_such_job'"),  # Hydra: an unknown group option
        (["job=shakespeare", "engine.seed=="], "Error parsing override"),  # Hydra: an override it cannot parse
        (["job=shakespeare", "+engine.max_num_seqz=4"], "engine.max_num_seqz"),  # batchgen: an unknown key
        (["job=shakespeare", "data.path=/no/such/prompts.jsonl"], "data.path"),  # batchgen: a bad value
    ],
)
def test_every_configuration_error_exits_2_and_leaves_no_run_dir(tmp_path, overrides, message):
    run_dir = tmp_path / "run"
    result = batchgen(f"hydra.run.dir={run_dir}", "engine.device=cpu", *overrides)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stdout + result.stderr
    assert not run_dir.exists()


def test_resume_takes_false_true_and_force():
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        for value, expected in (("true", True), ("false", False), ("force", "force"), ("'true'", True)):
            assert to_config(compose("config", overrides=["job=shakespeare", f"job.resume={value}"])).job.resume \
                == expected
        with pytest.raises(ConfigError, match="job.resume"):
            to_config(compose("config", overrides=["job=shakespeare", "job.resume=maybe"]))
