"""Records which modules of other packages `python -m batchgen OVERRIDES` imports (from `python -X importtime`) into
batchgen/startup_modules.txt, merged with what it lists already: the modules a cold bytecode cache compiles ahead
(batchgen/bytecode_precompile.py). Record on a GPU machine too: graph runs import modules that CPU runs do not.

    python -m benchmarks.record_startup_modules job=shakespeare engine.device=cpu data.limit=8
"""

from __future__ import annotations

import argparse
import tempfile

from batchgen.bytecode_precompile import STARTUP_MODULES, listed_modules, module_source
from benchmarks.process_timing import run_process

HEADER = ("# Modules of other packages that batchgen runs import, compiled ahead into a cold bytecode cache.\n"
          "# Written by benchmarks/record_startup_modules.py.\n")


def imported_modules(overrides: list[str]) -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        run = run_process(["-X", "importtime", "-m", "batchgen", *overrides, f"hydra.run.dir={tmp}/run"])
    if run.returncode != 0:
        raise RuntimeError(f"python -m batchgen {' '.join(overrides)} exited {run.returncode}:\n{run.output[-3000:]}")
    lines = (line.rsplit("|", 1)[-1].strip() for line in run.output.splitlines() if line.startswith("import time:"))
    names = [name for name in lines if name.replace(".", "_").isidentifier()]  # not the header's column names
    # what the interpreter imports before batchgen (site, encodings, an environment's sitecustomize) is imported
    # before the cache is filled too
    return names[names.index("batchgen") + 1:] if "batchgen" in names else names


def other_packages_modules(names: list[str]) -> set[str]:
    """Those of `names` that are not batchgen's and have a source file on this machine."""
    top_levels = {}
    return {name for name in names if name.split(".")[0] != "batchgen" and not name.startswith("__editable__")
            and module_source(name, top_levels)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", default=["job=shakespeare", "job.progress=false"])
    parser.add_argument("--replace", action="store_true", help="drop what the file lists instead of merging")
    args = parser.parse_args()
    known = set() if args.replace else set(listed_modules())
    modules = sorted(known | other_packages_modules(imported_modules(args.overrides)))
    STARTUP_MODULES.write_text(HEADER + "".join(f"{name}\n" for name in modules))
    print(f"{STARTUP_MODULES}: {len(modules)} modules ({len(modules) - len(known & set(modules))} new)")


if __name__ == "__main__":
    main()
