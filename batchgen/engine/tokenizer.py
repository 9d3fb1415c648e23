"""Loads a tokenizer through the narrowest entry point: the `tokenizers` library straight from a local
tokenizer.json, and transformers only for what needs it (slow tokenizers, configs that rewrite the fast one,
chat templates). Importing transformers' auto classes costs seconds; `tokenizers` costs milliseconds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from batchgen.models.gguf_file import gguf_file, is_gguf_path, read_header
from batchgen.models.gguf_tokenizer import build_tokenizer, has_tokenizer

# tokenizer_config.json keys with which transformers changes what tokenizer.json alone would do.
REWRITING_KEYS = ("add_bos_token", "add_eos_token", "add_prefix_space", "legacy", "from_slow")
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


class FastTokenizer:
    """A tokenizer.json through `tokenizers`, with the encode/decode behaviour of transformers' AutoTokenizer:
    special tokens added by the post-processor, decoding that skips the special added tokens, eos/bos ids from
    tokenizer_config.json (or special_tokens_map.json)."""

    def __init__(self, path: Path, backend: Tokenizer, config: dict[str, Any], in_gguf: bool = False):
        """in_gguf: the tokenizer was read from a GGUF file (path), which AutoTokenizer does not read as a path: its
        transformers view is built around `backend` instead, so both views are the same tokenizer."""
        self.path = path
        self.backend = backend
        self.config = config
        self.in_gguf = in_gguf
        self._transformers_tokenizer: Any = None

    @classmethod
    def from_dir(cls, path: Path) -> FastTokenizer | None:
        """None when the directory needs transformers: no tokenizer.json, a config that rewrites it, or
        cleanup of tokenization spaces on decode."""
        if not (path / "tokenizer.json").is_file():
            return None
        config = {**_read_json(path / "special_tokens_map.json"), **_read_json(path / "tokenizer_config.json")}
        if any(key in config for key in REWRITING_KEYS) or config.get("clean_up_tokenization_spaces"):
            return None
        backend = Tokenizer.from_file(str(path / "tokenizer.json"))
        added = {token.content for token in backend.get_added_tokens_decoder().values()}
        declared = {_token_content(t) for t in (config.get("added_tokens_decoder") or {}).values()}
        declared |= {_token_content(config.get(key)) for key in SPECIAL_TOKEN_KEYS} - {None}
        if not declared <= added | set(backend.get_vocab()):
            return None  # transformers would add tokens the file lacks
        return cls(path, backend, config)

    @classmethod
    def from_gguf(cls, path: str) -> FastTokenizer | None:
        """The tokenizer a GGUF file (or the directory holding one) describes; None when it holds no vocabulary."""
        header = read_header(gguf_file(path))
        if not has_tokenizer(header):
            return None
        built = build_tokenizer(header)
        return cls(header.path, built.backend, {**built.special_tokens, "chat_template": built.chat_template},
                   in_gguf=True)

    def _special_id(self, key: str) -> int | None:
        content = _token_content(self.config.get(key))
        return None if content is None else self.backend.token_to_id(content)

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """encode() of each text in one call, spread over the library's threads (offsets, unused, are skipped)."""
        encodings = self.backend.encode_batch_fast(texts, add_special_tokens=add_special_tokens)
        return [encoding.ids for encoding in encodings]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    @property
    def chat_template(self) -> str | None:
        template_file = self.path / "chat_template.jinja"
        if template_file.is_file():
            return template_file.read_text(encoding="utf-8")
        return self.config.get("chat_template") or _read_json(self.path / "chat_template.json").get("chat_template")

    def transformers_tokenizer(self) -> Any:
        """The same tokenizer through transformers, for what needs its API (chat templates, structured output);
        loaded on first use only."""
        if self._transformers_tokenizer is None:
            self._transformers_tokenizer = self._wrapped() if self.in_gguf else _auto_tokenizer(str(self.path))
        return self._transformers_tokenizer

    def _wrapped(self) -> Any:
        from transformers import PreTrainedTokenizerFast

        special = {key: self.config[key] for key in SPECIAL_TOKEN_KEYS if key in self.config}
        return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(self.backend.to_str()),
                                       chat_template=self.chat_template, **special)

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
        return self.transformers_tokenizer().apply_chat_template(messages, **kwargs)


def _auto_tokenizer(name_or_path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=False)


def load_tokenizer(name_or_path: str) -> Any:
    """A FastTokenizer where tokenizer.json alone gives AutoTokenizer's behaviour (or the tokenizer is a GGUF
    file's), else AutoTokenizer."""
    if is_gguf_path(name_or_path):
        return FastTokenizer.from_gguf(name_or_path)
    fast = FastTokenizer.from_dir(Path(name_or_path)) if Path(name_or_path).is_dir() else None
    return fast if fast is not None else _auto_tokenizer(name_or_path)
