"""Writes bench_prompts.jsonl: 512 windows of 96 characters from the text, for the seed-table presets.

Every window is longer than any preset's prompt (at most 32 tokens, one token per character), so each preset's
`sampling.truncate_prompt_tokens` gives every request exactly that many prompt tokens.

    python jobs/shakespeare/make_bench_prompts.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
NUM_PROMPTS = 512
WINDOW = 96


def main() -> None:
    text = (HERE / "tinyshakespeare.txt").read_text()
    rng = random.Random(0)
    starts = sorted(rng.randrange(len(text) - WINDOW) for _ in range(NUM_PROMPTS))
    with (HERE / "bench_prompts.jsonl").open("w") as out:
        for i, start in enumerate(starts):
            out.write(json.dumps({"id": f"bench-{i:05d}", "prompt": text[start:start + WINDOW]}) + "\n")


if __name__ == "__main__":
    main()
