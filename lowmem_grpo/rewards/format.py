"""Format and exact-match rewards."""

from __future__ import annotations

import re


def format_reward(completions, *, prompts=None, rows=None, pattern: str = r"^\s*-?\d+\s*$", **_) -> list[float]:
    """1.0 when the whole completion matches `pattern` (a regular expression, DOTALL), else 0.0.

    The default accepts a bare integer answer; a reasoning recipe would use e.g.
    '^<think>.*</think>\\s*<answer>.*</answer>$'."""
    rx = re.compile(pattern, re.DOTALL)
    return [1.0 if rx.search(c) else 0.0 for c in completions]


def exact_reward(completions, *, prompts=None, rows=None, answer_field: str = "answer", **_) -> list[float | None]:
    """1.0 when the stripped completion equals the row's answer as text; None when the row has none."""
    out = []
    for c, row in zip(completions, rows):
        gold = row.get(answer_field)
        out.append(None if gold is None else float(c.strip() == str(gold).strip()))
    return out
