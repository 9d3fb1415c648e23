"""Moves a step's log-probabilities onto its requests, as the dicts that completions.parquet stores."""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

from batchgen.core.scheduler import SchedulerOutput
from batchgen.engine.detokenizer import Detokenizer
from batchgen.worker.model_runner import StepResult


def token_texts(detokenizer: Detokenizer | None) -> Callable[[int], str | None]:
    """Each token's own text (special tokens included), cached per token id; None without a tokenizer."""
    if detokenizer is None:
        return lambda token_id: None
    return lru_cache(maxsize=65536)(lambda token_id: detokenizer.tokenizer.decode([token_id]))


def entry(token_id: int, logprob: float, rank: int, top_ids: list[int], top_logprobs: list[float],
          text: Callable[[int], str | None], k: int) -> dict:
    """The token's entry with its request's k most likely tokens: the step computed the most any of its rows asks
    for."""
    return {"token_id": token_id, "text": text(token_id), "logprob": logprob, "rank": rank,
            "top": [{"token_id": t, "text": text(t), "logprob": lp} for t, lp in zip(top_ids[:k], top_logprobs[:k],
                                                                                      strict=True)]}


def attach_logprobs(step: SchedulerOutput, result: StepResult, text: Callable[[int], str | None]) -> None:
    """After `Scheduler.commit`: a sampled token's entry goes to its output slot, unless the token was discarded
    (its request had ended); a prompt position's entry is added once (a recompute scores it again)."""
    for row, values in result.logprobs.items():
        request, slot = step.requests[row], step.output_slots[row]
        if request.logprobs is not None and slot < request.num_output_tokens and len(request.logprobs) == slot:
            request.logprobs.append(entry(request.output_token_ids[slot], *values, text,
                                          request.sampling_params.logprobs))
    prompt = result.prompt_logprobs
    if prompt is None:
        return
    for row, position, logprob, rank, top_ids, top_logprobs in zip(
        prompt.rows, prompt.positions, prompt.logprobs, prompt.ranks, prompt.top_ids, prompt.top_logprobs, strict=True
    ):
        request = step.requests[row]
        if len(request.prompt_logprobs) == position:
            request.prompt_logprobs.append(entry(request.prompt_token_ids[position], logprob, rank, top_ids,
                                                 top_logprobs, text, request.sampling_params.prompt_logprobs))
