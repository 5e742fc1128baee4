"""Format and exact-match rewards."""

from __future__ import annotations

import numbers
import re
import warnings
from decimal import Decimal
from typing import Optional

DEFAULT_PATTERN = r"^\s*-?\d+\s*$"   # a bare integer answer


# Seconds one completion's match may take. A pattern with nested quantifiers ('^(a|aa)+$') backtracks for hours on
# some texts (found by a red team: one hung a training step), and Python's re cannot be interrupted; the `regex`
# module (a dependency of transformers, so always installed) matches as re does and stops at a timeout. A match
# takes microseconds otherwise, so this only ever ends a runaway one; that completion is skipped, not scored 0
# (the pattern, not the model, failed), with a warning, once per process.
MATCH_TIMEOUT_S = 1.0
_timeout_warned = False


def format_reward(completions, *, prompts=None, rows=None, pattern: str = DEFAULT_PATTERN) -> list[Optional[float]]:
    """1.0 when `pattern` (a regular expression, DOTALL) matches anywhere in the completion (re.search: anchor it
    with ^...$ for a whole-completion match), else 0.0; None (skip) where the match ran past MATCH_TIMEOUT_S.

    The default accepts a bare integer answer; a reasoning recipe would use e.g.
    '^<think>.*</think>\\s*<answer>.*</answer>$'."""
    import regex   # (here, not at the top: rewards/options.py reads DEFAULT_PATTERN without it)

    global _timeout_warned
    rx = regex.compile(pattern, regex.DOTALL)
    out: list[Optional[float]] = []
    for c in completions:
        try:
            out.append(1.0 if rx.search(c, timeout=MATCH_TIMEOUT_S) else 0.0)
        except TimeoutError:
            out.append(None)
            if not _timeout_warned:
                _timeout_warned = True
                warnings.warn(f"[lowmem-grpo] format reward: the pattern {pattern!r} took over {MATCH_TIMEOUT_S:g} s "
                              "on a completion (catastrophic backtracking, e.g. nested quantifiers such as (a|aa)+): "
                              "such completions are skipped, not scored; rewrite the pattern", stacklevel=2)
    return out


def exact_reward(completions, *, prompts=None, rows=None, answer_field: str = "answer") -> list[float | None]:
    """1.0 when the stripped completion equals the row's answer as text, or, for an answer stored as a number (a
    JSON or Parquet number, a decimal), when the completion is a plain number of the same value ('100' for the
    100.0 that JSON reads from 1e2, '2.5' for a decimal 2.50); None when the row has none (missing or blank).
    In a recipe, `answer_field` is data.answer_field (the trainer passes it)."""
    if rows is None:
        raise ValueError("exact reward needs the dataset rows (with their answers)")
    out = []
    for c, row in zip(completions, rows):
        gold = row.get(answer_field) if isinstance(row, dict) else None
        if gold is None or not str(gold).strip():   # a blank answer matched an empty completion (found by a red team)
            out.append(None)
            continue
        out.append(float(c.strip() == str(gold).strip() or _same_number(c.strip(), gold)))
    return out


_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")


def _same_number(text: str, gold) -> bool:
    """Whether `text` is a plain number equal to a gold answer stored as a number, whose own text is lost (JSON reads
    1e2 as the float 100.0, written '100.0'), so its value is what is compared. A gold given as text stays text."""
    if isinstance(gold, bool) or not isinstance(gold, (numbers.Real, Decimal)) or not _NUMBER.fullmatch(text):
        return False
    if isinstance(gold, (numbers.Rational, Decimal)):   # exactly: an int of any length, a decimal, a fraction
        return Decimal(text) == (int(gold) if isinstance(gold, numbers.Integral) else gold)
    return float(text) == float(gold)   # a float: '0.1' is the float 0.1 (whose Decimal is not 0.1)
