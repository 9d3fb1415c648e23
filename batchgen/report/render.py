"""The report as Markdown and as one self-contained HTML page (plots embedded as base64 PNGs)."""

from __future__ import annotations

import base64
import html
import math
from typing import Any

import pandas as pd

from batchgen.report.plots import PlotFile

MARKDOWN_MAX_ROWS = 60


def format_value(value: Any) -> str:
    if value is None or isinstance(value, float) and math.isnan(value):
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.1f}" if abs(value) >= 100 else f"{value:.3g}"
    return str(value)


def markdown_table(frame: pd.DataFrame, max_rows: int = MARKDOWN_MAX_ROWS) -> str:
    if frame.empty:
        return "(no rows)"
    columns = [str(c) for c in frame.columns]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in frame.head(max_rows).itertuples(index=False):
        lines.append("| " + " | ".join(format_value(v).replace("|", "\\|") for v in row) + " |")
    if len(frame) > max_rows:
        lines.append(f"\n({len(frame) - max_rows} more rows in the table's Parquet file)")
    return "\n".join(lines)


def markdown(title: str, sections: list[tuple[str, str, pd.DataFrame]], plots: list[PlotFile],
             notes: list[str]) -> str:
    parts = [f"# {title}", *notes]
    for name, heading, frame in sections:
        parts += [f"## {heading}", markdown_table(frame), f"Data: `tables/{name}.parquet`"]
    if plots:
        parts += ["## Plots", *(f"![{plot.title}]({plot.path.name})" for plot in plots)]
    return "\n\n".join(parts) + "\n"


def _html_table(frame: pd.DataFrame) -> str:
    if frame.empty:
        return "<p>(no rows)</p>"
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in frame.columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(format_value(v))}</td>" for v in row) + "</tr>"
                   for row in frame.itertuples(index=False))
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


STYLE = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1400px}
table{border-collapse:collapse;font-size:13px;margin-bottom:1em}th,td{border:1px solid #ccc;padding:3px 6px}
th{background:#f0f0f0}td{text-align:right}img{max-width:100%;border:1px solid #ddd;margin:0.5em 0}
.wrap{overflow-x:auto}"""


def html_page(title: str, sections: list[tuple[str, str, pd.DataFrame]], plots: list[PlotFile],
              notes: list[str]) -> str:
    parts = [f"<h1>{html.escape(title)}</h1>", *(f"<p>{html.escape(note)}</p>" for note in notes)]
    for _, heading, frame in sections:
        parts += [f"<h2>{html.escape(heading)}</h2>", f"<div class='wrap'>{_html_table(frame)}</div>"]
    if plots:
        parts.append("<h2>Plots</h2>")
    for plot in plots:
        data = base64.b64encode(plot.path.read_bytes()).decode()
        parts.append(f"<h3>{html.escape(plot.title)}</h3><img alt='{html.escape(plot.title)}' "
                     f"src='data:image/png;base64,{data}'>")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style></head><body>{''.join(parts)}</body></html>\n")
