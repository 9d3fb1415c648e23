"""Whole jobs shaped like real ones, each through `python -m batchgen` in a subprocess as a user runs it.

Workloads (names select them; default: all, in this order):
- chat_mix: 20,000 rows, prompts of 50-400 random token ids, max_tokens 20-200 per row, temperature 0.6,
  max_num_seqs 512.
- classify: 4,000 rows of 1,000 prompt tokens, max_tokens 1.
- many_rows: 200,000 Shakespeare rows (`job=shakespeare`: the character-level GPT-2 and its tokenizer, so rows are
  text), windows of 8-32 characters of the play text, max_tokens 16, max_num_seqs 512.
- many_rows_shared: many_rows on three data-parallel ranks that share the GPU (engine.ranks_per_gpu=3): the job's
  host work a row split over three processes.
- scoring: 64 rows of 4,000 prompt tokens, max_tokens 0, sampling.prompt_logprobs=1, engine.max_model_len=8192.
- cold_start: the chat mix on its first 1,000 rows with empty Triton and Inductor caches (TRITON_CACHE_DIR and
  TORCHINDUCTOR_CACHE_DIR point at new directories, as `main_job --fresh-caches` does): a fresh machine. Its result
  lists the kernels the process compiled (`triton_compiles`, by name, with their number of specializations).

Every workload but many_rows runs `model=qwen3_0_6b` (the Qwen3-0.6B shape, dummy bf16 weights, no tokenizer), so
its prompts are token ids (< 10,000, seed 0) in a JSONL file with per-row max_tokens; rows ignore EOS, so each
generates exactly its max_tokens. `--tiny` shrinks every workload (fewer, shorter rows, a smaller token budget) and
runs it on CPU, the Qwen3 ones on a two-layer Qwen3: a smoke test of the benchmark and a host-path profile, not a
measurement of the GPU.

Each workload reports, from the process's wall clock and the run's summary.json and steps.parquet:
- process_s: spawn to exit of the whole command (imports, reading, engine start, the engine loop, writing);
  output_tok_s and prompt_tok_s over it. startup_s (process creation to the job's start: the interpreter, imports,
  Hydra, the config; the summary's startup_phases split it), engine_start_s (model load, KV cache, CUDA graphs) and
  engine_loop_s (the summary's engine loop: its steps' step_ms plus the loop's time outside every step).
  unaccounted_s: process_s less every phase of the summary's time_seconds, which together span the process's
  creation to its final files: the spawn, writing summary.json, and what follows it. after_summary_s is what follows
  it (from summary.json's modification time to the process's end): the lines the command prints last (with the
  exact match against an answer key) and the process's exit (its exit handlers: the command skips the interpreter's
  teardown, batchgen/__main__.py).
- loop_gc_s: the seconds of Python's garbage collections inside the engine loop (summary.json's
  engine_loop_collections).
- device_busy: the device time of the steps over engine_loop_s. A step's device time is forward_ms + sample_ms, the
  two device-timed columns (CUDA events around the forward and around the sampling; wait_ms is the host waiting and
  schedule_ms / prepare_ms are host work). An event span includes any gap in which the device waited for the host to
  launch the next kernel, so a launch-bound eager step counts as busy for its whole span: this share is an upper
  bound on the device's real occupancy. On CPU the columns are host time.
- device_util: where nvidia-smi runs (not --tiny), the mean of its utilization.gpu (the share of each sample period
  in which a kernel ran) sampled every 100 ms over the engine loop, on the GPUs that ran a kernel then: the device's
  occupancy without the job's own timing. Ranks sharing a GPU (engine.ranks_per_gpu) time their steps with events
  that may include the other ranks' kernels, so device_busy can overstate it there; device_util cannot.
- A run split over data-parallel ranks (engine.data_parallel_size) reports its merged summary: the phases are the
  ranks' means, engine_loop_s runs from the first rank's loop start to the last one's end, device_busy is every
  rank's device time over it (so up to the number of GPUs), and unaccounted_s is left out.
- prefill_s, decode_s, mixed_s: the step_ms of the steps of each kind.
- floor_s: what the job's device work takes at the speeds this run measured, with the host and the scheduling policy
  free: its prefill tokens (those of mixed steps included, decode tokens of mixed steps too, since they run in the
  same eager forward) at the full-chunk prefill rate, plus each decode step at the median graph forward time of its
  batch. The full-chunk prefill rate is engine.max_num_batched_tokens over the median forward_ms of the prefill
  steps of exactly that many tokens (eager forwards are launch-bound, so a full chunk is the fastest per token);
  where no step filled the budget, the prefill steps with the most tokens stand in (`prefill_rate_from` says which).
  A decode step's time is the median forward_ms of the decode steps whose rows fill the same default CUDA-graph
  bucket (1, 2, 4, then steps of 8; a step padded into a larger one counts with its own), or, for eager decode
  steps (CPU, or rows a graph cannot run), of those with the same number of rows.
  Sampling is not in the floor. floor_ratio = process_s / floor_s.

--repeats N runs the workloads N times over, in turn (a, b, a, b, ...), so that the host's drift between runs falls
on every workload alike, and reports each workload's median run (by process_s; the lower middle one of an even
number) with every run's process_s beside it (`process_s_runs`); the JSON's `runs` keeps every run's figures. A
process's start-up (imports, Hydra) varies by a second between runs on a shared GPU host (benchmarks/RESULTS.md,
2026-11-29, fourth session), as much as a change measured in one run may move.

Bytecode: an ordinary pip install writes every package's bytecode at install time, but the GPU image's packages have
none, so each process there would compile about 1,150 source files (2.2-2.4 s) first. The workloads share one
PYTHONPYCACHEPREFIX folder (--pycache, kept between runs; written even where PYTHONDONTWRITEBYTECODE is set) so that
only a process that finds it empty pays that, and each result says whether it found bytecode there (bytecode_warm).

A workload that fails (a non-zero exit, or no result within --timeout) is reported as failed with its exit status and
the last line of its output, and the next one runs. The table is printed last; the JSON goes to --out as
real_jobs[_tiny][_<names>].json (names only when not every workload ran).

Usage: python -m benchmarks.real_jobs [NAME ...] [--tiny] [--rows N] [--timeout S] [--pycache DIR] [--keep DIR]
       [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import tempfile
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from benchmarks.common import (
    QWEN3,
    TINY_QWEN3,
    add_out_argument,
    environment,
    markdown_table,
    save_json,
    text_windows,
)
from benchmarks.process_timing import run_process

PROMPT_ID_LIMIT = 10_000  # prompt token ids are drawn below this, as in the other Qwen3 benchmarks


@dataclass(frozen=True)
class TokenRows:
    """Rows of random prompt token ids; lengths and max_tokens uniform over inclusive ranges."""

    rows: int
    prompt_tokens: tuple[int, int]
    max_tokens: tuple[int, int]


@dataclass(frozen=True)
class TextRows:
    """Windows of the Shakespeare text, lengths uniform over an inclusive range of characters."""

    rows: int
    chars: tuple[int, int]
    max_tokens: int


@dataclass(frozen=True)
class Workload:
    name: str
    rows: TokenRows | TextRows
    overrides: tuple[str, ...]  # Hydra overrides besides the model, the input and the run directory
    fresh_caches: bool = False


CHAT_MIX = TokenRows(20_000, (50, 400), (20, 200))
MANY_ROWS = TextRows(200_000, (8, 32), 16)
WORKLOADS = {w.name: w for w in (
    Workload("chat_mix", CHAT_MIX, ("sampling.temperature=0.6", "engine.max_num_seqs=512")),
    Workload("classify", TokenRows(4_000, (1_000, 1_000), (1, 1)), ()),
    Workload("many_rows", MANY_ROWS, ("engine.max_num_seqs=512",)),
    Workload("many_rows_shared", MANY_ROWS,
             ("engine.max_num_seqs=512", "engine.data_parallel_size=3", "engine.ranks_per_gpu=3")),
    Workload("scoring", TokenRows(64, (4_000, 4_000), (0, 0)),
             ("sampling.prompt_logprobs=1", "engine.max_model_len=8192")),
    Workload("cold_start", replace(CHAT_MIX, rows=1_000), ("sampling.temperature=0.6", "engine.max_num_seqs=512"),
             fresh_caches=True),
)}
# The same shapes scaled down for a CPU and a two-layer Qwen3: a smaller token budget keeps full prefill chunks.
TINY_CHAT_MIX = TokenRows(64, (10, 80), (4, 24))
TINY_MANY_ROWS = replace(MANY_ROWS, rows=1_500)
TINY_WORKLOADS = {w.name: w for w in (
    Workload("chat_mix", TINY_CHAT_MIX, ("sampling.temperature=0.6", "engine.max_num_seqs=32",
                                         "engine.max_num_batched_tokens=512")),
    Workload("classify", TokenRows(64, (200, 200), (1, 1)), ("engine.max_num_batched_tokens=1024",)),
    Workload("many_rows", TINY_MANY_ROWS, ("engine.max_num_seqs=512",)),
    Workload("many_rows_shared", TINY_MANY_ROWS, ("engine.max_num_seqs=512", "engine.data_parallel_size=2")),
    Workload("scoring", TokenRows(4, (700, 1_200), (0, 0)),
             ("sampling.prompt_logprobs=1", "engine.max_model_len=2048", "engine.max_num_batched_tokens=256")),
    Workload("cold_start", replace(TINY_CHAT_MIX, rows=32),
             ("sampling.temperature=0.6", "engine.max_num_seqs=32", "engine.max_num_batched_tokens=512"),
             fresh_caches=True),
)}
TINY_ENGINE = ("engine.device=cpu",)
TINY_QWEN3_OVERRIDES = (*(f"model.hf_config.{key}={value}" for key, value in TINY_QWEN3.items()), "model.dtype=float32")


def write_token_rows(path: Path, spec: TokenRows, seed: int = 0) -> None:
    """JSONL rows {id, prompt_token_ids[, max_tokens]}; max_tokens is per row unless the range is one value (then the
    job's sampling.max_tokens carries it: 0 is valid only there, with prompt_logprobs)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(spec.prompt_tokens[0], spec.prompt_tokens[1] + 1, spec.rows)
    max_tokens = rng.integers(spec.max_tokens[0], spec.max_tokens[1] + 1, spec.rows)
    per_row = spec.max_tokens[0] != spec.max_tokens[1]
    with path.open("w") as file:
        for index, length in enumerate(lengths):
            record: dict[str, Any] = {"id": f"r{index:06d}",
                                      "prompt_token_ids": rng.integers(0, PROMPT_ID_LIMIT, length).tolist()}
            if per_row:
                record["max_tokens"] = int(max_tokens[index])
            file.write(json.dumps(record) + "\n")


def write_text_rows(path: Path, spec: TextRows, seed: int = 0) -> None:
    """JSONL rows {id, prompt}: windows starting anywhere in the text."""
    with path.open("w") as file:
        for index, prompt in enumerate(text_windows(spec.rows, spec.chars, seed)):
            file.write(json.dumps({"id": f"s{index:06d}", "prompt": prompt}) + "\n")


def job_arguments(workload: Workload, input_path: Path, run_dir: Path, tiny: bool,
                  extra: Sequence[str] = ()) -> list[str]:
    spec = workload.rows
    if isinstance(spec, TextRows):
        model = ["job=shakespeare", f"sampling.max_tokens={spec.max_tokens}"]
    else:
        model = [f"model={QWEN3}", "sampling.ignore_eos=true", *(TINY_QWEN3_OVERRIDES if tiny else ())]
        if spec.max_tokens[0] == spec.max_tokens[1]:
            model.append(f"sampling.max_tokens={spec.max_tokens[0]}")
    return ["-m", "batchgen", *model, f"data.path={input_path}", "data.id_field=id", *workload.overrides,
            *(TINY_ENGINE if tiny else ()), *extra, f"job.name=real_jobs_{workload.name}", "job.progress=false",
            f"hydra.run.dir={run_dir}"]


KEPT_SUFFIXES = (".json", ".parquet", ".log")  # the completions themselves are left out: they can be large


def last_line(output: str) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def run_workload(workload: Workload, directory: Path, tiny: bool, timeout: float,
                 extra: Sequence[str] = (), pycache: Path | None = None, keep: Path | None = None) -> dict[str, Any]:
    """Writes the input, runs the job; its figures, or {"failed": ...} with the exit status and last output line.
    pycache: the PYTHONPYCACHEPREFIX folder the job's bytecode is read from and written to (None: Python's own).
    keep: a folder to copy the run's own files into (summary.json, steps.parquet, the job's log), under the
    workload's name, to study its steps after the benchmark."""
    directory.mkdir(parents=True)
    input_path = directory / "input.jsonl"
    if isinstance(workload.rows, TextRows):
        write_text_rows(input_path, workload.rows)
    else:
        write_token_rows(input_path, workload.rows)
    run_dir = directory / "run"
    env = {}
    if workload.fresh_caches:
        env = {"TRITON_CACHE_DIR": str(directory / "triton_cache"),
               "TORCHINDUCTOR_CACHE_DIR": str(directory / "inductor_cache")}
    result: dict[str, Any] = {"workload": workload.name, "rows": workload.rows.rows}
    if pycache is not None:
        env.update(PYTHONPYCACHEPREFIX=str(pycache), PYTHONDONTWRITEBYTECODE="")  # empty: unset, as pip install has it
        result["bytecode_warm"] = pycache.is_dir() and any(pycache.iterdir())
    try:
        with UtilizationSampler(enabled=not tiny) as utilization:
            run = run_process(job_arguments(workload, input_path, run_dir, tiny, extra), env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**result, "failed": f"timed out after {timeout:g} s"}
    if run.returncode != 0:
        return {**result, "failed": f"exit status {run.returncode}: {last_line(run.output)}"}
    if keep is not None:
        kept = keep / workload.name
        kept.mkdir(parents=True, exist_ok=True)
        for path in run_dir.iterdir():
            if path.is_file() and path.suffix in KEPT_SUFFIXES and path.name != "completions.parquet":
                shutil.copy2(path, kept / path.name)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text())
    steps = pq.read_table(run_dir / "steps.parquet").to_pylist()
    generation = summary["generation"]
    figures = {**result, **job_figures(run.seconds, summary, steps),
               "device_util": utilization.mean_over(generation["started_at"], generation["finished_at"]),
               "after_summary_s": run.ended_at - summary_path.stat().st_mtime}
    if workload.fresh_caches:
        figures["triton_compiles"] = triton_compiles(directory / "triton_cache")
    return figures


class UtilizationSampler:
    """nvidia-smi's utilization.gpu of every GPU, every 100 ms while the block runs (nothing where nvidia-smi is not
    installed or `enabled` is false); the samples carry nvidia-smi's own timestamps, as its piped output is
    buffered."""

    QUERY = ["nvidia-smi", "--query-gpu=timestamp,index,utilization.gpu", "--format=csv,noheader,nounits", "-lms",
             "100"]

    def __init__(self, enabled: bool = True):
        self.enabled = enabled and shutil.which("nvidia-smi") is not None
        self.samples: list[tuple[float, int, int]] = []  # (seconds since the epoch, GPU, percent)

    def __enter__(self) -> UtilizationSampler:
        if self.enabled:
            self._process = subprocess.Popen(self.QUERY, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc_info: object) -> None:
        if not self.enabled:
            return
        self._process.terminate()
        self.samples = parse_utilization(self._process.communicate()[0])

    def mean_over(self, start: float, end: float) -> float | None:
        """The mean utilization (0 to 1) between two time.time() values, over the GPUs that ran a kernel then."""
        within = [(gpu, percent) for stamp, gpu, percent in self.samples if start <= stamp <= end]
        used = {gpu for gpu, percent in within if percent > 0}
        values = [percent for gpu, percent in within if gpu in used]
        return statistics.fmean(values) / 100 if values else None


def parse_utilization(output: str) -> list[tuple[float, int, int]]:
    """(seconds since the epoch, GPU, percent) of each line of the query's output; a line cut by the end is left out."""
    samples = []
    for line in output.splitlines():
        fields = [field.strip() for field in line.split(",")]
        if len(fields) == 3 and fields[2].isdigit():
            stamp = datetime.strptime(fields[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()  # local time, as time.time()
            samples.append((stamp, int(fields[1]), int(fields[2])))
    return samples


def triton_compiles(cache: Path) -> dict[str, int]:
    """Kernels a fresh process compiled, by name (how many specializations of each), from its Triton cache: each
    compile leaves one metadata JSON named after the kernel."""
    names: dict[str, int] = defaultdict(int)
    for metadata in cache.glob("*/*.json"):
        if not metadata.name.startswith("__grp__"):
            names[metadata.stem] += 1
    return dict(sorted(names.items(), key=lambda item: -item[1]))


def job_figures(process_s: float, summary: dict[str, Any], steps: list[dict[str, Any]]) -> dict[str, Any]:
    attempt = summary["this_attempt"]
    engine = summary["engine"]
    ranks = summary.get("num_shards", 1)
    times = {phase: seconds / ranks for phase, seconds in attempt["time_seconds"].items()}
    loop_s = summary["generation"]["seconds"] if ranks > 1 else times["steps"] + times["outside_steps"]
    device_s = sum(step["forward_ms"] + step["sample_ms"] for step in steps) / 1000
    seconds_by_kind: dict[str, float] = defaultdict(float)
    steps_by_kind: dict[str, int] = defaultdict(int)
    for step in steps:
        seconds_by_kind[step["kind"]] += step["step_ms"] / 1000
        steps_by_kind[step["kind"]] += 1
    floor = workload_floor(steps, engine["max_num_batched_tokens"])
    return {
        "process_s": process_s,
        "unaccounted_s": process_s - sum(times.values()) if ranks == 1 else None,
        "ranks": ranks,
        "output_tokens": attempt["output_tokens"],
        "prompt_tokens": attempt["prompt_tokens"],
        "output_tok_s": attempt["output_tokens"] / process_s,
        "prompt_tok_s": attempt["prompt_tokens"] / process_s,
        "startup_s": times["startup"],
        "startup_phases": attempt["startup_phases"],
        "read_input_s": times["read_input"],
        "open_outputs_s": times["open_outputs"],
        "engine_start_s": times["engine_start"],
        "capture_s": engine.get("cuda_graph_capture_seconds"),
        "load_s": engine.get("load_seconds"),
        "kv_sizing_s": engine.get("kv_sizing_seconds"),
        "capture_s_per_size": engine.get("cuda_graph_capture_seconds_per_size"),
        "warm_up_s": engine.get("warm_up_seconds"),
        # compile ahead (batchgen/worker/compile_ahead.py): the kernels it compiled, in how many processes, and its
        # seconds (absent where it did not run)
        **{key: value for key, value in engine.items() if key.startswith("parallel_compile_")},
        "engine_loop_s": loop_s,
        "engine_close_s": times["engine_close"],
        "loop_gc_s": attempt["engine_loop_collections"]["seconds"],
        "finish_s": times["finish"],
        "device_s": device_s,
        "device_busy": device_s / loop_s if loop_s > 0 else None,
        "prefill_s": seconds_by_kind["prefill"],
        "decode_s": seconds_by_kind["decode"],
        "mixed_s": seconds_by_kind["mixed"],
        "steps": dict(steps_by_kind),
        **floor,
        "floor_ratio": process_s / floor["floor_s"] if floor["floor_s"] else None,
        "error_rows": summary["job"]["error_rows"],
        "step_medians": summary["step_medians"],
    }


def workload_floor(steps: Sequence[dict[str, Any]], chunk_budget: int) -> dict[str, Any]:
    """floor_s and what it is made of (see the module docstring)."""
    prefill_steps = [s for s in steps if s["kind"] == "prefill"]
    full = [s for s in prefill_steps if s["num_tokens"] == chunk_budget]
    if not full and prefill_steps:
        largest = max(s["num_tokens"] for s in prefill_steps)
        full = [s for s in prefill_steps if s["num_tokens"] == largest]
    chunk_tokens = full[0]["num_tokens"] if full else 0
    rate = chunk_tokens / (statistics.median(s["forward_ms"] for s in full) / 1000) if full else None
    eager_tokens = sum(s["num_tokens"] for s in steps if s["kind"] != "decode")
    decode_ms_by_batch: dict[tuple[bool, int], list[float]] = defaultdict(list)
    for step in steps:
        if step["kind"] == "decode":
            decode_ms_by_batch[decode_batch(step)].append(step["forward_ms"])
    decode_median = {batch: statistics.median(ms) for batch, ms in decode_ms_by_batch.items()}
    decode_floor_s = sum(decode_median[batch] * len(ms) for batch, ms in decode_ms_by_batch.items()) / 1000
    prefill_floor_s = eager_tokens / rate if rate else 0.0
    return {
        "prefill_rate_tok_s": rate,
        "prefill_rate_from": f"{len(full)} steps of {chunk_tokens} tokens" if full else None,
        "prefill_floor_s": prefill_floor_s,
        "decode_floor_s": decode_floor_s,
        "decode_forward_ms": {f"{'graph' if graph else 'eager'}_{size}": ms
                              for (graph, size), ms in sorted(decode_median.items())},
        "floor_s": prefill_floor_s + decode_floor_s,
    }


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A workload's run of median process_s (the lower middle one of an even number; a failed run counts as the
    slowest), with every run's process_s in run order (None for a failed one)."""
    ranked = sorted(runs, key=lambda run: float("inf") if run.get("failed") else run["process_s"])
    return {**ranked[(len(ranked) - 1) // 2], "process_s_runs": [run.get("process_s") for run in runs]}


def decode_batch(step: dict[str, Any]) -> tuple[bool, int]:
    """(replayed a graph, the default bucket its rows fill) or (eager, its rows): decode steps whose forwards cost
    the same. The bucket is that of the full default list (1, 2, 4, then steps of 8), not the one the step replayed:
    a step padded into a larger bucket until its own was captured (engine.cuda_graph.lazy_capture) counts with the
    steps of its own rows' bucket, not with those that fill the larger one."""
    if step["cuda_graph"]:
        rows = step["num_seqs"]
        return True, min(bucket for bucket in (1, 2, 4, -(-rows // 8) * 8) if bucket >= rows)
    return False, step["num_seqs"]


TABLE = ("workload", "process_s", "output_tok_s", "prompt_tok_s", "startup_s", "open_outputs_s", "engine_start_s",
         "engine_loop_s", "loop_gc_s", "finish_s", "unaccounted_s", "after_summary_s", "device_busy", "device_util",
         "prefill_s", "decode_s", "mixed_s", "floor_s", "floor_ratio", "failed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help=f"workloads to run (default: all): {', '.join(WORKLOADS)}")
    parser.add_argument("--tiny", action="store_true", help="every workload shrunk, on CPU (a smoke test)")
    parser.add_argument("--rows", type=int, help="run this many rows of each workload instead of its own number")
    parser.add_argument("--timeout", type=float, default=600, help="seconds a workload may run before it fails")
    parser.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE",
                        help="a Hydra override for every workload (repeatable), e.g. engine.min_admit_rows=1")
    parser.add_argument("--tag", default="", help="a suffix for the JSON's name, to tell runs with --set apart")
    parser.add_argument("--pycache", type=Path, default=Path(tempfile.gettempdir()) / "batchgen_real_jobs_pycache",
                        help="the jobs' PYTHONPYCACHEPREFIX, kept between runs (default: %(default)s)")
    parser.add_argument("--keep", type=Path, default=None,
                        help="copy each run's summary.json, steps.parquet and log into this folder, by workload "
                             "(with --repeats, by repeat_<i>/workload)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run the workloads this many times over, in turn, and report each one's median run")
    add_out_argument(parser)
    args = parser.parse_args()
    unknown = [name for name in args.names if name not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {', '.join(unknown)}: choose from {', '.join(WORKLOADS)}")
    catalogue = TINY_WORKLOADS if args.tiny else WORKLOADS
    names = args.names or list(catalogue)
    workloads = [catalogue[name] for name in names]
    if args.rows is not None:
        workloads = [replace(w, rows=replace(w.rows, rows=args.rows)) for w in workloads]
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="batchgen_real_jobs_") as tmp:
        for repeat in range(args.repeats):
            for workload in workloads:
                directory = Path(tmp) / f"{workload.name}_{repeat}"
                keep = args.keep / f"repeat_{repeat}" if args.keep is not None and args.repeats > 1 else args.keep
                result = run_workload(workload, directory, args.tiny, args.timeout, args.extra, args.pycache, keep)
                shutil.rmtree(directory, ignore_errors=True)  # the next repeat's input and run dir are its own
                outcome = result.get("failed") or f"{result['process_s']:.1f} s"
                print(f"{workload.name}: {outcome}", flush=True)
                runs.append({**result, "repeat": repeat})
    results = [median_run([run for run in runs if run["workload"] == workload.name]) for workload in workloads]
    suffix = (("_tiny" if args.tiny else "") + ("" if names == list(catalogue) else "_" + "_".join(names))
              + (f"_{args.tag}" if args.tag else ""))
    settings = {"tiny": args.tiny, "rows": args.rows, "timeout": args.timeout, "overrides": args.extra,
                "pycache": str(args.pycache), "repeats": args.repeats,
                "workloads": [asdict(w) for w in workloads]}
    env = environment()
    report = {"environment": env, "settings": settings, "results": results}
    if args.repeats > 1:
        report["runs"] = runs
    save_json(args.out, f"real_jobs{suffix}", report)
    device = "CPU, --tiny" if args.tiny else env["device"]
    overrides = f"; {' '.join(args.extra)}" if args.extra else ""
    print(f"\n## real_jobs ({device}; {env['git_commit']}{overrides})\n")
    print(markdown_table(TABLE, [[r.get(column) for column in TABLE] for r in results]))
    for result in results:
        if len(times := result["process_s_runs"]) > 1:
            print(f"\n{result['workload']}: the median of {len(times)} runs; process_s "
                  + ", ".join("failed" if seconds is None else f"{seconds:.2f}" for seconds in times))
        if compiles := result.get("triton_compiles"):
            print(f"\n{result['workload']}: {sum(compiles.values())} Triton compiles: "
                  + ", ".join(f"{name} x{count}" for name, count in compiles.items()))


if __name__ == "__main__":
    main()
