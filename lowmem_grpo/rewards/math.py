"""Math answer reward: extract the final answer, check equivalence with the gold answer.

Extraction (`extract=`, an ordered list of extractor names, or a comma-separated string; the first one
that finds something wins). The default order is boxed, answer_tag, hashes, last_number:

    boxed        the content of the last complete \\boxed{...} / \\fbox{...} (also `\\boxed 5`)
    answer_tag   the content of the last <answer>...</answer> (a sentence there is reduced to its last number)
    hashes       the first line after the last '####' (GSM8K style) that holds an answer: a digit, and not a
                 word first ('#### Step 1: add' or '#### 1. Add' is a Markdown heading, no answer)
    last_number  the last number of the text (thousands separators, decimals, a/b, \\frac{a}{b}, a trailing %;
                 not an exponent, base, subscript, denominator or radicand)

A completion that closes its reasoning with </think> is read after its last </think> only: the reasoning is a
draft, and its \\boxed{} does not beat the final <answer> (nothing there: no answer). Without </think>
(a completion cut off while thinking, or a model that does not think in tags) the whole text is read.

Equivalence, cheapest first:

1. Exact numeric fast path: when both the prediction and the gold answer are plain numbers — integers,
   decimals, a/b, \\frac{a}{b}, thousands separators, currency signs, percentages, a trailing unit
   ('5 cm', '10 \\text{ dollars}', '45^\\circ'), 'x = 5' — they are compared exactly with
   fractions.Fraction. No math-verify call: 1,000 such completions take milliseconds. A percentage matches
   either its value or its bare number ('50%' matches 0.5 and 50), as math-verify does.
2. Otherwise math-verify (Hugging Face) parses both sides (LaTeX, sets, intervals, expressions) and checks
   symbolic equality.

Values are compared exactly on both paths: a decimal is the rational number it writes. '0.5' matches \\frac12 and
'2.50' matches \\frac52, but a decimal that only approximates the gold answer ('0.333333' for \\frac13, '0.866025'
for \\frac{\\sqrt3}{2}, '3.14' for \\pi) is another number and scores 0 (math-verify alone rounds to 6 places).

Words after a number: units ('5 cm', '3 apples', '2 m', '5cm') are dropped; value words ('3 tens', '5 thousand',
'5 squared') and variables ('2p', '2 p', '2ab', '2 xy': a one-letter word, two lowercase letters that are no unit
abbreviation or short English word, or letters glued to the number that are no unit abbreviation) make it another
value, on the gold side as on the prediction side: '2p' and '2 xy' score 0 for gold 2, and '2' scores 0 for gold
'2ab'.

An equation given for an answer that is none counts when one side of its single '=' names the answer ('x = 5',
'5 = x', 'a_{1} = 5', 'f(2) = 5'); '6 = 5', '5 = 5' and 'x = 5 = 6' score 0.

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


def _matching_braces(text: str, opening: str = "{", closing: str = "}") -> dict:
    """{index of '{': index of its matching '}'} for the balanced pairs of text, in one pass (or of another pair of
    brackets: '(' and ')')."""
    pairs, stack = {}, []
    for i, ch in enumerate(text):
        if ch == opening:
            stack.append(i)
        elif ch == closing and stack:
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
    value, wordy = _number(content)     # '3 tens' is no sentence to take the 3 from
    if value is None and not wordy and _PROSE_WORD.search(re.sub(r"\\text\{[^{}]*\}", "", content)):
        return last_number(content) or content
    return content


# A Markdown heading after '####': a word first ('Step 1: add', '**Final Answer**'), or a numbered title ('1. Add',
# '2) Check'). GSM8K's marker is followed by the answer itself ('42', '$1,080', '-3', 'x = 5', '**42**', '5 apples').
_HEADING = re.compile(r"(?:\*\*|__|\*|_)?\s*(?:[A-Za-z]{2,}|\d+\s*[.):]\s+[A-Za-z])")
_HASHES = re.compile(r"(?<!#)####(?!#)")


def after_hashes(text: str) -> Optional[str]:
    """The first line after the last '####' (GSM8K's answer marker) that is an answer: it holds a digit and is no
    Markdown heading ('#### Final Answer', '#### Step 1: add the numbers', '#### 1. Add'); a heading is passed over
    (found by a red team: '#### Step 1: ...' made 1 the answer). '#####' and longer runs are headings too."""
    if "####" not in text:
        return None
    for part in reversed(_HASHES.split(text)[1:]):
        tail = part.strip()
        line = tail.splitlines()[0].strip() if tail else ""
        if any(c.isdigit() for c in line) and not _HEADING.match(line):
            return line
    return None


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


def after_reasoning(text: str) -> str:
    """What follows the last </think> (the reasoning closed: its drafts are no answer), else the whole text."""
    close = text.lower().rfind("</think>")
    return text if close < 0 else text[close + len("</think>"):]


def extract_answer(text: str, order=DEFAULT_EXTRACT) -> Optional[str]:
    """The completion's final answer by the first extractor (in `order`) that finds one, else None. Read after
    the last </think> when there is one: a \\boxed{} draft in the reasoning lost to the final <answer> (found by a
    red team)."""
    text = after_reasoning(text)
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
# The word right after a number ('2p', '2 p', '2ab') is a variable, as in LaTeX, on both sides (found by a red team:
# '2p' scored 1.0 for gold 2, and '2' for gold '2ab'), unless it is a unit: a word set apart from the number ('5 cm',
# '3 apples', '10 \\text{dollars}'; of two lowercase letters only if _TWO_LETTER_WORDS has it), a one-letter unit symbol
# set apart ('2 m', '3\\,s'), or an abbreviation that may be glued to it ('5cm', '2kg', '3rd').
_UNIT_LETTERS = {"m", "g", "s", "h", "l", "L"}
_GLUED_UNITS = {"cm", "mm", "km", "kg", "mg", "ml", "mL", "ft", "lb", "lbs", "oz", "yd", "yds", "mi", "hr", "hrs",
                "min", "mins", "sec", "secs", "mph", "kph", "kmh", "st", "nd", "rd", "th",
                # (abbreviations no vowel spells: without them here, '10 yrs' would read as 10*y*r*s)
                "yrs", "wk", "wks", "pts", "qts", "tsp", "tbsp", "pcs", "pkg", "pkgs", "ppl", "mth", "mths", "ltr",
                "ltrs", "sqft"}
# Two lowercase letters set apart from a number are a product of variables too ('2 xy', '3 ab': math-verify reads
# 2*x*y), unless they are a unit abbreviation or a short English word that can follow a number in prose; so are
# more, when no vowel makes them a word ('2 xyz', 'abc' left a word: '3 abc' may count something).
_TWO_LETTER_WORDS = {w for w in _GLUED_UNITS if len(w) == 2} | {
    "in", "sq", "cu", "nm", "ms", "ns", "dl", "cl", "dm", "yr", "pt", "qt", "ha", "hp", "am", "pm",
    "of", "is", "on", "at", "as", "so", "it", "we", "an", "be", "no", "up", "us", "my", "he", "me", "do", "go",
    "if", "ok"}
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


def _units_ok(tail: str, apart: bool) -> bool:
    """Whether the words after a number (`tail`, _PLAIN's unit group; `apart`: set apart from the number by a
    space) are units, not mathematics."""
    words = re.findall(r"[A-Za-z]+(?:\.[A-Za-z]+)?", tail)
    if not words:
        return True
    first = words[0]
    if not apart:                         # glued to the number: '5cm' is a unit, '2p', '2ab', '5m' are products
        if first not in _GLUED_UNITS:
            return False
    elif len(first) == 1 and first not in _UNIT_LETTERS:    # '2 p': a variable; '2 m': metres
        return False
    elif len(first) == 2 and first.islower() and first not in _TWO_LETTER_WORDS:   # '2 xy': 2*x*y; '5 cm', '12 in'
        return False
    elif len(first) > 2 and first.islower() and not re.search("[aeiou]", first) and first not in _GLUED_UNITS:  # 2 xyz
        return False
    return not any(w.lower() in _NOT_UNITS and w not in _UNIT_LETTERS for w in words)


def _number(text: Optional[str]) -> tuple:
    """(value, wordy): the value of a plain numeric answer, or None when it is anything else; wordy is True when
    it is a number followed by words that are no units ('3 tens', '5 thousand', '2p', '5 x'): not that number,
    whatever math-verify makes of it (it drops a trailing \\text{} and unit-like words: '3 \\text{ tens}' was 3)."""
    if text is None:
        return None, False
    s = _clean(text)
    if len(s) > 200:
        return None, False
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
            return None, False
        return _Num(-value if m.group("sign") == "-" else value, False), False
    m = _PLAIN.fullmatch(s)
    if not m:
        return None, False
    if not _units_ok(m.group("unit") or "", s[m.start("unit") - 1].isspace()):
        return None, True
    try:
        value = Fraction(m.group("num").replace(",", ""))
        if m.group("den"):
            value /= Fraction(m.group("den"))
    except (ValueError, ZeroDivisionError):
        return None, False
    return _Num(-value if m.group("sign") == "-" else value, bool(m.group("pct"))), False


def _numeric(text: Optional[str]) -> Optional[_Num]:
    """The value of a plain numeric answer, or None when it is anything else (left to math-verify). '1.5e3' is
    1500 (scientific notation: str() writes a float column's 1e-07 so; math-verify read the e as Euler's number).
    Words after the number must be units (_units_ok): '2a' and '2 b' are products, so '2' and '2b' did not match
    gold '2a' (found by a red team), and '5 thousand' is not 5."""
    return _number(text)[0]


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


# The last word of an answer, as math-verify drops it for a unit: a trailing \\text{...} (any), or letters after a
# digit, a '}' or a space (its list of units holds 't', 'h', 'm', 'ab', 'more', 'less'...).
_TAIL = re.compile(r"(?P<sep>\s*)(?P<tail>\\(?:text|textrm|textnormal|textbf|textit|mathrm|mathbf|mathit|mbox)\s*"
                   r"\{[^{}]*\}(?:\^\{?\d+\}?)?|[A-Za-z]+)\s*$")


def _drops_a_value(s: str) -> bool:
    """Whether math-verify would drop, as a unit, words at the end of `s` that are no units by _units_ok: a value
    word ('\\frac12 \\text{ tens}', '5 thousand') or a variable ('\\frac{1}{2}t', '\\sqrt{2}m', '2ab')."""
    if "=" in s:
        return False
    if _number(s)[1]:
        return True
    end = s[-300:]     # (searched in the last characters only: linear time on a run of letters of any length)
    m = _TAIL.search(end)
    if not m:
        return False
    before, text = s[:len(s) - len(end) + m.start()].rstrip(), m.group("tail")
    apart = bool(m.group("sep")) or text.startswith("\\")
    if not before or not (apart or before[-1].isdigit() or before[-1] == "}"):
        return False
    return not _units_ok(_clean(text), apart)


# A degree mark ('^\\circ', '^{\\circ}', '°', '\\degree'), and a trigonometric function with its power, if any.
_DEGREE = r"(?:\s*\^\s*(?:\{\s*(?:\\circ|°)\s*\}|\\circ(?![A-Za-z]))|\s*°|\s*\\degree(?![A-Za-z]))"
_DEGREE_MARK = re.compile(r"\\circ|°|\\degree")
_TRIG = re.compile(r"\\(?:sin|cos|tan|cot|sec|csc)(?![A-Za-z])(?:\s*\^\s*(?:\{[^{}]*\}|\w))?\s*")
_NUMBER_DEGREES = re.compile(r"(\d+(?:\.\d+)?|\.\d+)" + _DEGREE)
_BARE_DEGREES = re.compile(r"([-+]?\s*)(?:(?P<num>\d+(?:\.\d+)?|\.\d+)|(?P<atom>[A-Za-z]|\\(?!circ|degree)[A-Za-z]+))"
                           + _DEGREE)


def _to_radians(arg: str) -> str:
    """Each degree mark of a trigonometric function's argument as a factor pi/180 ('30^\\circ': \\frac{30\\pi}{180})."""
    arg = _NUMBER_DEGREES.sub(r"\\frac{\1\\pi}{180}", arg)
    return re.sub(_DEGREE, r"\\cdot\\frac{\\pi}{180}", arg)


def _trig_degrees(s: str) -> str:
    """Degrees in the argument of a trigonometric function made radians: math-verify drops the degree mark, so
    '\\sin 30^\\circ' was sin(30 radians) and failed for 0.5. A degree mark anywhere else (an angle: '30^\\circ' for
    gold 30) is left to be dropped. The argument is a bracketed group ('\\sin(30^\\circ)', '\\sin{30^\\circ}',
    '\\cos\\left(90^\\circ - x\\right)') or one number or letter with its mark ('\\sin 30^\\circ', '\\tan\\theta°')."""
    if not _DEGREE_MARK.search(s) or not _TRIG.search(s):
        return s
    parens, braces = None, None
    out, done = [], 0
    for m in _TRIG.finditer(s):
        if m.start() < done:          # inside an argument already converted ('\\sin(\\cos 60^\\circ)')
            continue
        j = m.end()
        if s.startswith("\\left(", j):
            j += len("\\left")
        end = None
        if j < len(s) and s[j] in "({":
            if parens is None:        # matched once for the whole string: linear time however many functions
                parens, braces = _matching_braces(s, "(", ")"), _matching_braces(s)
            end = (parens if s[j] == "(" else braces).get(j)
        if end is not None:
            out += [s[done:j], _to_radians(s[j:end + 1])]
            done = end + 1
            continue
        bare = _BARE_DEGREES.match(s, j)
        if bare:
            sign, num, atom = bare.group(1), bare.group("num"), bare.group("atom")
            arg = f"\\frac{{{num}\\pi}}{{180}}" if num else f"{atom}\\cdot\\frac{{\\pi}}{{180}}"
            out += [s[done:j], f"({sign}{arg})"]
            done = bare.end()
    return "".join(out) + s[done:]


# A function name written without its backslash ('sin 30°', 'cos(x)', 'ln 2'): math-verify reads the letters as a
# product of variables, so 'sin 30°' failed for 1/2 and 'sin x' for '\sin x'
_BARE_FUNCTION = re.compile(r"(?<![\\A-Za-z])(arcsin|arccos|arctan|sinh|cosh|tanh|sin|cos|tan|cot|sec|csc|ln|log|exp)"
                            r"(?![A-Za-z])")


def _as_latex(s: str) -> str:
    # math-verify looks for LaTeX anchors; a bare answer is wrapped so that it is found. It reads 1.5e3 as
    # 1.5 * e * 3 (Euler's number): scientific notation goes as 1.5\times10^{3}.
    s = _trig_degrees(_BARE_FUNCTION.sub(r"\\\1", s.replace("\\$", "")))
    if "," not in s and _drops_a_value(s.strip().strip("$")):
        # '2ab', '3 \\text{ tens}', '\\frac{1}{2}t': a product or another value, which math-verify would read as the
        # number alone, dropping the words as units ('2t' and '2ab' were 2). In parentheses they stay.
        s = "(" + s.strip().strip("$").strip() + ")"
    s = _SCIENTIFIC.sub(r"\1\\times10^{\2}", s)
    return s if "$" in s or "\\boxed" in s or "\\(" in s or "\\[" in s else f"${s}$"


def _gold_parsed(gold: str, timeout: Optional[int]):
    from math_verify import parse

    # no_fallback: the raw string of an unparseable gold is not an answer to compare with.
    return parse(_as_latex(gold), fallback_mode="no_fallback", parsing_timeout=timeout)


def _exact_decimals(parsed: list) -> list:
    """math-verify's parse with each decimal made the rational number it writes (0.866025 is 34641/40000): math-verify
    rounds floats to 6 places, so 0.866025 matched sqrt(3)/2 while the exact path failed 0.333333 for 1/3 (found by
    a red team). Exact, a decimal that only approximates the gold answer fails; one that is its value passes."""
    from sympy import Float, Rational

    out = []
    for item in parsed:
        try:
            floats = item.atoms(Float) if not isinstance(item, str) else ()
            if floats:
                item = item.xreplace({f: Rational(str(f)) for f in floats})
        except Exception:
            pass
        out.append(item)
    return out


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
        return bool(verify(_exact_decimals(gold_parsed), _exact_decimals(pred_parsed), timeout_seconds=timeout))
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


# What names the answer: 'x = 5', 'a_{1} = 5', 'f(2) = 5', '\\theta = 5', 'AB = 5', "f'(1) = 5": letters or a Greek
# letter, with subscripts, superscripts, primes and arguments; no constant or operation ('\\pi = 3', '\\frac{1}{2} = 5',
# '\\sqrt{4} = 5' name nothing: their right side is no answer of theirs).
_GREEK = (r"\\(?:alpha|beta|gamma|delta|epsilon|varepsilon|zeta|eta|theta|vartheta|iota|kappa|lambda|mu|nu|xi|rho|"
          r"sigma|tau|upsilon|phi|varphi|chi|psi|omega|Gamma|Delta|Theta|Lambda|Xi|Sigma|Phi|Psi|Omega)(?![A-Za-z])")
_NAME = re.compile(rf"(?!(?:pi|infty|inf)\b)(?:[A-Za-z]+|{_GREEK})(?:\s*(?:[_^](?:\{{[^{{}}=]*\}}|\w)|'))*"
                   r"(?:\s*\([^=()]*\))?")


def _named_value(pred: str) -> Optional[str]:
    """An equation given for a gold answer that is none: 'name = value' when one side of its single '=' names the
    answer, as 'x = 5' or '5 = x' (either side: found by a red team), else None ('6 = 5', '5 = 5', 'x = 5 = 6')."""
    parts, raw = _clean(pred).split("="), pred.split("=")
    if len(parts) != 2 or len(raw) != 2 or not parts[0].strip() or not parts[1].strip():
        return None
    if _NAME.fullmatch(parts[0].strip()):
        return pred
    if _NAME.fullmatch(parts[1].strip()):
        return f"{raw[1].strip()} = {raw[0].strip()}"
    return None


def _fast_judge(pred: Optional[str], gold: str) -> tuple:
    """(verdict, prediction): the verdict when the exact numeric path can decide it, else None, and the
    prediction to give math-verify then ('5 = x' as 'x = 5')."""
    if pred and "=" in pred and "=" not in gold:
        pred = _named_value(pred)
        if pred is None:
            return False, None   # '6 = 5': math-verify compares an equation's right side only (found by a red team)
    g = _numeric(gold)
    if g is None:
        return None, pred        # math-verify must at least tell whether the gold answer parses
    if pred is None or not pred.strip():
        return False, pred
    p, wordy = _number(pred)
    if p is None:
        # '3 \\text{ tens}', '2p' for gold 3, 2: a number and words that make it another value, which math-verify
        # would drop (found by a red team)
        return (False, pred) if wordy else (None, pred)
    return _numbers_equal(p, g), pred


def judge(pred_text: Optional[str], gold: str, timeout: int = TIMEOUT_S) -> Optional[bool]:
    """Is the extracted prediction equivalent to gold? None: gold cannot be judged (skip)."""
    gold_ans = _gold_answer(gold)
    if gold_ans is None:
        return None
    fast, pred = _fast_judge(pred_text, gold_ans)
    if fast is not None:
        return fast
    return _verify_many([(pred, gold_ans)], timeout, DEFAULT_WORKERS)[0]


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
        fast, pred = _fast_judge(pred, gold)
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
        __import__("math_verify")   # before 'ready': start-up is not charged to an item

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
