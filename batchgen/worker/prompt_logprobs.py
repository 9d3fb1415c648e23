"""Which of a step's hidden states score which prompt tokens (`sampling.prompt_logprobs`): every prompt position the
step computes; position p's logits score prompt token p + 1, so the first prompt token has none, as in vLLM. The
plan's logits are computed and scored a bounded slice at a time."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from batchgen.core.scheduler import SchedulerOutput
from batchgen.sample.logprobs import LogprobsTensors, ScoredRange, SliceRows, compute_logprobs
from batchgen.worker.step_inputs import StepInputs


@dataclass
class PromptLogprobsPlan:
    token_index: np.ndarray  # (P,) int64: the flattened token whose hidden state scores the target
    targets: np.ndarray  # (P,) int64: the prompt token scored
    ranges: list[ScoredRange]  # which rows' positions the P targets are, in order
    k: int  # the most alternatives any row asks for


def plan_prompt_logprobs(step: SchedulerOutput, inputs: StepInputs) -> PromptLogprobsPlan | None:
    """Called at launch, before `Scheduler.advance`; skips positions already recorded (a recompute after
    preemption scores the same prompt again). A continuation-scoring request's entries start recorded up to its
    context (engine/continuation.py), so only its continuation's positions are scored. The step's decodes (its first
    rows) compute an output token's position, never a prompt's, and are not looked at."""
    token_index: list[np.ndarray] = []
    targets: list[np.ndarray] = []
    ranges: list[ScoredRange] = []
    k = 0
    first_chunk = step.num_decode_tokens
    for row, request, count in zip(range(first_chunk, step.num_seqs), step.requests[first_chunk:],
                                   step.num_scheduled_tokens[first_chunk:], strict=True):
        wanted = request.sampling_params.prompt_logprobs
        if wanted is None:
            continue
        begin, start = request.num_computed_tokens, int(inputs.query_start_loc[row])
        scored = np.arange(max(begin, request.prompt_logprobs.next_position - 1),
                           min(begin + count, request.num_prompt_tokens - 1), dtype=np.int64)  # positions scoring
        if not len(scored):
            continue
        token_index.append(scored + (start - begin))
        targets.append(request.prompt_array[scored + 1])
        ranges.append(ScoredRange(row, int(scored[0]) + 1, len(scored)))
        k = max(k, wanted)
    if not ranges:
        return None
    return PromptLogprobsPlan(np.concatenate(token_index), np.concatenate(targets), ranges, k)


def prompt_logprobs(plan: PromptLogprobsPlan, hidden: torch.Tensor,
                    compute_logits: Callable[[torch.Tensor], torch.Tensor], slice_rows: SliceRows,
                    pinned: bool) -> LogprobsTensors:
    """The plan's prompt logprobs from the step's hidden states (T, H), a slice of rows of logits at a time."""
    index, targets = (torch.from_numpy(a).to(hidden.device, non_blocking=True) for a in (plan.token_index,
                                                                                        plan.targets))
    return compute_logprobs(lambda start, end: compute_logits(hidden.index_select(0, index[start:end])), targets,
                            plan.k, slice_rows, pinned)
