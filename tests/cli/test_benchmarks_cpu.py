"""The benchmarks' CPU smoke modes run end to end, so a refactor of the engine cannot silently break them."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_benchmark(module: str, out: Path, *args: str) -> None:
    subprocess.run([sys.executable, "-m", f"benchmarks.{module}", *args, "--out", str(out)], cwd=REPO, check=True,
                   capture_output=True, text=True)


def test_prefix_cache_small_caches_the_shared_prefix_and_keeps_greedy_tokens(tmp_path):
    run_benchmark("prefix_cache", tmp_path, "--small")
    result = json.loads((tmp_path / "prefix_cache_small.json").read_text())
    assert result["caching_off"]["cached_tokens"] == 0 and result["caching_on"]["hit_rate"] > 0.5
    assert result["comparison"]["requests_with_identical_tokens"] == result["settings"]["num_requests"]


def test_profile_prefill_host_times_every_part_of_both_step_kinds(tmp_path):
    run_benchmark("profile_prefill_host", tmp_path, "--rows", "8")
    result = json.loads((tmp_path / "profile_prefill_host.json").read_text())
    by_kind = {row["kind"]: row for row in result["results"]}
    assert set(by_kind) == {"prefill", "decode"}
    for row in by_kind.values():
        # Every part ran at least once per step, so none reads as the missing-part zero.
        assert all(row[part] > 0 for part in ("schedule", "build_step_inputs", "sampling_tensors", "to_device",
                                              "forward_launch", "sample_launch", "commit"))


@pytest.mark.parametrize("stub", [False, True], ids=["forward", "stub_forward"])
def test_many_rows_host_runs_every_row_through_the_job(tmp_path, stub):
    run_benchmark("many_rows_host", tmp_path, "--rows", "600", *(["--stub-forward"] if stub else []))
    result = json.loads((tmp_path / "many_rows_host.json").read_text())
    assert result["stub_forward"] is stub
    kinds = {row["kind"]: row for row in result["step_kinds"]}
    assert set(kinds) == {"prefill", "decode"}
    assert kinds["prefill"]["steps"] * kinds["prefill"]["mean_rows"] == pytest.approx(600)  # each row admitted once
    assert all(result["us_per_row"][part] > 0 for part in ("engine_start", "engine_loop", "schedule", "prepare"))


@pytest.mark.parametrize("max_tokens", [[], ["4", "24"]], ids=["shared", "per-row"])
def test_decode_host_tiny_splits_the_full_decode_steps_host_time(tmp_path, max_tokens):
    run_benchmark("decode_host", tmp_path, "--tiny", *(["--max-tokens", *max_tokens] if max_tokens else []))
    data = json.loads((tmp_path / f"decode_host{'_range' if max_tokens else ''}_tiny.json").read_text())
    result = data["result"]
    assert data["max_tokens"] == ([4, 24] if max_tokens else [16])
    assert result["full_decode_steps"] > 0 and result["num_seqs"] >= 0.9 * 64
    assert result["host_ms"] == pytest.approx(result["schedule_ms"] + result["prepare_ms"] + result["outside_ms"])
    assert result["schedule_ms"] > 0 and result["prepare_ms"] > 0


def test_pytest_gpu_deals_every_file_once_into_balanced_groups():
    from collections import Counter

    from benchmarks.pytest_gpu import deal

    counts = Counter({"a.py": 150, "b.py": 40, "c.py": 30, "d.py": 20, "e.py": 10, "f.py": 5})
    groups = deal(counts, 3)
    assert sorted(f for group in groups for f in group) == sorted(counts)
    assert sorted(sum(counts[f] for f in group) for group in groups) == [50, 55, 150]
    assert deal(Counter({"a.py": 1}), 3) == [["a.py"]]


def test_pytest_gpu_leaves_the_tests_that_take_the_whole_gpu_to_a_process_of_their_own():
    from benchmarks.pytest_gpu import ALONE, CONCURRENT, gpu_test_counts

    alone, concurrent = gpu_test_counts(ALONE), gpu_test_counts(CONCURRENT)
    scoring, tasks = "tests/engine/test_gpu_scoring.py", "tests/worker/test_gpu_tasks.py"
    assert alone[scoring] == alone[tasks] == 1  # the Qwen3-shaped engines at gpu_memory_utilization=0.9
    assert scoring not in concurrent and concurrent[tasks] > 0  # the file's other tests still run in a group


def test_real_jobs_tiny_fills_every_column_and_its_floor_is_below_the_process_time(tmp_path):
    pycache = tmp_path / "pycache"
    completed = subprocess.run([sys.executable, "-m", "benchmarks.real_jobs", "--tiny", "classify", "scoring",
                                "--rows", "16", "--pycache", str(pycache), "--out", str(tmp_path),
                                "--keep", str(tmp_path / "kept")],
                               cwd=REPO, check=True, capture_output=True, text=True)
    header, rule, row, _ = completed.stdout.strip().splitlines()[-4:]  # the table is printed last
    columns = [cell.strip() for cell in header.strip("|").split("|")]
    cells = dict(zip(columns, (cell.strip() for cell in row.strip("|").split("|")), strict=True))
    assert cells.pop("failed") == "-" and cells.pop("workload") == "classify"
    assert cells.pop("device_util") == "-"  # nvidia-smi's, not sampled with --tiny
    assert all(value not in ("", "-") for value in cells.values()), cells
    classify, scoring = json.loads((tmp_path / "real_jobs_tiny_classify_scoring.json").read_text())["results"]
    # The first job wrote the bytecode of what it imported (batchgen's own included); the second one read it.
    assert not classify["bytecode_warm"] and scoring["bytecode_warm"]
    assert any(pycache.rglob("batchgen/engine/llm_engine.*.pyc"))
    result = classify
    assert result["prompt_tokens"] == 16 * 200 and result["output_tokens"] == 16
    assert result["prefill_rate_from"] == "3 steps of 1024 tokens"
    assert 0 < result["floor_s"] <= result["process_s"]
    assert 0 < result["device_busy"] <= 1
    # The summary accounts for the process from its creation: what it leaves out follows summary.json's write.
    assert 0 < result["startup_s"] == pytest.approx(sum(result["startup_phases"].values()))
    assert result["startup_s"] < result["process_s"] - result["engine_loop_s"]
    assert 0 < result["after_summary_s"] < result["process_s"] - result["startup_s"]
    # --keep: each run's own files, to study its steps later; not its completions
    for name in ("classify", "scoring"):
        kept = {path.name for path in (tmp_path / "kept" / name).iterdir()}
        assert {"summary.json", "steps.parquet"} <= kept and "completions.parquet" not in kept


def test_real_jobs_repeats_report_each_workload_s_median_run_with_every_run_kept(tmp_path):
    completed = subprocess.run([sys.executable, "-m", "benchmarks.real_jobs", "--tiny", "classify", "--rows", "8",
                                "--repeats", "2", "--out", str(tmp_path)],
                               cwd=REPO, check=True, capture_output=True, text=True)
    report = json.loads((tmp_path / "real_jobs_tiny_classify.json").read_text())
    first, second = report["runs"]
    assert (first["repeat"], second["repeat"]) == (0, 1) and report["settings"]["repeats"] == 2
    (result,) = report["results"]
    assert result["process_s_runs"] == [first["process_s"], second["process_s"]]
    assert result["process_s"] == min(first["process_s"], second["process_s"])  # the lower middle of two
    assert "classify: the median of 2 runs; process_s" in completed.stdout


def test_a_failed_run_counts_as_the_slowest_of_a_workload_s_runs():
    from benchmarks.real_jobs import median_run

    runs = [{"process_s": 3.0}, {"failed": "exit status 1: boom"}, {"process_s": 1.0}]
    assert median_run(runs) == {"process_s": 3.0, "process_s_runs": [3.0, None, 1.0]}
    assert median_run(runs[1:])["process_s"] == 1.0  # of [1.0, failed]: the lower middle
    assert median_run(runs[1:2])["failed"]


def test_device_idle_tiny_gives_every_gap_between_steps_to_one_transition_and_one_host_phase(tmp_path):
    run_benchmark("device_idle", tmp_path, "chat_mix", "--tiny", "--rows", "24")
    result = json.loads((tmp_path / "device_idle_chat_mix_tiny.json").read_text())
    assert not result["on_gpu"] and result["steps"] > 10
    transitions = result["by_transition"].values()
    assert sum(row["steps"] for row in transitions) == result["steps"] - 1
    assert sum(row["idle_s"] for row in transitions) == pytest.approx(result["idle_s"])
    assert sum(result["by_phase"].values()) == pytest.approx(result["idle_s"])
    # on CPU the steps' spans follow one another: busy and idle make up the whole span
    assert result["busy_s"] + result["idle_s"] == pytest.approx(result["span_s"])
    assert {row["steps"] for row in result["eager"]} <= {"at least half the budget", "smaller"}


def test_device_idle_gives_each_stretch_of_idle_time_to_the_innermost_host_phase():
    from benchmarks.device_idle import OUTSIDE, idle_by_phase, idle_by_transition

    def step(kind: str, start: float, end: float, graph: bool = False) -> list:
        return [kind, 4, 4, start, end, end - start, start - 0.1, start, graph]

    steps = [step("prefill", 0.0, 1.0), step("decode", 3.0, 4.0, graph=True), step("decode", 4.0, 5.0, True),
             step("prefill", 6.0, 7.0)]
    intervals = [(0.5, 3.5, "engine step"), (1.5, 2.0, "schedule"), (2.5, 3.2, "launch")]
    assert idle_by_phase(steps, intervals) == pytest.approx({"engine step": 1.0, "schedule": 0.5, "launch": 0.5,
                                                             OUTSIDE: 1.0})
    transitions = idle_by_transition(steps)
    assert list(transitions) == ["prefill -> decode (graph)", "decode -> prefill", "decode -> decode (graph)"]
    assert transitions["prefill -> decode (graph)"]["idle_s"] == 2.0
    assert transitions["decode -> decode (graph)"] == {"steps": 1, "idle_s": 0.0, "median_ms": 0.0, "longest_ms": 0.0}


def test_real_jobs_reports_data_parallel_ranks_from_their_merged_summary(tmp_path):
    completed = subprocess.run([sys.executable, "-m", "benchmarks.real_jobs", "--tiny", "many_rows_shared", "--rows",
                                "48", "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    (result,) = json.loads((tmp_path / "real_jobs_tiny_many_rows_shared.json").read_text())["results"]
    assert result["ranks"] == 2 and result["unaccounted_s"] is None and result["output_tokens"] == 48 * 16
    # The loop spans both ranks' loops; each phase is a rank's mean, inside the process's time.
    assert 0 < result["engine_loop_s"] < result["process_s"] and 0 < result["startup_s"] < result["process_s"]
    assert 0 < result["device_busy"] <= 2


def test_utilization_samples_are_averaged_over_a_span_on_the_gpus_that_ran():
    from benchmarks.real_jobs import UtilizationSampler, parse_utilization

    output = ("2026/11/28 10:00:00.000, 0, 0\n2026/11/28 10:00:00.000, 1, 0\n"
              "2026/11/28 10:00:00.100, 0, 40\n2026/11/28 10:00:00.100, 1, 0\n"
              "2026/11/28 10:00:00.200, 0, 80\n2026/11/28 10:00:00.200, 1, 0\n2026/11/28 10:00:00.3")
    samples = parse_utilization(output)
    assert len(samples) == 6 and samples[2][1:] == (0, 40)
    assert samples[2][0] - samples[0][0] == pytest.approx(0.1)
    sampler = UtilizationSampler(enabled=False)
    sampler.samples = samples
    start = samples[0][0]
    assert sampler.mean_over(start, start + 0.25) == pytest.approx(0.4)  # GPU 0's three samples; GPU 1 idle
    assert sampler.mean_over(start + 0.05, start + 0.25) == pytest.approx(0.6)
    assert sampler.mean_over(start + 1, start + 2) is None


def test_real_jobs_floor_counts_a_padded_decode_step_with_the_steps_of_its_own_bucket():
    from benchmarks.real_jobs import workload_floor

    def decode(rows: int, padded: int, forward_ms: float) -> dict:
        return {"kind": "decode", "num_seqs": rows, "num_tokens": rows, "cuda_graph": True, "padded_size": padded,
                "forward_ms": forward_ms}

    # 20 rows fill bucket 24: the steps padded into 32 (before 24 was captured) count at the 24 steps' median
    steps = [decode(20, 32, 9.0), decode(20, 24, 4.0), decode(22, 24, 4.0), decode(30, 32, 7.0)]
    floor = workload_floor(steps, chunk_budget=16)
    assert floor["decode_forward_ms"] == {"graph_24": 4.0, "graph_32": 7.0}
    assert floor["decode_floor_s"] == (4.0 * 3 + 7.0) / 1000


def test_real_jobs_reports_a_failed_workload_with_its_exit_status_and_last_line(tmp_path):
    from benchmarks.real_jobs import TokenRows, Workload, run_workload

    broken = Workload("broken", TokenRows(2, (4, 4), (1, 1)), ("engine.max_num_seqs=0",))
    result = run_workload(broken, tmp_path / "broken", tiny=True, timeout=120)
    assert result["failed"].startswith("exit status 2: ")  # a configuration error's exit status
    assert "engine.max_num_seqs=0 is invalid" in result["failed"]
    assert "process_s" not in result


def test_weight_read_floor_counts_the_active_weights_only():
    """A dense model with tied embeddings reads all its weights each decode step; a mixture of experts with untied
    embeddings reads its top_k experts a layer at one row (more at more rows, all of them at many) and one embedding
    row a token."""
    import torch

    from batchgen.layers.moe import StackedExperts
    from batchgen.models.loader import load_hf_config, load_model
    from benchmarks.common import benchmark_model_config, decode_read_bytes, expected_active_experts, weight_bytes

    def tiny(name):
        config = benchmark_model_config(name, tiny=True)
        config.hf_config = {**config.hf_config, "vocab_size": 512}
        return load_model(config, load_hf_config(config), torch.float32, torch.device("cpu"))

    dense = tiny("qwen3_0_6b")
    assert decode_read_bytes(dense, 1) == decode_read_bytes(dense, 64) == weight_bytes(dense)
    moe = tiny("qwen3_30b_a3b")
    layers = [m for m in moe.modules() if isinstance(m, StackedExperts)]
    assert len(layers) == 2 and layers[0].num_experts == 8 and layers[0].top_k == 2
    expert_bytes = (layers[0].gate_up_proj.nbytes + layers[0].down_proj.nbytes) / 8
    embedding = moe.model.embed_tokens.weight
    unread_embedding = embedding.nbytes - embedding[0].nbytes
    assert decode_read_bytes(moe, 1) == weight_bytes(moe) - unread_embedding - 2 * 6 * expert_bytes
    assert expected_active_experts(8, 2, 1) == 2 and expected_active_experts(8, 2, 2) == 8 * (1 - 0.75**2)
    assert decode_read_bytes(moe, 1) < decode_read_bytes(moe, 4) < decode_read_bytes(moe, 256)
    assert abs(decode_read_bytes(moe, 256) - (weight_bytes(moe) - embedding.nbytes + 256 * embedding[0].nbytes)) < 1


def test_nanovllm_kv_floor_counts_the_positions_the_engines_decode_attention_reads(monkeypatch):
    """decode_kv_positions, from the outputs alone, equals the positions every decode step's attention reads in the
    first layer of a tiny engine (prompts and output lengths of several sizes, no preemption)."""
    from batchgen.layers import attention_torch
    from batchgen.sample.params import SamplingParams
    from benchmarks.common import benchmark_model_config, build_engine, random_prompt, run_engine
    from benchmarks.nanovllm_bench import decode_kv_positions

    engine = build_engine(benchmark_model_config("qwen3_0_6b", tiny=True), enforce_eager=True, device="cpu",
                          max_model_len=256, max_num_seqs=4)
    first_layer = engine.runner.model.model.layers[0].self_attn.attn
    read = []
    decode_attention = attention_torch.decode_attention

    def counting(q, k_cache, *args, **kwargs):
        if k_cache is first_layer.k_cache:
            read.append(int(args[2].sum()))  # seq_lens: the positions each row attends over (0 for padding rows)
        return decode_attention(q, k_cache, *args, **kwargs)

    monkeypatch.setattr(attention_torch, "decode_attention", counting)
    try:
        requests = [(random_prompt(length, seed=length), SamplingParams(max_tokens=new, ignore_eos=True))
                    for length, new in ((5, 1), (17, 9), (40, 3), (3, 30), (64, 12))]
        outputs = run_engine(engine, requests)[0]
    finally:
        engine.close()
    assert [o.num_output_tokens for o in outputs] == [1, 9, 3, 30, 12]
    assert sum(read) == decode_kv_positions(outputs) == 8 * 17 + 36 + 2 * 40 + 3 + 29 * 3 + 435 + 11 * 64 + 66


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="b1_latency imports the PDL switch (Triton)")
def test_b1_latency_tiny_splits_the_model_over_two_ranks_and_times_one_shard(tmp_path):
    common = ["--tiny", "--modes", "eager", "--prompt-len", "8", "--new-tokens", "4", "--repeats", "1",
              "--copy-mib", "1"]
    run_benchmark("b1_latency", tmp_path, *common)
    run_benchmark("b1_latency", tmp_path, *common, "--tensor-parallel-size", "2")
    run_benchmark("b1_latency", tmp_path, *common, "--tensor-parallel-size", "2", "--no-custom-all-reduce")
    whole = json.loads((tmp_path / "b1_latency_tiny.json").read_text())
    split = json.loads((tmp_path / "b1_latency_tiny_tp2.json").read_text())
    nccl = json.loads((tmp_path / "b1_latency_tiny_tp2_nccl.json").read_text())
    assert (whole["tensor_parallel_size"], split["tensor_parallel_size"]) == (1, 2)
    assert (split["custom_all_reduce"], nccl["custom_all_reduce"]) == (True, False)
    # The floor is one rank's shard: half the weights, but for the norms every rank holds whole.
    assert 0.45 < split["weight_bytes"] / whole["weight_bytes"] < 0.55
    assert split["results"][0]["decode_step_ms"] > 0


def test_fp8_accuracy_tiny_compares_both_paths(tmp_path):
    run_benchmark("fp8_accuracy", tmp_path, "--tiny", "--models", "qwen3_0_6b", "--num-prompts", "1",
                  "--prompt-len", "12", "--decode-steps", "2")
    rows = json.loads((tmp_path / "fp8_accuracy_tiny.json").read_text())["results"]
    assert [(row["path"], row["positions"]) for row in rows] == [("prefill", 12), ("decode", 2)]
    for row in rows:  # the weights' rounding moves the distributions a little (KL up to float32 rounding)
        assert -1e-6 < row["mean_kl"] < 0.1 and 0 <= row["greedy_agreement"] <= 1 and 0 < row["bf16_top1_prob"] <= 1
