"""Math answer reward: extract the final answer, check equivalence with the gold answer.

Extraction (`extract=`, an ordered list of extractor names, or a comma-separated string; the first one
that finds something wins). The default order is boxed, answer_tag, hashes, last_number:

    boxed        the content of the last complete \\boxed{...} / \\fbox{...} (also `\\boxed 5`)
    answer_tag   the content of the last <answer>...</answer> (a sentence there is reduced to its last number)
    hashes       the first line after the last '####' (GSM8K style)
    last_number  the last number of the text (thousands separators, decimals, a/b, \\frac{a}{b}, a trailing %;
                 not an exponent, base, subscript, denominator or radicand)

Equivalence, cheapest first:

1. Exact numeric fast path: when both the prediction and the gold answer are plain numbers — integers,
   decimals, a/b, \\frac{a}{b}, thousands separators, currency signs, percentages, a trailing unit
   ('5 cm', '10 \\text{ dollars}', '45^\\circ'), 'x = 5' — they are compared exactly with
   fractions.Fraction. No math-verify call: 1,000 such completions take milliseconds. A percentage matches
   either its value or its bare number ('50%' matches 0.5 and 50), as math-verify does.
2. Otherwise math-verify (Hugging Face) parses both sides (LaTeX, sets, intervals, expressions) and checks
   symbolic equality.

Gold answers that cannot be parsed (missing, blank, or rejected by math-verify without its
string fallback, e.g. 'garbage{{') score None ("skip"), never 0: the model is not punished for a
broken dataset row, and the count shows up in the metrics.

Bounding the time of math-verify. Parsing and simplifying adversarial or just unlucky LaTeX can take
arbitrarily long (10^{10^{10}}, factorials, nested radicals). math-verify bounds itself with
signal.alarm, which works only in a process's main thread, and cannot interrupt C code that never
returns to the interpreter. So:

* a single judgement in the main thread runs inline with math-verify's own timeouts (`timeout`, seconds
  per parse / per comparison);
* batches, and any call from another thread, go to a small pool of worker processes (`workers`, 2 by
  default; created on first use, reused across calls). Each worker runs math-verify in its own main
  thread, so its timeouts work there, and each item also has a hard deadline (3 * timeout + 2 s: two
  parses and one comparison, plus slack). A worker past its deadline is SIGKILLed and replaced; its item
  scores 0.0 if the gold answer parses on its own within the timeout (the prediction was at fault:
  scoring it None would teach the policy that hanging the verifier avoids a bad reward), else None.

The workers are plain `python -I <this file> --worker` subprocesses speaking JSON lines, not a
ProcessPoolExecutor: killing one worker of an executor breaks the whole executor, and a spawned
executor worker would import this package (and with it torch) just to unpickle the task function.
They also cap their own address space (WORKER_MEMORY_MB) so that a runaway simplification ends in a
MemoryError rather than in the host's OOM killer, and die with their parent (PR_SET_PDEATHSIG).

This file must keep importing only the standard library at module level: it is run as a script.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import selectors
import subprocess
import sys
import threading
import time
from collections import deque
from fractions import Fraction
from math import isfinite
from typing import NamedTuple, Optional, Sequence

DEFAULT_EXTRACT = ("boxed", "answer_tag", "hashes", "last_number")
TIMEOUT_S = 5
DEFAULT_WORKERS = 2
WORKER_MEMORY_MB = 4096
WORKER_START_TIMEOUT_S = 120.0

# --------------------------------------------------------------------------------------------------
# Extraction

# The last number of a text, read as LaTeX would be: '\frac{1}{2}' is one number, and a digit group that is an
# exponent, a subscript, a power's base, a denominator or a radicand ('2^{10}', 'x_1', '\frac{\pi}{2}', '\sqrt{2}',
# '3\sqrt{2}', the 3 of '3 \times 10^{5}') is none. Without this, 'the final answer is $\frac{1}{2}$' scored 1.0 for gold 2 (and 0 for 1/2).
_NUMBER = re.compile(
    r"(?:(?<![\w)\]}])-)?\\[dt]?frac\s*\{\s*\d+(?:\.\d+)?\s*\}\s*\{\s*\d+(?:\.\d+)?\s*\}"
    r"|(?:(?<![\w)\]}])-)?"
    r"(?<![\d.^_])(?<!\^-)(?<!_-)(?<!\^\{)(?<!_\{)(?<!\^\{-)(?<!_\{-)(?<!\}\{)(?<!sqrt)(?<!sqrt\{)"
    r"(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?(?:/\d+)?|\.\d+)%?"
    r"(?!\.?\d|\s*[\^_](?!\s*\{?\s*\\circ)|\\(?:sqrt|pi)\b|\s*\\(?:times|cdot)\s*10\s*\^)")   # 45^\circ: degrees
_PROSE_WORD = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{3,}")


def _matching_braces(text: str) -> dict:
    """{index of '{': index of its matching '}'} for the balanced pairs of text, in one pass."""
    pairs, stack = {}, []
    for i, ch in enumerate(text):
        if ch == "{":
            stack.append(i)
        elif ch == "}" and stack:
            pairs[stack.pop()] = i
    return pairs


def last_boxed(text: str) -> Optional[str]:
    """Content of the last complete \\boxed{...} (or \\fbox{...}), braces balanced; `\\boxed 5` too.
    A final \\boxed{ left open (a completion cut off by the length limit) is passed over.
    Linear in the length of the text, however many \\boxed it holds."""
    if "\\boxed" not in text and "\\fbox" not in text:
        return None
    pairs = None
    for m in reversed(list(re.finditer(r"\\(?:boxed|fbox)\b", text))):
        i = m.end()
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] != "{":
            token = re.match(r"[^\s$]+", text[i:i + 200])   # \boxed 5 (no braces): up to the next space or $
            if token and i > m.end():
                return token.group(0).strip()
            continue
        if pairs is None:
            pairs = _matching_braces(text)
        end = pairs.get(i)
        if end is not None and text[i + 1:end].strip():
            return text[i + 1:end].strip()
    return None


def _last_tagged(text: str, tag: str) -> Optional[str]:
    """Content of the last <tag>...</tag> (case-insensitive), found from the end in linear time."""
    low = text.lower()
    close = low.rfind(f"</{tag}>")
    if close < 0:
        return None
    start = low.rfind(f"<{tag}>", 0, close)
    return None if start < 0 else text[start + len(tag) + 2:close]


def answer_tag(text: str) -> Optional[str]:
    """Content of the last <answer>...</answer>. If it is prose ('The answer is 42.') rather than a
    mathematical answer, its last number."""
    found = _last_tagged(text, "answer")
    if found is None:
        return None
    content = found.strip()
    if not content:
        return None
    if _numeric(content) is None and _PROSE_WORD.search(re.sub(r"\\text\{[^{}]*\}", "", content)):
        return last_number(content) or content
    return content


def after_hashes(text: str) -> Optional[str]:
    """The first line after the last '####' (GSM8K's answer marker), when it holds a digit: a Markdown heading
    ('#### Final Answer', '#### Step 1: add') is no answer, and the next extractor reads on (found by a red team)."""
    if "####" not in text:
        return None
    tail = text.rsplit("####", 1)[1].strip()
    line = tail.splitlines()[0].strip() if tail else ""
    return line if any(c.isdigit() for c in line) else None


def last_number(text: str) -> Optional[str]:
    found = _NUMBER.findall(text)
    return found[-1] if found else None


EXTRACTORS = {"boxed": last_boxed, "answer_tag": answer_tag, "hashes": after_hashes, "last_number": last_number}


def _extract_order(extract) -> tuple:
    names = tuple(n.strip() for n in extract.split(",")) if isinstance(extract, str) else tuple(extract)
    unknown = [n for n in names if n not in EXTRACTORS]
    if unknown or not names:
        raise ValueError(f"math reward: unknown extractor(s) {unknown or '(none given)'}; "
                         f"choose from {', '.join(EXTRACTORS)}")
    return names


def extract_answer(text: str, order=DEFAULT_EXTRACT) -> Optional[str]:
    """The completion's final answer by the first extractor (in `order`) that finds one, else None."""
    for name in _extract_order(order):
        got = EXTRACTORS[name](text)
        if got:
            return got
    return None


# --------------------------------------------------------------------------------------------------
# Plain numbers: the exact fast path

class _Num(NamedTuple):
    value: Fraction     # the number as written (50 for '50%')
    percent: bool


# Words after a number that are mathematics, not units: '5 x' or '3 pi' is no plain number.
_NOT_UNITS = {"pi", "e", "i", "j", "sqrt", "infty", "inf", "infinity", "x", "y", "z", "n", "k", "m", "t",
              "and", "or", "to", "times", "cdot", "mod", "plus", "minus", "over", "divided", "by", "i.e",
              # ... nor words that change the value: '5 thousand' is 5000 and '5 squared' 25, never 5
              # ('5 dozen' or '3 quarters' can name what is counted: left as units)
              "hundred", "hundreds", "thousand", "thousands", "million", "millions", "billion", "billions",
              "trillion", "trillions", "squared", "cubed", "factorial", "tenths", "hundredths", "thousandths",
              "reciprocal", "inverse", "below", "tens", "halves", "thirds", "fourths", "fifths", "sixths",
              "sevenths", "eighths", "ninths"}
_UNIT = r"[A-Za-z]+(?:\^\{?\d+\}?)?(?:/[A-Za-z]+(?:\^\{?\d+\}?)?)?"
_PLAIN = re.compile(
    r"(?P<sign>[-+]?)\s*(?P<num>(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d{1,3}(?![\d.]))?)"
    r"(?:\s*/\s*(?P<den>\d+(?:\.\d+)?))?"
    r"\s*(?P<pct>%|percent\b)?"
    rf"(?P<unit>(?:\s*{_UNIT}(?:\s+{_UNIT})*)?)\.?")   # words separated by whitespace: no backtracking blow-up
_FRAC = re.compile(r"(?P<sign>[-+]?)\s*\\[dt]?frac\s*(?:\{\s*(?P<a>[-+]?\d+(?:\.\d+)?)\s*\}|(?P<a1>\d))"
                   r"\s*(?:\{\s*(?P<b>[-+]?\d+(?:\.\d+)?)\s*\}|(?P<b1>\d))")


def _clean(text: str) -> str:
    """Strip presentation that never changes a value: math/currency $, \\!, \\, spacing, {,}, degree
    marks, \\text{} wrappers (units), a trailing period, unicode minus."""
    s = str(text).strip().replace("\u2212", "-").replace("\u2013", "-")
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "%")
    # Digit groups set apart by a (thin) space, as in '5\,000', '10,\!000' or '5 000', are thousands. Left to
    # math-verify, '5\,000' was read as 5 * 000: it scored 1.0 for gold 0 and 0.0 for gold 5000.
    s = re.sub(r"(?<=\d)(?:,?(?:\\[!,;:]|\\ |~)|\s)\s*(?=\d{3}(?!\d))", ",", s)
    s = re.sub(r"\\[!,;:]|\\ |~", " ", s).replace("{,}", ",")
    s = re.sub(r"\^\s*\{?\s*\\circ\s*\}?|\\circ|°|\\degree", "", s)
    s = re.sub(r"\\(?:text|textrm|textnormal|mathrm|mbox|textbf|mathbf|operatorname)\s*\{([^{}]*)\}", r" \1", s)
    s = re.sub(r"\\left|\\right", "", s)
    s = re.sub(r"\*\*|__", "", s)   # Markdown bold: '**42**'
    return s.strip().rstrip(".").strip()


def _numeric(text: Optional[str], letters_are_units: bool = True) -> Optional[_Num]:
    """The value of a plain numeric answer, or None when it is anything else (left to math-verify). '1.5e3' is
    1500 (scientific notation: str() writes a float column's 1e-07 so; math-verify read the e as Euler's number).
    letters_are_units=False (a gold answer): a one-letter word after the number is a variable ('2a'), not a unit,
    else '2' and '2b' matched gold '2a' (found by a red team)."""
    if text is None:
        return None
    s = _clean(text)
    if len(s) > 200:
        return None
    m = re.fullmatch(r"[A-Za-z]\w*\s*=\s*(.+)", s)   # 'x = 5'
    if m:
        s = m.group(1).strip()
    while len(s) > 1 and s[0] == "{" and s[-1] == "}" and "{" not in s[1:-1]:   # {5}
        s = s[1:-1].strip()
    m = _FRAC.fullmatch(s)
    if m:
        try:
            value = Fraction(m.group("a") or m.group("a1")) / Fraction(m.group("b") or m.group("b1"))
        except (ValueError, ZeroDivisionError):
            return None
        return _Num(-value if m.group("sign") == "-" else value, False)
    m = _PLAIN.fullmatch(s)
    if not m:
        return None
    words = [w.lower() for w in re.findall(r"[A-Za-z]+(?:\.[A-Za-z]+)?", m.group("unit") or "")]
    if any(w in _NOT_UNITS or (len(w) == 1 and not letters_are_units) for w in words):
        return None
    try:
        value = Fraction(m.group("num").replace(",", ""))
        if m.group("den"):
            value /= Fraction(m.group("den"))
    except (ValueError, ZeroDivisionError):
        return None
    return _Num(-value if m.group("sign") == "-" else value, bool(m.group("pct")))


def as_number(text: str) -> Optional[Fraction]:
    """An exact value for plain numeric answers ('1,234', '-0.5', '3/4', '\\frac{3}{4}', '12%' = 3/25,
    '$5', '5 cm'), else None."""
    n = _numeric(text)
    if n is None:
        return None
    return n.value / 100 if n.percent else n.value


def _numbers_equal(p: _Num, g: _Num) -> bool:
    scaled = (p.value / 100 if p.percent else p.value) == (g.value / 100 if g.percent else g.value)
    return scaled or (p.percent != g.percent and p.value == g.value)


# --------------------------------------------------------------------------------------------------
# math-verify (inline in the main thread, or in a worker process)

_SCIENTIFIC = re.compile(r"(?<![\w.])(\d+(?:\.\d*)?|\.\d+)[eE]([-+]?\d{1,3})(?![\w.])")


def _as_latex(s: str) -> str:
    # math-verify looks for LaTeX anchors; a bare answer is wrapped so that it is found. It reads 1.5e3 as
    # 1.5 * e * 3 (Euler's number): scientific notation goes as 1.5\times10^{3}.
    s = s.replace("\\$", "")
    s = _SCIENTIFIC.sub(r"\1\\times10^{\2}", s)
    return s if "$" in s or "\\boxed" in s or "\\(" in s or "\\[" in s else f"${s}$"


def _gold_parsed(gold: str, timeout: Optional[int]):
    from math_verify import parse

    # no_fallback: the raw string of an unparseable gold is not an answer to compare with.
    return parse(_as_latex(gold), fallback_mode="no_fallback", parsing_timeout=timeout)


def _verify_item(pred: Optional[str], gold: str, timeout: Optional[int]) -> Optional[bool]:
    """True/False, or None when the gold answer does not parse. Runs math-verify; `timeout` (seconds)
    needs the main thread."""
    from math_verify import parse, verify

    try:
        gold_parsed = _gold_parsed(gold, timeout)
    except Exception:
        return None
    if not gold_parsed:
        return None
    if pred is None or not pred.strip():
        return False
    try:
        pred_parsed = parse(_as_latex(pred), parsing_timeout=timeout)
        if not pred_parsed:
            return False
        return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout))
    except Exception:
        return False


class VerifyPool:
    """A few `python -I math.py --worker` processes that run math-verify, each item under a hard deadline.

    `run(requests, deadline_s)` sends each request to a free worker; a worker that has not answered
    `deadline_s` after it got its request is SIGKILLed and replaced, and that request's answer is None.
    Thread-safe (one batch at a time); workers are started on first use and reused."""

    def __init__(self, size: int = DEFAULT_WORKERS, memory_mb: int = WORKER_MEMORY_MB):
        self.size = max(1, int(size))
        self.memory_mb = int(memory_mb)
        self._workers: list = []
        self._lock = threading.Lock()
        self.killed = 0     # workers killed for missing a deadline (for metrics and tests)

    # -- workers --
    def _spawn(self):
        proc = subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__), "--worker", str(self.memory_mb)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                close_fds=True)
        os.set_blocking(proc.stdout.fileno(), False)
        return {"proc": proc, "buf": b"", "ready": False}

    def _read_lines(self, w) -> Optional[list]:
        """Complete lines available from worker `w`; None on EOF (the worker died)."""
        try:
            chunk = os.read(w["proc"].stdout.fileno(), 65536)
        except BlockingIOError:
            return []
        except OSError:
            return None
        if not chunk:
            return None
        w["buf"] += chunk
        *lines, w["buf"] = w["buf"].split(b"\n")
        return lines

    def _kill(self, w) -> None:
        try:
            w["proc"].kill()
        except OSError:
            pass
        for stream in (w["proc"].stdin, w["proc"].stdout):
            try:
                stream.close()
            except OSError:
                pass
        w["proc"].wait()
        if w in self._workers:
            self._workers.remove(w)

    def _ensure_workers(self, n: int) -> None:
        """Have at least n live, ready workers (starting them in parallel, waiting for their 'ready')."""
        for w in [w for w in self._workers if w["proc"].poll() is not None]:
            self._kill(w)
        fresh = [self._spawn() for _ in range(max(0, n - len(self._workers)))]
        deadline = time.monotonic() + WORKER_START_TIMEOUT_S
        for w in fresh:
            while not w["ready"]:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._kill(w)
                    raise RuntimeError("math-verify worker did not start in time")
                with selectors.DefaultSelector() as sel:
                    sel.register(w["proc"].stdout, selectors.EVENT_READ)
                    sel.select(min(remaining, 1.0))
                lines = self._read_lines(w)
                if lines is None:
                    self._kill(w)
                    raise RuntimeError(f"math-verify worker exited at start (status {w['proc'].returncode})")
                for line in lines:
                    msg = json.loads(line)
                    if not msg.get("ready"):
                        self._kill(w)
                        raise RuntimeError(f"math-verify worker cannot start: {msg.get('error')}")
                    w["ready"] = True
            self._workers.append(w)

    def close(self) -> None:
        with self._lock:
            for w in list(self._workers):
                self._kill(w)

    # -- batches --
    def run(self, requests: Sequence[dict], deadline_s: float) -> list:
        with self._lock:
            results: list = [None] * len(requests)
            pending = deque(enumerate(requests))
            busy: dict = {}          # id(worker) -> (worker, index, deadline)
            sel = selectors.DefaultSelector()
            try:
                while pending or busy:
                    if pending and len(busy) < self.size:
                        self._ensure_workers(min(self.size, len(busy) + len(pending)))
                        for w in self._workers:
                            if not pending:
                                break
                            if id(w) in busy:
                                continue
                            index, req = pending.popleft()
                            try:
                                w["proc"].stdin.write((json.dumps(dict(req, id=index)) + "\n").encode())
                                w["proc"].stdin.flush()
                            except OSError:        # died since the check: replace it, retry the item once
                                self._kill(w)
                                if req.get("_retried"):
                                    continue
                                pending.appendleft((index, dict(req, _retried=True)))
                                break
                            busy[id(w)] = (w, index, time.monotonic() + deadline_s)
                            sel.register(w["proc"].stdout, selectors.EVENT_READ, w)
                        continue
                    next_deadline = min(d for _, _, d in busy.values())
                    for key, _ in sel.select(max(0.0, next_deadline - time.monotonic())):
                        w = key.data
                        lines = self._read_lines(w)
                        _, index, _ = busy[id(w)]
                        if lines is None:          # the worker died (crash, OOM): no answer
                            sel.unregister(key.fileobj)
                            del busy[id(w)]
                            self._kill(w)
                            continue
                        for line in lines:
                            msg = json.loads(line)
                            if msg.get("id") == index:
                                results[index] = msg
                                sel.unregister(key.fileobj)
                                del busy[id(w)]
                                break
                    now = time.monotonic()
                    for key_id, (w, index, deadline) in list(busy.items()):
                        if now >= deadline:
                            sel.unregister(w["proc"].stdout)
                            del busy[key_id]
                            self.killed += 1
                            self._kill(w)
            finally:
                sel.close()
            return results


_pools: dict = {}
_pools_lock = threading.Lock()


def get_pool(workers: int = DEFAULT_WORKERS) -> VerifyPool:
    """The process-wide pool with `workers` workers (created lazily, closed at exit)."""
    with _pools_lock:
        if workers not in _pools:
            _pools[workers] = VerifyPool(workers)
        return _pools[workers]


@atexit.register
def _close_pools() -> None:
    for pool in list(_pools.values()):
        pool.close()


def _int_timeout(timeout) -> int:
    return max(1, int(-(-float(timeout) // 1)))   # signal.alarm wants whole seconds


def _verify_many(pairs: list, timeout, workers: int) -> list:
    """math-verify verdicts for (pred, gold) pairs: inline for one pair in the main thread (or workers=0),
    else in the worker pool with hard deadlines."""
    t = _int_timeout(timeout)
    main = threading.current_thread() is threading.main_thread()
    if main and (workers <= 0 or len(pairs) == 1):
        return [_verify_item(p, g, t) for p, g in pairs]
    pool = get_pool(max(1, int(workers)))
    answers = pool.run([{"op": "verify", "pred": p, "gold": g, "timeout": t} for p, g in pairs], 3 * t + 2)
    verdicts = [a.get("verdict") if a else None for a in answers]
    lost = [i for i, a in enumerate(answers) if a is None]
    if lost:
        # The worker hung (or died) on these: a 0 if the gold answer is sound on its own, else a skip.
        golds = pool.run([{"op": "gold", "gold": pairs[i][1], "timeout": t} for i in lost], t + 2)
        for i, a in zip(lost, golds):
            verdicts[i] = False if a and a.get("ok") else None
    return verdicts


# --------------------------------------------------------------------------------------------------
# The reward

def _gold_answer(gold) -> Optional[str]:
    """The answer in a gold field: a full GSM8K/MATH solution is reduced to its '####' or \\boxed answer."""
    if gold is None or isinstance(gold, bool):
        return None
    if isinstance(gold, float) and not isfinite(gold):   # pandas' missing answer: no gold, not 'a*n*n'
        return None
    gold = str(gold).strip()
    if not gold or gold.lower() == "nan":
        return None
    return after_hashes(gold) or last_boxed(gold) or gold


# What names the answer: 'x = 5', 'a_{1} = 5', 'f(2) = 5', '\\theta = 5' (one '=', a name on its left)
_ASSIGNMENT = re.compile(r"[A-Za-z\\][\w{}\\^']*(?:\([^=]*\))?\s*=\s*[^=]+")


def _fast_judge(pred: Optional[str], gold: str) -> Optional[bool]:
    """The verdict when the exact numeric path can decide it, else None."""
    if pred and "=" in pred and "=" not in gold and not _ASSIGNMENT.fullmatch(_clean(pred)):
        return False   # '6 = 5': math-verify compares an equation's right side only (found by a red team)
    g = _numeric(gold, letters_are_units=False)
    if g is None:
        return None        # math-verify must at least tell whether the gold answer parses
    if pred is None or not pred.strip():
        return False
    p = _numeric(pred)
    if p is None:
        return None
    return _numbers_equal(p, g)


def judge(pred_text: Optional[str], gold: str, timeout: int = TIMEOUT_S) -> Optional[bool]:
    """Is the extracted prediction equivalent to gold? None: gold cannot be judged (skip)."""
    gold_ans = _gold_answer(gold)
    if gold_ans is None:
        return None
    fast = _fast_judge(pred_text, gold_ans)
    if fast is not None:
        return fast
    return _verify_many([(pred_text, gold_ans)], timeout, DEFAULT_WORKERS)[0]


def math_reward(completions, *, prompts=None, rows=None, answer_field: str = "answer",
                extract=DEFAULT_EXTRACT, timeout: float = TIMEOUT_S,
                workers: int = DEFAULT_WORKERS) -> list[Optional[float]]:
    """1.0 if the completion's final answer equals the row's gold answer, 0.0 if not, None if the gold
    answer is missing or cannot be parsed. `extract`: extractor order; `timeout`: seconds per math-verify
    step; `workers`: size of the math-verify process pool (0: inline, main thread only). In a recipe,
    `answer_field` is data.answer_field (the trainer passes it)."""
    if rows is None:
        raise ValueError("math reward needs the dataset rows (with their answers)")
    order = _extract_order(extract)
    out: list[Optional[float]] = [None] * len(completions)
    todo: dict = {}
    for i, (completion, row) in enumerate(zip(completions, rows)):
        gold = _gold_answer(row.get(answer_field) if isinstance(row, dict) else None)
        if gold is None:
            continue
        pred = extract_answer(completion or "", order)
        fast = _fast_judge(pred, gold)
        if fast is not None:
            out[i] = float(fast)
        else:
            todo.setdefault((pred, gold), []).append(i)   # identical pairs are verified once
    if todo:
        pairs = list(todo)
        for pair, verdict in zip(pairs, _verify_many(pairs, timeout, workers)):
            for i in todo[pair]:
                out[i] = None if verdict is None else float(verdict)
    return out


# --------------------------------------------------------------------------------------------------
# Worker process: python -I math.py --worker MEMORY_MB

def _worker_main(memory_mb: int) -> None:
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)    # stray prints of libraries must not corrupt the protocol
    try:
        import ctypes
        import resource
        import signal

        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)   # PR_SET_PDEATHSIG: die with the parent
        if memory_mb > 0:
            resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
        import math_verify  # noqa: F401  (import before 'ready': start-up is not charged to an item)

        _verify_item("1", "1", 1)
    except Exception as exc:   # reported to the parent, which raises it
        out.write(json.dumps({"ready": False, "error": f"{type(exc).__name__}: {exc}"}) + "\n")
        return
    out.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        op, reply = req.get("op"), {"id": req.get("id")}
        try:
            if op == "verify":
                reply["verdict"] = _verify_item(req["pred"], req["gold"], req["timeout"])
            elif op == "gold":
                reply["ok"] = bool(_gold_parsed(req["gold"], req["timeout"]))
            elif op == "sleep":      # diagnostics: an item that ignores every timeout
                time.sleep(float(req["seconds"]))
                reply["slept"] = True
            else:
                reply["error"] = f"unknown op {op!r}"
        except MemoryError:
            reply.update(verdict=False, ok=False, error="MemoryError")
        except Exception as exc:
            reply["error"] = f"{type(exc).__name__}: {exc}"
        out.write(json.dumps(reply) + "\n")


if __name__ == "__main__" and len(sys.argv) >= 2 and sys.argv[1] == "--worker":
    _worker_main(int(sys.argv[2]) if len(sys.argv) > 2 else WORKER_MEMORY_MB)
