"""A step's sampling rows prepared on the host (`SamplingBatch`), and their view on the device (`SamplingTensors`).

Each row's parameters are named fields (FLOAT_FIELDS, INT_FIELDS), laid out as the rows of one byte buffer
(`ParamLayout`), so that a step uploads them in one copy: into a buffer of its own (an eager step) or into a sampler
graph's static one, padded to the graph's bucket.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cache
from itertools import repeat

import numpy as np
import torch

from batchgen.layers.staging import aligned_length
from batchgen.sample.bad_words import BadWordCandidates, bad_word_candidates
from batchgen.sample.params import SamplingParams
from batchgen.sample.penalties import PenaltyTensors
from batchgen.sample.state import SamplingState, TokenHistory

# Each field with the value of a row that uses nothing (also a graph bucket's padding rows): greedy, no filter, no
# penalty. The order is the buffer's.
FLOAT_FIELDS = {
    "temperature": 0.0,  # 0: greedy
    "inv_temperature": 1.0,  # 1 / temperature, 1 for greedy rows: computed once, on the host
    "top_p": 1.0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "block_stops": 0.0,  # 1 while fewer than min_tokens tokens are generated
}
INT_FIELDS = {"top_k": 0, "seed": 0, "position": 0, "state_row": 0}
_NEUTRAL_FLOATS = np.array(list(FLOAT_FIELDS.values()), dtype=np.float32)[:, None]
_NEUTRAL_INTS = np.array(list(INT_FIELDS.values()), dtype=np.int64)[:, None]
_POSITION = list(INT_FIELDS).index("position")
_SEED_MODULUS = 1 << 63


@dataclass(frozen=True)
class SamplingFeatures:
    """The stages a step runs. Fixed per step (and per captured graph): shapes never depend on the data, and a
    stage no row uses is not run at all."""

    random: bool = False  # some row draws (temperature > 0)
    top_k: bool = False
    top_p: bool = False
    min_p: bool = False
    penalties: bool = False  # some row uses its per-request state rows (penalties, bias, min_tokens, ...)
    bitmask: bool = False  # a structured-output token bitmask

    @property
    def any(self) -> bool:
        return self != SamplingFeatures()


@dataclass(frozen=True)
class SamplingBatch:
    """A step's sampling rows on the host: their parameters, one block row per field, and what else the stages read."""

    features: SamplingFeatures
    floats: np.ndarray  # (len(FLOAT_FIELDS), S) float32
    ints: np.ndarray  # (len(INT_FIELDS), S) int64
    logprobs: list[int | None]  # per row: how many alternatives to report, None for none
    bad_words: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # (row, expected last token, banned token)
    bitmask: torch.Tensor | None = None  # (S, ceil(V / 32)) int32 on the host, pinned on CUDA

    @classmethod
    def prepare(cls, params: list[SamplingParams], positions: Sequence[int] | np.ndarray,
                state: SamplingState | None = None, histories: list[TokenHistory | None] | None = None,
                seeds: Sequence[int] | None = None) -> SamplingBatch:
        """params: the rows'. positions: the index in its sequence of the token each row samples. histories: None
        unless some row uses penalty state, which `state` then holds. seeds: the rows' (any integers: they are
        reduced modulo 2**63); None: their params' seeds. Greedy rows keep their filter values: the filters do not
        change an argmax."""
        n = len(params)
        shared = shared_params(params)
        # Where the rows share one parameters object (a job's rows without overrides), its values are read once and
        # each column broadcasts them.
        distinct = params if shared is None else [shared]
        logprobs = [p.logprobs for p in params] if shared is None else [shared.logprobs] * n
        temperatures = [p.temperature for p in distinct]
        random_rows = np.array(temperatures, dtype=np.float64) != 0  # greedy: temperature 0, compared as given
        if not random_rows.any() and histories is None:  # argmax alone (the common greedy step): neutral rows
            return cls(SamplingFeatures(), np.repeat(_NEUTRAL_FLOATS, n, axis=1), np.repeat(_NEUTRAL_INTS, n, axis=1),
                       logprobs)
        temperature = np.array(temperatures, dtype=np.float32)
        top_p = np.array([p.top_p for p in distinct], dtype=np.float64)
        min_p = np.array([p.min_p for p in distinct], dtype=np.float64)
        top_k = np.maximum(np.array([p.top_k for p in distinct], dtype=np.int64), 0)
        one = np.float32(1)
        columns = {
            "temperature": temperature,
            "inv_temperature": one / np.where(temperature == 0, one, temperature),  # in float32, as the kernels read it
            "top_p": top_p,
            "min_p": min_p,
            # Without penalty state every row's penalties are off: their columns hold the neutral values.
            "repetition_penalty": [p.repetition_penalty for p in distinct] if histories is not None else 1.0,
            "presence_penalty": [p.presence_penalty for p in distinct] if histories is not None else 0.0,
            "frequency_penalty": [p.frequency_penalty for p in distinct] if histories is not None else 0.0,
            "block_stops": 0,
            "top_k": top_k,
            "seed": [seed % _SEED_MODULUS for seed in (seeds if seeds is not None else [p.seed for p in params])],
            "position": positions,
            "state_row": 0,
        }
        bad_words = None
        if histories is not None:
            # The token being sampled is output number len(output_token_ids) (pending slots included).
            columns["block_stops"] = [h is not None and len(h.output_token_ids) < p.min_tokens
                                      for h, p in zip(histories, params, strict=True)]
            columns["state_row"] = state.rows(params, histories)
            bad_words = bad_word_candidates(histories)
        floats = np.empty((len(FLOAT_FIELDS), n), dtype=np.float32)
        ints = np.empty((len(INT_FIELDS), n), dtype=np.int64)
        for i, name in enumerate(FLOAT_FIELDS):
            floats[i] = columns[name]
        for i, name in enumerate(INT_FIELDS):
            ints[i] = columns[name]
        features = SamplingFeatures(
            random=bool(random_rows.any()),
            top_k=bool((top_k[random_rows] > 0).any()),
            top_p=bool((top_p[random_rows] < 1).any()),
            min_p=bool((min_p[random_rows] > 0).any()),
            penalties=histories is not None,
        )
        return cls(features, floats, ints, logprobs, bad_words)

    @property
    def num_rows(self) -> int:
        return self.floats.shape[1]

    @property
    def greedy_rows(self) -> np.ndarray | None:
        """Per row, whether it is greedy (temperature 0: it takes the argmax); None when every row is."""
        return self.floats[0] == 0 if self.features.random else None

    @property
    def fixed_shape(self) -> bool:
        """Whether the stages' shapes are the batch's alone, as a graph needs: bad-word candidates vary in number."""
        return self.bad_words is None

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs.count(None) != len(self.logprobs)

    def with_bitmask(self, array: np.ndarray | None, vocab_size: int, pinned: bool) -> SamplingBatch:
        """The batch with the rows' structured-output mask (None: no row guided), padded to the vocabulary's words
        (missing words: disallowed)."""
        if array is None:
            return self
        rows, words = self.num_rows, -(-vocab_size // 32)
        if array.ndim != 2 or array.shape[0] != rows or array.dtype != np.int32:
            raise ValueError(f"bitmask_provider returned {array.dtype} {array.shape}; expected int32 ({rows}, {words})")
        bitmask = torch.zeros(rows, words, dtype=torch.int32, pin_memory=pinned)
        width = min(words, array.shape[1])
        bitmask.numpy()[:, :width] = array[:, :width]
        return replace(self, features=replace(self.features, bitmask=True), bitmask=bitmask)

    def to_device(self, device: torch.device | str, state: SamplingState | None = None,
                  last_tokens: torch.Tensor | None = None) -> SamplingTensors:
        """The eager step's tensors; last_tokens (S,): each row's latest token on the device (for bad words)."""
        if not self.features.any and self.bad_words is None:  # argmax alone: nothing to copy
            return SamplingTensors()
        layout = ParamLayout.of(self.num_rows)
        # Pinned, so that the copy queues behind the device's work instead of waiting for it.
        host = torch.empty(layout.nbytes, dtype=torch.uint8, pin_memory=torch.device(device).type == "cuda")
        layout.stage(self, host.numpy())
        bitmask = None if self.bitmask is None else self.bitmask.to(device, non_blocking=True)
        tensors = SamplingTensors.view(self.features, layout.fields(host.to(device, non_blocking=True)), state,
                                       bitmask)
        if self.bad_words is not None:
            rows, expected, banned = (torch.from_numpy(a).to(device, non_blocking=True) for a in self.bad_words)
            tensors.bad_words = BadWordCandidates(rows, expected, banned, last_tokens)
        return tensors


class LastPacked:
    """The previous step's batch without penalty state. A step of the same rows in the same order (most decode
    steps) shares its parameters and only moves the positions; a step of some of them takes their columns."""

    def __init__(self) -> None:
        self.params: list[SamplingParams] = []
        self.seeds: Sequence[int] | None = None
        self.batch: SamplingBatch | None = None

    def prepare(self, params: list[SamplingParams], positions: Sequence[int] | np.ndarray,
                state: SamplingState | None = None, histories: list[TokenHistory | None] | None = None,
                seeds: Sequence[int] | None = None) -> SamplingBatch:
        """SamplingBatch.prepare, reusing the previous step's rows where it can."""
        if histories is not None:
            return SamplingBatch.prepare(params, positions, state, histories, seeds)
        batch = self.repeat(params, positions, seeds)
        if batch is None:
            batch = SamplingBatch.prepare(params, positions, seeds=seeds)
            self.params, self.seeds, self.batch = params, seeds, batch
        return batch

    def repeat(self, params: list[SamplingParams], positions: Sequence[int] | np.ndarray,
               seeds: Sequence[int] | None = None, rows: list[int] | None = None) -> SamplingBatch | None:
        """The previous batch with these positions, when its rows had these very parameters and these seeds; else
        None. rows: the previous rows this step keeps (ascending indices among them; None: all), whose columns the
        batch takes, with the previous batch's stages: a stage that none of the kept rows uses leaves their tokens as
        they are (as it does a graph bucket's padding rows). Such rows use no penalty state (the previous batch had
        none, and that depends on the parameters alone), so a caller may ask this before it gathers the rows' token
        histories."""
        last = self.batch
        if last is None:
            return None
        if rows is None:
            kept_params, kept_seeds = self.params, self.seeds
        elif rows and rows[-1] < len(self.params):
            kept_params = list(map(self.params.__getitem__, rows))
            kept_seeds = None if self.seeds is None else list(map(self.seeds.__getitem__, rows))
        else:
            return None
        if (len(params) != len(kept_params) or seeds != kept_seeds
                or not all(map(operator.is_, params, kept_params))):
            return None
        if rows is None:  # the floats are never written, the ints only here, on a copy
            floats, ints, logprobs = last.floats, last.ints.copy(), last.logprobs
        else:
            floats, ints, logprobs = last.floats[:, rows], last.ints[:, rows], list(map(last.logprobs.__getitem__,
                                                                                          rows))
        ints[_POSITION] = positions
        self.params, self.seeds = params, seeds
        self.batch = replace(last, floats=floats, ints=ints, logprobs=logprobs)
        return self.batch


def shared_params(params: list[SamplingParams]) -> SamplingParams | None:
    """The parameters object of every row where they all share one (a job's rows without overrides), else None."""
    if not params:
        return None
    first = params[0]
    return first if all(map(operator.is_, params, repeat(first))) else None


@dataclass(frozen=True)
class ParamLayout:
    """Where the fields of `size` rows lie in one byte buffer: the float32 rows, then the int64 rows, each starting on
    a 64-byte line (Triton specializes on alignment)."""

    size: int
    stride: int  # elements from one field's row to the next: whole 64-byte lines for float32 rows, so for int64 too
    floats_nbytes: int
    nbytes: int

    @classmethod
    @cache
    def of(cls, size: int) -> ParamLayout:
        stride = aligned_length(size, 4)
        floats_nbytes = len(FLOAT_FIELDS) * stride * 4
        return cls(size, stride, floats_nbytes, floats_nbytes + len(INT_FIELDS) * stride * 8)

    def stage(self, batch: SamplingBatch, host: np.ndarray) -> None:
        """The batch's rows into a host byte buffer, padded to `size` with neutral rows."""
        n, end = batch.num_rows, self.floats_nbytes
        floats = host[:end].view(np.float32).reshape(len(FLOAT_FIELDS), self.stride)
        ints = host[end:self.nbytes].view(np.int64).reshape(len(INT_FIELDS), self.stride)
        floats[:, :n], ints[:, :n] = batch.floats, batch.ints
        floats[:, n:self.size], ints[:, n:self.size] = _NEUTRAL_FLOATS, _NEUTRAL_INTS

    def fields(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each field's (size,) view of a device byte buffer laid out this way."""
        end = self.floats_nbytes
        floats = buffer[:end].view(torch.float32).view(len(FLOAT_FIELDS), self.stride)[:, :self.size]
        ints = buffer[end:self.nbytes].view(torch.int64).view(len(INT_FIELDS), self.stride)[:, :self.size]
        return dict(zip(FLOAT_FIELDS, floats, strict=True)) | dict(zip(INT_FIELDS, ints, strict=True))


@dataclass
class SamplingTensors:
    """A step's rows on the device, (B,) each, for the stages its features run; None where no row uses a stage (every
    draw field when all rows are greedy)."""

    temperature: torch.Tensor | None = None  # float32, 0 = greedy row
    inv_temperature: torch.Tensor | None = None  # float32, 1 for greedy rows
    top_k: torch.Tensor | None = None  # int64, 0 = off
    top_p: torch.Tensor | None = None  # float32
    min_p: torch.Tensor | None = None  # float32
    seed: torch.Tensor | None = None  # int64 in [0, 2**63)
    position: torch.Tensor | None = None  # int64: the index in its sequence of the token being sampled
    penalties: PenaltyTensors | None = None
    bitmask: torch.Tensor | None = None  # (B, ceil(V / 32)) int32, applied first
    bad_words: BadWordCandidates | None = None  # eager steps only: their count depends on the data

    @property
    def all_greedy(self) -> bool:
        return self.temperature is None

    @classmethod
    def view(cls, features: SamplingFeatures, fields: dict[str, torch.Tensor], state: SamplingState | None = None,
             bitmask: torch.Tensor | None = None) -> SamplingTensors:
        """The fields (a step's own buffer, or a graph's static one) that the stages of `features` read."""
        random = features.random
        penalties = None
        if features.penalties:
            penalties = PenaltyTensors(state.rows_tensors, fields["state_row"], fields["repetition_penalty"],
                                       fields["presence_penalty"], fields["frequency_penalty"], fields["block_stops"])
        return cls(
            temperature=fields["temperature"] if random else None,
            inv_temperature=fields["inv_temperature"] if random else None,
            top_k=fields["top_k"] if features.top_k else None,
            top_p=fields["top_p"] if features.top_p else None,
            min_p=fields["min_p"] if features.min_p else None,
            seed=fields["seed"] if random else None,
            position=fields["position"] if random else None,
            penalties=penalties,
            bitmask=bitmask if features.bitmask else None,
        )
