"""With PYTHONDONTWRITEBYTECODE=1 over sources without bytecode, batchgen keeps the bytecode in a cache directory."""

import py_compile
import subprocess
import sys
from pathlib import Path

from batchgen.bytecode_cache import CACHE_ENV, default_cache_dir, use_bytecode_cache

REPO = Path(__file__).resolve().parent.parent


def make_package(root: Path, name: str) -> Path:
    package = root / name
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("VALUE = 42\n")
    return package


def test_bytecode_goes_to_the_cache_and_not_beside_the_sources(tmp_path):
    package = make_package(tmp_path / "site", "probepkg")
    cache = tmp_path / "cache"
    probe = ("from batchgen.bytecode_cache import use_bytecode_cache\n"
             "print(use_bytecode_cache(probe_module='probepkg'))\n"
             "import probepkg; assert probepkg.VALUE == 42")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{tmp_path / 'site'}:{REPO}", "PYTHONDONTWRITEBYTECODE": "1",
           CACHE_ENV: str(cache)}
    result = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(cache)
    assert not (package / "__pycache__").exists()
    assert [path.name for path in cache.rglob("*.pyc") if "probepkg" in path.parts] == [
        f"__init__.{sys.implementation.cache_tag}.pyc"]


def test_nothing_changes_where_python_may_write_bytecode(monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    assert use_bytecode_cache({}) is None
    assert sys.pycache_prefix is None


def test_nothing_changes_when_turned_off(monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    assert use_bytecode_cache({CACHE_ENV: "off"}, probe_module="json") is None
    assert sys.pycache_prefix is None and sys.dont_write_bytecode


def test_nothing_changes_when_the_bytecode_is_beside_the_sources(tmp_path, monkeypatch):
    package = make_package(tmp_path, "compiledpkg")
    py_compile.compile(str(package / "__init__.py"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    assert use_bytecode_cache({CACHE_ENV: str(tmp_path / "cache")}, probe_module="compiledpkg") is None
    assert sys.pycache_prefix is None and sys.dont_write_bytecode


def test_the_default_directory_follows_the_cache_home(tmp_path):
    assert default_cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "batchgen" / "bytecode"
