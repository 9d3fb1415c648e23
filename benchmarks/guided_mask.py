"""Structured output's host cost: ms per step to advance the matchers and fill the token bitmask, per guided row.

Run from the repo root: python -m benchmarks.guided_mask [--tokenizer DIR] [--vocab-size N] [--steps N] [--out DIR]
Without --tokenizer it trains a byte-level BPE tokenizer on jobs/shakespeare/tinyshakespeare.txt (--vocab-size
tokens; a real model's tokenizer directory gives real numbers: mask cost grows with the vocabulary). Each step picks
a random allowed token per row (not timed) and times `StructuredOutputManager.bitmask` for the batch, which consumes
the previous token and fills every row. Unguided rows: the same call for a batch with no guided row (no mask).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import numpy as np
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from batchgen.core.request import Request
from batchgen.engine.structured_output import StructuredOutputManager
from batchgen.sample.params import SamplingParams
from benchmarks.common import add_out_argument, environment, markdown_table, save_json

CORPUS = Path(__file__).resolve().parent.parent / "jobs" / "shakespeare" / "tinyshakespeare.txt"
SPECS = {
    "json schema": dict(guided_json={
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
                       "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 8}},
        "required": ["name", "age", "tags"], "additionalProperties": False}),
    "regex": dict(guided_regex=r"[A-Z][a-z]{2,12}( [a-z]{1,12}){3,40}\."),
    "choice": dict(guided_choice=["positive", "negative", "neutral", "mixed feelings about it"]),
}
BATCHES = (1, 8, 64, 256)


def byte_level_tokenizer(vocab_size: int) -> PreTrainedTokenizerBase:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(CORPUS.read_text().splitlines(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")


def _pick(row: np.ndarray, eos: int, rng: random.Random) -> int:
    """A random allowed token, EOS only when nothing else is allowed."""
    allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))
    others = allowed[allowed != eos]
    return int(rng.choice(others if len(others) else allowed))


def time_steps(manager: StructuredOutputManager, params: SamplingParams, batch: int, steps: int,
               eos: int) -> list[float]:
    """ms of each step's bitmask call for `batch` rows guided by `params` (matchers renewed when they stop)."""
    rng = random.Random(0)
    requests = [Request(i, [0], params) for i in range(batch)]
    if params.guided_json or params.guided_regex or params.guided_choice:
        for request in requests:
            manager.add(request)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        mask = manager.bitmask(requests)
        times.append((time.perf_counter() - start) * 1000)
        if mask is None:
            continue
        for i, request in enumerate(requests):
            token = _pick(mask[i], eos, rng)
            if token == eos:  # the grammar is complete: a new request takes the row
                manager.release([request])
                requests[i] = request = Request(request.request_id, [0], params)
                manager.add(request)
            else:
                request.output_token_ids.append(token)
    manager.release(requests)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", help="a Hugging Face tokenizer directory (default: a trained byte-level BPE)")
    parser.add_argument("--vocab-size", type=int, default=8192, help="of the trained tokenizer")
    parser.add_argument("--steps", type=int, default=50)
    add_out_argument(parser)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer) if args.tokenizer else byte_level_tokenizer(
        args.vocab_size)
    start = time.perf_counter()
    manager = StructuredOutputManager(tokenizer, len(tokenizer))
    setup_ms = (time.perf_counter() - start) * 1000
    eos = tokenizer.eos_token_id
    rows = []
    for name, params in [*((name, SamplingParams(**spec)) for name, spec in SPECS.items()),
                         ("unguided (no mask)", SamplingParams())]:
        for batch in BATCHES:
            median = statistics.median(time_steps(manager, params, batch, args.steps, eos))
            per_row = None if name.startswith("unguided") else median / batch
            rows.append(dict(spec=name, rows=batch, ms_per_step=median, ms_per_guided_row=per_row))
    path = save_json(args.out, "guided_mask", dict(
        environment=environment(), tokenizer=args.tokenizer or f"trained byte-level BPE ({len(tokenizer)} tokens)",
        vocab_size=len(tokenizer), tokenizer_setup_ms=setup_ms, steps=args.steps, rows=rows))
    print(f"{len(tokenizer)}-token tokenizer ({args.tokenizer or 'trained byte-level BPE'}); llguidance tokenizer "
          f"setup {setup_ms:.0f} ms; median of {args.steps} steps per cell; JSON: {path}\n")
    headers = ["spec", "rows", "ms_per_step", "ms_per_guided_row"]
    print(markdown_table(headers, [[row[h] for h in headers] for row in rows]))


if __name__ == "__main__":
    main()
