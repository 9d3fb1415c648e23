"""A step's sampling inputs on the host: packed per-row parameters, the structured-output bitmask, the bad-word
candidates and the logprobs each row asks for."""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from batchgen.core.request import Request
from batchgen.sample.params import SamplingParams
from batchgen.sample.penalties import BadWordCandidates
from batchgen.sample.sampler import INT_FIELDS, PackedSampling, SamplingTensors
from batchgen.sample.state import SamplingState

# (sampling rows' requests) -> (B, W) int32 bitmask, bit j of word w allowing token 32 * w + j; None: no row guided.
BitmaskProvider = Callable[[list[Request]], np.ndarray | None]


@dataclass
class StepSampling:
    packed: PackedSampling
    bitmask: torch.Tensor | None  # (S, ceil(V / 32)) int32 on the host, pinned on CUDA
    bad_words: tuple[np.ndarray, np.ndarray, np.ndarray] | None  # (batch rows, expected last token, banned token)
    logprobs: list[int | None]  # per sampling row: how many alternatives to report, None for none

    def add_bitmask(self, array: np.ndarray | None, vocab_size: int, pinned: bool) -> None:
        """The structured-output mask of the sampling rows (None: no row guided), padded to the vocabulary's words
        (missing words: disallowed)."""
        if array is None:
            return
        rows, words = len(self.logprobs), -(-vocab_size // 32)
        if array.ndim != 2 or array.shape[0] != rows or array.dtype != np.int32:
            raise ValueError(f"bitmask_provider returned {array.dtype} {array.shape}; expected int32 ({rows}, {words})")
        bitmask = torch.zeros(rows, words, dtype=torch.int32, pin_memory=pinned)
        width = min(words, array.shape[1])
        bitmask.numpy()[:, :width] = array[:, :width]
        self.bitmask = bitmask
        self.packed = replace(self.packed, features=replace(self.packed.features, bitmask=True))

    @property
    def wants_logprobs(self) -> bool:
        return any(k is not None for k in self.logprobs)

    def tensors(self, device: torch.device, state: SamplingState | None,
                last_tokens: torch.Tensor | None) -> SamplingTensors:
        """The eager step's tensors; last_tokens (S,): each row's latest token on the device (for bad words)."""
        if not self.packed.features.any and self.bad_words is None:  # argmax alone: nothing to copy
            return SamplingTensors(None, None, None, None, None, None, all_greedy=True)
        floats, ints = self.packed.to_device(device)
        bitmask = None if self.bitmask is None else self.bitmask.to(device, non_blocking=True)
        tensors = SamplingTensors.from_packed(self.packed.features, floats, ints,
                                              state.rows_tensors if state is not None else None, bitmask)
        if self.bad_words is not None:
            rows, expected, banned = (torch.from_numpy(a).to(device, non_blocking=True) for a in self.bad_words)
            tensors.bad_words = BadWordCandidates(rows, expected, banned, last_tokens)
        return tensors


class LastPacked:
    """The previous step's packed rows and their requests. A step of the same requests in the same order (most
    decode steps) shares its parameters and only moves the positions (52 -> 17 µs of host time at batch 64)."""

    def __init__(self) -> None:
        self.requests: list[Request] = []
        self.packed: PackedSampling | None = None

    def pack(self, requests: list[Request], params: list[SamplingParams]) -> PackedSampling:
        positions = np.fromiter((r.num_tokens for r in requests), dtype=np.int64, count=len(requests))
        last = self.packed
        if last is not None and len(requests) == len(self.requests) and all(map(operator.is_, requests,
                                                                                self.requests)):
            ints = last.ints.copy()  # the floats are never written, the ints only here, on a copy
            ints[INT_FIELDS.index("position")] = positions
            packed = PackedSampling(last.features, last.floats, ints)
        else:
            packed = PackedSampling.from_params(params, [p.seed for p in params], positions)
        self.requests, self.packed = requests, packed
        return packed


def build_step_sampling(requests: list[Request], state: SamplingState | None, pinned: bool,
                        last: LastPacked | None = None) -> StepSampling:
    """requests: the step's sampling rows, in order. state: None unless some request uses penalty state.
    last: the previous step's rows, reused for a step without penalty state."""
    params = [r.sampling_params for r in requests]
    state_rows = state.rows(requests) if state is not None else None
    if state_rows is None and last is not None:
        packed = last.pack(requests, params)
    else:
        # The token being sampled is output number num_output_tokens (pending slots included).
        block_stops = None
        if state_rows is not None:
            block_stops = [r.num_output_tokens < p.min_tokens for r, p in zip(requests, params, strict=True)]
        packed = PackedSampling.from_params(params, [p.seed for p in params], [r.num_tokens for r in requests],
                                            state_rows, block_stops)
    bad_words = _bad_word_candidates(requests) if state_rows is not None else None  # bad words use state rows
    return StepSampling(packed, None, bad_words, [p.logprobs for p in params])


def _bad_word_candidates(requests: list[Request]) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """vLLM's rule on output tokens: a word's last token is banned when the tokens before it end the output. All
    but the latest output token are known here; the device compares that one (it may still be pending)."""
    rows, expected, banned = [], [], []
    for row, request in enumerate(requests):
        outputs = request.output_token_ids
        for ids in request.bad_words_token_ids:
            prefix_len = len(ids) - 1
            if prefix_len == 0 or prefix_len > len(outputs):  # one-token words are in the state row's bias
                continue
            if prefix_len > 1 and outputs[-prefix_len:-1] != ids[:-2]:
                continue
            rows.append(row)
            expected.append(ids[-2])
            banned.append(ids[-1])
    if not rows:
        return None
    return (np.array(rows, dtype=np.int64), np.array(expected, dtype=np.int64), np.array(banned, dtype=np.int64))
