"""A CPU engine's steps reuse freed memory (glibc's thresholds, worker/host_memory.py), not fresh pages."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from batchgen.worker import host_memory

REPO = Path(__file__).resolve().parents[2]
glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc tunables")

# Decode steps of the main job's model on 64 rows of one prompt (contexts of about 100-150 tokens, alike: one gather a
# layer, of a few MiB); prints the minor page faults a step, with the worker's thresholds or (argument "off") without.
FAULTS_A_STEP = """
import json, resource, sys
import batchgen.engine.model_worker as model_worker
if sys.argv[1] == "off":
    model_worker.keep_freed_memory = lambda: False
from batchgen import LLM, SamplingParams
llm = LLM("jobs/shakespeare/model", device="cpu", max_num_seqs=64)
prompts = (json.loads(line)["prompt"] for line in open("jobs/shakespeare/prompts.jsonl"))
prompt = next(prompt for prompt in prompts if len(prompt) >= 100)[:100]
params = SamplingParams(max_tokens=200, temperature=0.8, top_k=40, ignore_eos=True, seed=0)
for i in range(64):
    llm.engine.add_request(i, prompt, None, params)
for _ in range(40):
    llm.engine.step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    llm.engine.step()
print(json.dumps((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10))
"""


def faults_a_step(setting: str) -> float:
    result = subprocess.run([sys.executable, "-c", FAULTS_A_STEP, setting], cwd=REPO, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


@glibc
def test_cpu_decode_steps_take_freed_blocks_again_instead_of_fresh_pages():
    kept, unmapped = faults_a_step("on"), faults_a_step("off")
    # Without the thresholds each step's MiB-sized temporaries are mapped afresh: thousands of faults a step.
    assert unmapped > 1000
    assert kept * 10 < unmapped


@glibc
def test_the_thresholds_are_set_unless_the_user_set_glibcs_own(monkeypatch):
    assert host_memory.keep_freed_memory.__wrapped__() is True
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1048576")
    assert host_memory.keep_freed_memory.__wrapped__() is False
