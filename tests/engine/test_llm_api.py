"""The Python API on the shipped Shakespeare model: order, text, stops, seeds, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from batchgen import LLM, SamplingParams

MODEL_DIR = Path(__file__).resolve().parents[2] / "jobs" / "shakespeare" / "model"
PROMPTS_FILE = MODEL_DIR.parent / "prompts.jsonl"


@pytest.fixture(scope="module")
def llm():
    engine = LLM(str(MODEL_DIR), device="cpu", max_num_seqs=16)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    with PROMPTS_FILE.open() as f:
        return [json.loads(line)["prompt"] for line in f][:20]


def test_greedy_text_equals_transformers_on_20_prompts(llm, prompts):
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
        assert output.token_ids == expected[0, ids.shape[1]:].tolist()
        assert output.text == tokenizer.decode(output.token_ids)
        assert output.prompt == prompt


def test_outputs_keep_input_order_and_per_prompt_params(llm, prompts):
    params = [SamplingParams(temperature=0, max_tokens=n) for n in range(1, 11)]
    outputs = llm.generate(prompts[:10], params, use_tqdm=False)
    assert [o.request_id for o in outputs] == list(range(10))
    assert [o.num_output_tokens for o in outputs] == list(range(1, 11))
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(prompts[:3], params[:2], use_tqdm=False)


def test_stop_string_is_excluded_from_the_text(llm, prompts):
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    full = llm.generate(prompts[0], greedy, use_tqdm=False)[0].text
    stop = full[10:13]
    stopped = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=30, stop=[stop]), use_tqdm=False)[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == full[: full.index(stop)]
    assert stop not in stopped.text


def test_stop_strings_apply_to_their_rows_only_and_the_check_ends_with_them(llm, prompts):
    """Steps skip the stop check while no unfinished row has stop strings; rows with them, mixed with rows
    without, in a batch or after an error row, still stop as alone."""
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    full = [o.text for o in llm.generate(prompts[:4], greedy, use_tqdm=False)]
    assert not llm.engine.detokenizer.checks_stop_strings
    stops = [full[0][10:13], full[2][5:8]]
    stopping = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]) for stop in stops]
    too_long = "x" * 5000  # finishes as an error on arrival, its stop string never checked
    outputs = llm.generate([prompts[0], prompts[1], prompts[2], prompts[3], too_long],
                           [stopping[0], greedy, stopping[1], greedy, stopping[0]], use_tqdm=False)
    assert [o.finish_reason for o in outputs] == ["stop", "length", "stop", "length", "error"]
    assert outputs[0].text == full[0][:full[0].index(stops[0])]
    assert outputs[2].text == full[2][:full[2].index(stops[1])]
    assert [outputs[1].text, outputs[3].text] == [full[1], full[3]]
    assert not llm.engine.detokenizer.checks_stop_strings


def test_seeded_sampling_reproduces_regardless_of_batch(llm, prompts):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=123)
    alone = llm.generate(prompts[3], params, use_tqdm=False)[0].token_ids
    batched = llm.generate(prompts[:8], params, use_tqdm=False)[3].token_ids
    assert alone == batched
    other_seed = llm.generate(prompts[3], SamplingParams(temperature=1.0, max_tokens=16, seed=7), use_tqdm=False)
    assert other_seed[0].token_ids != alone


def test_token_id_prompts_and_too_long_prompts(prompts):
    llm = LLM(str(MODEL_DIR), device="cpu", max_model_len=32)
    outputs = llm.generate([[5, 6, 7], list(range(1, 40)), prompts[0][:10]], SamplingParams(max_tokens=4),
                           use_tqdm=False)
    assert outputs[0].num_output_tokens == 4 and outputs[0].text is not None
    assert outputs[1].finish_reason == "error" and "max_model_len" in outputs[1].error
    assert outputs[2].finish_reason in ("length", "stop")
    llm.close()


def test_unknown_engine_option_is_rejected():
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(str(MODEL_DIR), device="cpu", max_num_seq=4)
