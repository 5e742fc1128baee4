"""Countdown reward: reach the target number with the given numbers and + - * / .

A row is {"numbers": [25, 3, 7, 50], "target": 146}. The completion's final expression — the content
of its last <answer>...</answer> if it has one, else its last line that looks like an arithmetic
expression — scores 1.0 when

* it uses only numbers from the row, each at most as many times as the row lists it (all of them
  exactly once with use_all=True, the stricter TinyZero rule),
* it uses only + - * / , parentheses and unary minus,
* and it evaluates exactly (rational arithmetic, so 7/2*2 is 7, and no float rounding) to the target;

else 0.0. A trailing '= <number>' (as in '(25 - 5) * 4 = 80') is ignored, and so is formatting that does not change
the arithmetic: $...$ or backticks around the expression, a final period, \\left( \\right), and ×, ·, \\times, \\cdot
for * (÷, \\div for /). After a closing </think>, only what follows it is read. A malformed row (numbers not a
non-empty list of integers, target not an integer) gives None: skip, not 0. A row without the field at all is an
error naming it (the recipe's numbers_field / target_field name no field of the data: every completion would be
skipped); `lowmem-grpo validate` checks a local file's first rows for both.

The expression is never passed to eval(): it is parsed with ast.parse(mode='eval') and walked by an
evaluator that accepts only BinOp (Add, Sub, Mult, Div), UnaryOp (USub) and integer constants, so
nothing but arithmetic on the given numbers can happen.
"""

from __future__ import annotations

import ast
import random
import re
from collections import Counter
from fractions import Fraction
from typing import Optional

MAX_EXPRESSION_CHARS = 300
_EXPR_LINE = re.compile(r"[\d\s+\-*/().=]+")
_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
        ast.Div: lambda a, b: a / b}


class _Rejected(Exception):
    """The expression breaks a rule."""


# Presentation that never changes the arithmetic: multiplication and division signs, unicode minus, \\left( \\right).
# Signs become ' * ' and ' / ' with spaces, so that two in a row ('××', '\\div\\div') are a syntax error, never '**'
# or '//' (which the evaluator refuses too).
_SIGNS = {"\u00d7": " * ", "\u00b7": " * ", "\u22c5": " * ", "\u2217": " * ", "\u00f7": " / ", "\u2215": " / ",
          "\u2212": "-", "\u2013": "-", "x": " * ", "X": " * "}
_LATEX_SIGNS = re.compile(r"\\(?:times|cdot|ast|div)(?![A-Za-z])|\\(?:left|right)(?=\s*[()])")


def _normalize(text: str) -> str:
    """The expression as Python reads it: ×, ·, ⋅, \\times, \\cdot, x are *, ÷ and \\div are /, \\left( \\right) are
    ( ), and what wraps it is dropped: $...$, backticks (`(1+2)*3`, a ``` fence), a final period ('(1+2)*3.')
    (found by a red team: each scored 0 for a right expression). Nothing here can add a number or an operation:
    '**', '//', '3.5' and the rest are left for the evaluator to refuse."""
    text = _LATEX_SIGNS.sub(lambda m: {"\\div": " / ", "\\left": "", "\\right": ""}.get(m.group(0), " * "), text)
    text = text.translate(str.maketrans(_SIGNS))
    while True:
        stripped = re.sub(r"^(?:\s|\$|`|\\[(\[])+|(?:\s|\$|`|\\[)\]])+$", "", text)
        stripped = re.sub(r"\.$", "", stripped)     # a sentence's period: '3.' is no decimal here
        if stripped == text:
            return text
        text = stripped


def _strip_result(expr: str) -> str:
    """'(25 - 5) * 4 = 80' -> '(25 - 5) * 4'; '80 = (25 - 5) * 4' -> '(25 - 5) * 4'."""
    if expr.count("=") == 1:
        left, _, right = expr.partition("=")
        if re.fullmatch(r"\s*-?\d+(?:\.\d+)?\s*", right):
            return left.strip()
        if re.fullmatch(r"\s*-?\d+(?:\.\d+)?\s*", left):
            return right.strip()
    return expr.strip()


def extract_expression(completion: str) -> Optional[str]:
    """The completion's final expression: last <answer>...</answer>, else its last expression-like line; read after
    the last </think> when there is one (drafts in the reasoning are no answer)."""
    close = completion.lower().rfind("</think>")
    if close >= 0:
        completion = completion[close + len("</think>"):]
    low = completion.lower()
    close = low.rfind("</answer>")
    start = low.rfind("<answer>", 0, close) if close >= 0 else -1
    if start >= 0:   # found from the end: linear even for a completion full of unclosed tags
        return _strip_result(_normalize(completion[start + len("<answer>"):close]))
    for line in reversed(completion.splitlines()):
        line = _normalize(line)
        if line and _EXPR_LINE.fullmatch(line) and re.search(r"\d", line) and re.search(r"[-+*/]", line):
            return _strip_result(line)
    return None


def evaluate(expression: str) -> tuple[Fraction, list[int]]:
    """(exact value, the integer literals used) of an arithmetic expression; _Rejected for anything else
    (names, calls, powers, floats, division by zero, ...)."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise _Rejected("expression too long")
    try:
        tree = ast.parse(expression, mode="eval")
    except (SyntaxError, ValueError, RecursionError) as exc:
        raise _Rejected(f"not an expression: {exc}") from None
    used: list[int] = []

    def walk(node) -> Fraction:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise _Rejected("division by zero")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return Fraction(node.value)
        raise _Rejected(f"{type(node).__name__} is not allowed")

    try:
        return walk(tree), used
    except RecursionError:
        raise _Rejected("expression nested too deeply") from None


def _row(row, numbers_field: str = "numbers", target_field: str = "target") -> Optional[tuple[list[int], int]]:
    if not isinstance(row, dict):
        return None
    numbers, target = row.get(numbers_field), row.get(target_field)
    if not isinstance(numbers, (list, tuple)) or not numbers:
        return None
    if not all(type(n) is int for n in numbers) or type(target) is not int:
        return None
    return list(numbers), target


def missing_field(row, numbers_field: str = "numbers", target_field: str = "target") -> Optional[tuple[str, str]]:
    """(option, field) of the first of the two fields a row (a mapping) does not have at all; None when it has both.
    Not a malformed value (that row is skipped): a field name the data does not use."""
    if not isinstance(row, dict):
        return None
    for option, name in (("numbers_field", numbers_field), ("target_field", target_field)):
        if name not in row:
            return option, name
    return None


def score_expression(expression: Optional[str], numbers: list[int], target: int, use_all: bool = False) -> float:
    """1.0 if `expression` follows the rules and equals `target`, else 0.0."""
    if not expression:
        return 0.0
    try:
        value, used = evaluate(expression)
    except _Rejected:
        return 0.0
    available, wanted = Counter(numbers), Counter(used)
    if any(wanted[n] > available[n] for n in wanted):
        return 0.0
    if use_all and wanted != available:
        return 0.0
    return 1.0 if value == target else 0.0


def countdown_reward(completions, *, prompts=None, rows=None, use_all: bool = False, numbers_field: str = "numbers",
                     target_field: str = "target") -> list[Optional[float]]:
    """1.0 when the completion's final expression reaches the row's target by the rules, 0.0 when not,
    None when the row is malformed; a ValueError naming a field the row does not have. `numbers_field` /
    `target_field`: the row's field names (the hub's Jiayi-Pan/Countdown-Tasks-3to4 calls its numbers `nums`)."""
    if rows is None:
        raise ValueError("countdown reward needs the dataset rows (numbers and target)")
    out: list[Optional[float]] = []
    for completion, row in zip(completions, rows):
        absent = missing_field(row, numbers_field, target_field)
        if absent:   # a field name the data does not use skipped every completion, silently (found by a red team)
            raise ValueError(f"countdown reward: the row has no field {absent[1]!r} ({absent[0]}; the row has: "
                             f"{', '.join(sorted(map(str, row))) or 'nothing'}): set rewards.functions[].kwargs."
                             f"{absent[0]} to the row's field")
        parsed = _row(row, numbers_field, target_field)
        if parsed is None:
            out.append(None)
            continue
        numbers, target = parsed
        out.append(score_expression(extract_expression(completion or ""), numbers, target, use_all))
    return out


# --------------------------------------------------------------------------------------------------
# Instances

PROMPT = ("Using the numbers {numbers}, create an expression that equals {target}. You may use +, -, * and /, "
          "parentheses, and each number at most once. Show your reasoning, then give only the expression "
          "inside <answer></answer>, for example <answer>(1 + 2) * 3</answer>.")


def generate_countdown(n: int, seed: int = 0) -> list[dict]:
    """n solvable instances, deterministic in `seed`: {"prompt", "numbers", "target", "solution"}.

    Each instance draws 3 or 4 numbers (each 1-10 or 11-100 with equal odds), then builds a random
    expression over all of them (half the time) or over 2 or more of them, with subtraction only when
    positive and division only when exact, so every intermediate value is a positive integer; its value
    is the target (10-999, not itself one of the numbers). The expression is kept as "solution", so each
    target is known to be reachable."""
    rng = random.Random(seed)
    out: list[dict] = []
    seen = set()
    while len(out) < n:
        count = rng.choice((3, 3, 4, 4, 4))
        numbers = [rng.randint(1, 10) if rng.random() < 0.5 else rng.randint(11, 100) for _ in range(count)]
        k = count if rng.random() < 0.5 else rng.randint(2, count)   # often all of them: harder
        chosen = rng.sample(range(count), k)
        items = [(Fraction(numbers[i]), str(numbers[i])) for i in chosen]
        while len(items) > 1:
            i, j = rng.sample(range(len(items)), 2)
            (a, ea), (b, eb) = items[i], items[j]
            options = [(a + b, f"({ea} + {eb})"), (a * b, f"({ea} * {eb})")]
            if a > b:
                options.append((a - b, f"({ea} - {eb})"))
            if b != 0 and a % b == 0 and b != 1:
                options.append((a / b, f"({ea} / {eb})"))
            value, expr = rng.choice(options)
            items = [it for idx, it in enumerate(items) if idx not in (i, j)] + [(value, expr)]
        value, expr = items[0]
        expr = expr[1:-1] if expr.startswith("(") and expr.endswith(")") else expr
        target = int(value)
        key = (tuple(numbers), target)
        if value.denominator != 1 or not 10 <= target <= 999 or target in numbers or key in seen:
            continue
        assert evaluate(expr)[0] == target   # the generator's own check: the solution reaches the target
        seen.add(key)
        out.append({"prompt": PROMPT.format(numbers=numbers, target=target), "numbers": numbers,
                    "target": target, "solution": expr})
    return out
