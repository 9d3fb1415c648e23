"""Structured output: every completion of a guided row satisfies its spec, greedy and sampled, async on and off,
through preemption; invalid specs are error rows; the packed token bitmask as the sampler applies it."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from batchgen import LLM, SamplingParams
from batchgen.sample.bitmask import apply_token_bitmask, unpack_token_bitmask
from batchgen.sample.params import row_params
from tests.helpers.common import tiny_hf_config
from tests.sample.test_sampler import sample, tensors_for

SHAKESPEARE = Path(__file__).resolve().parents[2] / "jobs" / "shakespeare" / "model"
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "mood": {"enum": ["happy", "sad"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "mood", "tags"],
    "additionalProperties": False,
}
# The Shakespeare model's character vocabulary has no '{', '"', '[' and no digit but 3: no JSON object or string
# can be spelled with it, so it is tested with regexes, choices, a grammar and a boolean schema.
SHAKESPEARE_REGEX = r"(yes|no|ay), my (lord|liege)[.!]"
SHAKESPEARE_GRAMMAR = 'start: speaker ": " word (" " word)* "."\nspeaker: "ROMEO" | "JULIET"\nword: /[a-z]{1,8}/'
SHAKESPEARE_CHOICES = ["to be", "not to be", "that is the question"]
ENGINE_SETUPS = {
    "async": dict(),
    "sync": dict(async_scheduling=False),
    "preemption": dict(block_size=4, num_gpu_blocks_override=24, max_num_seqs=8),
}


def _pack(allowed: torch.Tensor) -> torch.Tensor:  # (B, V) bool -> (B, ceil(V / 32)) int32
    words = -(-allowed.shape[1] // 32)
    padded = torch.nn.functional.pad(allowed, (0, words * 32 - allowed.shape[1])).view(-1, words, 32).long()
    packed = (padded << torch.arange(32)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def test_unpack_token_bitmask_reads_every_bit() -> None:
    allowed = torch.rand(5, 100, generator=torch.Generator().manual_seed(0)) < 0.3
    allowed[0, 31] = allowed[1, 63] = True  # bit 31: the sign bit of a word
    assert torch.equal(unpack_token_bitmask(_pack(allowed), 100), allowed)
    all_allowed = torch.full((2, 4), -1, dtype=torch.int32)
    assert unpack_token_bitmask(all_allowed, 128).all()
    assert not unpack_token_bitmask(all_allowed, 130)[:, 128:].any()  # ids past the mask's words: disallowed


def test_sampler_only_draws_allowed_tokens() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 70, generator=gen)
    allowed = torch.rand(6, 70, generator=gen) < 0.1
    allowed[:, 5] = True
    packed = _pack(allowed)
    masked = apply_token_bitmask(logits, packed)
    assert torch.equal(masked.isfinite(), allowed)
    greedy = tensors_for([SamplingParams(temperature=0)] * 6)
    assert torch.equal(sample(logits, replace(greedy, bitmask=packed)), masked.argmax(-1))
    for position in range(20):
        tensors = tensors_for([SamplingParams(temperature=1.5, top_p=0.9)] * 6, list(range(6)), [position] * 6)
        ids = sample(logits, replace(tensors, bitmask=packed))
        assert allowed[torch.arange(6), ids].all()


@pytest.fixture(scope="module")
def llguidance():
    return pytest.importorskip("llguidance", reason="structured output needs the guided extra (llguidance)")


def _generate(model: Path, params: list[SamplingParams], prompt: str, device: str = "cpu", **engine) -> list:
    llm = LLM(str(model), device=device, dtype="float32", **engine)
    try:
        return llm.generate([prompt] * len(params), params, use_tqdm=False)
    finally:
        llm.close()


@pytest.mark.parametrize("setup", list(ENGINE_SETUPS))
def test_shakespeare_completions_follow_regex_choice_grammar_and_schema(llguidance, setup: str) -> None:
    params = []
    for temperature in (0.0, 1.0, 1.3):
        params += [
            SamplingParams(max_tokens=40, temperature=temperature, guided_regex=SHAKESPEARE_REGEX),
            SamplingParams(max_tokens=40, temperature=temperature, guided_choice=SHAKESPEARE_CHOICES),
            SamplingParams(max_tokens=60, temperature=temperature, guided_grammar=SHAKESPEARE_GRAMMAR, stop=["!"]),
            SamplingParams(max_tokens=10, temperature=temperature, guided_json={"type": "boolean"}),
            SamplingParams(max_tokens=12, temperature=temperature, ignore_eos=True),  # unguided rows alongside
        ]
    outputs = _generate(SHAKESPEARE, params, "KING HENRY:\n", **ENGINE_SETUPS[setup])
    grammar_line = re.compile(r"(ROMEO|JULIET): [a-z]{1,8}( [a-z]{1,8})*\.")
    for o, p in zip(outputs, params, strict=True):
        assert o.error is None
        if p.guided_regex:
            assert o.finish_reason == "stop" and re.fullmatch(SHAKESPEARE_REGEX, o.text), o.text
        elif p.guided_choice:
            assert o.finish_reason == "stop" and o.text in SHAKESPEARE_CHOICES, o.text
        elif p.guided_grammar:
            # A sentence may run past max_tokens; what was generated is still a prefix of the grammar's language.
            assert grammar_line.fullmatch(o.text) if o.finish_reason == "stop" else \
                re.fullmatch(r"(ROMEO|JULIET): [a-z ]*", o.text), o.text
        elif p.guided_json:
            assert o.finish_reason == "stop" and json.loads(o.text) in (True, False), o.text
        else:
            assert o.finish_reason == "length" and len(o.token_ids) == 12
    if setup == "preemption":
        assert sum(o.num_preemptions for o in outputs) > 0, "the small cache should have forced a preemption"


def test_unguided_rows_equal_a_run_without_guided_rows(llguidance) -> None:
    plain = [SamplingParams(max_tokens=16, temperature=0.9, seed=s) for s in range(3)]
    guided = [SamplingParams(max_tokens=16, temperature=0.9, guided_choice=SHAKESPEARE_CHOICES)] * 2
    alone = _generate(SHAKESPEARE, plain, "ROMEO:")
    mixed = _generate(SHAKESPEARE, guided + plain, "ROMEO:")
    assert [o.token_ids for o in mixed[2:]] == [o.token_ids for o in alone]


def test_every_sample_of_a_guided_row_has_its_own_matcher(llguidance) -> None:
    """n samples share their row's request id; each must follow the grammar from its own start."""
    [output] = _generate(SHAKESPEARE, [SamplingParams(n=4, max_tokens=40, temperature=1.0, seed=3,
                                                      guided_choice=SHAKESPEARE_CHOICES)], "ROMEO:")
    assert len(output.outputs) == 4
    assert all(sample.text in SHAKESPEARE_CHOICES for sample in output.outputs)


def test_invalid_specs_are_error_rows_naming_the_field(llguidance) -> None:
    params = [
        SamplingParams(max_tokens=8, guided_regex="(unclosed"),
        SamplingParams(max_tokens=8, guided_json='{"type": "strin"}'),
        SamplingParams(max_tokens=8, guided_json="{not json"),
        SamplingParams(max_tokens=8, guided_grammar="start: undefined_rule"),
        SamplingParams(max_tokens=8, guided_json={"type": "object"}),  # needs '{', which this vocab lacks
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
    ]
    outputs = _generate(SHAKESPEARE, params, "ROMEO:")
    fields = ["guided_regex", "guided_json", "guided_json", "guided_grammar", "guided_json"]
    for o, field in zip(outputs[:5], fields, strict=True):
        assert o.finish_reason == "error" and o.error.startswith(f"{field} "), o.error
        assert o.token_ids == []
    assert "cannot be spelled" in outputs[4].error
    assert outputs[5].finish_reason == "length" and len(outputs[5].token_ids) == 8


def test_two_guided_options_are_rejected() -> None:
    with pytest.raises(ValueError, match="set at most one guided"):
        SamplingParams(guided_regex="a", guided_choice=["a"])
    row = row_params(SamplingParams(guided_regex="a"), {"guided_choice": ["b"]}, 0)
    assert row.guided_regex is None and row.guided_choice == ["b"]


@pytest.fixture(scope="module")
def byte_level_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3 with a byte-level BPE tokenizer of ~300 tokens; the model's vocab (320) is larger."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    directory = tmp_path_factory.mktemp("byte-level")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = [json.dumps({"name": "ann", "age": 31, "mood": "happy", "tags": [True, False]})] * 20
    corpus += (SHAKESPEARE.parent / "tinyshakespeare.txt").read_text()[:20000].splitlines()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>").save_pretrained(directory)
    config = tiny_hf_config("Qwen3ForCausalLM")
    config.vocab_size = 320
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).float().save_pretrained(directory)
    return directory


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_random_byte_level_model_writes_valid_json(llguidance, byte_level_model: Path, async_scheduling) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    params = [SamplingParams(max_tokens=120, temperature=t, seed=i, guided_json=PERSON_SCHEMA)
              for i, t in enumerate([0.0, 0.7, 1.0, 1.0, 1.5])]
    params += [SamplingParams(max_tokens=20, temperature=1.0, guided_choice=["red", "green", "blue"]),
               SamplingParams(max_tokens=20, temperature=1.0, guided_regex=r"[0-9]{3}-[a-z]{2}")]
    outputs = _generate(byte_level_model, params, "Give me a person as JSON:", async_scheduling=async_scheduling)
    for o in outputs[:5]:
        assert o.finish_reason == "stop", (o.finish_reason, o.text)
        jsonschema.validate(json.loads(o.text), PERSON_SCHEMA)
    assert outputs[5].text in ("red", "green", "blue")
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", outputs[6].text)
    assert all(t < 300 for o in outputs for t in o.token_ids), "an id the tokenizer lacks was sampled"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_guided_rows_on_gpu_eager_and_graphs(llguidance, byte_level_model: Path, enforce_eager: bool) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    params = [SamplingParams(max_tokens=120, temperature=t, seed=i, guided_json=PERSON_SCHEMA)
              for i, t in enumerate([0.0, 1.0, 1.5])]
    params += [SamplingParams(max_tokens=20, temperature=1.0, guided_choice=["red", "green", "blue"]),
               SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)]
    outputs = _generate(byte_level_model, params, "Person:", device="cuda", enforce_eager=enforce_eager)
    for o in outputs[:3]:
        assert o.finish_reason == "stop", (o.finish_reason, o.text)
        jsonschema.validate(json.loads(o.text), PERSON_SCHEMA)
    assert outputs[3].text in ("red", "green", "blue")
    assert outputs[4].finish_reason == "length" and len(outputs[4].token_ids) == 20


def test_bitmask_is_none_without_guided_rows(llguidance) -> None:
    llm = LLM(str(SHAKESPEARE), device="cpu")
    llm.generate(["ROMEO:"], SamplingParams(max_tokens=4, guided_choice=["ay"]), use_tqdm=False)
    engine = llm.engine
    assert engine.structured_output is not None
    engine.add_request(1, "ROMEO:", None, SamplingParams())
    requests = list(engine.scheduler.waiting)
    assert engine.structured_output.bitmask(requests) is None  # no guided row: no mask, no host work
    llm.close()


def test_bitmask_rows_for_guided_and_unguided_requests(llguidance) -> None:
    llm = LLM(str(SHAKESPEARE), device="cpu")
    engine = llm.engine
    engine.add_request(0, "ROMEO:", None, SamplingParams(guided_choice=["ay", "no"]))
    engine.add_request(1, "ROMEO:", None, SamplingParams())
    requests = list(engine.scheduler.waiting)
    mask = engine.structured_output.bitmask(requests)
    assert mask.shape == (2, 3) and mask.dtype == np.int32
    allowed = unpack_token_bitmask(torch.from_numpy(mask), 66)
    tokenizer = engine.detokenizer.transformers_tokenizer()
    assert sorted(tokenizer.convert_ids_to_tokens(allowed[0].nonzero().flatten().tolist())) == ["a", "n"]
    assert allowed[1].all()
    llm.close()


def test_job_with_per_row_guided_options(llguidance, tmp_path: Path) -> None:
    """Job-wide guided_choice from the command line; rows override it with their own regex, choices or schema."""
    import pyarrow.parquet as pq

    from tests.helpers.common import batchgen, write_lines

    rows = [{"prompt": "ROMEO:"},
            {"prompt": "ROMEO:", "guided_regex": SHAKESPEARE_REGEX},
            {"prompt": "ROMEO:", "guided_json": {"type": "boolean"}},
            {"prompt": "ROMEO:", "guided_regex": "(unclosed"},
            {"prompt": "ROMEO:", "guided_choice": ["ay", "nay"]}]
    prompts = write_lines(tmp_path / "prompts.jsonl", [json.dumps(r) for r in rows])
    result = batchgen(tmp_path / "run", "job=shakespeare", f"data.path={prompts}", "data.id_field=null",
                      "data.on_error=skip", "sampling.max_tokens=40", "sampling.guided_choice=[to be,not to be]")
    assert result.returncode == 0, result.stdout + result.stderr
    table = pq.read_table(tmp_path / "run" / "completions.parquet").to_pandas()
    assert table["completion"][0] in ("to be", "not to be")
    assert re.fullmatch(SHAKESPEARE_REGEX, table["completion"][1])
    assert table["completion"][2] in ("true", "false")
    assert table["finish_reason"][3] == "error" and table["error"][3].startswith("guided_regex is invalid")
    assert table["completion"][4] in ("ay", "nay")
    assert list(table["finish_reason"][[0, 1, 2, 4]]) == ["stop"] * 4


def test_model_vocab_larger_than_the_tokenizer_masks_extra_ids(llguidance) -> None:
    from transformers import AutoTokenizer

    from batchgen.core.request import Request
    from batchgen.engine.structured_output import StructuredOutputManager

    manager = StructuredOutputManager(AutoTokenizer.from_pretrained(SHAKESPEARE), vocab_size=200)
    guided = Request(0, [1], SamplingParams(guided_regex="[a-z]+"))
    manager.add(guided)
    mask = manager.bitmask([Request(1, [1], SamplingParams()), guided])
    assert mask.shape == (2, 7)
    allowed = unpack_token_bitmask(torch.from_numpy(mask), 200)
    assert allowed[0].all()
    assert allowed[1, 39:65].all() and allowed[1].sum() == 26  # a-z: ids 39-64 of 66; none of the extra ids
