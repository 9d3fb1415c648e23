"""Text in and out of the engine: prompt encoding, stop strings and the final completion text."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from batchgen.config import ModelConfig
from batchgen.core.request import Request
from batchgen.core.scheduler import Scheduler, SchedulerOutput
from batchgen.engine.tokenizer import FastTokenizer, load_tokenizer
from batchgen.models.gguf_file import is_gguf_path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
STOP_WINDOW_MARGIN = 8  # extra tokens decoded beyond the longest stop string's length in characters


class Detokenizer:
    def __init__(self, tokenizer: Any):
        """tokenizer: a FastTokenizer or a transformers tokenizer (both encode, decode and know their eos)."""
        self.tokenizer = tokenizer
        self._stop_texts: dict[tuple[int, int], str] = {}  # text cut before the stop string, by (request id, sample)
        # The keys of requests with stop strings between add_request and remove_request: while there are none, a
        # step's stop check is skipped instead of visiting each of its rows.
        self._with_stop_strings: set[tuple[int, int]] = set()

    @classmethod
    def load(cls, model: ModelConfig) -> Detokenizer | None:
        """None when the checkpoint ships no tokenizer (or there is no checkpoint): prompts must be token ids."""
        if model.tokenizer is not None:
            return cls(load_tokenizer(model.tokenizer))
        if is_gguf_path(model.path):
            tokenizer = FastTokenizer.from_gguf(model.path)
            return None if tokenizer is None else cls(tokenizer)
        if model.path is None or not any((Path(model.path) / name).exists() for name in TOKENIZER_FILES):
            return None
        return cls(load_tokenizer(model.path))

    def transformers_tokenizer(self) -> Any:
        """The tokenizer as a transformers one, for APIs that need it (structured output)."""
        if isinstance(self.tokenizer, FastTokenizer):
            return self.tokenizer.transformers_tokenizer()
        return self.tokenizer

    @property
    def eos_token_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """The ids encode() gives each text, in one batched call: a transformers tokenizer's __call__ on a list adds
        special tokens as its encode() does."""
        if isinstance(self.tokenizer, FastTokenizer):
            return self.tokenizer.encode_batch(texts)
        return self.tokenizer(texts)["input_ids"] if texts else []  # transformers fails on an empty list

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def add_request(self, request: Request) -> None:
        """Counts a request whose stop strings the steps check, until `remove_request`."""
        if request.sampling_params.stop:
            self._with_stop_strings.add(request.key)

    def remove_request(self, request: Request, with_text: bool = True) -> str | None:
        """The request's output is handed back: no later step checks its stop strings. Returns its completion text
        (cut before the stop string that ended it) when with_text, else None."""
        key = request.key
        self._with_stop_strings.discard(key)
        stopped = self._stop_texts.pop(key, None)
        if not with_text:
            return None
        return stopped if stopped is not None else self.decode(request.output_token_ids)

    @property
    def checks_stop_strings(self) -> bool:
        """Whether a request added and not yet removed has stop strings: else steps skip the stop check."""
        return bool(self._with_stop_strings)

    def apply_stop_strings(self, step: SchedulerOutput, scheduler: Scheduler) -> list[Request]:
        """After `Scheduler.commit`: finishes requests whose text now ends in a stop string; returns those not
        already finished."""
        if not self.checks_stop_strings:
            return []
        newly_finished = []
        for request, samples, slot in zip(step.requests, step.samples, step.output_slots, strict=True):
            stops = request.sampling_params.stop
            if not samples or not stops or slot >= request.num_output_tokens:  # no token, or a discarded one
                continue
            if slot + 1 < request.sampling_params.min_tokens:  # as in vLLM, no stop before min_tokens
                continue
            if not self._tail_has_stop(request.output_token_ids, slot + 1, stops):
                continue
            text = self.decode(request.output_token_ids[:slot + 1])
            cut = min(i for i in (text.find(s) for s in stops) if i >= 0)
            self._stop_texts[request.key] = text[:cut]
            if request.is_finished:
                request.finish_reason = "stop"
            else:
                scheduler.finish_request(request, "stop")
                newly_finished.append(request)
        return newly_finished

    def _tail_has_stop(self, token_ids: list[int], end: int, stops: list[str]) -> bool:
        """Whether token_ids[:end] ends in a stop string, decoding only the last tokens, enough for the longest stop
        string: a full decode per step is O(n^2).

        Earlier text was checked at earlier steps, so a new match must end in the newest token. Tokens decode to
        at least one character each, except pieces of a multi-byte character: the margin covers those.
        """
        window = max(len(s) for s in stops) + STOP_WINDOW_MARGIN
        tail = self.decode(token_ids[max(0, end - window):end])
        return any(s in tail for s in stops)
