"""The few lines a single run prints at its end (plain text: no pandas needed)."""

from __future__ import annotations

from typing import Any

from batchgen.report.summary_fields import read_figures


def brief_table(summary: dict[str, Any]) -> str:
    f = read_figures(summary)
    lines = [
        f"rows {f.rows}  errors {f.errors}  prompt tokens {f.prompt_tokens}  output tokens {f.output_tokens}  "
        f"wall {f.wall_s:.2f} s  device {f.device}",
        f"prompt tok/s {f.prompt_tok_s:.1f}  output tok/s {f.output_tok_s:.1f}",
        f"{'steps':<16}{'count':>7}{'batch':>8}{'step_ms':>10}{'forward_ms':>12}",
    ]
    for group, medians in (summary.get("step_medians") or {}).items():
        lines.append(f"{group:<16}{medians['steps']:>7}{medians['mean_num_seqs']:>8.1f}"
                     f"{medians['median_step_ms']:>10.3f}{medians['median_forward_ms']:>12.3f}")
    return "\n".join(lines)
