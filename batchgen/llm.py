"""The Python API in vLLM's offline shape: `LLM(model=...).generate(prompts, sampling_params)`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from tqdm.auto import tqdm

from batchgen.config import CudaGraphConfig, EngineConfig, ModelConfig, validate_engine, validate_model
from batchgen.engine.llm_engine import LLMEngine
from batchgen.engine.outputs import RequestOutput
from batchgen.models.hub import resolve_model
from batchgen.sample.params import SamplingParams

Prompt = str | list[int]


class LLM:
    """Engine options use vLLM's names: max_num_seqs, max_num_batched_tokens, max_model_len, block_size,
    enforce_eager, dtype, gpu_memory_utilization, seed, num_gpu_blocks_override, ...; model_impl is model.impl."""

    def __init__(self, model: str | None = None, *, tokenizer: str | None = None, load_format: str = "auto",
                 hf_config: dict[str, Any] | None = None, dtype: str = "auto", model_impl: str = "auto",
                 cuda_graph_capture_sizes: list[int] | None = None, **engine_options: Any):
        known = {f.name for f in fields(EngineConfig)} - {"cuda_graph"}
        unknown = set(engine_options) - known
        if unknown:
            raise TypeError(f"unknown engine options {sorted(unknown)}; known: {', '.join(sorted(known))}")
        model_config = ModelConfig(path=model, tokenizer=tokenizer, load_format=load_format, hf_config=hf_config,
                                   dtype=dtype, impl=model_impl)
        engine_config = EngineConfig(cuda_graph=CudaGraphConfig(capture_sizes=cuda_graph_capture_sizes),
                                     **engine_options)
        validate_model(model_config)
        validate_engine(engine_config)
        self.engine = LLMEngine(resolve_model(model_config), engine_config)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """One output per prompt, in input order. A prompt is text or a list of token ids. With n > 1 samples the
        output is the prompt's first sample and `outputs` lists all n (vLLM's RequestOutput.outputs)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            if isinstance(prompt, str):
                self.engine.add_request(i, prompt, None, p)
            else:
                self.engine.add_request(i, None, list(prompt), p)
        samples: list[RequestOutput] = []
        with tqdm(total=sum(p.n for p in params), desc="generate", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests:
                finished, _ = self.engine.step()
                samples += finished
                bar.update(len(finished))
        return group_samples(samples)

    def close(self) -> None:
        self.engine.close()


def group_samples(samples: list[RequestOutput]) -> list[RequestOutput]:
    """Each prompt's first sample, in prompt order, holding all of the prompt's samples in `outputs`."""
    firsts: list[RequestOutput] = []
    for sample in sorted(samples, key=lambda o: (o.request_id, o.sample_index)):
        if firsts and firsts[-1].request_id == sample.request_id:
            firsts[-1].outputs.append(sample)
        else:
            sample.outputs = [sample]
            firsts.append(sample)
    return firsts
