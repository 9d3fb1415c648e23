"""What a finished request hands back to the caller: the Python API's result and one completions row."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    text: str | None  # None without a tokenizer (token-id prompts on a dummy model) or for an error
    token_ids: list[int]
    finish_reason: str  # stop | length | error
    error: str | None = None
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    latency_ms: float | None = None
    num_preemptions: int = 0
    sample_index: int = 0  # which of the prompt's n samples this is
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    # The engine's int64 copy of prompt_token_ids (a view of the array its step inputs slice): the completions
    # writer builds its column from these arrays, much faster than from a Python list a row.
    prompt_array: np.ndarray | None = field(default=None, repr=False, compare=False)
    # LLM.generate: the prompt's n samples in sample order (vLLM's RequestOutput.outputs), this one first.
    outputs: list[RequestOutput] = field(default_factory=list, repr=False, compare=False)
    # With sampling.logprobs / prompt_logprobs: per token {token_id, text, logprob, rank, top: [{token_id, text,
    # logprob}]}, the prompt's first entry None. The prompt's entries are a sequence whose dicts are made when read
    # (engine/request_logprobs.py PromptLogprobEntries), or a list.
    logprobs: list[dict] | None = None
    prompt_logprobs: Sequence[dict | None] | None = None
    # Continuation scoring (job.task=score): the continuation tokens' summed logprob given the context, their number,
    # and whether each was the most likely token.
    continuation_logprob: float | None = None
    continuation_num_tokens: int | None = None
    continuation_is_greedy: bool | None = None
    embedding: list[float] | None = None  # job.task=embed
    # job.task=classify: the label logits, their softmax and the most likely label's name; a reward model (one
    # label) gives its logit as `score`, and no probs or label.
    logits: list[float] | None = None
    probs: list[float] | None = None
    label: str | None = None
    score: float | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens_run(self) -> int:
        """The prompt tokens the engine ran: none for a request that failed before it ran (a prompt longer than
        max_model_len, an option the engine refuses), which has an error and no output tokens. The rule of
        summary.ran_rows."""
        return 0 if self.finish_reason == "error" and not self.token_ids else len(self.prompt_token_ids)

def classification_fields(logits: list[float], id2label: dict[Any, str] | None) -> dict[str, Any]:
    """RequestOutput's classification fields from a classifier's logits; id2label as config.json has it (string
    keys) or transformers' config (int keys)."""
    if len(logits) == 1:
        return {"logits": logits, "score": logits[0]}
    largest = max(logits)
    exps = [math.exp(logit - largest) for logit in logits]
    total = sum(exps)
    best = logits.index(largest)
    labels = {int(key): name for key, name in (id2label or {}).items()}
    return {"logits": logits, "probs": [e / total for e in exps], "label": labels.get(best, f"LABEL_{best}")}
