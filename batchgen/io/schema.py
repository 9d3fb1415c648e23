"""Arrow schemas of the Parquet outputs, and the run metadata stored in them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

METADATA_PREFIX = "batchgen."

# One token's log-probability with sampling.logprobs / prompt_logprobs: the token, its rank in the distribution
# (1 = most likely) and the k most likely tokens, most likely first.
LOGPROB_ENTRY = pa.struct(
    [
        pa.field("token_id", pa.int32()),
        pa.field("text", pa.string()),
        pa.field("logprob", pa.float32()),
        pa.field("rank", pa.int32()),
        pa.field("top", pa.list_(pa.struct([pa.field("token_id", pa.int32()), pa.field("text", pa.string()),
                                            pa.field("logprob", pa.float32())]))),
    ]
)

COMPLETIONS_SCHEMA = pa.schema(
    [
        pa.field("index", pa.int64(), nullable=False),
        pa.field("id", pa.string(), nullable=False),
        pa.field("prompt", pa.string()),
        pa.field("completion", pa.string()),
        pa.field("prompt_token_ids", pa.list_(pa.int32())),
        pa.field("output_token_ids", pa.list_(pa.int32())),
        pa.field("num_prompt_tokens", pa.int32()),
        pa.field("num_output_tokens", pa.int32()),
        pa.field("finish_reason", pa.string(), nullable=False),  # stop | length | error
        pa.field("error", pa.string()),  # null unless finish_reason is "error"
        pa.field("ttft_ms", pa.float64()),  # timings are null for error rows
        pa.field("tpot_ms", pa.float64()),
        pa.field("latency_ms", pa.float64()),
        pa.field("sample_index", pa.int32()),  # which of the row's n samples (sampling.n); 0 when n = 1
        pa.field("num_cached_tokens", pa.int32()),  # prompt tokens found in the prefix cache
        pa.field("logprobs", pa.list_(LOGPROB_ENTRY)),  # one per output token; null unless sampling.logprobs
        pa.field("prompt_logprobs", pa.list_(LOGPROB_ENTRY)),  # one per prompt token, the first null
        # job.task=score: the continuation tokens' summed logprob given the context, their number, all argmax
        pa.field("continuation_logprob", pa.float64()),
        pa.field("continuation_num_tokens", pa.int32()),
        pa.field("continuation_is_greedy", pa.bool_()),
        pa.field("embedding", pa.list_(pa.float32())),  # job.task=embed
        # job.task=classify: label logits, their softmax, the argmax's id2label name; a reward model's one logit
        pa.field("logits", pa.list_(pa.float32())),
        pa.field("probs", pa.list_(pa.float32())),
        pa.field("label", pa.string()),
        pa.field("score", pa.float64()),
    ]
)

STEPS_SCHEMA = pa.schema(
    [
        pa.field("step", pa.int64(), nullable=False),
        pa.field("attempt", pa.int32(), nullable=False),  # 0 for the first run, +1 per resume
        pa.field("kind", pa.string(), nullable=False),  # prefill | decode | mixed
        pa.field("num_seqs", pa.int32(), nullable=False),
        pa.field("num_tokens", pa.int32(), nullable=False),
        pa.field("num_prefill_tokens", pa.int32(), nullable=False),
        pa.field("num_decode_tokens", pa.int32(), nullable=False),
        pa.field("padded_size", pa.int32()),  # the CUDA-graph bucket; null when eager
        pa.field("cuda_graph", pa.bool_(), nullable=False),
        pa.field("cascade_attention", pa.bool_(), nullable=False),  # a decode step that read a shared prefix once
        pa.field("schedule_ms", pa.float64(), nullable=False),
        pa.field("prepare_ms", pa.float64(), nullable=False),
        pa.field("forward_ms", pa.float64(), nullable=False),
        pa.field("sample_ms", pa.float64(), nullable=False),
        pa.field("wait_ms", pa.float64(), nullable=False),
        pa.field("step_ms", pa.float64(), nullable=False),
        # The part of step_ms the job spent outside the engine before the step (writing rows, adding requests).
        pa.field("job_ms", pa.float64()),
        pa.field("kv_blocks_used", pa.int32(), nullable=False),
        pa.field("kv_blocks_total", pa.int32(), nullable=False),
        pa.field("num_waiting", pa.int32(), nullable=False),
        pa.field("num_running", pa.int32(), nullable=False),
        pa.field("num_preempted", pa.int32(), nullable=False),
        pa.field("num_cached_tokens", pa.int32(), nullable=False),  # of the requests admitted in the step
    ]
)

KERNELS_SCHEMA = pa.schema(
    [
        pa.field("step", pa.int64(), nullable=False),  # the step's index, as in steps.parquet
        pa.field("kind", pa.string(), nullable=False),  # prefill | decode | mixed
        pa.field("cuda_graph", pa.bool_(), nullable=False),
        pa.field("name", pa.string(), nullable=False),  # the kernel (on CPU: the top-level op)
        pa.field("start_us", pa.float64(), nullable=False),  # from the step's first kernel
        pa.field("duration_us", pa.float64(), nullable=False),
        pa.field("gap_before_us", pa.float64(), nullable=False),  # idle time since the previous kernel ended
    ]
)


def with_metadata(schema: pa.Schema, metadata: dict[str, Any]) -> pa.Schema:
    """`schema` with each value stored JSON-encoded under b"batchgen.<key>", keeping its other metadata."""
    encoded = {
        f"{METADATA_PREFIX}{key}".encode(): json.dumps(value).encode() for key, value in metadata.items()
    }
    return schema.with_metadata({**(schema.metadata or {}), **encoded})


def read_metadata(path: Path) -> dict[str, Any]:
    """The values `with_metadata` stored in a Parquet file's schema, by key without the prefix."""
    stored = pq.read_schema(path).metadata or {}
    prefix = METADATA_PREFIX.encode()
    return {
        key[len(prefix) :].decode(): json.loads(value)
        for key, value in stored.items()
        if key.startswith(prefix)
    }
