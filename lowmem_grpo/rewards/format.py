"""Format and exact-match rewards."""

from __future__ import annotations

import re

DEFAULT_PATTERN = r"^\s*-?\d+\s*$"   # a bare integer answer


def format_reward(completions, *, prompts=None, rows=None, pattern: str = DEFAULT_PATTERN) -> list[float]:
    """1.0 when the whole completion matches `pattern` (a regular expression, DOTALL), else 0.0.

    The default accepts a bare integer answer; a reasoning recipe would use e.g.
    '^<think>.*</think>\\s*<answer>.*</answer>$'."""
    rx = re.compile(pattern, re.DOTALL)
    return [1.0 if rx.search(c) else 0.0 for c in completions]


def exact_reward(completions, *, prompts=None, rows=None, answer_field: str = "answer") -> list[float | None]:
    """1.0 when the stripped completion equals the row's answer as text; None when the row has none.
    In a recipe, `answer_field` is data.answer_field (the trainer passes it)."""
    if rows is None:
        raise ValueError("exact reward needs the dataset rows (with their answers)")
    out = []
    for c, row in zip(completions, rows):
        gold = row.get(answer_field) if isinstance(row, dict) else None
        out.append(None if gold is None else float(c.strip() == str(gold).strip()))
    return out
