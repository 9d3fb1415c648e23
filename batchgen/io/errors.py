"""Errors raised while reading prompts."""

from __future__ import annotations


class InputError(ValueError):
    """Bad input: the message names the file, the line (JSONL, 1-based) or row (0-based), and the problem."""


class RowError(ValueError):
    """What is wrong with one row, before the reader adds where the row is."""
