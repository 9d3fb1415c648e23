"""A cold bytecode cache is filled ahead, in parallel, with the modules a run imports."""

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from batchgen import bytecode_cache, bytecode_precompile
from batchgen.bytecode_cache import CACHE_ENV, use_bytecode_cache
from batchgen.bytecode_precompile import STARTUP_MODULES, compile_source, listed_modules, module_source

REPO = Path(__file__).resolve().parent.parent


def write(path: Path, text: str = "VALUE = 1\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_module_names_map_to_their_sources_without_importing_them(tmp_path, monkeypatch):
    package = write(tmp_path / "mappkg" / "__init__.py").parent
    sub = write(package / "sub" / "__init__.py")
    leaf = write(package / "sub" / "leaf.py")
    single = write(tmp_path / "mapsingle.py")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    top_levels = {}
    assert module_source("mappkg", top_levels) == package / "__init__.py"
    assert module_source("mappkg.sub", top_levels) == sub
    assert module_source("mappkg.sub.leaf", top_levels) == leaf
    assert module_source("mapsingle", top_levels) == single
    for missing in ("mappkg.nothing", "mapsingle.attribute", "no_such_top_level_module"):
        assert module_source(missing, top_levels) is None
    assert "mappkg" not in sys.modules and "mapsingle" not in sys.modules


def test_a_source_that_does_not_compile_is_left_to_its_import(tmp_path):
    compile_source(str(write(tmp_path / "broken.py", "def (:\n")))
    compile_source(str(tmp_path / "gone.py"))


def test_a_cold_cache_holds_the_listed_modules_before_they_are_imported(tmp_path):
    site = tmp_path / "site"
    write(site / "probepkg" / "__init__.py")
    later = write(site / "probepkg" / "later.py", "VALUE = 2\n")
    listed = write(tmp_path / "modules.txt", "# header\nprobepkg\nprobepkg.later\nprobepkg.not_here\n")
    cache = tmp_path / "cache"
    probe = (
        "import importlib.util, os, sys\n"
        "from pathlib import Path\n"
        "import batchgen.bytecode_precompile as precompile\n"
        f"precompile.STARTUP_MODULES = Path({str(listed)!r})\n"
        "precompile.available_cpus = lambda: 2\n"
        "from batchgen.bytecode_cache import use_bytecode_cache\n"
        "use_bytecode_cache(probe_module='probepkg')\n"
        f"pyc = Path(importlib.util.cache_from_source({str(later)!r}))\n"
        "before = pyc.stat()\n"
        "import probepkg.later\n"
        "assert probepkg.later.VALUE == 2\n"
        "after = pyc.stat()\n"
        "print(before.st_mtime_ns == after.st_mtime_ns and before.st_ino == after.st_ino)\n"
        "cli = Path(precompile.__file__).with_name('cli.py')\n"
        "print(Path(importlib.util.cache_from_source(str(cli))).exists())\n"
    )
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": f"{site}:{REPO}",
           "PYTHONDONTWRITEBYTECODE": "1", CACHE_ENV: str(cache)}
    result = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    reused_unchanged, own_compiled = result.stdout.split()
    assert reused_unchanged == "True"  # the import took the compiled file as it was
    assert own_compiled == "True"  # batchgen's modules come without being listed
    assert not (site / "probepkg" / "__pycache__").exists()


def test_a_warm_cache_is_not_compiled_again(tmp_path, monkeypatch):
    source = write(tmp_path / "site" / "warmpkg" / "__init__.py")
    cache = tmp_path / "cache"
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setattr(sys, "pycache_prefix", str(cache))
    compile_source(str(source))
    monkeypatch.setattr(sys, "pycache_prefix", None)

    def must_not_run():
        raise AssertionError("a warm cache was compiled again")

    monkeypatch.setattr(bytecode_precompile, "precompile_startup_modules", must_not_run)
    assert use_bytecode_cache({CACHE_ENV: str(cache)}, probe_module="warmpkg") == cache
    assert bytecode_cache.has_bytecode("warmpkg")


def test_one_cpu_compiles_nothing_ahead(monkeypatch):
    monkeypatch.setattr(bytecode_precompile, "available_cpus", lambda: 1)
    monkeypatch.setattr(bytecode_precompile, "precompile", lambda *args: pytest.fail("compiled on one CPU"))
    assert bytecode_precompile.precompile_startup_modules() == 0


def test_the_shipped_list_names_other_packages_modules_once_in_order():
    names = listed_modules()
    assert names == sorted(set(names))
    assert {"torch", "torch.nn", "pyarrow", "omegaconf"} <= set(names)
    assert all(name.replace(".", "_").isidentifier() for name in names)
    assert not [name for name in names if name.split(".")[0] == "batchgen"]
    assert STARTUP_MODULES.read_text().startswith("#")
