"""Draw a deterministic set of prompts of varied length from tinyshakespeare.

Usage: python jobs/shakespeare/make_prompts.py [--n 640] [--out jobs/shakespeare/prompts.jsonl]
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
SPEAKER = re.compile(r"^[A-Z][A-Za-z' ]*:$")


def speaker(rng: random.Random, lines: list[str], speakers: list[int]) -> str:
    return lines[rng.choice(speakers)] + "\n"


def few_words(rng: random.Random, lines: list[str], verse: list[int]) -> str:
    words = lines[rng.choice(verse)].split()
    start = rng.randrange(len(words))
    return " ".join(words[start : start + rng.randint(2, 6)])


def whole_line(rng: random.Random, lines: list[str], verse: list[int]) -> str:
    # Half end with a newline, so the model starts a fresh line; half stop at the last character.
    return lines[rng.choice(verse)] + ("\n" if rng.random() < 0.5 else "")


def passage(rng: random.Random, lines: list[str], verse: list[int]) -> str:
    target, i = rng.randint(40, 150), rng.choice(verse)
    out = lines[i] + "\n"
    while i + 1 < len(lines) and len(out) + len(lines[i + 1]) + 1 <= target:
        i += 1
        out += lines[i] + "\n"
    return out


def make_prompts(text: str, n: int, seed: int = 0) -> list[dict[str, str]]:
    rng = random.Random(seed)
    lines = text.split("\n")
    speakers = [i for i, line in enumerate(lines) if SPEAKER.match(line)]
    verse = [i for i, line in enumerate(lines) if line.strip() and not SPEAKER.match(line) and len(line) > 10]
    kinds = [
        lambda: speaker(rng, lines, speakers),
        lambda: few_words(rng, lines, verse),
        lambda: whole_line(rng, lines, verse),
        lambda: passage(rng, lines, verse),
    ]
    prompts = [kinds[k % len(kinds)]() for k in range(n)]
    rng.shuffle(prompts)
    return [{"id": f"shakespeare-{i:05d}", "prompt": p} for i, p in enumerate(prompts)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=640)
    parser.add_argument("--out", type=Path, default=HERE / "prompts.jsonl")
    args = parser.parse_args()
    text = (HERE / "tinyshakespeare.txt").read_text(encoding="utf-8")
    rows = make_prompts(text, args.n)
    vocab = set(text)
    assert all(r["prompt"] and set(r["prompt"]) <= vocab for r in rows)
    with args.out.open("w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    print(f"wrote {len(rows)} prompts to {args.out}")


if __name__ == "__main__":
    main()
