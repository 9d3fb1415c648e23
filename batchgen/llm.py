"""The Python API in vLLM's offline shape: `LLM(model=...).generate(prompts, sampling_params)`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from tqdm.auto import tqdm

from batchgen.config import TASKS, CudaGraphConfig, EngineConfig, ModelConfig, validate_engine, validate_model
from batchgen.engine.collector import rare_collections
from batchgen.engine.continuation import encode_pair
from batchgen.engine.llm_engine import LLMEngine
from batchgen.engine.outputs import RequestOutput
from batchgen.models.hub import resolve_model
from batchgen.sample.params import SamplingParams

Prompt = str | list[int]
Text = str | list[int]  # a text, or its token ids


class LLM:
    """Engine options use vLLM's names: max_num_seqs, max_num_batched_tokens, max_model_len, block_size,
    enforce_eager, dtype, quantization ("fp8"), gpu_memory_utilization, seed, num_gpu_blocks_override,
    tensor_parallel_size (the model split over that many GPUs, whose processes the engine starts and stops: close()
    it), ...; model_impl is model.impl.

    task: generate (`generate`, and `loglikelihood`) | score (`loglikelihood`) | embed (`embed`, with `pooling`:
    last | mean | cls, default the checkpoint's sentence-transformers pooling or last, and `normalize`) | classify
    (`classify`, a *ForSequenceClassification checkpoint)."""

    def __init__(self, model: str | None = None, *, task: str = "generate", pooling: str | None = None,
                 normalize: bool = True, tokenizer: str | None = None, load_format: str = "auto",
                 hf_config: dict[str, Any] | None = None, dtype: str = "auto", model_impl: str = "auto",
                 quantization: str | None = None,
                 cuda_graph_capture_sizes: list[int] | None = None, **engine_options: Any):
        if task not in TASKS:
            raise ValueError(f"task={task!r} is invalid: allowed values are {', '.join(TASKS)}")
        known = {f.name for f in fields(EngineConfig)} - {"cuda_graph"}
        unknown = set(engine_options) - known
        if unknown:
            raise TypeError(f"unknown engine options {sorted(unknown)}; known: {', '.join(sorted(known))}")
        model_config = ModelConfig(path=model, tokenizer=tokenizer, load_format=load_format, hf_config=hf_config,
                                   dtype=dtype, impl=model_impl, pooling=pooling, normalize=normalize,
                                   quantization=quantization)
        engine_config = EngineConfig(cuda_graph=CudaGraphConfig(capture_sizes=cuda_graph_capture_sizes),
                                     **engine_options)
        validate_model(model_config)
        validate_engine(engine_config)
        self.task = task
        self.engine = LLMEngine(resolve_model(model_config), engine_config, task=task)

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
        self._require_task("generate", "generate")
        self.engine.add_requests((i, prompt, None, p, None) if isinstance(prompt, str)
                                 else (i, None, list(prompt), p, None)
                                 for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)))
        return group_samples(self._run(sum(p.n for p in params), "generate", use_tqdm))

    def loglikelihood(self, requests: Sequence[tuple[Text, Text]], use_tqdm: bool = True) -> list[tuple[float, bool]]:
        """lm-evaluation-harness's loglikelihood: for each (context, continuation), both texts or both token ids, the
        sum of the continuation tokens' log-probabilities given the context and whether every one of them is the
        most likely token, in request order. Texts are tokenized as lm-eval does (see engine/continuation.py).
        Raises ValueError naming the first request that cannot be scored (an empty continuation, too long)."""
        self._require_task("loglikelihood", "generate", "score")
        for i, (context, continuation) in enumerate(requests):
            if isinstance(context, str) and isinstance(continuation, str):
                if self.engine.detokenizer is None:
                    raise ValueError("the model has no tokenizer: give token ids instead of texts")
                context_ids, continuation_ids = encode_pair(self.engine.detokenizer.tokenizer, context, continuation)
                self.engine.add_score_request(i, context_ids, continuation_ids, context + continuation)
            elif isinstance(context, str) or isinstance(continuation, str):
                raise TypeError(f"request {i}: give context and continuation both as texts or both as token ids")
            else:
                self.engine.add_score_request(i, list(context), list(continuation))
        outputs = sorted(self._run(len(requests), "loglikelihood", use_tqdm), key=lambda o: o.request_id)
        failed = next((o for o in outputs if o.error is not None), None)
        if failed is not None:
            raise ValueError(f"request {failed.request_id}: {failed.error}")
        return [(o.continuation_logprob, o.continuation_is_greedy) for o in outputs]

    def embed(self, prompts: Prompt | Sequence[Prompt], use_tqdm: bool = True) -> list[RequestOutput]:
        """One output per prompt, in input order, its `.embedding` the pooled (and normalized) final hidden states;
        needs LLM(..., task="embed")."""
        self._require_task("embed", "embed")
        return self._pool(prompts, "embed", use_tqdm)

    def classify(self, prompts: Prompt | Sequence[Prompt], use_tqdm: bool = True) -> list[RequestOutput]:
        """One output per prompt, in input order, with `.probs` (softmax over the labels), `.logits` and `.label`, or
        a reward model's `.score`; needs LLM(..., task="classify") and a *ForSequenceClassification checkpoint."""
        self._require_task("classify", "classify")
        return self._pool(prompts, "classify", use_tqdm)

    def _pool(self, prompts: Prompt | Sequence[Prompt], desc: str, use_tqdm: bool) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                self.engine.add_pooling_request(i, prompt, None)
            else:
                self.engine.add_pooling_request(i, None, list(prompt))
        return sorted(self._run(len(prompts), desc, use_tqdm), key=lambda o: o.request_id)

    def _require_task(self, method: str, *tasks: str) -> None:
        if self.task not in tasks:
            raise ValueError(f"LLM.{method} needs LLM(..., task={tasks[-1]!r}); this one has task={self.task!r}")

    def _run(self, total: int, desc: str, use_tqdm: bool) -> list[RequestOutput]:
        """Steps the engine until every queued request has finished; their outputs in finishing order."""
        outputs: list[RequestOutput] = []
        with tqdm(total=total, desc=desc, disable=not use_tqdm) as bar, rare_collections():
            while self.engine.has_unfinished_requests:
                finished, _ = self.engine.step()
                outputs += finished
                bar.update(len(finished))
        return outputs

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
