"""The benchmarks' CPU smoke modes run end to end, so a refactor of the engine cannot silently break them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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


def test_pytest_gpu_deals_every_file_once_into_balanced_groups():
    from collections import Counter

    from benchmarks.pytest_gpu import deal

    counts = Counter({"a.py": 150, "b.py": 40, "c.py": 30, "d.py": 20, "e.py": 10, "f.py": 5})
    groups = deal(counts, 3)
    assert sorted(f for group in groups for f in group) == sorted(counts)
    assert sorted(sum(counts[f] for f in group) for group in groups) == [50, 55, 150]
    assert deal(Counter({"a.py": 1}), 3) == [["a.py"]]
