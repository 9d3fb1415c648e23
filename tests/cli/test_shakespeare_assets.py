"""Checks on the committed Shakespeare job assets (tokenizer, model weights, prompts)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

JOB = Path(__file__).resolve().parents[2] / "jobs" / "shakespeare"
MODEL = JOB / "model"
EOS = "<|endoftext|>"


@pytest.fixture(scope="module")
def text() -> str:
    return (JOB / "tinyshakespeare.txt").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(MODEL)


def test_tokenizer_round_trips_text(text: str, tok) -> None:
    rng = random.Random(0)
    samples = [text[s : s + rng.randint(1, 400)] for s in (rng.randrange(len(text) - 400) for _ in range(50))]
    samples += ["", " ", "\n\n", "  two  spaces\n", "".join(sorted(set(text)))]
    for s in samples:
        ids = tok.encode(s, add_special_tokens=False)
        assert len(ids) == len(s)
        assert tok.decode(ids) == s
    assert tok("ROMEO:\n")["input_ids"] == tok.encode("ROMEO:\n", add_special_tokens=False)


def test_each_character_is_its_vocabulary_entry_and_an_unknown_one_is_eos(text: str, tok) -> None:
    vocab = tok.get_vocab()
    sample = text[:5000]
    assert tok.encode(sample, add_special_tokens=False) == [vocab[c] for c in sample]
    assert tok.encode("a\u00e9b", add_special_tokens=False) == [vocab["a"], tok.eos_token_id, vocab["b"]]
    assert tok.encode(f"a{EOS}b", add_special_tokens=False) == [vocab["a"], tok.eos_token_id, vocab["b"]]


def test_vocab_matches_config(text: str, tok) -> None:
    config = AutoConfig.from_pretrained(MODEL)
    chars = sorted(set(text))
    assert len(tok) == config.vocab_size == len(chars) + 1
    assert tok.eos_token == EOS
    assert tok.eos_token_id == config.eos_token_id == len(chars)
    assert EOS not in text


def test_prompts(text: str, tok) -> None:
    rows = [json.loads(line) for line in (JOB / "prompts.jsonl").read_text(encoding="utf-8").splitlines()]
    assert len(rows) >= 500
    assert len({r["id"] for r in rows}) == len(rows)
    vocab = set(text)
    for r in rows:
        assert r["prompt"] and set(r["prompt"]) <= vocab
        ids = tok.encode(r["prompt"], add_special_tokens=False)
        assert len(ids) == len(r["prompt"]) and tok.eos_token_id not in ids


def test_model_is_trained(text: str, tok) -> None:
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    val = text[int(0.9 * len(text)) :]
    ids = torch.tensor([tok.encode(val[i * 256 : (i + 1) * 256], add_special_tokens=False) for i in range(4)])
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    assert loss < 2.0, loss
