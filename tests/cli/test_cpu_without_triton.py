"""The CPU path where triton cannot be imported, as with torch's CPU wheels, proven on any machine.

torch's CUDA build brings triton, so a machine with it (CI) would never notice a module-level `import triton` on the
CPU path. These tests run subprocesses in which triton is absent: a `sitecustomize.py` first on PYTHONPATH puts
None in `sys.modules["triton"]`, so `import triton` raises ModuleNotFoundError and `importlib.util.find_spec`
answers None, as for a package that is not installed. The running interpreter keeps its triton.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parents[2]

# Modules that are Triton kernels themselves, besides those named *triton*: PDL's wait is a @triton.jit function.
TRITON_KERNEL_MODULES = {"batchgen.layers.pdl"}

# Fails unless triton is blocked, then imports every batchgen module that is not a Triton kernel and prints those
# that fail. The __main__ modules run a command line when imported.
IMPORT_EVERY_MODULE = f"""
import importlib, importlib.util, pkgutil, traceback
import batchgen

assert importlib.util.find_spec("triton") is None, "triton is not blocked"
try:
    import triton
except ModuleNotFoundError:
    pass
else:
    raise AssertionError("import triton succeeded")
kernel_modules = {sorted(TRITON_KERNEL_MODULES)!r}
for module in pkgutil.walk_packages(batchgen.__path__, "batchgen."):
    name = module.name
    if "triton" in name.rsplit(".", 1)[-1] or name in kernel_modules or name.endswith(".__main__"):
        continue
    try:
        importlib.import_module(name)
        print("imported", name)
    except Exception:
        print("FAILED", name, traceback.format_exc(limit=-1).strip().splitlines()[-1])
"""


@pytest.fixture(scope="module")
def without_triton(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of a subprocess in which `import triton` fails."""
    blocker = tmp_path_factory.mktemp("no_triton")
    (blocker / "sitecustomize.py").write_text('import sys\n\nsys.modules["triton"] = None  # as if not installed\n')
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(blocker), env.get("PYTHONPATH")]))
    return env


def run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_every_module_but_the_triton_kernels_imports(without_triton):
    result = run(["-c", IMPORT_EVERY_MODULE], without_triton)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    failed = [line for line in result.stdout.splitlines() if line.startswith("FAILED")]
    assert failed == []
    imported = {line.split()[1] for line in result.stdout.splitlines() if line.startswith("imported ")}
    assert {"batchgen.engine.llm_engine", "batchgen.worker.cuda_graph", "batchgen.job.run", "batchgen.llm",
            "batchgen.sample.sampler", "batchgen.models.llama"} <= imported


def test_the_main_job_runs_on_cpu(without_triton, tmp_path):
    run_dir = tmp_path / "run"
    result = run(["-m", "batchgen", "job=shakespeare", "data.limit=4", "sampling.max_tokens=4",
                  "engine.device=cpu", f"hydra.run.dir={run_dir}"], without_triton)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    completions = pq.read_table(run_dir / "completions.parquet").to_pylist()
    assert [row["index"] for row in completions] == [0, 1, 2, 3]
    assert all(row["error"] is None and row["finish_reason"] in {"stop", "length"}
               and 1 <= row["num_output_tokens"] <= 4 for row in completions)


def test_the_whole_suite_collects(without_triton):
    result = run(["-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests",
                  f"--ignore={Path(__file__).relative_to(REPO)}"], without_triton)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "error" not in result.stdout.splitlines()[-1].lower(), result.stdout[-3000:]
    assert "tests/engine/test_engine_greedy.py" in result.stdout
    assert "tests/layers/test_attention_triton.py::" not in result.stdout
