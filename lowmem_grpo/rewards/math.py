"""Math answer reward: extract the final answer, check equivalence with the gold answer.

Extraction order (configurable with `extract=`): the last \\boxed{...}, the text after the last '####'
(GSM8K style), the last number in the completion. Equivalence: plain numbers (integers, decimals,
fractions, thousands separators, percentages) are compared exactly with `fractions.Fraction`; anything
else goes to math-verify (Hugging Face), which parses LaTeX and checks symbolic equality.

math-verify bounds its own time with signal.alarm, which only works in the main thread. There we let it;
elsewhere (a reward called from a worker thread) we pass no timeout to math-verify and bound the call
ourselves by running it in a worker process (`_verify_in_subprocess`).

A gold answer that cannot be parsed makes the sample "skip" (None), never a 0: the model is not punished
for a broken dataset row, and the count shows up in the metrics.
"""

from __future__ import annotations

import re
import threading
from fractions import Fraction
from typing import Optional

DEFAULT_EXTRACT = ("boxed", "hashes", "last_number")
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?(?:/\d+)?|-?\.\d+")
TIMEOUT_S = 5


def last_boxed(text: str) -> Optional[str]:
    """Content of the last \\boxed{...} (or \\fbox{...}), braces balanced."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j].strip()
    return None


def after_hashes(text: str) -> Optional[str]:
    if "####" not in text:
        return None
    tail = text.rsplit("####", 1)[1].strip()
    return tail.splitlines()[0].strip() if tail else None


def last_number(text: str) -> Optional[str]:
    found = _NUMBER.findall(text)
    return found[-1] if found else None


EXTRACTORS = {"boxed": last_boxed, "hashes": after_hashes, "last_number": last_number}


def extract_answer(text: str, order=DEFAULT_EXTRACT) -> Optional[str]:
    for name in order:
        got = EXTRACTORS[name](text)
        if got:
            return got
    return None


def as_number(text: str) -> Optional[Fraction]:
    """An exact value for plain numeric answers ('1,234', '-0.5', '3/4', '12%', '$5'), else None."""
    s = text.strip().rstrip(".").replace("$", "").replace("\\$", "").replace("\\%", "%").strip()
    percent = s.endswith("%")
    s = s.rstrip("%").strip()
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    if not re.fullmatch(r"-?(\d+(\.\d+)?|\.\d+|\d+/\d+)", s):
        return None
    try:
        value = Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None
    return value / 100 if percent else value


def _math_verify(pred: str, gold: str, timeout: Optional[int]) -> Optional[bool]:
    """True/False, or None when the gold answer does not parse."""
    from math_verify import parse, verify

    gold_parsed = parse(_as_latex(gold), parsing_timeout=timeout)
    if not gold_parsed:
        return None
    pred_parsed = parse(_as_latex(pred), parsing_timeout=timeout)
    if not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout))


def _as_latex(s: str) -> str:
    # math-verify looks for LaTeX anchors; a bare answer is wrapped so that it is found.
    return s if "$" in s or "\\boxed" in s else f"${s}$"


def _verify_in_subprocess(pred: str, gold: str, timeout: int) -> Optional[bool]:
    import concurrent.futures as cf
    import multiprocessing as mp

    with cf.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        fut = pool.submit(_math_verify, pred, gold, timeout)
        try:
            return fut.result(timeout=timeout + 10)
        except cf.TimeoutError:
            for proc in list(getattr(pool, "_processes", {}).values()):
                proc.kill()
            return False


def judge(pred_text: Optional[str], gold: str, timeout: int = TIMEOUT_S) -> Optional[bool]:
    """Is the extracted prediction equivalent to gold? None: gold cannot be judged (skip)."""
    gold = str(gold).strip()
    gold_gsm = after_hashes(gold) or last_boxed(gold) or gold  # a full solution as gold: take its answer
    g = as_number(gold_gsm)
    if pred_text is None:
        return None if g is None and not gold_gsm else False
    p = as_number(pred_text)
    if g is not None and p is not None:
        return p == g
    if threading.current_thread() is threading.main_thread():
        try:
            return _math_verify(pred_text, gold_gsm, timeout)
        except Exception:
            return False
    return _verify_in_subprocess(pred_text, gold_gsm, timeout)


def math_reward(completions, *, prompts=None, rows=None, answer_field: str = "answer",
                extract=DEFAULT_EXTRACT, timeout: int = TIMEOUT_S, **_) -> list[Optional[float]]:
    """1.0 if the completion's final answer equals the row's gold answer, 0.0 if not, None if the gold
    answer is missing or cannot be parsed."""
    out: list[Optional[float]] = []
    for completion, row in zip(completions, rows):
        gold = row.get(answer_field)
        if gold is None or str(gold).strip() == "":
            out.append(None)
            continue
        verdict = judge(extract_answer(completion, tuple(extract)), str(gold), timeout)
        out.append(None if verdict is None else float(verdict))
    return out
