"""The job's "read input" phase (Job.__init__: the tokenizer's load, iter_prompts, each row's sampling parameters and
the shard split; summary.json's read_input_seconds) on the inputs of two `benchmarks/real_jobs.py` workloads, in one
process set up as a job's is (the engine's modules imported, then gc.freeze, as batchgen/cli/main.py does):
- chat_mix: 20,000 JSONL rows {id, prompt_token_ids (50-400 ids), max_tokens (20-200)}, model=qwen3_0_6b (no
  tokenizer), temperature 0.6, ignore_eos;
- many_rows: 200,000 JSONL rows {id, prompt} of 8-32 characters of the play text, the Shakespeare model and tokenizer,
  max_tokens 16, temperature 0.8, top_k 40.
Each workload's Job is built --repeats times, and its parts are timed on their own too (see read_once). Milliseconds
of wall time (medians over the repeats; the job's best too), and rows per second of the job's median. --profile NAME
prints a cProfile of one more Job of that workload, sorted by --sort.

Usage: python -m benchmarks.read_input [NAME ...] [--repeats N] [--dir DIR] [--profile NAME] [--sort KEY] [--out DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import shutil
import statistics
import time
from pathlib import Path

from batchgen.config import Config, DataConfig
from batchgen.engine.collector import rare_collections
from batchgen.engine.detokenizer import Detokenizer
from batchgen.io.readers import iter_prompts
from batchgen.io.sources import jsonl_rows
from batchgen.job.run import Job
from batchgen.sample.params import SamplingParams
from benchmarks.common import QWEN3, add_out_argument, environment, load_model_config, markdown_table, save_json
from benchmarks.real_jobs import WORKLOADS, TextRows, write_text_rows, write_token_rows

CONFIGS = {
    "chat_mix": lambda path: Config(model=load_model_config(QWEN3), data=DataConfig(path=str(path), id_field="id"),
                                    sampling=SamplingParams(temperature=0.6, ignore_eos=True)),
    "many_rows": lambda path: Config(model=load_model_config("shakespeare"),
                                     data=DataConfig(path=str(path), id_field="id"),
                                     sampling=SamplingParams(max_tokens=16, temperature=0.8, top_k=40)),
}


def input_file(directory: Path, name: str) -> Path:
    """The workload's input, written once (the same seed as real_jobs)."""
    path = directory / f"{name}.jsonl"
    if not path.exists():
        spec = WORKLOADS[name].rows
        (write_text_rows if isinstance(spec, TextRows) else write_token_rows)(path, spec)
    return path


PHASES = ("tokenizer_load", "parse", "prompt_rows", "job")


def read_once(config: Config, run_dir: Path) -> tuple[dict[str, float], int]:
    """Seconds of each of PHASES, and the rows read: the tokenizer's load (Detokenizer.load), the file's lines parsed
    one by one (jsonl_rows: the line-by-line path, a reference where the rows are read by columns), the rows read and
    checked (iter_prompts, the parse included) and the whole phase as a job runs it (Job's read_seconds: all of it,
    each row's sampling parameters and the shard split included)."""
    seconds = {}
    start = time.perf_counter()
    detokenizer = Detokenizer.load(config.model)
    seconds["tokenizer_load"] = time.perf_counter() - start
    with rare_collections():
        start = time.perf_counter()
        for _ in jsonl_rows(Path(config.data.path)):
            pass
        seconds["parse"] = time.perf_counter() - start
        start = time.perf_counter()
        rows = list(iter_prompts(config.data, detokenizer.tokenizer if detokenizer else None))
        seconds["prompt_rows"] = time.perf_counter() - start
    del rows
    gc.collect()
    job = Job(config, run_dir)
    seconds["job"] = job.read_seconds
    num_rows = job.num_input_rows
    del job
    gc.collect()
    return seconds, num_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"workloads (default: all): {', '.join(CONFIGS)}")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/batchgen_read_input"), help="where the inputs are kept")
    parser.add_argument("--profile", choices=list(CONFIGS), help="print a cProfile of one more Job of this workload")
    parser.add_argument("--sort", default="tottime", help="the profile's sort key (default: %(default)s)")
    add_out_argument(parser)
    args = parser.parse_args()
    import batchgen.runners.local  # noqa: F401  (what launch imports before a job: torch and the engine)
    import batchgen.runners.ranks  # noqa: F401

    gc.freeze()
    args.dir.mkdir(parents=True, exist_ok=True)
    run_dir = args.dir / "run"
    results = []
    for name in args.names or list(CONFIGS):
        config = CONFIGS[name](input_file(args.dir, name))
        passes = [read_once(config, run_dir) for _ in range(args.repeats)]
        rows = passes[0][1]
        result = {"workload": name, "rows": rows}
        for phase in PHASES:
            result[f"{phase}_ms"] = 1000 * statistics.median(seconds[phase] for seconds, _ in passes)
        result["job_ms_best"] = 1000 * min(seconds["job"] for seconds, _ in passes)
        result["rows_per_s"] = rows / (result["job_ms"] / 1000)
        results.append(result)
    shutil.rmtree(run_dir, ignore_errors=True)
    columns = list(results[0])
    print(markdown_table(columns, [[r[c] for c in columns] for r in results]))
    save_json(args.out, "read_input", {"environment": environment(), "repeats": args.repeats, "results": results})
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        Job(CONFIGS[args.profile](input_file(args.dir, args.profile)), run_dir)
        profiler.disable()
        pstats.Stats(profiler).sort_stats(args.sort).print_stats(30)


if __name__ == "__main__":
    main()
