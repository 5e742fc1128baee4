"""Code rewards judged on standard input and output, as programming contests judge: the completion's program
runs on each case's input in the sandbox, and the trainer compares what it printed with the expected output.

    code_io         score = fraction of the row's cases whose output matches
    code_io_binary  score = 1.0 only if every case matches

The cases are in the row field `tests_field`, in any of the shapes code datasets store them (or a JSON string
of one):

    {"inputs": [...], "outputs": [...]}          APPS, TACO (`input_output`)
    {"input": [...], "output": [...]}            CodeContests (`public_tests`, `private_tests`)
    [{"input": ..., "output": ...}, ...]         Codeforces-style test lists (also "stdin"/"stdout" keys),
                                                 LiveCodeBench's `public_test_cases` ("testtype": "stdin")
    {"test_cases": [...]}                        the list above inside a wrapper (`verification_info`)

An input or output is text (a list of lines is joined); an input without a final newline is given one, as
contest input files end. A row whose cases are missing, empty or of another kind (a case whose `"type"` is
"function_call"; LiveCodeBench's compressed `private_test_cases`, which are never unpickled) cannot be scored:
None (skip), never 0.

Function-call problems (LeetCode style) are judged by calling the function (`get_calls`):

    {"fn_name": "f", "inputs": [[arg, ...], ...], "outputs": [value or [value], ...]}      APPS, TACO
    [{"input": "<one JSON value per line>", "output": "<JSON>", "testtype": "functional"}]  LiveCodeBench, with
                                                                                            the row's `metadata`
                                                                                            {"func_name": ...}

The program's top level runs once, then each case's call, `Solution().f(*args)` where the program defines a
class Solution, else `f(*args)`, each under `timeout`; only the arguments enter the sandbox, the return value
comes back as plain data (rewards/code.py, "judged outside") and matches here when it equals the expected one
with tuples read as lists (as JSON carries them), or, for APPS/TACO, the one element of an expected output they
store wrapped in a list (as their own judge accepts).

A case passes when the program exits 0 within `timeout` (wall-clock time less what it waited for a CPU, up to
code.LOAD_ALLOWANCE x `timeout`: docs/sandbox.md, "Time limits under load") and its output matches: the same lines
once trailing spaces and trailing blank lines are dropped, or else the same tokens, where whitespace is
ASCII's only (space, \t, \n, \r, \v, \f: not U+00A0, U+3000, ...) and two plain decimal numbers (ASCII digits; no
"inf", "nan", "1_000") also match within `float_tolerance` (relative, or absolute below 1) when the expected one has a
decimal point or an exponent (a "1e-6" checker, as many problems state). The expected output never enters the
program's sandbox and the comparison happens here: a program can only print, never claim a verdict, so there is nothing to
forge (docs/sandbox.md, "Verdicts"). A completion's cases run in one sandboxed program (_IO_HARNESS), each in a
fresh fork of it that holds only the case's stdin and stdout (what a case leaves running is killed, and what it
wrote in /tmp, /dev/shm and its directory removed, before the next case starts; a case that ends past its limit
is a timeout however it kept the relay from seeing the clock); that saves the sandbox's start-up (~0.1 s) per case:
5.5x faster on 10 cases (scripts/bench_rewards.py), with the same verdicts as a sandboxed program per case
(`run_cases_separately`, the reference the tests compare with; its limit is plain wall-clock time, so on a loaded
machine it may fail a case as a timeout that run_cases passes). Each case's output is capped at twice the
expected size plus 4 KiB, plus 16 bytes per number compared within the tolerance, in place of max_output_bytes
(a program printing more has failed already). That cap is applied here: a case's fork holds a copy of the relaying
program's memory, which gets only 64 KiB or the power of two above the cap, so that no case can read the length of
its expected output there (a YES/NO answer from it); above ~30 KiB, that tells its band of sizes.

Problems with more than one right answer come with a checker (a special judge): with `checker_field` set, a row
whose field holds one (Python source) has each output that is not the expected one token for token judged by
it, in a sandbox of its own where no model-written code runs (`run_checks`): it gets `input.txt`,
`correct_output.txt` and `solution_output.txt` in its directory, their names as sys.argv[1:] in that order, and
the input on stdin. It accepts by exiting 0 with nothing on stdout (testlib's convention: the exit status is the
verdict), or with a stdout that is, but for surrounding whitespace, wholly one of ok / accepted / ac / yes /
correct / pass / passed / true or a score of exactly 1 (open-r1/codeforces' generated checkers print 1 or 0);
anything else on stdout, or another exit status, is a wrong answer. So a checker must never print the program's
output as its verdict: one that echoes it ("<output> is wrong") is judged wrong, but one that prints it alone
gives the program the verdict. A row whose checker is not a Python program (C++ testlib source, say) is skipped,
not scored: its alternative answers could not be told from wrong ones. The checker sees the program's output only
as data, as a contest's does.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import json
import keyword
import marshal
import math
import re
import secrets
from decimal import Decimal
from typing import Iterable, Optional

from .code import (DEFAULT_TEST_TIMEOUT_S, DEFAULT_WORKERS, HARNESS_COMMON, LOAD_ALLOWANCE, Judging, field_value,
                   private_run, run_tests, sandbox_check, score_in_sandbox)
from .sandbox import SandboxError, SandboxLimits, run_python, sandbox_info

DEFAULT_FLOAT_TOLERANCE = 1e-6
_IO_KEYS = (("inputs", "outputs"), ("input", "output"), ("stdin", "stdout"))
_IO_TYPES = (None, "stdin_stdout", "stdin", "stdio")
_TYPE_KEYS = ("type", "testtype")   # PrimeIntellect's "type"; LiveCodeBench's (and DeepCoder's lcbv5) "testtype"
# A checker's whitespace is ASCII's, as testlib's: str.split() and str.rstrip() would also take U+00A0, U+3000,
# U+2028, \x1c-\x1f, \x85 ... for separators, so "1\u00a02" would pass for "1 2".
_WHITESPACE = " \t\n\r\v\f"
_SPACES = re.compile(r"[ \t\n\r\v\f]+")
# A number as a contest prints it (strtod's decimal syntax, ASCII digits): float() would also take "1_000.5",
# "\u0661.5" (Arabic-Indic digits), full-width digits, "inf", "nan" and unicode whitespace around the number.
# Written so that no two ways to match the same digits exist: "[0-9]+\\.?[0-9]*" backtracks quadratically on a
# long run of digits that ends in a letter (32,000 digits: ~30 s), and the program chooses its tokens.
_NUMBER = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_FLOAT_SLACK = 16   # output bytes allowed per number of the expected output that is compared within a tolerance
DEFAULT_CHECKER_TIMEOUT_S = 5.0
CHECKER_FILES = ("input.txt", "correct_output.txt", "solution_output.txt")
_CHECKER_OUTPUT_CAP = 4096   # a verdict is a word or a number; a checker printing more has not given one
_ACCEPT_WORDS = {"ok", "accepted", "ac", "yes", "correct", "pass", "passed", "true"}


def _text(value) -> Optional[str]:
    """A case's input or output as text: a string, or a list of lines (joined); else None."""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return "\n".join(value) + ("\n" if value else "")
    return None


def _tests_value(row: dict, tests_field: str):
    """The row's tests field, decoded, out of a {"test_cases": ...} wrapper."""
    cases = field_value(row, tests_field)
    return cases["test_cases"] if isinstance(cases, dict) and "test_cases" in cases else cases


def get_cases(row: dict, tests_field: str = "tests") -> Optional[list[tuple[str, str]]]:
    """The row's (input, expected output) cases, or None when they are missing, malformed or not stdin/stdout."""
    cases = _tests_value(row, tests_field)
    if isinstance(cases, dict) and cases.get("fn_name"):   # APPS/TACO's call-based problems: arguments, not stdin
        return None
    if isinstance(cases, dict):   # parallel lists of inputs and outputs
        keys = next(((i, o) for i, o in _IO_KEYS if i in cases and o in cases), None)
        if keys is None or not isinstance(cases[keys[0]], list) or not isinstance(cases[keys[1]], list) \
                or len(cases[keys[0]]) != len(cases[keys[1]]):
            return None
        pairs = list(zip(cases[keys[0]], cases[keys[1]]))
    elif isinstance(cases, list):   # one mapping per case
        pairs = []
        for case in cases:
            # a function-call case ("type": "function_call", "testtype": "functional") is arguments, not stdin
            if not isinstance(case, dict) or any(case.get(k) not in _IO_TYPES for k in _TYPE_KEYS):
                return None
            keys = next(((i, o) for i, o in _IO_KEYS if i in case and o in case), None)
            if keys is None:
                return None
            pairs.append((case[keys[0]], case[keys[1]]))
    else:
        return None
    out = [(_text(i), _text(o)) for i, o in pairs]
    if not out or any(i is None or o is None for i, o in out):
        return None
    return out


@dataclasses.dataclass(frozen=True)
class Calls:
    """A function-call problem's cases: the function's name, (arguments, expected return value) per case."""
    fn_name: str
    cases: tuple
    unwrap: bool   # APPS/TACO store a return value as [value]: the value alone matches too


def _plain(value, depth: int = 0) -> bool:
    """JSON's data with finite numbers, not too deep: what repr() writes as a literal the sandbox reads back."""
    if depth > 100:
        return False
    if value is None or isinstance(value, (bool, int, str)):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_plain(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v, depth + 1) for k, v in value.items())
    return False


def _json_lines(text) -> Optional[list]:
    if not isinstance(text, str):
        return None
    try:
        return [json.loads(line) for line in text.split("\n") if line.strip()]
    except ValueError:
        return None


def _func_name(row: dict) -> Optional[str]:
    meta = field_value(row, "metadata")   # LiveCodeBench: a JSON string {"func_name": ...}
    return meta.get("func_name") if isinstance(meta, dict) else None


def get_calls(row: dict, tests_field: str = "tests") -> Optional[Calls]:
    """The row's function-call cases (module docstring), or None when it has none usable."""
    cases = _tests_value(row, tests_field)
    if isinstance(cases, dict) and cases.get("fn_name"):   # APPS, TACO
        name, inputs, outputs, unwrap = cases["fn_name"], cases.get("inputs"), cases.get("outputs"), True
        if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs):
            return None
    elif isinstance(cases, list) and cases and all(isinstance(c, dict) and c.get("testtype") == "functional"
                                                     for c in cases):   # LiveCodeBench
        name, unwrap = _func_name(row), False
        inputs = [_json_lines(c.get("input")) for c in cases]
        outputs = [_json_lines(c.get("output")) for c in cases]
        if any(o is None or len(o) != 1 for o in outputs):
            return None
        outputs = [o[0] for o in outputs]
    else:
        return None
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name) or not inputs:
        return None
    if not all(isinstance(args, list) and _plain(args) and _plain(out) for args, out in zip(inputs, outputs)):
        return None
    return Calls(name, tuple(zip(inputs, outputs)), unwrap)


def _as_json(value):
    if isinstance(value, (list, tuple)):
        return [_as_json(v) for v in value]
    if isinstance(value, dict):
        return {k: _as_json(v) for k, v in value.items()}
    return value


def returns_match(value, expected, unwrap: bool = False) -> bool:
    """Whether a returned value (plain data, decoded) is the expected return value (module docstring)."""
    got = _as_json(value)
    return got == expected or (unwrap and isinstance(expected, list) and len(expected) == 1 and got == expected[0])


_CLASS_SOLUTION = re.compile(r"^class\s+Solution\b", re.MULTILINE)


def _callee(code: str, calls: Calls) -> tuple[str, str]:
    """(what a case calls, the name the program must define for it): LeetCode's class Solution, else fn_name."""
    if _CLASS_SOLUTION.search(code):
        return f"Solution().{calls.fn_name}", "Solution"
    return calls.fn_name, calls.fn_name


def call_tests(code: str, calls: Calls) -> list[Judging]:
    """Each case as a test judged outside: the call enters the sandbox, its value is compared here."""
    callee = _callee(code, calls)[0]
    match = functools.partial(returns_match, unwrap=calls.unwrap)
    return [Judging("value", f"{callee}(*{_arguments(args)})", expected=out, matches=match) for args, out in calls.cases]


def _arguments(args: list) -> str:
    """A call's arguments as source: JSON text in one string literal where JSON holds them exactly (the datasets'
    are JSON), read by json.loads in the sandbox; a Python literal of 400,000 pairs took the sandbox's whole
    memory to compile. Anything JSON would change (tuples, sets, NaN) as a Python literal."""
    try:
        text = json.dumps(args)
    except (TypeError, ValueError):
        return repr(args)
    return f"__import__('json').loads({text!r})" if json.loads(text) == args else repr(args)


# The names a function-call problem's program may use unimported, as on the sites and in the datasets' own judges
# (LiveCodeBench and TACO prepend these star imports): starter code annotates with List[int] and solutions call
# deque or heappush without importing them. The program sees them as it sees the builtins, which win (math's pow
# must not stand for the built-in three-argument pow); the function a case calls must be the program's own (a
# program that defines nothing must not answer "lcm" with math's), and `from __future__` can stay its first line.
CALL_PRELUDE = ("from typing import *\nfrom collections import *\nfrom heapq import *\nfrom bisect import *\n"
                "from itertools import *\nfrom functools import *\nfrom math import *\n"
                "import bisect, collections, functools, heapq, itertools, math, operator, re, string, sys\n")


def run_calls(code: str, calls: Calls, *, timeout: float = DEFAULT_TEST_TIMEOUT_S,
              limits: Optional[SandboxLimits] = None, allow_weak_sandbox: bool = False) -> list[bool]:
    """Run the program (with CALL_PRELUDE's names) once, then each case's call, in one sandboxed program
    (rewards/code.py's); one bool per case, judged here on the value it returns."""
    run = run_tests(code, call_tests(code, calls), timeout=timeout, limits=limits, prelude=CALL_PRELUDE,
                    defines=[_callee(code, calls)[1]])
    return private_run(run, allow_weak_sandbox, "code_io").passed


@functools.lru_cache(maxsize=1024)   # a row's checker comes back every epoch
def _compiles(source: str) -> bool:
    try:   # compiled, never run, here: the checker runs only in the sandbox
        compile(source, "checker.py", "exec")
        return True
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
        return False


def row_checker(row: dict, checker_field: Optional[str]) -> tuple[bool, Optional[str]]:
    """(usable, source) of the row's checker: (True, None) without one (no field, or null / empty there), (True,
    source) for Python source that compiles, (False, None) for anything else (the row cannot be judged)."""
    value = row.get(checker_field) if checker_field and isinstance(row, dict) else None
    if value is None or (isinstance(value, str) and not value.strip()):
        return True, None
    if isinstance(value, str) and _compiles(value):
        return True, value
    return False, None


def row_job(row: dict, tests_field: str = "tests", checker_field: Optional[str] = None) -> tuple:
    """What the reward runs for a row: (its Calls, None), ((its stdin/stdout cases, its checker or None), None), or
    (None, why not): "cases" (none usable) or "checker" (one that is not a Python program, which could not tell a
    right answer from a wrong one)."""
    found = get_cases(row, tests_field)
    if found is None:
        calls = get_calls(row, tests_field)
        return (calls, None) if calls is not None else (None, "cases")
    usable, checker = row_checker(row, checker_field)
    return ((found, checker), None) if usable else (None, "checker")


@dataclasses.dataclass(frozen=True)
class CaseCounts:
    rows: int                 # rows looked at
    rows_without_cases: int   # rows the reward skips (no usable stdin/stdout or function-call cases)
    cases: int
    checkers: int = 0         # rows with cases whose checker judges what is not the expected output
    broken_checkers: int = 0  # rows with cases skipped because their checker is not a Python program
    calls: int = 0            # rows of function-call cases

    def describe(self, source: str = "the data") -> str:
        judged = self.rows - self.rows_without_cases - self.broken_checkers
        what = "test cases" if self.calls else "stdin/stdout cases"
        line = f"{what} in {source}: {self.cases} cases in {judged} rows, all judged outside the sandbox"
        kinds = [f"{judged - self.calls} rows of stdin/stdout, {self.calls} rows of function calls"] if self.calls else []
        kinds += [f"{self.checkers} rows by their checker, in a sandbox of its own"] if self.checkers else []
        if kinds:
            line += f" ({'; '.join(kinds)})"
        if self.rows_without_cases:
            line += f"; {self.rows_without_cases} rows without usable cases (skipped, not scored)"
        if self.broken_checkers:
            line += f"; {self.broken_checkers} rows whose checker is not a Python program (skipped, not scored)"
        return line


def count_cases(rows: Iterable[dict], tests_field: str = "tests", checker_field: Optional[str] = None) -> CaseCounts:
    """The cases of `rows`, and how many rows have none the reward can run (for `lowmem-grpo validate`)."""
    n = missing = cases = checkers = broken = calls = 0
    for row in rows:
        n += 1
        job, why = row_job(row, tests_field, checker_field)
        if why is not None:
            missing += why == "cases"
            broken += why == "checker"
        elif isinstance(job, Calls):
            calls += 1
            cases += len(job.cases)
        else:
            cases += len(job[0])
            checkers += job[1] is not None
    return CaseCounts(n, missing, cases, checkers, broken, calls)


def _lines(text: str) -> list[str]:
    lines = [line.rstrip(_WHITESPACE) for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _tokens(text: str) -> list[str]:
    text = text.strip(_WHITESPACE)
    return _SPACES.split(text) if text else []


def _number_matches(got: str, expected: str, tolerance: float) -> bool:
    if tolerance <= 0 or not any(c in expected for c in ".eE"):
        return False
    if not (_NUMBER.fullmatch(got) and _NUMBER.fullmatch(expected)):
        return False
    g, e = float(got), float(expected)   # (what _NUMBER matches, float reads)
    return math.isfinite(g) and math.isfinite(e) and abs(g - e) <= tolerance * max(1.0, abs(e))


def outputs_match(got: str, expected: str, float_tolerance: float = DEFAULT_FLOAT_TOLERANCE) -> bool:
    """Whether a program's output is the expected one (see the module docstring)."""
    if got == expected or _lines(got) == _lines(expected):
        return True
    a, b = _tokens(got), _tokens(expected)
    return len(a) == len(b) and all(x == y or _number_matches(x, y, float_tolerance) for x, y in zip(a, b))


# The sandbox runs Python with -S (no site module), which is what defines exit() and quit(); contest programs end
# with them often enough ("print(ans); exit()") that a right program would fail with a NameError. Both runners
# define them first, as sys.exit.
_EXIT_BUILTINS = "import builtins, sys; builtins.exit = builtins.quit = sys.exit; del builtins, sys\n"
# What the relay does for each case's program before running it, as the reference's lines: exit() and quit(), and
# stderr to /dev/null (a right program's debug output to stderr must not count against its output cap).
_REFERENCE_FIRST = _EXIT_BUILTINS + ("import os as _os; _fd = _os.open(_os.devnull, _os.O_WRONLY); _os.dup2(_fd, 2); "
                                     "_os.close(_fd); del _os, _fd\n")
_LINE_END = re.compile(r"\r\n|\r|\n")   # where Python's tokenizer ends a line


def _after_future_imports(first: str, code: str) -> str:
    """`code` with `first` (source lines) put before it, or after its `from __future__` imports (and the docstring
    before them), which must open a module."""
    try:
        body = ast.parse(code).body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return first + code
    end = 0
    for i, node in enumerate(body):
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            end = node.end_lineno
        elif not (i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):
            break
    if not end:
        return first + code
    ends = [m.end() for m in _LINE_END.finditer(code)]
    if end > len(ends):   # its last line, without a line end
        return code + "\n" + first
    return code[:ends[end - 1]] + first + code[ends[end - 1]:]


def _output_cap(expected: str, float_tolerance: float) -> int:
    """The most a right program may print for this expected output: twice it, plus 4 KiB."""
    # surrogatepass, as the inputs and the checker's files are: a dataset's lone surrogate raised here, before
    # any sandbox ran (found by a red team)
    cap = 2 * len(expected.encode("utf-8", "surrogatepass")) + 4096
    if float_tolerance > 0:   # "0.5" may rightly be printed "0.500000000000": room for the digits of
        # each number (an upper bound: its '.', 'e' and 'E' counted, without splitting a large output)
        cap += _FLOAT_SLACK * (expected.count(".") + expected.count("e") + expected.count("E"))
    return cap


def _stdin(text: str) -> str:
    # A contest's input file ends with a newline; some datasets stripped it, which breaks right programs
    # (sys.stdin.readline()[:-1] would cut a character of the last line).
    return text + "\n" if text and not text.endswith("\n") else text


# The checker's program: its three files written from the job on stdin, then its source run as checker.py would
# run (its own __main__ namespace, argv naming the files, the input on stdin).
_CHECKER_MAIN = '''import marshal as _marshal, sys as _sys
for _name, _data in zip(%(files)r, _marshal.loads(_sys.stdin.buffer.read())):
    with open(_name, "wb") as _f:
        _f.write(_data)
_sys.argv = ["checker.py", *%(files)r]
_sys.stdin = open(%(files)r[0])
exec(compile(%%r, "checker.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
''' % {"files": CHECKER_FILES}


def checker_program(source: str) -> str:
    return _CHECKER_MAIN % source


def checker_job(stdin: str, expected: str, got: str) -> bytes:
    """The checker's stdin: the case's input (as the program had it), the expected output, the program's."""
    return marshal.dumps(tuple(t.encode("utf-8", "surrogatepass") for t in (_stdin(stdin), expected, got)))


def checker_accepts(exit_status: Optional[int], stdout: str) -> bool:
    """A checker's verdict (module docstring): exit 0 and silence, or a stdout that is wholly a word of acceptance
    or a score of 1 (as open-r1's scorer takes `stdout.strip() == "1"`). Only the whole of it: a checker that
    printed a diagnostic starting with the contestant's output ("ok is wrong, expected 1 2") gave the program the
    verdict when its first word counted (found by a red team). Never raises, whatever the checker printed."""
    if exit_status != 0:
        return False
    line = stdout.strip(_WHITESPACE)
    if not line:
        return True
    if _NUMBER.fullmatch(line):   # exactly: float() rounds "0.99999999999999999" (a lesser score) to 1.0
        try:
            return Decimal(line) == 1
        except (ArithmeticError, ValueError):   # "0e9999999999999999999": past Decimal's exponents, not a score of 1
            return False
    return line.strip(".!:;,").lower() in _ACCEPT_WORDS


# What a Python checker splits on: str.split()'s whitespace (Unicode's: U+00A0, U+3000, \x1c-\x1f, ...), and
# the commas and semicolons of "x,y" output; float() strips that whitespace itself.
_CHECKER_TOKENS = re.compile(r"[\s,;]+")


def _as_float(token: str) -> Optional[float]:
    try:
        return float(token)
    except (ValueError, OverflowError):
        return None


def _before_checker(got: str, expected: str) -> Optional[bool]:
    """The verdict on an output that needs no checker, else None. The expected output token for token passes (and
    saves the checker's sandbox). A number that reads as NaN ("nan", "-NaN\u00a0") or as an infinity ("inf",
    "1e999", 400 digits) fails where the expected output holds numbers and none of that kind: every comparison
    with NaN is false, so the usual generated check `if abs(expected - got) > eps: reject` accepts it, and inf/inf
    is NaN in a relative one. Where the expected output holds no number ("aba"), "nan" may be a right word."""
    if outputs_match(got, expected, 0.0):
        return True
    numbers = _numbers(expected)
    if numbers and _non_finite(_numbers(got)) - _non_finite(numbers):
        return False
    return None


def _numbers(text: str) -> list[float]:
    """The tokens of `text` that a Python checker's float() reads."""
    return [v for v in map(_as_float, _CHECKER_TOKENS.split(text)) if v is not None]


def _non_finite(numbers: list[float]) -> set[str]:
    """The kinds ("nan", "inf") of the non-finite ones."""
    return {"nan" if math.isnan(v) else "inf" for v in numbers if not math.isfinite(v)}


def run_cases_separately(code: str, cases: list[tuple[str, str]], *, timeout: float = DEFAULT_TEST_TIMEOUT_S,
                         float_tolerance: float = DEFAULT_FLOAT_TOLERANCE, limits: Optional[SandboxLimits] = None,
                         checker: Optional[str] = None,
                         checker_timeout: float = DEFAULT_CHECKER_TIMEOUT_S) -> list[bool]:
    """Run `code` as its own sandboxed program once per case, the case's input on stdin (and `checker`, where
    given, as one more program per output to judge); one bool per case. The plain reference that `run_cases` is
    checked against (tests/test_rewards_code_io.py); ~0.1 s of sandbox start-up a case. Each run's limit is, as in
    run_cases, wall-clock time less what it waited for a CPU, up to LOAD_ALLOWANCE x the limit (found by a red team:
    its plain wall clock failed a correct program as a timeout on a loaded machine)."""
    lim = limits or SandboxLimits()

    def run(program, seconds, stdin, cap):
        result = run_python(_after_future_imports(_REFERENCE_FIRST, program), seconds, stdin=stdin,
                            limits=SandboxLimits.of(lim, max_output_bytes=cap), load_allowance=LOAD_ALLOWANCE)
        if result.killed_reason == "sandbox_error":
            raise SandboxError(f"the sandbox could not be set up: {result.error}")
        # Output past the cap (stdout_truncated) is never judged on the part that was kept: it has failed.
        return result.ok and not result.stdout_truncated, result

    passed = []
    for stdin, expected in cases:
        ok, result = run(code, timeout, _stdin(stdin), _output_cap(expected, float_tolerance))
        early = _before_checker(result.stdout, expected) if ok and checker is not None else None
        if ok and checker is not None and early is None:
            ok, verdict = run(checker_program(checker), checker_timeout, checker_job(stdin, expected, result.stdout),
                              _CHECKER_OUTPUT_CAP)
            passed.append(ok and checker_accepts(verdict.returncode, verdict.stdout))
        elif early is not None:
            passed.append(early)
        else:
            passed.append(ok and outputs_match(result.stdout, expected, float_tolerance if checker is None else 0.0))
    return passed


# One sandboxed program runs every case of a completion (a fork of it per case), which saves the sandbox's start-up
# per case. It only relays: the case's input to the program's stdin, its stdout back as hex, with its exit status;
# the expected outputs never come in. It makes itself non-dumpable before anything else (HARNESS_COMMON), so that
# what a case leaves running can neither open its descriptors nor read or trace it; each case's program starts
# with only its own stdin and stdout pipes, and its process group is killed when the case ends, then every process
# it left (the harness is their subreaper) and the files it wrote in the run's own tmpfs. Constant text:
# everything run-specific comes on stdin.
_IO_HARNESS = r"""
import _signal as signal, marshal, os, select, sys, time
# What `python main.py` puts in __main__'s namespace (__file__, __loader__, ...): the program gets the same.
MAIN = {k: v for k, v in globals().items() if k.startswith("__") and k.endswith("__")}
%(common)s

def is_closed(stream):
    try:
        return bool(stream.closed)
    except BaseException:
        return False


def execute(code):
    # as `python main.py` would: __main__, SystemExit's status, 1 after an exception (its traceback to stderr),
    # the threads it left joined, its atexit functions run and its output flushed before the end
    status = 0
    # The frames below the program's (this harness's) must not count against its recursion limit: python main.py
    # starts the program at depth 1. (A program that sets its own limit gets it as given, these frames included.)
    depth, frame = 0, sys._getframe()
    while frame is not None:
        depth, frame = depth + 1, frame.f_back
    sys.setrecursionlimit(sys.getrecursionlimit() + depth)
    try:
        exec(compile(%(exit_builtins)s, "<exit>", "exec"), {})
        # its own module as __main__, as python main.py has it: pickle finds the classes it defines there (this
        # fork's sys.modules only; the harness's functions keep their own globals)
        main = type(sys)("__main__")
        main.__dict__.update(MAIN)
        sys.modules["__main__"] = main
        exec(compile(code, "main.py", "exec"), main.__dict__)
    except SystemExit as exc:
        code_ = exc.code
        # CPython's: an int (its real type, not what __class__ claims) as the C long it holds (-1, so 255,
        # past a long), with no method of the program's subclass called; anything else 1
        if code_ is None:
            status = 0
        elif issubclass(type(code_), int):
            n = int.__int__(code_)
            status = n & 255 if -(1 << 63) <= n < (1 << 63) else 255
        else:
            status = 1
    except BaseException:
        status = 1
    threading = sys.modules.get("threading")
    if threading is not None:
        for t in threading.enumerate():
            if t is not threading.main_thread() and not t.daemon:
                try:
                    t.join()
                except BaseException:
                    pass
    try:   # Python runs them at exit: the fast-output templates write their buffer there
        import atexit
        atexit._run_exitfuncs()
    except BaseException:
        pass
    # As Python's exit: sys.stdout and sys.stderr flushed unless None or closed (a failure: 120), then the
    # original stdout (its errors ignored). A program that printed and closed sys.stdout has passed.
    for stream in (sys.stdout, sys.stderr):
        if stream is not None and not is_closed(stream):
            try:
                stream.flush()
            except BaseException:
                status = status or 120
    if sys.__stdout__ is not None and not is_closed(sys.__stdout__):
        try:
            sys.__stdout__.flush()
        except BaseException:
            pass
    return status


def descendants_killed(me, limit, own_pidns):
    # SIGKILL every process a case left (a daemon in a process group of its own escapes the group kill, and would work on
    # for later cases past its own time limit): orphans come to this process (a child subreaper), so once it has
    # no child left, nothing of the case is. False if that takes past `limit` seconds.
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if own_pidns:
            # In the run's own PID namespace, every process but init and this one is a case's: kill(-1) reaches
            # them all, also those the sandbox's /proc (hidepid) does not show this process (non-dumpable ones).
            try:
                os.kill(-1, signal.SIGKILL)
            except OSError:
                pass
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    with open("/proc/%%s/stat" %% name, "rb") as f:
                        ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
                except (OSError, ValueError, IndexError):
                    continue
                if ppid == me:
                    try:
                        os.kill(int(name), signal.SIGKILL)
                    except OSError:
                        pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            return True
        time.sleep(0.001)
    return False


def clear(dir_fd):
    # remove what is in the directory (nothing of the program runs now): its files must not reach a later case
    for entry in list(os.scandir(dir_fd)):
        if entry.is_dir(follow_symlinks=False):
            os.chmod(entry.name, 0o700, dir_fd=dir_fd)
            fd = os.open(entry.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
            try:
                clear(fd)
            finally:
                os.close(fd)
            os.rmdir(entry.name, dir_fd=dir_fd)
        else:
            os.unlink(entry.name, dir_fd=dir_fd)


def private_dirs():
    # The directories a case can write that are the run's own tmpfs (minimal root, or the private /tmp of the
    # fallback): /tmp (sandbox.py runs the program in /tmp/sandbox only on a fresh tmpfs /tmp) and /dev/shm where
    # it has the same size and inode limit (its mount failed otherwise: the host's, never cleared). Elsewhere (no
    # mount namespace) /tmp is the host's and nothing is cleared.
    if os.getcwd() != "/tmp/sandbox":
        return []
    dirs = ["/tmp"]
    try:
        a, b = os.statvfs("/tmp"), os.statvfs("/dev/shm")
        if (a.f_blocks, a.f_files, a.f_frsize) == (b.f_blocks, b.f_files, b.f_frsize) \
                and os.stat("/tmp").st_dev != os.stat("/dev/shm").st_dev:
            dirs.append("/dev/shm")
    except OSError:
        pass
    return dirs


def reset(dirs):
    # between cases: what a case wrote goes, as a fresh sandbox per case would have it. The case's directory is
    # made anew, and the private directories' times set to now: a directory's mode, times and extended attributes
    # carried state to the next case as well as its files did.
    try:
        if not dirs:
            os.chmod(".", 0o700)
            fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY)
            try:
                clear(fd)
            finally:
                os.close(fd)
            return True
        os.chdir("/")
        for d in dirs:
            fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
            try:
                clear(fd)   # (/tmp/sandbox with the rest)
            finally:
                os.close(fd)
        os.mkdir("/tmp/sandbox", 0o700)
        os.chdir("/tmp/sandbox")
        for d in dirs:
            os.utime(d)
        return True
    except (OSError, RecursionError):
        return False


def read_exactly(n):
    # n bytes of stdin, fewer only at its end
    chunks = []
    while n > 0:
        chunk = os.read(0, min(n, 1 << 16))
        if not chunk:
            break
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def skip(n):
    # n bytes of stdin read and dropped, 64 KiB at a time
    while n > 0 and read_exactly(min(n, 1 << 16)):
        n -= 1 << 16


def frame():
    # an 8-byte length, then that many bytes
    return read_exactly(int.from_bytes(read_exactly(8), "little"))


def run_case(code, size, limit, load, cap):
    # The case's input comes from this process's stdin as the program takes it, 64 KiB at a time: held whole here,
    # it (and every case's, in one job) would count against the program's RLIMIT_AS in each fork, which its own
    # sandbox would not count.
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    # The clock starts before the case can run: taken after the fork, a case that stopped this process first (or
    # a relay the machine did not run for a while) would have its time from then on. It allows the time the case
    # waits for a CPU (Clock), up to `load` x `limit`.
    clock = Clock(limit, load, None)
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            # (dumpable under hidepid: it holds the relay's memory as of now, and what an earlier case left is gone)
            show_waiting()
            os.setpgid(0, 0)
            os.dup2(in_r, 0)
            os.dup2(out_w, 1)
            os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
            os.closerange(3, os.sysconf("SC_OPEN_MAX"))   # (the sandbox's RLIMIT_NOFILE: a small range)
            status = execute(code)
        finally:
            os._exit(status)
    clock.fresh(pid)
    os.close(in_r)
    os.close(out_w)
    os.set_blocking(in_w, False)
    pending, out, left_in = b"", bytearray(), size
    reading = [out_r]
    writing = [in_w] if left_in else []
    if not left_in:
        os.close(in_w)
    verdict, status = None, None
    while verdict is None:
        left = clock.left()
        if left <= 0:
            verdict = "timeout"
            break
        readable, writable, _ = select.select(reading, writing, [], min(left, 0.05))
        if writable:
            if not pending:
                pending = read_exactly(min(left_in, 1 << 16))
                left_in -= len(pending)
                left_in = left_in if pending else 0
            try:
                pending = pending[os.write(in_w, pending):]
            except BlockingIOError:
                pass
            except OSError:   # the program closed its stdin
                pending = b""
                skip(left_in)
                left_in = 0
            if not pending and not left_in:
                os.close(in_w)
                writing = []
        if readable:
            chunk = os.read(out_r, 65536)
            out += chunk
            if len(out) > cap:
                verdict = "over"
            elif not chunk:   # every writer of its stdout is gone; the program may run on: waited for below,
                reading = []  # within its deadline (a blocking wait here held the relay past every later case's)
        if status is None and verdict is None and os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT):
            # it ended; how long it waited for a CPU, read before it is reaped; take what it printed (a process it
            # left may hold the pipe open)
            clock.refresh()
            status = os.waitpid(pid, 0)[1]
            os.set_blocking(out_r, False)
            try:
                while len(out) <= cap:
                    chunk = os.read(out_r, 65536)
                    if not chunk:
                        break
                    out += chunk
            except BlockingIOError:
                pass
            if len(out) > cap:
                verdict = "over"
            break
    # The deadline again, now that it has ended: a program that stopped this process (SIGSTOP from the case,
    # SIGCONT once it has printed) would otherwise finish past its limit unseen. What ends in time is seen in time.
    if verdict is None and time.monotonic() > clock.end():
        verdict = "timeout"
    for target in (pid, -pid):   # the program by pid too: it may have left its process group
        try:
            os.kill(target, signal.SIGKILL)
        except OSError:
            pass
    if status is None:
        status = os.waitpid(pid, 0)[1]
    for fd in writing + [out_r]:
        os.close(fd)
    skip(left_in)   # what it did not take: the next case's input follows
    if verdict is None:
        verdict = "exit:%%d" %% os.WEXITSTATUS(status) if os.WIFEXITED(status) else "signal:%%d" %% os.WTERMSIG(status)
    return verdict, bytes(out[:cap])


def main():
    private = start()
    # PR_SET_CHILD_SUBREAPER: what a case leaves (its own process group, double fork) stays a descendant of this process, to be
    # killed before the next case starts (descendants_killed). Without it the run does not count as isolated.
    try:
        private = private and prctl(36, 1) == 0
    except Exception:
        private = 0
    dirs = private_dirs()
    job = marshal.loads(frame())
    nonce = job["nonce"]
    me = os.getpid()
    own_pidns = job["pidns"] and me == 2   # (the program is init's first child there)

    def report(line):
        data = memoryview((nonce + " " + line + "\n").encode())
        while data:
            data = data[os.write(1, data):]

    report("ready %%d" %% private)
    for i, (size, cap) in enumerate(zip(job["sizes"], job["caps"])):
        verdict, out = run_case(job["code"], size, job["timeout"], job["load"], cap)
        # Nothing of this case may run on, or stay on disk, into the next (each case is its own run in the
        # reference, run_cases_separately): a daemon started in case 0 worked on case 3's answer past case 3's
        # limit. If that cannot be made sure, the later cases are not run (they fail).
        if not descendants_killed(me, 2.0, own_pidns):
            break
        report("%%d %%s %%s" %% (i, verdict, out.hex()))
        if not reset(dirs):
            break
    os._exit(0)


main()
""" % {"common": HARNESS_COMMON, "exit_builtins": repr(_EXIT_BUILTINS)}
_IO_GRACE_S = 0.5   # per case, for the fork and the relaying, past the program's own limit
_RELAY_FLOOR = 1 << 16   # the least the relay reads of a case's output (a cap of an expected output up to ~30 KiB)


def _relay_cap(cap: int) -> int:
    """What the relay may read of a case's output. Never the exact cap: it follows from the expected output's
    length, and a case's fork holds a copy of the relay's memory (its frames: `cap`), so "YES\n" (cap 4120) and
    "NO\n" (4102) would tell a program its answer. The floor for every cap up to 64 KiB, a power of two above (the
    band, not the length); the exact cap is applied outside (_relay)."""
    return max(_RELAY_FLOOR, 1 << (cap - 1).bit_length())


def _relay(code: str, inputs: list[bytes], caps: list[int], timeout: float, limits: SandboxLimits,
           allow_weak_sandbox: bool) -> dict:
    """Run `code` once per input in one sandboxed program (_IO_HARNESS), each run in a fresh fork with its input on
    stdin: {index: (verdict, stdout)} for the runs it reported, the verdict "exit:N", "signal:N", "timeout" or
    "over" (past its cap)."""
    nonce = secrets.token_hex(16)
    inside = [_relay_cap(cap) for cap in caps]
    pidns = "pidns" in sandbox_info(limits.namespaces, limits.drop_privileges, limits.minimal_root)["protections"]
    head = marshal.dumps({"nonce": nonce, "code": code, "timeout": float(timeout), "load": LOAD_ALLOWANCE,
                          "caps": inside, "sizes": [len(data) for data in inputs], "pidns": pidns})
    job = b"".join([len(head).to_bytes(8, "little"), head, *inputs])   # each input streamed to its case (run_case)
    room = sum(2 * cap + 64 for cap in inside) + 4096   # hex doubles each output
    result = run_python(_IO_HARNESS, len(inputs) * (float(timeout) * LOAD_ALLOWANCE + _IO_GRACE_S) + 2.0, stdin=job,
                        limits=SandboxLimits.of(limits, max_output_bytes=max(room, limits.max_output_bytes)))
    if result.killed_reason == "sandbox_error":
        raise SandboxError(f"the sandbox could not be set up: {result.error}")
    outputs: dict = {}
    private = False
    for line in result.stdout.split("\n"):
        words = line.split(" ")
        if len(words) < 3 or words[0] != nonce:
            continue
        if words[1] == "ready":
            private = words[2] == "1"
        elif len(words) == 4 and words[1].isdigit() and int(words[1]) < len(inputs) and int(words[1]) not in outputs:
            try:
                out = bytes.fromhex(words[3])
                verdict = "over" if len(out) > caps[int(words[1])] else words[2]   # the exact cap, here
                outputs[int(words[1])] = (verdict, out.decode("utf-8", "replace"))
            except ValueError:
                outputs[int(words[1])] = ("protocol", "")
    if not private and not allow_weak_sandbox and outputs:
        raise SandboxError("code_io reward: the harness could not make itself non-dumpable (PR_SET_DUMPABLE) or its "
                           "cases' subreaper (PR_SET_CHILD_SUBREAPER), so a program could reach its descriptors or "
                           "outlive its case; set allow_weak_sandbox: true to accept that explicitly (docs/sandbox.md)")
    return outputs


def run_cases(code: str, cases: list[tuple[str, str]], *, timeout: float = DEFAULT_TEST_TIMEOUT_S,
              float_tolerance: float = DEFAULT_FLOAT_TOLERANCE, limits: Optional[SandboxLimits] = None,
              allow_weak_sandbox: bool = False, checker: Optional[str] = None,
              checker_timeout: float = DEFAULT_CHECKER_TIMEOUT_S) -> list[bool]:
    """Run `code` on every case in one sandboxed program, each case in a fresh fork with its input on stdin; one
    bool per case, judged here on the output it relays, or by `checker` (run_checks) where given and the output is
    not the expected one. Same verdicts as `run_cases_separately`."""
    lim = limits or SandboxLimits()
    outputs = _relay(code, [_stdin(stdin).encode("utf-8", "surrogatepass") for stdin, _ in cases],
                     [_output_cap(expected, float_tolerance) for _, expected in cases], timeout, lim, allow_weak_sandbox)
    ran = {i: got for i, (verdict, got) in outputs.items() if verdict == "exit:0"}
    if checker is None:
        return [i in ran and outputs_match(ran[i], expected, float_tolerance) for i, (_, expected) in enumerate(cases)]
    verdicts = {i: _before_checker(got, cases[i][1]) for i, got in ran.items()}
    judge = [i for i, verdict in verdicts.items() if verdict is None]
    accepted = run_checks(checker, [(*cases[i], ran[i]) for i in judge], timeout=checker_timeout, limits=lim,
                          allow_weak_sandbox=allow_weak_sandbox)
    verdicts.update(zip(judge, accepted))
    return [i in ran and verdicts[i] for i in range(len(cases))]


def run_checks(checker: str, outputs: list[tuple[str, str, str]], *, timeout: float = DEFAULT_CHECKER_TIMEOUT_S,
               limits: Optional[SandboxLimits] = None, allow_weak_sandbox: bool = False) -> list[bool]:
    """The checker's verdict on each (input, expected output, program's output), all in one sandboxed program of
    their own (no model-written code runs there; the program's output is only a file it reads)."""
    if not outputs:
        return []
    reports = _relay(checker_program(checker), [checker_job(*o) for o in outputs], [_CHECKER_OUTPUT_CAP] * len(outputs),
                     timeout, limits or SandboxLimits(), allow_weak_sandbox)
    return [i in reports and reports[i][0].startswith("exit:")
            and checker_accepts(int(reports[i][0][5:]), reports[i][1]) for i in range(len(outputs))]


def startup_report(*, allow_weak_sandbox: bool = False, tests_field: str = "tests", workers: int = DEFAULT_WORKERS,
                   timeout: float = DEFAULT_TEST_TIMEOUT_S, float_tolerance: float = DEFAULT_FLOAT_TOLERANCE,
                   max_cases: Optional[int] = None, checker_field: Optional[str] = None,
                   checker_timeout: float = DEFAULT_CHECKER_TIMEOUT_S, **sandbox_kwargs) -> list[str]:
    """When loaded from a recipe: the sandbox's line to log; raises SandboxError where isolation is missing."""
    return [sandbox_check(SandboxLimits.of(**sandbox_kwargs), allow_weak_sandbox)]


def _score_all(completions, rows, *, binary: bool, tests_field: str, workers: int, timeout: float,
               float_tolerance: float, max_cases: Optional[int], checker_field: Optional[str], checker_timeout: float,
               allow_weak_sandbox: bool, sandbox_kwargs: dict):
    def cases(row):
        job, _ = row_job(row, tests_field, checker_field)
        if job is None or not max_cases:
            return job
        if isinstance(job, Calls):
            return dataclasses.replace(job, cases=job.cases[:max_cases])
        return job[0][:max_cases], job[1]

    def score(code, job, limits):
        if isinstance(job, Calls):
            passed = run_calls(code, job, timeout=timeout, limits=limits, allow_weak_sandbox=allow_weak_sandbox)
        else:
            passed = run_cases(code, job[0], timeout=timeout, float_tolerance=float_tolerance, limits=limits,
                               allow_weak_sandbox=allow_weak_sandbox, checker=job[1], checker_timeout=checker_timeout)
        return float(all(passed)) if binary else sum(passed) / len(passed)

    return score_in_sandbox(completions, rows, name="code_io", cases=cases, score=score, workers=workers,
                            allow_weak_sandbox=allow_weak_sandbox, sandbox_kwargs=sandbox_kwargs)


def code_io_reward(completions, *, prompts=None, rows=None, tests_field: str = "tests", workers: int = DEFAULT_WORKERS,
                   timeout: float = DEFAULT_TEST_TIMEOUT_S, float_tolerance: float = DEFAULT_FLOAT_TOLERANCE,
                   max_cases: Optional[int] = None, checker_field: Optional[str] = None,
                   checker_timeout: float = DEFAULT_CHECKER_TIMEOUT_S, allow_weak_sandbox: bool = False,
                   **sandbox_kwargs) -> list:
    """Fraction of the row's stdin/stdout cases the completion's program gets right; None when the row has no
    usable cases. Other keyword arguments are SandboxLimits fields (memory_mb, max_procs, ...)."""
    return _score_all(completions, rows, binary=False, tests_field=tests_field, workers=workers, timeout=timeout,
                      float_tolerance=float_tolerance, max_cases=max_cases, checker_field=checker_field,
                      checker_timeout=checker_timeout, allow_weak_sandbox=allow_weak_sandbox,
                      sandbox_kwargs=sandbox_kwargs)


def code_io_binary_reward(completions, *, prompts=None, rows=None, tests_field: str = "tests",
                          workers: int = DEFAULT_WORKERS, timeout: float = DEFAULT_TEST_TIMEOUT_S,
                          float_tolerance: float = DEFAULT_FLOAT_TOLERANCE, max_cases: Optional[int] = None,
                          checker_field: Optional[str] = None, checker_timeout: float = DEFAULT_CHECKER_TIMEOUT_S,
                          allow_weak_sandbox: bool = False, **sandbox_kwargs) -> list:
    """1.0 when the completion's program gets every case of the row right, else 0.0; None without usable cases."""
    return _score_all(completions, rows, binary=True, tests_field=tests_field, workers=workers, timeout=timeout,
                      float_tolerance=float_tolerance, max_cases=max_cases, checker_field=checker_field,
                      checker_timeout=checker_timeout, allow_weak_sandbox=allow_weak_sandbox,
                      sandbox_kwargs=sandbox_kwargs)
