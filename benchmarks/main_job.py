"""The main job as a user runs it: `python -m batchgen job=shakespeare`, whole process (subprocess wall time),
eager and graph, with what the job's summary says of its parts: engine start (model load, KV cache, graph capture),
the engine loop (sum of step_ms) and the rest (imports, Hydra, reading, writing); startup_s is the part of the rest
before the job (the interpreter, imports, Hydra, the config).

--fresh-caches points TRITON_CACHE_DIR and TORCHINDUCTOR_CACHE_DIR at new empty directories for every run: a fresh
machine's cold compile caches; triton_compiles counts the entries Triton's cache holds after the run (one per kernel
specialisation compiled). Without a GPU only eager runs (graph mode needs CUDA).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from benchmarks.common import add_out_argument, cuda_available, environment, markdown_table, save_json
from benchmarks.process_timing import run_process

MODES = {"eager": ["engine.enforce_eager=true"], "graph": ["engine.enforce_eager=false"]}


def triton_compiles(cache_dir: Path) -> int:
    """Entries of a Triton cache that started empty (none where nothing compiled, e.g. on CPU)."""
    return len(list(cache_dir.iterdir())) if cache_dir.is_dir() else 0


def run_job(run_dir: Path, mode: str, fresh_cache: bool, extra: list[str]) -> dict[str, Any]:
    env = {}
    if fresh_cache:
        env = {"TRITON_CACHE_DIR": str(run_dir / "triton_cache"), "TORCHINDUCTOR_CACHE_DIR": str(run_dir / "inductor")}
    args = ["-m", "batchgen", "job=shakespeare", f"hydra.run.dir={run_dir}", "job.progress=false", *MODES[mode],
            *extra]
    run = run_process(args, env)
    if run.returncode != 0:
        raise RuntimeError(f"the {mode} job exited {run.returncode}:\n{run.output[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = pq.read_table(run_dir / "steps.parquet", columns=["step_ms"]).column("step_ms").to_pylist()
    engine = summary["engine"]
    loop_s = sum(steps) / 1000
    return {
        "mode": mode, "fresh_cache": fresh_cache, "process_s": run.seconds, "job_s": summary["wall_seconds"],
        "engine_loop_s": loop_s, "load_s": engine.get("load_seconds"), "kv_sizing_s": engine.get("kv_sizing_seconds"),
        "capture_s": engine.get("cuda_graph_capture_seconds"),
        "capture_s_per_size": engine.get("cuda_graph_capture_seconds_per_size"),
        "outside_job_s": run.seconds - summary["wall_seconds"],
        "startup_s": summary["this_attempt"]["time_seconds"]["startup"], "steps": summary["steps"],
        "kv_blocks": engine.get("kv_blocks"), "output_tokens_per_s": summary["output_tokens_per_s"],
        "step_medians": summary.get("step_medians"),
        "triton_compiles": triton_compiles(run_dir / "triton_cache") if fresh_cache else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=1, help="runs per mode (rows are per run)")
    parser.add_argument("--fresh-caches", action="store_true", help="every run with empty compile caches")
    parser.add_argument("--override", action="append", default=[], help="extra Hydra override, e.g. data.limit=64")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), help="default: eager, and graph where CUDA is")
    add_out_argument(parser)
    args = parser.parse_args()
    modes = args.modes or (["eager", "graph"] if cuda_available() else ["eager"])
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:
            for i in range(args.repeats):
                results.append(run_job(Path(tmp) / f"{mode}{i}", mode, args.fresh_caches, args.override))
    save_json(args.out, "main_job", {"environment": environment(), "results": results})
    headers = ["mode", "fresh_cache", "process_s", "job_s", "engine_loop_s", "load_s", "kv_sizing_s", "capture_s",
               "outside_job_s", "startup_s", "steps", "kv_blocks", "triton_compiles"]
    print(markdown_table(headers, [[r[h] for h in headers] for r in results]))


if __name__ == "__main__":
    main()
