"""Draw multiple-choice questions from the held-out end of tinyshakespeare, four rows per question.

Each question is a context (two whole lines, then the start of the next line) and four continuations: the next four
words of the text in their order, and three other orders of the same words; the model should find the text's. One
row per choice: {"id": "q000-c1", "question": "q000", "choice": 1, "answer": 2, "context": "...",
"continuation": " ..."}.

Usage: python jobs/mc_eval/make_questions.py [--n 50] [--out jobs/mc_eval/questions.jsonl]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
TEXT = HERE.parent / "shakespeare" / "tinyshakespeare.txt"
HELD_OUT = 0.9  # the model trained on the first 90% of the text
NUM_CHOICES = 4
NUM_WORDS = 4


def question(rng: random.Random, lines: list[str], candidates: list[int]) -> tuple[str, list[str], int]:
    """(context, the four continuations, the index of the text's own)."""
    line = rng.choice(candidates)
    words = lines[line].split()
    cut = rng.randrange(1, len(words) - NUM_WORDS + 1)
    context = "\n".join(lines[line - 2:line]) + "\n" + " ".join(words[:cut])
    span = words[cut:cut + NUM_WORDS]
    others = rng.sample([order for order in itertools.permutations(span) if list(order) != span], NUM_CHOICES - 1)
    choices = [" " + " ".join(order) for order in [span, *others]]
    rng.shuffle(choices)
    return context, choices, choices.index(" " + " ".join(span))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=50)
    parser.add_argument("--out", type=Path, default=HERE / "questions.jsonl")
    args = parser.parse_args()
    text = TEXT.read_text(encoding="utf-8")
    lines = text[int(len(text) * HELD_OUT):].split("\n")[1:]  # from the first whole line
    # Lines of distinct words, longer than the span, after two lines of the same speech.
    candidates = [i for i in range(2, len(lines))
                  if len(lines[i].split()) > NUM_WORDS and len(set(lines[i].split())) == len(lines[i].split())
                  and all(lines[j] and not lines[j].endswith(":") for j in (i - 2, i - 1, i))]
    rng = random.Random(0)
    with args.out.open("w", encoding="utf-8") as out:
        for number in range(args.n):
            context, choices, answer = question(rng, lines, candidates)
            for choice, continuation in enumerate(choices):
                row = {"id": f"q{number:03d}-c{choice}", "question": f"q{number:03d}", "choice": choice,
                       "answer": answer, "context": context, "continuation": continuation}
                out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
