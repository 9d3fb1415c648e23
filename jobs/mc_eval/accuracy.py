"""The accuracy of a job=mc_eval run: per question, the choice whose continuation is the most likely given the
context is the model's answer (lm-evaluation-harness's acc); a failed row counts as a wrong choice.

Usage: python jobs/mc_eval/accuracy.py <run dir> [--questions jobs/mc_eval/questions.jsonl]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent


def accuracy(run_dir: Path, questions_path: Path) -> tuple[float, int]:
    """(the share of questions answered right, the number of questions)."""
    rows = {row["id"]: row for row in map(json.loads, questions_path.read_text(encoding="utf-8").splitlines())}
    results = pq.read_table(run_dir / "completions.parquet", columns=["id", "continuation_logprob"]).to_pylist()
    best: dict[str, tuple[float, int]] = {}  # question -> (highest log-likelihood, its choice)
    for result in results:
        row, logprob = rows[result["id"]], result["continuation_logprob"]
        if logprob is not None and (row["question"] not in best or logprob > best[row["question"]][0]):
            best[row["question"]] = (logprob, row["choice"])
    answers = {row["question"]: row["answer"] for row in rows.values()}
    right = sum(best.get(question, (None, -1))[1] == answer for question, answer in answers.items())
    return right / len(answers), len(answers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--questions", type=Path, default=HERE / "questions.jsonl")
    args = parser.parse_args()
    acc, num_questions = accuracy(args.run_dir, args.questions)
    print(f"{num_questions} questions: acc {acc:.3f} (chance {1 / 4:.3f})")


if __name__ == "__main__":
    main()
