"""Sampling: a row's SamplingParams to sampled ids and logprobs (penalties, masks, filters, draw, graphs)."""
