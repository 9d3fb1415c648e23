"""The `tokenizers`-only loader encodes, decodes and knows its special tokens exactly as AutoTokenizer does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer

from batchgen.engine.detokenizer import Detokenizer
from batchgen.engine.tokenizer import FastTokenizer, load_tokenizer

SHAKESPEARE_MODEL = Path(__file__).resolve().parents[2] / "jobs" / "shakespeare" / "model"
TEXTS = [
    "First Citizen:\nBefore we proceed any further, hear me speak.",
    "  leading spaces and\ttabs\n\n",
    "ünïcödé — and emoji 🎭 too",
    "",
    "<|endoftext|>in the middle<|endoftext|>",
]
CHAT_TEMPLATE = "{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}<|assistant|>"


@pytest.fixture(scope="module")
def byte_level_bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny byte-level BPE like GPT-2's or Llama 3's, with a bos-adding post-processor and special tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>", "<|user|>", "<|assistant|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([*TEXTS, "the quick brown fox jumps over the lazy dog " * 20], trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    path = tmp_path_factory.mktemp("bpe")
    tokenizer.save(str(path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": {"__type": "AddedToken", "content": "</s>", "special": True},
              "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("which", ["shakespeare", "byte_level_bpe"])
def test_fast_tokenizer_matches_auto_tokenizer(which: str, byte_level_bpe_dir: Path) -> None:
    path = SHAKESPEARE_MODEL if which == "shakespeare" else byte_level_bpe_dir
    fast, reference = load_tokenizer(str(path)), AutoTokenizer.from_pretrained(path)
    assert isinstance(fast, FastTokenizer)
    assert (fast.eos_token_id, fast.bos_token_id) == (reference.eos_token_id, reference.bos_token_id)
    for text in [*TEXTS, "the lazy dog</s><s>"]:
        ids = fast.encode(text)
        assert ids == reference(text).input_ids == reference.encode(text)
        for skip in (True, False):
            assert fast.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
    assert fast.chat_template == reference.chat_template


def test_chat_template_renders_as_transformers(byte_level_bpe_dir: Path) -> None:
    messages = [{"role": "user", "content": "hi"}]
    fast = load_tokenizer(str(byte_level_bpe_dir))
    reference = AutoTokenizer.from_pretrained(byte_level_bpe_dir)
    kwargs = dict(tokenize=False, add_generation_prompt=True)
    assert fast.apply_chat_template(messages, **kwargs) == reference.apply_chat_template(messages, **kwargs)


def test_configs_that_rewrite_tokenizer_json_load_through_transformers(byte_level_bpe_dir: Path,
                                                                       tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((byte_level_bpe_dir / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "add_eos_token": True}))
    assert not isinstance(load_tokenizer(str(tmp_path)), FastTokenizer)


@pytest.mark.parametrize("which", ["shakespeare", "byte_level_bpe"])
@pytest.mark.parametrize("through", ["tokenizers", "transformers"])
def test_batched_encode_gives_the_ids_of_one_at_a_time(which: str, through: str, byte_level_bpe_dir: Path) -> None:
    path = SHAKESPEARE_MODEL if which == "shakespeare" else byte_level_bpe_dir
    tokenizer = load_tokenizer(str(path)) if through == "tokenizers" else AutoTokenizer.from_pretrained(path)
    assert isinstance(tokenizer, FastTokenizer) == (through == "tokenizers")
    detokenizer = Detokenizer(tokenizer)
    shakespeare = (SHAKESPEARE_MODEL.parent / "tinyshakespeare.txt").read_text()[:4000]
    texts = [*TEXTS, "the lazy dog</s><s>", *(shakespeare[i:i + 8 + i % 25] for i in range(0, 3900, 37))]
    assert detokenizer.encode_batch(texts) == [detokenizer.encode(text) for text in texts]
    assert detokenizer.encode_batch([]) == []


def test_batched_encode_keeps_a_rewriting_config(byte_level_bpe_dir: Path, tmp_path: Path) -> None:
    """A config that adds EOS loads through transformers; its batched ids add it too."""
    (tmp_path / "tokenizer.json").write_bytes((byte_level_bpe_dir / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "add_eos_token": True}))
    detokenizer = Detokenizer(load_tokenizer(str(tmp_path)))
    assert detokenizer.encode_batch(TEXTS) == [detokenizer.encode(text) for text in TEXTS]
