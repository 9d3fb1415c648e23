"""Structured output: guided_json / guided_regex / guided_choice / guided_grammar through llguidance.

Each distinct spec is compiled once (a template matcher, cached); each guided request gets a copy that follows its
committed output tokens. Before a step samples, `bitmask` fills one packed row of allowed tokens per sampling row
on the host (-1, all allowed, for unguided rows); after it, `commit` advances the matchers and finishes the requests
whose grammar is complete (finish_reason "stop", as when EOS ends them: the mask allows EOS whenever the grammar
accepts). No host work and no mask at all while no guided request is alive.

The matcher follows `output_token_ids`, which preemption by recompute keeps, so a resumed request's matcher is
already where it was; if a request's outputs ever shrink, its matcher is reset and replayed from them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from batchgen.core.request import PENDING_TOKEN, Request
from batchgen.core.scheduler import Scheduler, SchedulerOutput
from batchgen.sample.params import GUIDED_FIELDS, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

EXTRA_HINT = "structured output needs the guided extra: pip install 'batchgen[guided]' (llguidance)"
_FORMATS = {"guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}  # llguidance's names


@dataclass(frozen=True)
class GuidedSpec:
    field: str  # the SamplingParams field that set it
    text: str  # the spec as text: a JSON schema or choice list as canonical JSON, else as given


def guided_spec(params: SamplingParams) -> GuidedSpec | None:
    for name in GUIDED_FIELDS:
        value = getattr(params, name)
        if value is not None:
            if name == "guided_choice" or (name == "guided_json" and not isinstance(value, str)):
                value = json.dumps(value)  # key order kept: it is the output order
            return GuidedSpec(name, value)
    return None


class _TokenTable:
    """The token table llguidance's TokenizerWrapper reads, for tokenizers whose decoder llguidance cannot infer
    from tokenizer.json (such as the Shakespeare model's character-level one, whose decoder is Fuse)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = list(tokenizer.all_special_ids)
        self.tokens = [tokenizer.decode([i]).encode() for i in range(len(tokenizer))]

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special_tokens=False)


def guidance_tokenizer(tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> Any:
    """llguidance's view of the tokenizer (about a second to build: built once per engine)."""
    import llguidance
    import llguidance.hf

    try:
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
    except ValueError:  # "can't determine decoder type": read the tokens one by one instead
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TokenTable(tokenizer)), n_vocab=vocab_size)


@dataclass
class _Guided:
    matcher: Any  # llguidance.LLMatcher
    num_consumed: int = 0  # output tokens the matcher has consumed


class StructuredOutputManager:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int):
        try:
            import llguidance
        except ImportError as exc:
            raise ValueError(EXTRA_HINT) from exc
        self._llguidance = llguidance
        self._tokenizer = guidance_tokenizer(tokenizer, vocab_size)
        self._executor = llguidance.LLExecutor()  # fills the rows of a step on several threads
        self.num_words = -(-vocab_size // 32)
        # Ids the tokenizer does not know (the model's vocab may be larger) are never allowed.
        self._tokenizer_words = -(-self._tokenizer.vocab_size // 32)
        self._templates: dict[GuidedSpec, Any] = {}  # compiled matcher, or the error message
        self._requests: dict[tuple[int, int], _Guided] = {}  # by request key, while unfinished

    # -- requests -------------------------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Gives a guided request its matcher; a spec that does not compile raises ValueError naming the field."""
        spec = guided_spec(request.sampling_params)
        template = self._templates.get(spec)
        if template is None:
            template = self._templates[spec] = self._compile(spec)
        if isinstance(template, str):
            raise ValueError(template)
        self._requests[request.key] = _Guided(template.deep_copy())

    def is_guided(self, request: Request) -> bool:
        return request.key in self._requests

    def samples_guided(self, step: SchedulerOutput) -> bool:
        """Whether the step samples a token for a guided request (the next step's mask depends on it)."""
        return any(samples and self.is_guided(r) for r, samples in zip(step.requests, step.samples, strict=True))

    def _compile(self, spec: GuidedSpec) -> Any:
        """The template matcher, or an error message naming the field."""
        llguidance = self._llguidance
        try:
            if spec.field == "guided_json":
                # Compact separators, no free whitespace: a weak model cannot pad forever.
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    spec.text, defaults={"whitespace_flexible": False})
            else:
                grammar = llguidance.grammar_from(_FORMATS[spec.field], spec.text)
        except ValueError as exc:
            return _invalid(spec, str(exc))
        error = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer)
        if error:
            return _invalid(spec, error)
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            return _invalid(spec, matcher.get_error())
        first = np.full((1, self.num_words), -1, dtype=np.int32)
        self._fill(matcher, first[0])
        if not matcher.is_accepting() and _allowed_ids(first[0]) <= set(self._tokenizer.eos_tokens):
            return f"{spec.field} cannot be spelled with this model's vocabulary (no allowed first token)"
        return matcher

    # -- one step -------------------------------------------------------------------------------------------

    def bitmask(self, requests: list[Request]) -> np.ndarray | None:
        """(S, ceil(V / 32)) int32 allowed tokens for the step's sampling rows, None when no row is guided."""
        rows = [(i, self._requests[r.key]) for i, r in enumerate(requests) if r.key in self._requests]
        if not rows:
            return None
        for i, guided in rows:
            self._sync(requests[i], guided)
        mask = np.full((len(requests), self.num_words), -1, dtype=np.int32)
        words = self._tokenizer_words
        target = mask if words == self.num_words else np.zeros((len(requests), words), dtype=np.int32)
        self._executor.unsafe_compute_mask_ptr([(guided.matcher, i) for i, guided in rows], target.ctypes.data,
                                               words * 4, len(requests))
        if target is not mask:  # the model's vocab is larger: its extra ids stay disallowed
            guided_rows = [i for i, _ in rows]
            mask[guided_rows] = 0
            mask[guided_rows, :words] = target[guided_rows]
        return mask

    def _fill(self, matcher: Any, row: np.ndarray) -> None:
        """Writes the matcher's allowed tokens into one mask row (tokenizer words, then zeros for extra ids)."""
        row[self._tokenizer_words:] = 0
        matcher.unsafe_compute_mask_ptr(row.ctypes.data, self._tokenizer_words * 4)

    def commit(self, step: SchedulerOutput, scheduler: Scheduler) -> list[Request]:
        """After the step's tokens are committed: advances the matchers, forgets finished requests, and finishes
        those whose grammar is complete; returns the requests it finished."""
        finished = []
        for request in step.requests:
            guided = self._requests.get(request.key)
            if guided is None:
                continue
            if request.is_finished:
                del self._requests[request.key]
                continue
            error = self._sync(request, guided)
            if error is None and not guided.matcher.is_stopped():
                continue
            del self._requests[request.key]
            scheduler.finish_request(request, "stop" if error is None else "error")
            request.error = error
            finished.append(request)
        return finished

    def _sync(self, request: Request, guided: _Guided) -> str | None:
        """Feeds the matcher the request's committed output tokens it has not seen; an error message if one is
        rejected (the mask makes that impossible unless the request was not masked)."""
        tokens = request.output_token_ids
        if guided.num_consumed > len(tokens):
            guided.matcher.reset()
            guided.num_consumed = 0
        new = tokens[guided.num_consumed:]
        if PENDING_TOKEN in new:
            new = new[:new.index(PENDING_TOKEN)]
        if new and not guided.matcher.consume_tokens(new):
            return f"a generated token breaks the {guided_spec(request.sampling_params).field} grammar: " \
                   f"{guided.matcher.get_error()}"
        guided.num_consumed += len(new)
        return None


def _invalid(spec: GuidedSpec, error: str) -> str:
    return f"{spec.field} is invalid: {' '.join(error.split())}"


def _allowed_ids(row: np.ndarray) -> set[int]:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())
