"""Compiled bytecode kept in a cache directory when Python may not write it beside the sources.

Container images often set PYTHONDONTWRITEBYTECODE=1 (to keep .pyc files out of their layers) over packages
installed without bytecode (uv does not compile by default). Then every process compiles torch's thousand-odd modules
from source: 1.8 s of each `python -m batchgen` on the H200 machine, more than the main job's generation. Python's
pycache_prefix writes the bytecode to a separate tree instead, so the source tree stays as clean as the variable
asks. BATCHGEN_BYTECODE_CACHE names that directory (default: <cache home>/batchgen/bytecode), or `off`. A cold cache
is filled on every core before the imports (bytecode_precompile.py).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Mapping
from pathlib import Path

CACHE_ENV = "BATCHGEN_BYTECODE_CACHE"


def default_cache_dir(environ: Mapping[str, str]) -> Path:
    cache_home = environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache_home) / "batchgen" / "bytecode"


def has_bytecode(module: str) -> bool:
    """Whether `module`'s compiled bytecode is where imports look for it: beside its source, or in the tree that
    sys.pycache_prefix names when set (True if not found: then there is nothing to speed up)."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return True
    return Path(importlib.util.cache_from_source(spec.origin)).exists()


def use_bytecode_cache(environ: Mapping[str, str] = os.environ, probe_module: str = "torch") -> Path | None:
    """Points later imports' bytecode at the cache directory when Python may not write it beside the sources and
    probe_module (the largest import) has none there; returns the directory, or None where nothing changed."""
    setting = environ.get(CACHE_ENV, "")
    if setting == "off" or not sys.dont_write_bytecode or sys.pycache_prefix is not None:
        return None
    if has_bytecode(probe_module):
        return None
    directory = Path(setting) if setting else default_cache_dir(environ)
    sys.pycache_prefix = str(directory)
    sys.dont_write_bytecode = False
    if not has_bytecode(probe_module):  # a cold cache
        from batchgen.bytecode_precompile import precompile_startup_modules

        precompile_startup_modules()
    return directory
