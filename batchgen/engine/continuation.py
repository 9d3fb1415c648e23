"""Continuation scoring (job.task=score, `LLM.loglikelihood`): lm-evaluation-harness's `loglikelihood` requests.

A (context, continuation) pair is tokenized as lm-eval's `_encode_pair` does: trailing whitespace of the context
moves to the front of the continuation, the whole text is encoded once, and the continuation's tokens are those after
the context's own encoding, so that context + continuation tokens are exactly the whole text's tokens. No special
tokens are added (lm-eval's default for causal models); an empty context is the prefix token alone (BOS, else EOS).

The request prefills context + continuation and generates nothing; the prompt log-probability of every continuation
token is computed (worker/prompt_logprobs.py), so its result is their sum and whether each was the argmax.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from batchgen.core.prompt_logprobs import PromptLogprobs
from batchgen.sample.params import SamplingParams

# The sampling options of a request that only prefills (continuation scoring and pooling): no generated token; a
# scoring request's prompt logprobs are its continuation's, with no alternatives (a pooling step computes none).
PREFILL_ONLY = SamplingParams(max_tokens=0, prompt_logprobs=0, temperature=0.0, seed=0)


def encode_pair(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context tokens, continuation tokens); the context's tokens are empty for an empty context (the engine puts
    the prefix token there)."""
    if not context:
        return [], tokenizer.encode(continuation, add_special_tokens=False)
    num_spaces = len(context) - len(context.rstrip())
    if num_spaces:
        context, continuation = context[:-num_spaces], context[-num_spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    context_ids = tokenizer.encode(context, add_special_tokens=False)
    return context_ids, whole[len(context_ids):]


@dataclass(frozen=True)
class ContinuationScore:
    logprob: float  # the sum of the continuation tokens' log-probabilities given the context
    num_tokens: int
    is_greedy: bool  # every continuation token was the most likely one


def continuation_score(scored: PromptLogprobs) -> ContinuationScore:
    """From a scoring request's prompt logprobs: those of its continuation's tokens, the positions after its
    context."""
    return ContinuationScore(float(scored.logprobs.sum(dtype=np.float64)), scored.num_recorded,
                             bool((scored.ranks == 1).all()))
