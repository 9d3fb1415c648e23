"""A cold bytecode cache filled by worker processes before the imports that need it.

Where the bytecode cache (bytecode_cache.py) starts empty, the first `python -m batchgen` compiles each of the
1,700-odd modules it imports from source, one after another, as it imports them: about 4 s of a fresh H200
machine's first run. Which modules a run imports is known ahead, so this compiles them all at once on every core
first, as installers do. startup_modules.txt lists the modules of other packages (benchmarks/record_startup_modules.py
records them from real runs); batchgen's own are found in its directory. A name this machine does not have is
skipped, and a module not listed is compiled by its import, as before.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import py_compile
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

STARTUP_MODULES = Path(__file__).with_name("startup_modules.txt")
MAX_WORKERS = 16


def listed_modules(path: Path | None = None) -> list[str]:
    path = path or STARTUP_MODULES
    if not path.is_file():  # an install without the package's data files
        return []
    return [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]


def top_level_location(name: str) -> Path | None:
    """The directory of top-level package `name`, or the source file of top-level module `name`, found without
    importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(spec.origin) if spec.origin and spec.origin.endswith(".py") else None


def module_source(name: str, top_levels: dict[str, Path | None]) -> Path | None:
    """The source file of module `name` (`top_levels` caches the top-level lookups), or None where it has none."""
    top, *rest = name.split(".")
    if top not in top_levels:
        top_levels[top] = top_level_location(top)
    location = top_levels[top]
    if location is None:
        return None
    if location.suffix == ".py":
        return location if not rest else None
    base = location.joinpath(*rest)
    for candidate in (base / "__init__.py", base.with_name(base.name + ".py")):
        if candidate.is_file():
            return candidate
    return None


def startup_sources() -> list[str]:
    """Source files of the listed modules not imported yet, then batchgen's own."""
    top_levels: dict[str, Path | None] = {}
    listed = (module_source(name, top_levels) for name in listed_modules() if name not in sys.modules)
    own = sorted(Path(__file__).parent.rglob("*.py"))
    return [str(path) for path in [*listed, *own] if path is not None]


def compile_source(path: str) -> None:
    try:
        py_compile.compile(path, doraise=True, invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP)
    except (py_compile.PyCompileError, OSError, ValueError):
        pass  # its import reports what is wrong, as it would without this


def set_pycache_prefix(prefix: str | None) -> None:
    sys.pycache_prefix = prefix


def available_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def precompile(sources: list[str], workers: int) -> None:
    """Compiles `sources` into the bytecode cache that sys.pycache_prefix names, `workers` processes at a time."""
    # fork starts a worker in milliseconds; nothing heavy is imported yet
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else None)
    with ProcessPoolExecutor(workers, mp_context=context, initializer=set_pycache_prefix,
                             initargs=(sys.pycache_prefix,)) as pool:
        for _ in pool.map(compile_source, sources, chunksize=max(1, len(sources) // (workers * 8))):
            pass


def precompile_startup_modules() -> int:
    """Fills the bytecode cache with what a run imports, on every core (none where there is one); returns how many
    sources it compiled."""
    workers = min(MAX_WORKERS, available_cpus())
    if workers < 2:
        return 0
    sources = startup_sources()
    precompile(sources, workers)
    return len(sources)
