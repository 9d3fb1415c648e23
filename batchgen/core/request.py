"""A generation request as the scheduler sees it (no torch)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum, auto
from itertools import chain

import numpy as np

from batchgen.core.prompt_logprobs import PromptLogprobs
from batchgen.sample.params import SamplingParams

# An output slot whose token is still being sampled on the device (async scheduling runs one step ahead).
PENDING_TOKEN = -1


class RequestStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(slots=True)
class Request:
    request_id: int
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose KV is in the cache; after preemption it restarts at 0 and prompt + outputs are recomputed.
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # stop | length | error
    error: str | None = None
    num_preemptions: int = 0
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    # Prefix caching. False for requests that must compute every prompt token (prompt logprobs need their logits).
    use_prefix_cache: bool = True
    # At most this many leading tokens may come from the cache (None: no limit): a scoring or pooling request needs
    # the hidden states of the positions after them (a continuation's, a pooled position's).
    max_cached_tokens: int | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the cache at the first admission
    block_hashes: list[bytes] = field(default_factory=list, repr=False)  # of the full blocks of known tokens
    num_hashed_blocks: int = 0  # leading blocks of block_ids registered in (or taken from) the cache
    # n > 1: the sample's index among its prompt's samples, and the prompt's first sample (None for that one)
    sample_index: int = 0
    first_sample: Request | None = field(default=None, repr=False)
    # The seed of its random draws (None: sampling_params.seed): the engine gives each request its own, so that the
    # requests of a job share one parameters object.
    seed: int | None = None
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # sampling_params.bad_words, tokenized
    # Per generated token when sampling_params asks for logprobs; per prompt token with prompt_logprobs.
    logprobs: list | None = None
    prompt_logprobs: PromptLogprobs | None = None
    # prompt_array's value, made on its first use (a slots class has no instance dict for cached_property).
    _prompt_array: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)
    # Set by the scheduler when it receives the request, so that its per-step checks read one attribute each: the
    # output count that ends it on length (max_tokens, or the tokens max_model_len leaves after the prompt), and the
    # sampled ids that end it on stop (its eos_token_id unless ignore_eos, and stop_token_ids).
    max_num_outputs: int = field(default=0, init=False, repr=False, compare=False)
    stop_token_set: frozenset[int] = field(default=frozenset(), init=False, repr=False, compare=False)

    @property
    def key(self) -> tuple[int, int]:
        """Unique among live requests: the n samples of a prompt share its request id."""
        return self.request_id, self.sample_index

    @property
    def sampling_seed(self) -> int | None:
        """The seed of its random draws."""
        return self.sampling_params.seed if self.seed is None else self.seed

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def prompt_array(self) -> np.ndarray:
        """The prompt as int64, for the step inputs: a prefill chunk of the prompt is then one slice of it. Made
        when the scheduler receives the request, not in the step that admits it."""
        if self._prompt_array is None:
            self._prompt_array = np.array(self.prompt_token_ids, dtype=np.int64)
        return self._prompt_array

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def is_decoding(self) -> bool:
        """Only the last sampled token is missing from the cache: the next step is a decode."""
        outputs = self.output_token_ids  # read directly: the scheduler asks this of every running request per step
        return bool(outputs) and self.num_computed_tokens == len(self.prompt_token_ids) + len(outputs) - 1

    def drop_pending_tokens(self) -> None:
        """Forget the slots of steps launched after the request finished: their tokens are discarded."""
        while self.output_token_ids and self.output_token_ids[-1] == PENDING_TOKEN:
            self.output_token_ids.pop()

    def token_id(self, position: int) -> int:
        if position < self.num_prompt_tokens:
            return self.prompt_token_ids[position]
        return self.output_token_ids[position - self.num_prompt_tokens]

    def token_ids(self, start: int, end: int) -> list[int]:
        prompt_len = self.num_prompt_tokens
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len:end - prompt_len]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - prompt_len]

    def known_token_ids(self, start: int, end: int) -> list[int]:
        """token_ids(start, end) up to the first pending token. Only the last output slots can be pending (steps
        commit in order), so a prompt range or outputs not ending in a pending slot need no scan."""
        token_ids, outputs = self.token_ids(start, end), self.output_token_ids
        if end > len(self.prompt_token_ids) and outputs and outputs[-1] == PENDING_TOKEN:
            first_pending = len(self.prompt_token_ids) + outputs.index(PENDING_TOKEN)
            return token_ids[:max(0, first_pending - start)]
        return token_ids

    def known_block(self, start: int, end: int) -> list[int] | None:
        """token_ids(start, end) when all of them are known (none pending, none past the last), else None:
        known_token_ids for a range the caller needs whole, without building the tokens it would cut off."""
        outputs, num_prompt = self.output_token_ids, len(self.prompt_token_ids)
        if end <= num_prompt:
            token_ids = self.prompt_token_ids[start:end]
        elif outputs and outputs[-1] == PENDING_TOKEN and num_prompt + outputs.index(PENDING_TOKEN) < end:
            return None
        elif start >= num_prompt:
            token_ids = outputs[start - num_prompt:end - num_prompt]
        else:
            token_ids = self.prompt_token_ids[start:] + outputs[:end - num_prompt]
        return token_ids if len(token_ids) == end - start else None


def prompt_arrays(requests: list[Request]) -> list[bytes | None]:
    """Makes the prompt_array of each request that has none, as a view of one int64 array holding all their prompts
    (one conversion instead of one per request); returns, parallel to requests, the int64 bytes of each prompt made
    here (None for a request whose array was already made)."""
    new = [request for request in requests if request._prompt_array is None]
    lengths = [len(request.prompt_token_ids) for request in new]
    prompts = np.fromiter(chain.from_iterable(request.prompt_token_ids for request in new), dtype=np.int64,
                          count=sum(lengths))
    data = prompts.tobytes()
    made: dict[int, bytes] = {}
    start = 0
    for request, length in zip(new, lengths, strict=True):
        end = start + length
        request._prompt_array = prompts[start:end]
        made[id(request)] = data[8 * start:8 * end]
        start = end
    return [made.get(id(request)) for request in requests]
