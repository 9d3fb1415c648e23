"""Which of a step's hidden states score which prompt tokens (`sampling.prompt_logprobs`): every prompt position the
step computes; position p's logits score prompt token p + 1, so the first prompt token has none, as in vLLM."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchgen.core.scheduler import SchedulerOutput
from batchgen.worker.step_inputs import StepInputs


@dataclass
class PromptLogprobsPlan:
    token_index: np.ndarray  # (P,) int64: the flattened token whose hidden state scores the target
    targets: np.ndarray  # (P,) int64: the prompt token scored
    owners: list[tuple[int, int]]  # (step row, prompt position of the target), parallel to targets
    k: int  # the most alternatives any row asks for


def plan_prompt_logprobs(step: SchedulerOutput, inputs: StepInputs) -> PromptLogprobsPlan | None:
    """Called at launch, before `Scheduler.advance`; skips positions already recorded (a recompute after
    preemption scores the same prompt again)."""
    token_index: list[int] = []
    targets: list[int] = []
    owners: list[tuple[int, int]] = []
    k = 0
    for row, (request, count) in enumerate(zip(step.requests, step.num_scheduled_tokens, strict=True)):
        wanted = request.sampling_params.prompt_logprobs
        if wanted is None:
            continue
        begin, start = request.num_computed_tokens, int(inputs.query_start_loc[row])
        first = max(begin, len(request.prompt_logprobs) - 1)
        for position in range(first, min(begin + count, request.num_prompt_tokens - 1)):
            token_index.append(start + position - begin)
            targets.append(request.prompt_token_ids[position + 1])
            owners.append((row, position + 1))
            k = max(k, wanted)
    if not owners:
        return None
    return PromptLogprobsPlan(np.array(token_index, dtype=np.int64), np.array(targets, dtype=np.int64), owners, k)
