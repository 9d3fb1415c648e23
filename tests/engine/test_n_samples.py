"""n > 1: a prompt's samples share its KV blocks, are seeded each, stop independently, and come out in row order."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from batchgen import LLM, SamplingParams
from batchgen.config import Config, DataConfig, EngineConfig, JobConfig, ModelConfig
from batchgen.io.writers import CompletionWriter
from batchgen.job.run import run

MODEL_DIR = Path(__file__).resolve().parents[2] / "jobs" / "shakespeare" / "model"
PROMPTS = ["ROMEO:\nWhat light through yonder window breaks?\n", "To be, or not", "KING"]
TIMING_COLUMNS = ["ttft_ms", "tpot_ms", "latency_ms"]


@pytest.fixture(scope="module")
def llm():
    engine = LLM(str(MODEL_DIR), device="cpu", max_num_seqs=16)
    yield engine
    engine.close()


def samples_of(outputs) -> list[list[list[int]]]:
    return [[sample.token_ids for sample in output.outputs] for output in outputs]


def test_greedy_samples_are_identical_and_equal_n_1(llm):
    single = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    triple = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=20, n=3), use_tqdm=False)
    assert [o.request_id for o in triple] == [0, 1, 2]
    assert [[s.sample_index for s in o.outputs] for o in triple] == [[0, 1, 2]] * 3
    assert samples_of(triple) == [[o.token_ids] * 3 for o in single]
    assert [o.outputs[0] is o for o in triple] == [True] * 3 and single[0].outputs == [single[0]]


def test_seeded_samples_differ_reproduce_and_sample_0_equals_n_1(llm):
    params = SamplingParams(temperature=1.0, max_tokens=32, n=3, seed=11)
    first = samples_of(llm.generate(PROMPTS, params, use_tqdm=False))
    assert all(len({tuple(tokens) for tokens in samples}) == 3 for samples in first)
    other = LLM(str(MODEL_DIR), device="cpu", max_num_seqs=2)  # another engine, other batches
    try:
        assert samples_of(other.generate(PROMPTS, params, use_tqdm=False)) == first
    finally:
        other.close()
    single = llm.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=32, seed=11), use_tqdm=False)
    assert [o.token_ids for o in single] == [samples[0] for samples in first]


def test_samples_stop_independently(llm):
    newline = llm.engine.detokenizer.encode("\n")[0]
    params = SamplingParams(temperature=1.0, max_tokens=40, n=6, seed=3, stop_token_ids=[newline])
    (output,) = llm.generate(PROMPTS[1:2], params, use_tqdm=False)
    lengths = {len(sample.token_ids) for sample in output.outputs}
    assert len(lengths) > 1 and all(s.finish_reason in ("stop", "length") for s in output.outputs)


def test_samples_share_the_prompt_blocks(llm):
    engine = llm.engine
    prompt = "MERCUTIO:\nO, then, I see Queen Mab hath been with you. She is the"  # 65 tokens: 4 full blocks
    assert len(engine.detokenizer.encode(prompt)) == 65
    engine.add_request(0, prompt, None, SamplingParams(temperature=0.8, max_tokens=30, n=3, ignore_eos=True))
    records = []
    while engine.scheduler.num_running < 3:
        records.append(engine.step()[1])
    samples = engine.scheduler.running
    shared = samples[0].block_ids[:4]
    assert all(sample.block_ids[:4] == shared for sample in samples)
    assert [engine.scheduler.block_manager.ref_counts[b] for b in shared] == [3] * 4
    finished = []
    while engine.has_unfinished_requests:
        done, record = engine.step()
        finished += done
        records.append(record)
    assert sum(r.num_cached_tokens for r in records if r is not None) == 2 * 64
    assert sorted(o.num_cached_tokens for o in finished) == [0, 64, 64]


def job_config(prompts_file: Path, run_dir_resume: bool) -> Config:
    return Config(
        job=JobConfig(progress=False, resume=run_dir_resume, flush_rows=1),
        model=ModelConfig(path=str(MODEL_DIR)),
        engine=EngineConfig(device="cpu", max_num_seqs=4),
        data=DataConfig(path=str(prompts_file)),
        sampling=SamplingParams(temperature=0.9, max_tokens=12, n=3),
    )


def comparable(path: Path) -> list[dict]:
    return pq.read_table(path).drop_columns(TIMING_COLUMNS).to_pylist()


def test_job_writes_a_row_per_sample_in_order_and_resumes_missing_samples(tmp_path):
    prompts_file = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "ROMEO:\n"}, {"prompt": "JULIET:\n", "n": 1}, {"prompt": "To be", "n": 2},
            {"prompt": "KING"}]
    prompts_file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    reference_dir = tmp_path / "reference"
    summary = run(job_config(prompts_file, False), reference_dir)
    reference = comparable(reference_dir / "completions.parquet")
    assert [(r["index"], r["sample_index"]) for r in reference] == [
        (0, 0), (0, 1), (0, 2), (1, 0), (2, 0), (2, 1), (3, 0), (3, 1), (3, 2)]
    assert summary["rows"] == 9
    assert len({tuple(r["output_token_ids"]) for r in reference if r["index"] == 0}) == 3

    # A killed attempt that wrote row 0 whole, and only sample 1 of rows 2 and 3.
    resumed_dir = tmp_path / "resumed"
    partial = CompletionWriter(resumed_dir, {}, flush_rows=1)
    full = pq.read_table(reference_dir / "completions.parquet").to_pylist()
    for record in full:
        if record["index"] == 0 or (record["index"] in (2, 3) and record["sample_index"] == 1):
            partial.write(record)
    partial.wait_for_parts()  # flushed before the kill
    del partial
    run(job_config(prompts_file, True), resumed_dir)
    assert comparable(resumed_dir / "completions.parquet") == reference


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_samples_on_gpu_equal_cpu():
    params = [SamplingParams(temperature=0, max_tokens=20, n=3), SamplingParams(temperature=1.0, max_tokens=20, n=3)]
    results = []
    for device in ("cpu", "cuda"):
        llm = LLM(str(MODEL_DIR), device=device, dtype="float32", max_num_seqs=16)
        try:
            results.append([samples_of(llm.generate(PROMPTS, p, use_tqdm=False)) for p in params])
        finally:
            llm.close()
    cpu, cuda = results
    assert cuda[0] == cpu[0] and all(len(set(map(tuple, samples))) == 1 for samples in cuda[0])
    assert all(len(set(map(tuple, samples))) == 3 for samples in cuda[1])
