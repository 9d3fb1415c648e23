"""How many KV blocks a job can use at once (no torch): the memory budget is only an upper bound.

At most max_num_seqs requests run at once, and a running request never holds more than
ceil(min(prompt + max_tokens, max_model_len) / block_size) blocks: its last sampled token is never written to the
cache, and with async scheduling a request whose pending token reaches its length is not scheduled again, so no
lookahead block is needed. Finished requests free their blocks at commit, before they leave the running set.
So the max_num_seqs largest rows together bound what the job holds at any moment, and a cache that size never
preempts.

Besides the forward's activations, a step's log-probabilities need logits rows of the whole vocabulary: they are
computed in slices of `logprobs_slice_rows` rows, whose memory the profiling forward measures, so the cache leaves it.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

# The memory one slice of logprobs rows may take: at Qwen3's vocabulary (151,936) about 350 rows scored by torch,
# 1,750 by the fused kernel.
LOGPROBS_SLICE_BYTES = 512 * 2**20
# Per vocabulary entry of a slice row scored by torch: a 16-bit logit, its float32 copy and logsumexp's float32
# temporary (freed before the rank comparison's one-byte row).
LOGPROBS_BYTES_PER_LOGIT = 2 + 4 + 4
# Scored by the fused kernel (CUDA, at most one alternative: sample/logprobs_triton.py): the 16-bit logit alone.
FUSED_LOGPROBS_BYTES_PER_LOGIT = 2


class KVDemand:
    """What a job knows of its rows before the engine starts: per row, prompt tokens and max_tokens.

    num_decoding: the requests that take decode steps (max_tokens > 1: a prefill step draws the first token); a decode
    step holds at most this many.
    """

    def __init__(self, rows: Sequence[tuple[int, int]]):
        self._rows: Sequence[tuple[int, int]] | Future = rows
        self.num_decoding = sum(1 for _, max_tokens in rows if max_tokens > 1)

    @classmethod
    def coming(cls, rows: Future, num_decoding: int) -> KVDemand:
        """A demand whose rows are still being worked out (the job tokenizes its prompts while the engine loads):
        `rows` waits for them, and raises what working them out raised."""
        demand = cls([])
        demand._rows, demand.num_decoding = rows, num_decoding
        return demand

    @property
    def rows(self) -> Sequence[tuple[int, int]]:
        if isinstance(self._rows, Future):
            self._rows = self._rows.result()
        return self._rows

    def lengths(self, max_model_len: int) -> list[int]:
        """The longest sequence each row can grow to: prompt + max_tokens, at most max_model_len."""
        return [min(prompt + max_tokens, max_model_len) for prompt, max_tokens in self.rows]

    def longest(self, max_model_len: int) -> int:
        """The longest of `lengths`; max_model_len for a job without rows, as job_block_limit takes it."""
        return max(self.lengths(max_model_len), default=max_model_len)

    def __reduce__(self) -> tuple:  # a tensor-parallel follower's copy holds the rows themselves
        return KVDemand, (self.rows,)


@dataclass(frozen=True)
class KVBlockChoice:
    num_blocks: int
    reason: str


def _blocks(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def job_block_limit(max_num_seqs: int, max_model_len: int, block_size: int,
                    demand: KVDemand | None = None) -> KVBlockChoice:
    """The most blocks the job can hold at once: max_num_seqs full-length sequences, or less when its rows are known."""
    per_seq = _blocks(max_model_len, block_size)
    choice = KVBlockChoice(max_num_seqs * per_seq,
                           f"max_num_seqs={max_num_seqs} x {per_seq} blocks for max_model_len={max_model_len}")
    if not demand or not demand.rows:
        return choice
    needs = sorted((_blocks(length, block_size) for length in demand.lengths(max_model_len)),
                   reverse=True)[:max_num_seqs]
    if sum(needs) < choice.num_blocks:
        return KVBlockChoice(sum(needs), f"the {len(needs)} largest of the job's {len(demand.rows)} rows "
                                         "(prompt + max_tokens) run at once without preemption")
    return choice


def choose_num_blocks(budget_blocks: int, budget_reason: str, limit: KVBlockChoice) -> KVBlockChoice:
    """The smaller of the memory budget and what the job can use."""
    if budget_blocks <= limit.num_blocks:
        return KVBlockChoice(budget_blocks, budget_reason)
    return KVBlockChoice(limit.num_blocks, f"{limit.reason} (the memory budget allows {budget_blocks})")


def kv_budget_bytes(total_bytes: int, utilization: float, ranks_per_gpu: int, peak_bytes: int) -> int:
    """What one engine may give its KV cache on a GPU: its share of `utilization` of the GPU (engine.ranks_per_gpu
    engines split it evenly) less its own peak of model and activations, the one peak it can measure."""
    return int(total_bytes * utilization / ranks_per_gpu) - peak_bytes


def logprobs_slice_rows(vocab_size: int, bytes_per_logit: int) -> int:
    """How many rows of logits a step scores at once for prompt (or sampled) logprobs."""
    return max(1, LOGPROBS_SLICE_BYTES // (vocab_size * bytes_per_logit))
