"""Verdicts decided outside the sandbox (rewards/code.py; docs/sandbox.md, "Verdicts").

A test `assert <expr> <op> <literal>` is judged by the trainer: the sandboxed program sends the value of
<expr> as plain data and the trainer compares it with the literal, which never enters the sandbox. Shown
here: the classification; that honest plain values are judged exactly as Python judges the assert; that
nothing but plain data passes; that a solution knowing the nonce, writing to every descriptor and reading
the harness's memory still cannot pass a test it fails; and what remains for tests judged inside.
"""

from __future__ import annotations

import collections
import json
import marshal
import time

import pytest

from conftest import one_cpu_shared_with
from lowmem_grpo.rewards import code, code_io
from lowmem_grpo.rewards.code import (classify_tests, count_judging, decode_value, judge_value, judging,
                                      run_tests)
from lowmem_grpo.rewards.sandbox import SandboxLimits

OUTSIDE = ["assert f(1) == 2", "assert f(1) != 2", "assert 2 == f(1)", "assert f(1) < 3.5", "assert f(1) in ['a', 'b']",
           "assert 'a' in f(1)", "assert f(1) not in (1, 2)", "assert f() is None", "assert f() is not True",
           "assert f() == (1, [2, {3: 'x'}])", "assert f() == -1", "assert f() == set()", "assert f() >= 1e-9",
           "assert f(1) == 2, 'a message'", "assert (f(1,\n          2) == 3)", "assert len(calls) == 1"]
INSIDE = ["assert f(1)", "assert not f(1)", "assert f(1) == g(2)", "assert f(1) == [1] * 3", "assert f() is 5",
          "assert 1 < f() < 3", "x = f()\nassert x == 1", "assert f(1) == 2 and f(2) == 3", "f(1)",
          "assert isinstance(f(), int)", "assert f(1) == list('ab')"]


# ---------------------------------------------------------------------------------------------
# Which tests are judged outside

def test_classification():
    for t in OUTSIDE:
        assert judging(t).outside, t
    for t in INSIDE:
        assert not judging(t).outside, t
    assert classify_tests(OUTSIDE + INSIDE) == (len(OUTSIDE), len(INSIDE))
    j = judging("assert 2 == f(1)")
    assert (j.src, j.expected, j.literal_first) == ("f(1)", 2, True)
    assert judging("assert f() == (1, [2, {3: 'x'}])").expected == (1, [2, {3: "x"}])


def test_the_expected_value_never_enters_the_sandbox(monkeypatch):
    seen = []
    real = code.run_python

    def spy(program, timeout_s, *, stdin=None, limits=None):
        seen.append(stdin)
        return real(program, timeout_s, stdin=stdin, limits=limits)

    monkeypatch.setattr(code, "run_python", spy)
    run = run_tests("def f(x):\n    return x * 2", ["assert f(36963077) == 73926154", "assert f(5) == 31415926"])
    assert run.passed == [True, False] and run.judged_outside == [True, True]
    sent = [repr(marshal.loads(job)) for job in seen]   # everything the program is given, whatever its type
    assert "36963077" in sent[0] and "73926154" not in sent[0] and "31415926" not in sent[0]
    run_tests("def f(x):\n    return x", ["assert f(1) == 1 and 27182818"])   # judged inside: the text goes in
    assert "27182818" in repr(marshal.loads(seen[1]))


def test_counts_per_dataset():
    rows = [{"tests": OUTSIDE[:3]}, {"tests": INSIDE[:2] + OUTSIDE[:1]}, {"tests": []}, {"other": 1},
            {"tests": json.dumps(OUTSIDE[:2])}]
    counts = count_judging(rows)
    # (the second row's test judged outside comes after two judged inside: it counts as inside, code.unforgeable)
    assert (counts.rows, counts.rows_without_tests, counts.outside, counts.inside) == (5, 2, 5, 3)
    line = counts.describe("rows.jsonl")
    assert "5 judged outside" in line and "3 judged inside" in line and "docs/sandbox.md" in line
    assert count_judging(rows, limit=1).rows == 1
    assert "inside" not in count_judging(rows[:1]).describe()


# ---------------------------------------------------------------------------------------------
# The trainer's side: a strict decoder and Python's comparison

@pytest.mark.parametrize("text", [
    '{"a": 1}', '["X", 1]', '["I", "1_0"]', '["I", " 1"]', '["I", 10]', '["L", {}]', '["B", 1]', '["S", 5]',
    '["F", 1.5]', '["S", "zz"]', '["S", "ff"]', '["S", "abc"]', 'NaN', '["N", 1]', '["D", [[["L", []], ["N"]]]]', '["E", [["L", []]]]', '["D", [["N"]]]',
    "[" * 5000 + "]" * 5000, '["L", ' * 101 + '["N"]' + "]" * 101, "not json", ""])
def test_decoder_rejects_anything_but_tagged_plain_data(text):
    with pytest.raises(ValueError):
        decode_value(text)
    assert judge_value(judging("assert f() == 1"), text) == (False, "malformed value")


def test_decoder_round_trip():
    cases = {'["N"]': None, '["B", true]': True, '["I", "-ff"]': -255, '["F", "0x1.8p+1"]': 3.0,
             '["C", "0x1p+0", "-0x1p+1"]': 1 - 2j, '["S", "c3a90a"]': "é\n", '["S", "eda080"]': "\ud800",
             '["Y", "6162"]': b"ab",
             '["T", [["I", "1"], ["L", []]]]': (1, []), '["E", [["I", "1"]]]': {1}, '["Z", [["S", "61"]]]': frozenset("a"),
             '["D", [[["T", [["I", "1"]]], ["N"]]]]': {(1,): None}}
    for text, value in cases.items():
        got = decode_value(text)
        assert got == value and type(got) is type(value), text


VALUES = """
import collections, enum
class Colour(enum.IntEnum):
    RED = 1
class Plain(str):
    pass
Point = collections.namedtuple('Point', 'x y')
VALUES = [3, 3.0, True, 1, -0.0, 10 ** 30, 2 ** 64 - 1, 'abc', b'ab', (1, 2), [1, 2], {1: 'a'}, {1, 2},
          frozenset({1}), None, 1 + 2j, float('inf'), float('nan'), [[1, [2, [3]]]], collections.Counter('aab'),
          collections.OrderedDict(a=1), collections.defaultdict(int, a=1), Point(1, 2), Colour.RED, Plain('abc'),
          '\\u00e9\\u2028', {'k': [None, True]}, (), 0]
def v(k):
    return VALUES[k]
"""
LITERALS = ["3", "1", "True", "0", "'abc'", "b'ab'", "(1, 2)", "[1, 2]", "{1: 'a'}", "{1, 2}", "None", "1 + 2j",
            "{'a': 2, 'b': 1}", "{'a': 1}", "10 ** 30", "1000000000000000000000000000000", "[[1, [2, [3]]]]", "()",
            "'\\u00e9\\u2028'", "{'k': [None, True]}", "-0.0", "18446744073709551615"]


def test_plain_values_are_judged_as_python_judges_the_assert():
    """Every (value, operator, literal) of a table, judged outside, gets Python's own verdict for the assert."""
    local: dict = {}
    exec(VALUES, local)
    tests, expected = [], []
    for k in range(len(local["VALUES"])):
        for lit in LITERALS:
            for op in ("==", "!=", "<", "in"):
                test = f"assert v({k}) {op} {lit}" if op != "in" else f"assert {lit} in v({k})"
                if not judging(test).outside:
                    continue
                tests.append(test)
                try:
                    exec(test, dict(local))
                    expected.append(True)
                except (AssertionError, TypeError, ValueError):
                    expected.append(False)
        tests += [f"assert v({k}) is None", f"assert v({k}) is not True"]
        expected += [local["VALUES"][k] is None, local["VALUES"][k] is not True]
    assert all(judging(t).outside for t in tests) and len(tests) > 1000
    run = run_tests(VALUES, tests, timeout=2, total_timeout=120)
    assert run.sandbox.killed_reason is None, run.sandbox
    wrong = [(t, e) for t, e, got in zip(tests, expected, run.passed) if e != got]
    assert not wrong, wrong[:10]
    assert 0 < sum(expected) < len(expected)


# ---------------------------------------------------------------------------------------------
# Hostile values and forged reports

NOT_PLAIN = {
    "always equal": "class V:\n    def __eq__(self, other):\n        return True\n    def __ne__(self, other):\n"
                    "        return False\n    __hash__ = object.__hash__",
    "int subclass": "class V(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__",
    "str subclass": "class V(str):\n    def __eq__(self, other):\n        return True\n    __hash__ = str.__hash__",
    "list subclass": "class V(list):\n    def __eq__(self, other):\n        return True",
    "dict subclass": "class V(dict):\n    def __ne__(self, other):\n        return False\n    def __eq__(self, other):\n"
                     "        return True",
    "lying __class__": "class V:\n    __class__ = property(lambda self: int)\n    def __eq__(self, other):\n        return True",
    "in a list": "class W:\n    def __eq__(self, other):\n        return True\nclass V(list):\n    pass\n_V = V\nV = lambda: _V([W()])",
}


@pytest.mark.parametrize("name", sorted(NOT_PLAIN))
def test_values_that_are_not_plain_data_fail(name):
    solution = NOT_PLAIN[name] + "\ndef add(a, b):\n    return V() if callable(V) else V\n"
    tests = ["assert add(1, 2) == 738261", "assert add(1, 2) == [0]", "assert add(1, 2) == 'secret'"]
    local: dict = {}
    exec(solution, local)
    # in the solution's own interpreter these asserts pass: the hole of a harness that compares inside
    assert sum(_passes(t, local) for t in tests) >= 1
    run = run_tests(solution, tests, timeout=2)
    assert run.passed == [False] * 3, run.details
    assert all(d.startswith("not_plain_data") or d == "AssertionError" for d in run.details), run.details


def _passes(test, namespace) -> bool:
    try:
        exec(test, dict(namespace))
        return True
    except Exception:
        return False


def test_a_solution_that_knows_the_nonce_and_every_descriptor_cannot_pass(monkeypatch):
    """The nonce is fixed and given to the solution, with the expected value: it writes well-formed pass and
    value reports for every test to every descriptor it has and every /proc/*/fd it can open, and searches
    its memory for keys. Its function is wrong: every test must fail."""
    nonce = "0123456789abcdef" * 2
    monkeypatch.setattr(code.secrets, "token_hex", lambda n=16: nonce)
    forger = """
import gc, os, sys
NONCE = 'NONCE_HERE'
LINES = b''.join(b'%s %d %s\\n' % (NONCE.encode(), i, v) for i in range(3)
                 for v in (b'pass', b'value ["I","2a"]', b'value ["I","3"]'))

def spray(lines):
    for fd in range(0, 1024):
        try:
            os.write(fd, lines)
        except OSError:
            pass
    for pid in os.listdir('/proc'):
        try:
            fds = os.listdir('/proc/%s/fd' % pid)
        except OSError:
            continue
        for fd in fds:
            try:
                with open('/proc/%s/fd/%s' % (pid, fd), 'wb') as f:
                    f.write(lines)
            except OSError:
                pass

def keys():
    # every 16-character string in memory, and the key of the command being run: the solver's keys
    found = {o for o in gc.get_objects() if type(o) is str and len(o) == 16}
    f = sys._getframe()
    while f is not None:
        cmd = f.f_locals.get('cmd')
        if isinstance(cmd, dict):
            found.add(cmd['key'])
        f = f.f_back
    return found

spray(LINES)

def add(a, b):
    spray(LINES + b''.join(b'%s value ["I","2a"]\\n%s pass\\n' % (k.encode(), k.encode()) for k in keys()))
    return a - b
""".replace("NONCE_HERE", nonce)
    tests = ["assert add(20, 22) == 42", "assert add(1, 2) == 3", "assert add(0, 3) == 3"]
    run = run_tests(forger, tests, timeout=2)
    assert run.passed == [False, False, False], run.details
    assert run.channel_private and run.sandbox.stdout.startswith(f"{nonce} ready 1")
    # honest or forged, a test is reported once, by the reporter
    assert sorted(line.split()[1] for line in run.sandbox.stdout.splitlines()) == ["0", "1", "2", "ready"]


def test_the_reporter_is_out_of_the_solvers_reach():
    """From the solution's process: the reporter (its parent) can be neither traced nor read through /proc,
    and the solver's stdio is /dev/null. Judged outside: each probe must return [] to pass."""
    probe = """
import ctypes, os
def reporter():
    ppid, reached = os.getppid(), []
    for path, mode in (('/proc/%d/fd/1' % ppid, 'wb'), ('/proc/%d/mem' % ppid, 'rb'), ('/proc/%d/environ' % ppid, 'rb')):
        try:
            open(path, mode).close()
            reached.append(path)
        except OSError:
            pass
    try:
        reached.append(os.listdir('/proc/%d/fd' % ppid))
    except OSError:
        pass
    if ctypes.CDLL(None).ptrace(16, ppid, 0, 0) == 0:   # PTRACE_ATTACH
        reached.append('ptrace')
    return reached
def stdio():
    return [os.readlink('/proc/self/fd/%d' % fd) for fd in (0, 1, 2) if os.readlink('/proc/self/fd/%d' % fd) != '/dev/null']
"""
    run = run_tests(probe, ["assert reporter() == []", "assert stdio() == []"], timeout=2)
    assert run.passed == [True, True], run.details


def test_a_forged_report_can_only_claim_a_value():
    """A solution that replaces the harness's encoder reports 42 for everything: exactly what returning 42
    would give; it still cannot know a literal it was never sent."""
    claimer = "import sys\nsys.modules['__main__'].encode = lambda value: '[\"I\",\"2a\"]'\ndef guess():\n    return None"
    run = run_tests(claimer, ["assert guess() == 738261", "assert guess() == 42", "assert guess() is None"], timeout=2)
    assert run.passed == [False, True, False]


def test_verdicts_judged_inside_remain_forgeable():
    """The known limit, counted by classify_tests: for a bare assert the program's own verdict is the only one,
    and a solution that finds the solver's current key can report a pass. The same trick fails on a test
    judged outside in the same run."""
    forger = """
import os, sys
def check():
    f = sys._getframe()
    while f is not None and 'cmd' not in f.f_locals:
        f = f.f_back
    line = ('%s pass \\n' % f.f_locals['cmd']['key']).encode()
    for fd in range(3, 64):
        try:
            os.write(fd, line)
        except OSError:
            pass
    return False
"""
    run = run_tests(forger, ["assert check() == True", "assert check()"], timeout=2)
    assert run.judged_outside == [True, False]
    assert run.passed == [False, True]


def test_a_value_side_that_compares_or_holds_the_expected_value_is_judged_inside():
    """The value side runs in the sandbox with the solution's objects, and its source is readable there: when
    it compares, does arithmetic or calls a module's function, the verdict (or the expected value) is in
    there. Such tests are judged inside, and counted so; inputs and indices are still fine."""
    inside = ["assert (f(1) == 2) is True", "assert (f(1) == 2) == True", "assert f(2) - 7 == 0",
              "assert abs(f(1) - g(2)) < 1e-6", "assert math.isclose(f(1), 0.5) is True",
              "assert (f(1) if g() else 2) == 2", "assert (f(1) or 2) == 2"]
    outside = ["assert f(x + 1, [1] * 3) == 4", "assert f(1)[-1] == 2", "assert Solution().two_sum([2, 7], 9) == [0, 1]",
               "assert f('a').count('b') == 2", "assert round(f(1), 2) == 3.14", "assert ' '.join(f(1)) == 'a b'",
               "assert sorted(f([3, 1]), reverse=True) == [3, 1]", "assert -f(1) == 2"]
    assert [t for t in inside if judging(t).outside] == []
    assert [t for t in outside if not judging(t).outside] == []
    # an object whose operators give what the test wants: it passes the first two inside, none outside
    forger = "class E:\n    def __eq__(self, o):\n        return True\n    def __sub__(self, o):\n        return 0\n" \
             "def f(x):\n    return E()\n"
    run = run_tests(forger, ["assert f(1) == 2"] + inside[:3], timeout=2)
    assert run.judged_outside == [True, False, False, False] and run.passed == [False, True, True, True]


def test_an_index_the_solution_computes_by_a_comparison_is_judged_inside():
    """Found by a red team: an index was taken for an input, so in ['no', 'yes'][f(7) == True] an __eq__ that always
    says yes picked the expected literal, judged outside. An index that reads the solution's objects obeys the
    value side's rules now; one of literals and builtins, or a bool the solution must commit to, stays outside."""
    inside = ["assert ['no', 'yes'][is_prime(7) == True] == 'yes'", "assert (0, 1)[int(is_prime(97) == True)] == 1",
              "assert 'ny'[is_prime(5) - 0] == 'y'"]
    outside = ["assert ['no', 'yes'][is_prime(7)] == 'yes'", "assert f(1)[len([1, 2]) - 1] == 2",
               "assert f(1)[[k for k in range(3) if k > 1][0]] == 2", "assert f(g(1) == 2) == 3"]
    assert [t for t in inside if judging(t).outside] == []
    assert [t for t in outside if not judging(t).outside] == []
    forger = "class Any:\n    def __eq__(self, other):\n        return True\n    __hash__ = object.__hash__\n" \
             "def is_prime(n):\n    return Any()\n"
    run = run_tests(forger, inside[:2] + ["assert ['no', 'yes'][is_prime(7)] == 'yes'"], timeout=2)
    assert run.judged_outside == [False, False, False]   # (the third after one judged inside)
    assert classify_tests(inside[:2]) == (0, 2)
    honest = "def is_prime(n):\n    return n > 1 and all(n % d for d in range(2, n))\n"
    assert run_tests(honest, ["assert ['no', 'yes'][is_prime(7)] == 'yes'"], timeout=2).passed == [True]
    assert run_tests(forger, ["assert ['no', 'yes'][is_prime(7)] == 'yes'"], timeout=2).passed == [False]


def test_a_runs_values_are_capped_in_total():
    """Found by a red team: each value may be 4 MiB, and the run's output cap grew with the tests, so 40 calls
    returning 2,000,000-character strings made the trainer hold ~500 MiB for one completion. The run stops past
    VALUES_CAP in all; the tests it did not reach fail."""
    n = code.VALUES_CAP // (code.VALUE_CAP // 2) + 4
    run = run_tests("def f(i):\n    return 'a' * 1_900_000\n", [f"assert f({i}) == 'b'" for i in range(n)], timeout=2)
    assert len(run.sandbox.stdout) <= code.VALUES_CAP + 4096 and run.sandbox.killed_reason == "output_limit"
    assert run.details[-1].startswith("not run") and not any(run.passed)
    assert run_tests("def f(i):\n    return 'a' * 1_900_000\n", ["assert len(f(0)) == 1_900_000",
                     "assert f(0) == 'a' * 1_900_000"], timeout=2).passed == [True, True]


def test_tolerance_checks_are_judged_outside_on_the_difference():
    """abs(<expr> - <number>) < tol: the number is the expected value. Only <expr> enters the sandbox and the
    trainer takes the difference, so an object whose __sub__ gives 0, a solution that rebinds abs, and one
    that reads the number from the test's source all fail; an honest one passes."""
    tests = ["assert abs(truncate(3.5) - 0.5) < 1e-6", "assert 1e-6 > abs(0.25 - truncate(2.25))"]
    j = judging(tests[0])
    assert j.outside and j.src == "truncate(3.5)" and j.around == (0.5, False) and judging(tests[1]).around == (0.25, True)
    forgers = {
        "__sub__": "class Z:\n    def __sub__(self, o):\n        return 0\n    __rsub__ = __sub__\n"
                   "def truncate(x):\n    return Z()\n",
        "abs": "abs = lambda v: 0\ndef truncate(x):\n    return 7.0\n",
        "source": "import ast, sys\ndef truncate(x):\n    f = sys._getframe()\n    while 'cmd' not in f.f_locals:\n"
                  "        f = f.f_back\n    tree = ast.parse(f.f_locals['cmd']['src'], mode='eval').body\n"
                  "    return [n.value for n in ast.walk(tree) if isinstance(getattr(n, 'value', None), float)][-1]\n",
    }
    for name, solution in forgers.items():
        assert run_tests(solution, tests, timeout=2).passed == [False, False], name
    assert run_tests("def truncate(x):\n    return x % 1.0", tests, timeout=2).passed == [True, True]
    assert judge_value(j, '["S", "61"]') == (False, "TypeError")           # Python's own error for str - float
    assert judge_value(j, '["I", "%x"]' % 10 ** 400) == (False, "OverflowError")


def test_sets_of_colliding_hashes_are_refused_quickly():
    """Ints k * (2**61 - 1) all hash to 0: a 1 MiB set of them took the trainer ~20 s to build (quadratic).
    The decoder refuses many elements of one hash; honest sets (even -1 and -2, which share one) pass."""
    p = 2 ** 61 - 1
    ints = ['["I","%x"]' % (k * p) for k in range(1, 38000)]   # 1 MiB: the largest value a test may send
    start = time.monotonic()
    for text in ('["E",[%s]]' % ",".join(ints), '["D",[%s]]' % ",".join('[%s,["N"]]' % i for i in ints[:5000]),
                 '["Z",[%s]]' % ",".join('["T",[%s]]' % i for i in ints[:5000])):
        with pytest.raises(ValueError, match="colliding"):
            decode_value(text)
    assert time.monotonic() - start < 10   # (the set alone took ~20 s to build before; linear now, ~0.1 s)
    assert decode_value('["E",[["I","-1"],["I","-2"],["I","%x"]]]' % p) == {-1, -2, p}


# ---------------------------------------------------------------------------------------------
# Limits the reporter enforces

def test_oversized_and_cyclic_values_fail_and_the_run_goes_on():
    solution = "def big():\n    return [0] * 10 ** 6\ndef loop():\n    x = []\n    x.append(x)\n    return x\n" \
               "def ok():\n    return 1"
    run = run_tests(solution, ["assert big() == [0]", "assert loop() == []", "assert ok() == 1"], timeout=5)
    assert run.passed == [False, False, True], run.details
    assert run.details[:2] == ["value_too_large", "too_deep"]


def test_a_test_that_swallows_its_timeout_is_cut_off_by_the_reporter():
    solution = "def add(a, b):\n    if a == 2:\n        while True:\n            try:\n                while True:\n" \
               "                    pass\n            except BaseException:\n                pass\n    return a + b"
    start = time.monotonic()
    run = run_tests(solution, ["assert add(1, 1) == 2", "assert add(2, 2) == 4", "assert add(3, 3) == 6"],
                    timeout=0.5, total_timeout=30)
    assert run.passed == [True, False, False] and run.details[1:] == ["_TestTimeout", "not_run"]
    assert time.monotonic() - start < 10     # the reporter gave up at 0.5 + 0.2 s, not at the 30 s wall clock


@pytest.mark.parametrize("namespaces", [pytest.param(True, id="namespaces"), pytest.param(False, id="no-namespaces")])
def test_a_solution_waiting_for_the_cpu_is_not_failed_as_a_timeout(monkeypatch, namespaces):
    """Found by a red team: every time limit was wall-clock time, so a correct solution taking 0.3 s of a 0.6 s limit,
    judged while two busy processes shared its CPU (the trainer's load, or the programs judged beside it), got at most
    a third of it and failed every test as a timeout, scored as a wrong answer. A step's time is now the wall clock
    less the time the program (and the harness) waited for a CPU, up to LOAD_ALLOWANCE x the limit (raised here to
    keep the test far from it on a loaded machine). A solution that needs more than its limit, of CPU or asleep,
    still fails: the harness's own waiting is not forgiven (the relay, polling, waits for the CPU too). (With
    namespaces the harness reads the waiting of a process it forked only because that makes itself dumpable: the
    sandbox's /proc hides the others; without, the host's shows it.)"""
    monkeypatch.setattr(code, "LOAD_ALLOWANCE", 10.0)
    monkeypatch.setattr(code_io, "LOAD_ALLOWANCE", 10.0)
    burn = "import time\ndef f(x, seconds):\n    t = time.thread_time()\n    while time.thread_time() - t < seconds:\n" \
           "        pass\n    return x * 2\ndef g(x, seconds):\n    time.sleep(seconds)\n    return x * 2\n"
    program = burn + "x, seconds, how = input().split()\nprint((f if how == 'burn' else g)(int(x), float(seconds)))\n"
    with one_cpu_shared_with(2):
        limits = SandboxLimits(namespaces=namespaces)
        run = run_tests(burn, ["assert f(1, 0.3) == 2", "assert f(2, 0.3) == 4", "assert f(3, 0.9) == 6",
                               "assert g(4, 0.8) == 8"], timeout=0.6, limits=limits)
        io = code_io.run_cases(program, [("1 0.3 burn\n", "2\n"), ("3 0.9 burn\n", "6\n"), ("4 0.8 sleep\n", "8\n")],
                               timeout=0.6, limits=limits, allow_weak_sandbox=not namespaces)
    assert run.passed == [True, True, False, False] and run.details[2:] == ["_TestTimeout"] * 2, run.details
    assert io == [True, False, False]


def test_counter_and_subclasses_that_compare_like_their_base_still_pass():
    solution = "import collections\ndef count(s):\n    return collections.Counter(s)\nclass Name(str):\n    pass\n" \
               "def name():\n    return Name('ada')"
    run = run_tests(solution, ["assert count('aab') == {'a': 2, 'b': 1}", "assert name() == 'ada'"], timeout=2)
    assert run.passed == [True, True], run.details
    assert collections.Counter("aab") == {"a": 2, "b": 1}


# ---------------------------------------------------------------------------------------------
# The counts reach the user: `lowmem-grpo validate`

def test_validate_counts_the_tests_judged_inside(tmp_path):
    import subprocess
    import sys

    import yaml

    data = tmp_path / "problems.jsonl"
    rows = [{"prompt": "p", "tests": ["assert f(1) == 2", "assert f(2)"]}, {"prompt": "q", "checks": ["assert g() == 1"]}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"model": {"name_or_path": "m"}, "data": {"train_path": str(data)},
                                    "rewards": {"functions": [{"function": "code"}]}}))
    code_ = ("import sys\nfrom lowmem_grpo.cli import main\ntry:\n    main(['validate', sys.argv[1]])\n"
             "except SystemExit as exc:\n    print('exit', exc.code, 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code_, str(path)], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().endswith("exit 0 False"), out.stdout + out.stderr   # still no torch import
    assert f"code tests in {data}: 2 tests in 1 rows; 1 judged outside" in out.stdout
    assert "1 judged inside" in out.stdout and "1 rows without usable tests" in out.stdout


def test_a_test_judged_outside_after_one_judged_inside_counts_as_forgeable():
    """Found by a red team: a test judged inside sends its whole source, literals included, into the solver; a
    solution read the expected value there and claimed it for a later test judged outside on the same input,
    which then passed as if unforgeable. Such a test counts as inside now, in the run and in count_judging; the
    same test before any inside one stays unforgeable."""
    solution = ("import sys, re\nseen = {}\ndef f(x):\n    fr = sys._getframe()\n"
                "    while fr is not None and 'cmd' not in fr.f_locals:\n        fr = fr.f_back\n"
                "    m = [c for c in fr.f_locals['cmd']['code'].co_consts if type(c) is int and c != x]\n"
                "    if m:\n        seen[x] = m[-1]\n"
                "    return seen.get(x, 0)\n")
    inside, outside = "r = f(12345)\nassert r == 67890", "assert f(12345) == 67890"
    run = run_tests(solution, [inside, outside], timeout=2.0)
    assert run.passed == [True, True] and run.judged_outside == [False, False]   # the forgery works; it is counted
    assert count_judging([{"tests": [inside, outside]}]).outside == 0
    run = run_tests(solution, [outside, inside], timeout=2.0)
    assert run.passed == [False, True] and run.judged_outside == [True, False], run.details
    assert count_judging([{"tests": [outside, inside]}]).outside == 1


def test_a_tests_own_literals_are_compiled_off_its_clock():
    """Found by a red team: a test's source was compiled inside its time limit, so a test with a large literal
    (400,000 argument pairs took 1.1 s) failed a solution that does nothing. Compiled first now; the limit is the
    solution's."""
    test = f"assert size({[[i, i] for i in range(150_000)]!r}) == 150000"
    assert run_tests("def size(pairs):\n    return len(pairs)", [test], timeout=0.25).passed == [True]
