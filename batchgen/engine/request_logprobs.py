"""Moves a step's log-probabilities onto its requests: a sampled token's as the dict completions.parquet stores, a
prompt's as slices of arrays (core/prompt_logprobs.py) whose dicts exist only when a Python API user reads them."""

from __future__ import annotations

from batchgen.core.scheduler import SchedulerOutput
from batchgen.engine.logprob_entries import TokenTexts, entry
from batchgen.worker.model_runner import StepResult


def attach_logprobs(step: SchedulerOutput, result: StepResult, texts: TokenTexts) -> None:
    """After `Scheduler.commit`: a sampled token's entry goes to its output slot, unless the token was discarded
    (its request had ended); a prompt position's values are recorded once (a recompute scores it again)."""
    for row, values in result.logprobs.items():
        request, slot = step.requests[row], step.output_slots[row]
        if request.logprobs is not None and slot < request.num_output_tokens and len(request.logprobs) == slot:
            request.logprobs.append(entry(request.output_token_ids[slot], *values, texts,
                                          request.sampling_params.logprobs))
    prompt = result.prompt_logprobs
    if prompt is None:
        return
    start = 0
    for scored in prompt.ranges:
        end = start + scored.count
        step.requests[scored.row].prompt_logprobs.record(scored.start, prompt.logprobs[start:end],
                                                         prompt.ranks[start:end], prompt.top_ids[start:end],
                                                         prompt.top_logprobs[start:end])
        start = end
