"""How a step's logits become token ids: four routes, one choice."""

from __future__ import annotations

from enum import Enum, auto

from batchgen.sample.batch import SamplingBatch


class SamplingRoute(Enum):
    FORWARD_ARGMAX = auto()  # the decode graph's own argmax: a greedy step with no stage before the draw
    GRAPH_LOGITS = auto()  # the sampler graph of the bucket, on the decode graph's static logits
    STAGED_LOGITS = auto()  # the sampler graph of a bucket, on an eager forward's logits staged into its buffer
    EAGER = auto()  # the pipeline run eagerly (bad words, whose candidates vary in number; no bucket fits)


def choose_route(batch: SamplingBatch, forward_graphed: bool, bucket_fits: bool) -> SamplingRoute:
    """Once the forward ran and the bitmask is in. forward_graphed: a decode graph computed the logits (a step whose
    batch has a fixed shape); bucket_fits: a sampler graph's bucket holds the batch's rows."""
    if forward_graphed:
        return SamplingRoute.GRAPH_LOGITS if batch.features.any else SamplingRoute.FORWARD_ARGMAX
    if bucket_fits and batch.num_rows and batch.features.any and batch.fixed_shape:
        return SamplingRoute.STAGED_LOGITS
    return SamplingRoute.EAGER
