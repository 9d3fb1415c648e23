"""A GGUF file's tokenizer as a `tokenizers.Tokenizer`: the byte-level BPE vocabulary and merges, the special
tokens, and the pre-tokenizer that `tokenizer.ggml.pre` names (llama.cpp's name for the model's split rule)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from batchgen.models.gguf_file import GGUFHeader, UnsupportedGGUF

# llama.cpp's token types
_CONTROL, _USER_DEFINED = 3, 4

# The split rules of the tokenizers llama.cpp reads as `tokenizer.ggml.pre`, as their tokenizer.json spells them.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


def _gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2()])


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


PRE_TOKENIZERS = {
    "default": _gpt2,
    "gpt2": _gpt2,
    "smollm": _digits_then_gpt2,
    "starcoder": _digits_then_gpt2,
    "refact": _digits_then_gpt2,
    "llama-bpe": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "llama3": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "smaug-bpe": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "qwen2": lambda: _split_then_bytes(_QWEN2_SPLIT),
    "deepseek-r1-qwen": lambda: _split_then_bytes(_QWEN2_SPLIT),
}


@dataclass(frozen=True)
class GGUFTokenizer:
    backend: Tokenizer
    special_tokens: dict[str, str]  # bos_token, eos_token, unk_token, pad_token: the ones the file names
    chat_template: str | None


def has_tokenizer(header: GGUFHeader) -> bool:
    return "tokenizer.ggml.tokens" in header.metadata


def check_tokenizer(header: GGUFHeader) -> None:
    """Raises UnsupportedGGUF for a tokenizer this module cannot build."""
    if not has_tokenizer(header):
        return
    kind = header.metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedGGUF(f"{header.path}: tokenizer.ggml.model={kind!r} is not supported; batchgen builds "
                              "byte-level BPE tokenizers (gpt2); give model.tokenizer=DIR with its tokenizer.json")
    pre = header.metadata.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise UnsupportedGGUF(f"{header.path}: tokenizer.ggml.pre={pre!r} is not supported; supported: "
                              f"{', '.join(PRE_TOKENIZERS)}; or give model.tokenizer=DIR with its tokenizer.json")


def build_tokenizer(header: GGUFHeader) -> GGUFTokenizer:
    meta = header.metadata
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type", [])
    merges = [tuple(merge.split(" ", 1)) for merge in meta.get("tokenizer.ggml.merges", [])]
    vocab = {token: index for index, token in enumerate(tokens)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = PRE_TOKENIZERS[meta.get("tokenizer.ggml.pre", "default")]()
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False)
                                for token, kind in zip(tokens, types, strict=False) if kind == _CONTROL])
    backend.add_tokens([AddedToken(token, special=False, normalized=False)
                        for token, kind in zip(tokens, types, strict=False) if kind == _USER_DEFINED])
    special_tokens = {name: tokens[meta[key]] for name, key in (
        ("bos_token", "tokenizer.ggml.bos_token_id"), ("eos_token", "tokenizer.ggml.eos_token_id"),
        ("unk_token", "tokenizer.ggml.unknown_token_id"), ("pad_token", "tokenizer.ggml.padding_token_id"),
    ) if key in meta and 0 <= meta[key] < len(tokens)}
    backend.post_processor = _post_processor(meta, special_tokens, vocab)
    return GGUFTokenizer(backend, special_tokens, meta.get("tokenizer.chat_template"))


def _post_processor(meta: dict[str, Any], special_tokens: dict[str, str],
                    vocab: dict[str, int]) -> processors.PostProcessor:
    """BOS/EOS around each encoded text where the file asks for them (tokenizer.ggml.add_bos_token/add_eos_token)."""
    before = [special_tokens["bos_token"]] if meta.get("tokenizer.ggml.add_bos_token") and "bos_token" in \
        special_tokens else []
    after = [special_tokens["eos_token"]] if meta.get("tokenizer.ggml.add_eos_token") and "eos_token" in \
        special_tokens else []
    single = " ".join([*before, "$A", *after])
    pair = " ".join([*before, "$A", *after, *before, "$B", *after])
    return processors.TemplateProcessing(single=single, pair=pair,
                                         special_tokens=[(token, vocab[token]) for token in {*before, *after}])
