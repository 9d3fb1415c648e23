"""The Ray Data side of runner=ray: one engine per actor, fed batches of rows, returning outputs and steps.

Rows and results cross the process boundary as JSON strings in a single column, so Ray's Arrow conversion never
has to guess types for nullable prompts or ragged token-id lists.
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from typing import Any

import numpy as np
import ray

from batchgen.config import Config
from batchgen.engine.detokenizer import Detokenizer
from batchgen.engine.llm_engine import LLMEngine
from batchgen.engine.outputs import RequestOutput
from batchgen.sample.params import row_params

OUTPUT = "output"
STEP = "step"
INFO = "info"


class EngineActor:
    """A callable class for `Dataset.map_batches`: each call generates one batch of rows to the end."""

    def __init__(self, config: Config):
        self.config = config
        self.actor_id = ray.get_runtime_context().get_actor_id()
        self.engine = LLMEngine(config.model, config.engine, Detokenizer.load(config.model))
        self.info_sent = False

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list[str]]:
        for line in batch["row"]:
            row = json.loads(line)
            params = row_params(self.config.sampling, row["overrides"], row["index"])  # the driver checked them
            self.engine.add_request(row["index"], row["prompt"], row["prompt_token_ids"], params, row["samples"])
        results: list[tuple[str, dict[str, Any]]] = []
        if not self.info_sent:
            results.append((INFO, self.engine.info))
            self.info_sent = True
        while self.engine.has_unfinished_requests:
            finished, step = self.engine.step()
            if step is not None:
                results.append((STEP, asdict(step)))
            results.extend((OUTPUT, output_record(output)) for output in finished)
        return {"kind": [kind for kind, _ in results], "actor": [self.actor_id] * len(results),
                "record": [json.dumps(record) for _, record in results]}


def output_record(output: RequestOutput) -> dict[str, Any]:
    """The output's fields as JSON values, its prompt logprobs as a list of entries (its prompt's ids once: as the
    list)."""
    entries = output.prompt_logprobs
    return {**asdict(replace(output, prompt_logprobs=None, prompt_array=None)),
            "prompt_logprobs": None if entries is None else list(entries)}
