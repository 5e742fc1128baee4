"""stdin/stdout code rewards (rewards/code_io.py): the case shapes datasets use, the output comparison against a
hand-written table, the sandboxed runs (what passes, what fails, what the program is given), and the recipe path."""

from __future__ import annotations

import base64
import json
import marshal
import pickle
import zlib

import pytest

from conftest import recipe_dict
from lowmem_grpo.recipe import recipe_from_dict
from lowmem_grpo.rewards import Rewards, code_io
from lowmem_grpo.rewards.code_io import (code_io_binary_reward, code_io_reward, get_calls, get_cases, outputs_match,
                                         run_calls)
from lowmem_grpo.rewards.options import option_problems
from lowmem_grpo.rewards.sandbox import SandboxLimits, SandboxResult, sandbox_info

ADD = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
CASES = {"inputs": ["1 2\n", "10 -3\n", "0 0\n"], "outputs": ["3\n", "7\n", "0\n"]}


# -- the shapes of the cases -----------------------------------------------------------------------------

@pytest.mark.parametrize("value, expected", [
    (CASES, [("1 2\n", "3\n"), ("10 -3\n", "7\n"), ("0 0\n", "0\n")]),                       # APPS / TACO
    (json.dumps(CASES), [("1 2\n", "3\n"), ("10 -3\n", "7\n"), ("0 0\n", "0\n")]),           # ... as a JSON string
    ({"input": ["5\n"], "output": ["25\n"]}, [("5\n", "25\n")]),                              # CodeContests
    ([{"input": "5\n", "output": "25\n"}, {"stdin": "2\n", "stdout": "4\n"}], [("5\n", "25\n"), ("2\n", "4\n")]),
    ({"test_cases": [{"type": "stdin_stdout", "input": "1\n", "output": "1\n"}]}, [("1\n", "1\n")]),
    ({"inputs": [["1 2", "3 4"]], "outputs": [["3", "7"]]}, [("1 2\n3 4\n", "3\n7\n")]),     # lists of lines
])
def test_the_case_shapes_of_code_datasets_are_read(value, expected):
    assert get_cases({"tests": value}) == expected


def relay_job(stdin: bytes) -> dict:
    """What code_io's relay is sent (its head, then each case's input streamed after it), read back."""
    size = int.from_bytes(stdin[:8], "little")
    job, at, inputs = marshal.loads(stdin[8:8 + size]), 8 + size, []
    for n in job["sizes"]:
        inputs.append(stdin[at:at + n])
        at += n
    assert at == len(stdin)
    return {**job, "inputs": inputs}

def test_livecodebench_testtype_keeps_stdin_cases_and_skips_functional_ones():
    # LiveCodeBench's public_test_cases (and DeepCoder's lcbv5 `tests`): a JSON list of {input, output, testtype};
    # a "functional" case's input is the arguments of a LeetCode-style method, not a program's stdin
    stdin = [{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}]
    functional = [{"input": "[1, 2]", "output": "3", "testtype": "functional"}]
    assert get_cases({"tests": json.dumps(stdin)}) == [("1 2\n", "3\n")]
    assert get_cases({"tests": json.dumps(functional)}) is None
    assert get_cases({"tests": functional + stdin}) is None
    # code_generation_lite's private_test_cases: base64(zlib(pickle(JSON))), never unpickled here: skipped
    blob = base64.b64encode(zlib.compress(pickle.dumps(json.dumps(stdin)))).decode()
    assert get_cases({"tests": blob}) is None


@pytest.mark.parametrize("value", [
    None, "", "not json", [], {}, {"inputs": ["1"], "outputs": []}, {"inputs": "1", "outputs": "1"},
    {"inputs": [1], "outputs": [1]}, [{"input": "1"}], [{"type": "function_call", "input": "f(1)", "output": "1"}],
    [{"input": "1", "output": None}], 5,
    {"fn_name": "add", "inputs": [["1", "2"]], "outputs": [["3"]]},   # APPS/TACO call-based: arguments, not stdin
])
def test_cases_that_cannot_be_judged_are_none(value):
    assert get_cases({"tests": value}) is None


# -- the comparison ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("got, expected, match", [
    ("3\n", "3\n", True),
    ("3", "3\n", True),                        # no final newline
    ("3   \n\n\n", "3\n", True),               # trailing spaces and blank lines
    ("1 2\r\n3\r\n", "1 2\n3\n", True),        # CRLF
    ("1  2\n3", "1 2 3\n", True),              # the same tokens, spaced differently
    ("3\n", "4\n", False),
    ("3 4\n", "3\n", False),                   # an extra token
    ("", "0\n", False),
    ("0.3333333\n", "0.333333333\n", True),    # within 1e-6 (absolute below 1)
    ("1000000.5\n", "1000000.0\n", True),      # within 1e-6 relative
    ("0.334\n", "0.333333333\n", False),
    ("3.0000001\n", "3\n", False),             # an integer answer is compared as text
    ("3\n", "3.0\n", True),
    ("nan\n", "nan\n", True),                  # equal as text
    ("inf\n", "1e308\n", False),
    ("YES\n", "yes\n", False),                 # case matters
])
def test_outputs_match_a_hand_written_table(got, expected, match):
    assert outputs_match(got, expected) is match


@pytest.mark.parametrize("got, expected", [
    ("1\u00a02\n", "1 2\n"),       # no-break space
    ("1\u30002\n", "1 2\n"),       # ideographic space
    ("3\u00a0\n", "3\n"),          # ... as "trailing whitespace" of a line
    ("3\u3000", "3"),
    ("1\x1c2", "1 2"),              # str.split()'s file/group/record separators
    ("1\x852", "1 2"),              # NEL
    ("1\u20282", "1\n2"),           # line separator
])
def test_only_ascii_whitespace_separates_tokens(got, expected):
    assert not outputs_match(got, expected)


def test_ascii_whitespace_of_every_kind_still_separates_tokens():
    assert outputs_match("1\t2\v3\f4\r\n5 \r\n", "1 2 3 4\n5\n")


@pytest.mark.parametrize("got, expected, match", [
    ("1_000.5", "1000.5", False),     # float() takes underscores
    ("\u0661.5", "1.5", False),       # Arabic-Indic digit one
    ("\uff11.5", "1.5", False),       # full-width digit one
    ("1.5\u3000", "1.5", False),      # float() strips unicode whitespace
    ("1.5e0", "1.5", True),
    ("+1.5", "1.5", True),
    (".5", "0.5", True),
    ("0.5000001", ".5", True),
])
def test_numbers_within_the_tolerance_are_plain_ascii_decimals(got, expected, match):
    assert outputs_match(got, expected) is match


def test_a_long_token_is_judged_in_linear_time():
    import time
    start = time.monotonic()   # a number pattern that backtracks takes ~10 s on this one
    assert not outputs_match("1" * 20000 + "x", "1.5")
    assert time.monotonic() - start < 2.0


def test_a_zero_tolerance_compares_tokens_as_text():
    assert outputs_match("0.5000001", "0.5", 1e-6) and not outputs_match("0.5000001", "0.5", 0.0)


# -- in the sandbox ---------------------------------------------------------------------------------------

def test_right_partly_right_and_wrong_programs_score_as_they_should():
    rows = [{"tests": CASES}] * 4 + [{"prompt": "no cases"}]
    partly = "```python\na, b = map(int, input().split())\nprint(a + b if b >= 0 else a - b)\n```"   # wrong on 10 -3
    completions = [ADD, partly, "print(42)", "", ADD]
    scores = code_io_reward(completions, rows=rows, workers=2)
    assert scores == [1.0, pytest.approx(2 / 3), 0.0, 0.0, None]
    assert code_io_binary_reward(completions[:2], rows=rows[:2]) == [1.0, 0.0]


@pytest.mark.parametrize("program, why", [
    ("a, b = map(int, input().split())\nprint(a + b)\nraise SystemExit(1)", "a non-zero exit"),
    ("import time\ntime.sleep(30)", "past the timeout"),
    ("while True:\n    print('3')", "printing without end"),
    ("print(3)\nimport os\nos.kill(os.getpid(), 9)", "killed by a signal"),
])
def test_a_run_that_does_not_end_cleanly_fails_whatever_it_printed(program, why):
    rows = [{"tests": {"inputs": ["1 2\n"], "outputs": ["3\n"]}}]
    assert code_io_reward([f"```python\n{program}\n```"], rows=rows, timeout=1.0) == [0.0], why


@pytest.mark.parametrize("program, why", [
    ("import sys\nsys.stderr.write('3\\n')", "the answer on stderr"),
    ("import sys\nsys.stdout.write('3\\x00\\n')", "a NUL byte after it"),
    ("import sys\nsys.stdout.buffer.write(b'3\\xff\\n')", "invalid UTF-8 after it"),
    ("print(3)\nimport os\nos._exit(0)", "buffered, never flushed"),
    ("import os, sys, time\nif os.fork() == 0:\n    os.setpgid(0, 0); time.sleep(0.3); print('3', flush=True)\n", "a child"),
])
def test_output_that_is_not_the_answer_on_stdout_fails(program, why):
    rows = [{"tests": {"inputs": ["1 2\n"], "outputs": ["3\n"]}}]
    assert code_io_reward([f"```python\n{program}\n```"], rows=rows, timeout=2.0) == [0.0], why


def test_an_input_without_its_final_newline_gets_one():
    # contest input files end with a newline; a dataset that stripped it must not fail readline()[:-1]
    rows = [{"tests": {"inputs": ["abc"], "outputs": ["cba\n"]}}]
    program = "```python\nimport sys\ns = sys.stdin.readline()[:-1]\nprint(s[::-1])\n```"
    assert code_io_reward([program], rows=rows) == [1.0]


def test_a_lone_surrogate_in_an_expected_output_is_scored_not_raised():
    """Found by a red team: an expected output holding a lone surrogate (JSON "\\ud800") raised UnicodeEncodeError
    out of the reward, before any sandbox ran, while `validate` counted the row as fine. It is encoded as the
    inputs are (surrogatepass): no program prints that case, the row's other cases still score."""
    rows = [{"tests": json.dumps({"inputs": ["1 2\n", "2 2\n"], "outputs": ["\ud800\n", "4\n"]})}]
    assert code_io.count_cases(rows).cases == 2
    assert code_io_reward([ADD], rows=rows) == [0.5]


def test_numbers_printed_with_more_digits_fit_under_the_output_cap():
    # 3000 expected "0.5" (12 KB): a right program printing them "%.12f" writes 45 KB, past 2x + 4 KiB
    rows = [{"tests": {"inputs": ["3000\n"], "outputs": ["0.5\n" * 3000]}}]
    program = "```python\nn = int(input())\nprint('\\n'.join(['%.12f' % 0.5] * n))\n```"
    assert code_io_reward([program], rows=rows) == [1.0]
    assert code_io_reward([program], rows=rows, float_tolerance=0.0) == [0.0]   # text: "0.500000000000" != "0.5"


def test_a_truncated_output_fails_even_if_what_was_kept_matches(monkeypatch):
    kept = SandboxResult(returncode=0, stdout="3\n", stderr="", timed_out=False, killed_reason=None,
                         stdout_truncated=True)
    monkeypatch.setattr(code_io, "run_python", lambda *a, **k: kept)
    assert code_io.run_cases_separately(ADD, [("1 2\n", "3\n")]) == [False]
    monkeypatch.undo()   # one program for all cases: output past the cap is its "over" verdict
    assert code_io.run_cases("print(3)\nprint(' ' * 20000)", [("1 2\n", "3\n")]) == [False]


def test_the_expected_output_never_enters_the_sandbox(monkeypatch):
    seen = []
    real = code_io.run_python

    def spy(program, timeout_s, *, stdin=None, limits=None):
        seen.append((program, repr(relay_job(stdin)), limits.model_dump_json()))   # all it is given
        return real(program, timeout_s, stdin=stdin, limits=limits)

    monkeypatch.setattr(code_io, "run_python", spy)
    rows = [{"tests": {"inputs": ["36963077\n"], "outputs": ["73926154\n"]}}]
    assert code_io_reward(["```python\nprint(int(input()) * 2)\n```"], rows=rows) == [1.0]
    assert seen and "36963077" in seen[0][1] and not any("73926154" in part for call in seen for part in call)


def test_nothing_that_follows_from_the_expected_output_enters_the_sandbox(monkeypatch):
    """A case's fork holds a copy of the relaying program's memory: an output cap there taken from the expected
    output's length ("YES\\n" against "NO\\n") told a program its answer. The job is the same whatever the
    expected outputs are, and a program reading its cap from the relay's frames scores as in its own sandbox."""
    jobs = []
    real = code_io.run_python
    monkeypatch.setattr(code_io, "run_python", lambda *a, **k: jobs.append(relay_job(k["stdin"])) or real(*a, **k))
    for expected in ("YES\n", "NO\n", "1 2 3\n" * 3000):
        code_io.run_cases("print('NO')", [("1\n", expected)])
    assert len(jobs) == 3 and all({**j, "nonce": ""} == {**jobs[0], "nonce": ""} for j in jobs)
    monkeypatch.undo()
    reads_its_cap = ("import sys\nf = sys._getframe()\nwhile f is not None and 'cap' not in f.f_locals:\n"
                     "    f = f.f_back\nprint('NO' if f is not None and f.f_locals['cap'] == 2 * 3 + 4096 else 'YES')")
    cases = [("1\n", "YES\n"), ("2\n", "NO\n")]
    together, separately = code_io.run_cases(reads_its_cap, cases), code_io.run_cases_separately(reads_its_cap, cases)
    assert together == separately == [True, False]


def test_one_sandboxed_program_runs_the_cases_and_max_cases_keeps_the_first(monkeypatch):
    jobs = []
    real = code_io.run_python
    monkeypatch.setattr(code_io, "run_python", lambda *a, **k: jobs.append(relay_job(k["stdin"])) or real(*a, **k))
    rows = [{"tests": {"inputs": ["1 1\n", "2 2\n", "3 3\n"], "outputs": ["0\n", "4\n", "6\n"]}}]   # case 0 is wrong
    assert code_io_binary_reward([ADD], rows=rows) == [0.0] and len(jobs) == 1 and len(jobs[0]["inputs"]) == 3
    jobs.clear()
    assert code_io_reward([ADD], rows=rows, max_cases=2) == [0.5] and [j["inputs"] for j in jobs] == [[b"1 1\n", b"2 2\n"]]


# Programs x cases, each judged by run_cases (one program, a fork per case) and by the plain reference
# run_cases_separately (one sandboxed program per case): the same verdicts.
PARITY_PROGRAMS = {
    "right": "a, b = map(int, input().split())\nprint(a + b)",
    "wrong on one": "a, b = map(int, input().split())\nprint(a + b if b >= 0 else 0)",
    "all of stdin": "import sys\nprint(sum(map(int, sys.stdin.read().split())))",
    "open(0)": "print(sum(map(int, open(0).read().split())))",
    "bytes": "import sys\na, b = map(int, sys.stdin.buffer.readline().split())\nsys.stdout.buffer.write(b'%d\\n' % (a + b))",
    "exit 0 after": "import sys\na, b = map(int, input().split())\nprint(a + b)\nsys.exit(0)",
    "exit 3 after": "import sys\na, b = map(int, input().split())\nprint(a + b)\nsys.exit(3)",
    "exit message": "import sys\na, b = map(int, input().split())\nprint(a + b)\nsys.exit('bye')",
    "raises after": "a, b = map(int, input().split())\nprint(a + b)\nraise ValueError",
    "input past the end": "a, b = map(int, input().split())\nprint(a + b)\ninput()",
    "main guard": "def main():\n    a, b = map(int, input().split())\n    print(a + b)\nif __name__ == '__main__':\n    main()",
    "thread": ("import threading\ndef main():\n    a, b = map(int, input().split())\n    print(a + b)\n"
               "threading.stack_size(1 << 26)\nthreading.Thread(target=main).start()"),
    "deep recursion": ("import sys\nsys.setrecursionlimit(10000)\ndef f(n):\n    return 0 if n == 0 else 1 + f(n - 1)\n"
                       "a, b = map(int, input().split())\nprint(a + b + f(2000) - 2000)"),
    "syntax error": "print(",
    "too slow": "import time\ntime.sleep(5)",
    "too much": "print(3)\nprint(' ' * 20000)",
    "killed": "import os, signal\na, b = map(int, input().split())\nprint(a + b, flush=True)\nos.kill(os.getpid(), signal.SIGKILL)",
    "os._exit unflushed": "import os\nprint(3)\nos._exit(0)",
    "recursion near the limit": ("def f(n):\n    return 0 if n == 0 else 1 + f(n - 1)\n"
                                 "a, b = map(int, input().split())\nprint(a + b + f(996) - 996)"),
    "recursion past the limit": ("def f(n):\n    return 0 if n == 0 else 1 + f(n - 1)\n"
                                 "a, b = map(int, input().split())\nprint(a + b + f(1000) - 1000)"),
    "pickles its own class": ("import pickle\nclass Pair:\n    def __init__(self, a, b):\n        self.a, self.b = a, b\n"
                              "p = pickle.loads(pickle.dumps(Pair(*map(int, input().split()))))\nprint(p.a + p.b)"),
    "exit()": "a, b = map(int, input().split())\nprint(a + b)\nexit()",
    "quit(0) early": "a, b = map(int, input().split())\nif b < 0:\n    print(a + b)\n    quit(0)\nprint(a + b)",
    "no newline": "import sys\na, b = map(int, input().split())\nsys.stdout.write(str(a + b))",
    # Python's own exit, which the relaying program imitates: atexit functions run (the fast-output template),
    # a closed or None sys.stdout is not flushed, SystemExit's int status as CPython reads it
    "atexit template": ("import atexit, io, sys\nbuf = io.StringIO()\nout, sys.stdout = sys.stdout, buf\n"
                        "atexit.register(lambda: out.write(buf.getvalue()))\na, b = map(int, input().split())\n"
                        "print(a + b)"),
    "closes stdout": "import sys\na, b = map(int, input().split())\nprint(a + b)\nsys.stdout.close()",
    "stdout None": "import sys\na, b = map(int, input().split())\nprint(a + b)\nsys.stdout.flush()\nsys.stdout = None",
    "__file__": "import os\na, b = map(int, input().split())\nprint(a + b if os.path.basename(__file__) == 'main.py' else 0)",
    "exit 2**100": "import sys\na, b = map(int, input().split())\nprint(a + b)\nsys.exit(2 ** 100)",
    "exit int subclass": ("import sys\nclass Zero(int):\n    def __and__(self, other):\n        return 0\n"
                          "a, b = map(int, input().split())\nprint(a + b)\nsys.exit(Zero(1))"),
}


def test_the_cases_run_in_one_program_are_judged_as_each_in_its_own():
    cases = [("1 2\n", "3\n"), ("10 -3\n", "7\n"), ("4 4", "8\n")]
    for name, program in PARITY_PROGRAMS.items():
        together = code_io.run_cases(program, cases, timeout=1.0)
        separately = code_io.run_cases_separately(program, cases, timeout=1.0)
        assert together == separately, (name, together, separately)
    assert code_io.run_cases(PARITY_PROGRAMS["right"], cases) == [True] * 3   # (the table is not all failures)
    assert code_io.run_cases(PARITY_PROGRAMS["exit()"], cases) == [True] * 3     # exit() exists under -S too
    assert code_io.run_cases(PARITY_PROGRAMS["pickles its own class"], cases) == [True] * 3


def test_what_a_case_leaves_running_cannot_reach_the_next():
    """A program that leaves a process behind (its own process group, so the group kill misses it) gets nothing into
    the next case's output: it holds only its own case's pipes, and it is killed before the next case starts. (Under
    hidepid each case's process makes itself dumpable, so that the relay can read how long it waited for a CPU: a
    process of the run's uid may then open its /proc entries, descriptors included, but none of an earlier case is
    left to.)"""
    program = ("import os, sys, time\nn = int(input())\n"
               "print(n, flush=True)\n"
               "if n == 1:\n    os.close(1)\n"   # (what it leaves then holds no output of its own case)
               "if n == 1 and os.fork() == 0:\n"
               "    os.setpgid(0, 0)\n"
               "    for _ in range(30):\n"   # while the next case runs: into every descriptor it can reach
               "        for fd in range(3, 64):\n"
               "            try:\n                os.write(fd, b'9\\n')\n            except OSError:\n                pass\n"
               "        for pid in os.listdir('/proc'):\n"
               "            try:\n                open(f'/proc/{pid}/fd/1', 'w').write('9\\n')\n"
               "            except OSError:\n                pass\n"
               "        time.sleep(0.02)\n"
               "    os._exit(0)\n"
               "time.sleep(0.3 if n == 2 else 0)\n")
    assert code_io.run_cases(program, [("1\n", "1\n"), ("2\n", "2\n")], timeout=2.0) == [True, True]


def test_a_process_left_running_cannot_work_on_a_later_case_past_its_limit():
    """Case 0 leaves a daemon (its own process group: the group kill misses it) that takes 2 s, twice the limit, on
    case 3's answer and leaves it in /tmp, where case 3 picks it up in time. Each case in its own sandbox fails
    case 3; so must the cases run in one program: what a case leaves is killed before the next starts."""
    program = ("import os, time\nn = int(input())\n"
               "if n == 0 and os.fork() == 0:\n"
               "    os.setpgid(0, 0)\n"
               "    if os.fork() == 0:\n"
               "        time.sleep(2.0)\n"
               "        open('/tmp/a.tmp', 'w').write('30')\n        os.rename('/tmp/a.tmp', '/tmp/answer')\n"
               "    os._exit(0)\n"
               "if n in (1, 2):\n    time.sleep(0.9)\n"
               "if n == 3:\n"
               "    t = time.monotonic()\n"
               "    while not os.path.exists('/tmp/answer') and time.monotonic() - t < 0.9:\n        time.sleep(0.01)\n"
               "    print(open('/tmp/answer').read())\n"
               "else:\n    print(n * 10)\n")
    cases = [("0\n", "0\n"), ("1\n", "10\n"), ("2\n", "20\n"), ("3\n", "30\n")]
    assert code_io.run_cases(program, cases, timeout=1.0) == [True, True, True, False]


def test_a_case_cannot_read_the_relays_counters_and_what_it_leaves_is_still_killed():
    """Found by a red team: /proc/<pid>/stat is world-readable, the relaying program's too, and its counters of reaped
    children (cminflt, cutime) grew by what each case's fork did: a case read the previous case's input there, to the
    page. The sandbox's /proc shows a process only what it may ptrace now (hidepid=2), which hides the non-dumpable
    relay from its cases, and the cases from the relay: it kills what a case left with kill(-1) in the run's own PID
    namespace (without it, a sleeping daemon it could not see made it give up every later case)."""
    program = ("import os, time\nn = int(input())\n"
               "if n == 1 and os.fork() == 0:\n    os.setpgid(0, 0)\n    time.sleep(30)\n    os._exit(0)\n"
               "bytearray(n * 4096)\n"
               "try:\n    open('/proc/%d/stat' % os.getppid()).read()\n    print(n, 'seen')\n"
               "except OSError:\n    print(n, 'hidden')\n")
    hidden = "private_proc" in sandbox_info()["protections"]   # (the host's /proc in weak mode: still readable)
    cases = [(f"{n}\n", f"{n} {'hidden' if hidden else 'seen'}\n") for n in (1, 1000, 2)]
    assert code_io.run_cases(program, cases, timeout=2.0) == [True] * 3
    if not hidden:
        pytest.skip("no private /proc in this machine's sandbox: the relay's counters stay readable (docs/sandbox.md)")


def test_files_a_case_writes_do_not_reach_the_next():
    """A fresh sandbox per case starts with an empty /tmp, /dev/shm and working directory; so does each case run
    in one program (else a case could leave work, or a state, for the next)."""
    program = ("import os\nn = input()\n"
               "left = [p for d in ('/tmp', '/dev/shm', '.') for p in os.listdir(d) if p not in ('sandbox', 'main.py')]\n"
               "os.mkdir('/tmp/d')\nos.mkdir('/tmp/d/e')\nopen('/tmp/d/e/f', 'w').close()\nos.chmod('/tmp/d', 0)\n"
               "open('/dev/shm/s', 'w').close()\nopen('here', 'w').close()\nos.symlink('/tmp/d', 'link')\n"
               "print(n if not left else left)")
    cases = [("1\n", "1\n"), ("2\n", "2\n"), ("3\n", "3\n")]
    assert code_io.run_cases(program, cases) == code_io.run_cases_separately(program, cases) == [True] * 3


def test_stopping_the_relaying_program_does_not_hide_a_timeout():
    """The program stops the relaying program (its parent, same uid: SIGSTOP is allowed), works 2 s with a 1 s
    limit, prints, ends, and has a process it left wake the relay, which then saw an exit and an output but not
    the time: it took the 2 s run for a pass. The deadline is checked again once the case has ended."""
    program = ("import os, signal, time\nparent, me = os.getppid(), os.getpid()\n"
               "os.kill(parent, signal.SIGSTOP)\n"
               "if os.fork() == 0:\n"
               "    os.setpgid(0, 0)\n    os.close(0)\n    os.close(1)\n"
               "    while open('/proc/%d/stat' % me).read().split()[2] != 'Z':\n        time.sleep(0.01)\n"
               "    os.kill(parent, signal.SIGCONT)\n    os._exit(0)\n"
               "time.sleep(2.0)\nprint(int(input()) * 2)\n")
    assert code_io.run_cases(program, [("1\n", "2\n")], timeout=1.0) == [False]


# -- from a recipe ----------------------------------------------------------------------------------------

def test_the_recipe_path_validates_options_and_scores(tiny_model_dir, tiny_data, tmp_path):
    assert option_problems("code_io", {"float_tolerance": -1.0})
    assert option_problems("code_io_binary", {"float_tolerance": float("inf")})
    assert [k for k, _ in option_problems("code_io", {"total_timeout": 3.0})] == ["total_timeout"]   # code's, not this
    assert not option_problems("code_io", {"tests_field": "input_output", "max_cases": 5, "memory_mb": 256})
    d = recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run")
    d["rewards"] = {"functions": [{"function": "code_io", "kwargs": {"tests_field": "input_output"}}]}
    rewards = Rewards.from_recipe(recipe_from_dict(d))
    assert any("sandbox" in note for note in rewards.notes)   # the start-up line: the active protections
    result = rewards([ADD, "print(0)"], ["p", "p"], [{"input_output": json.dumps(CASES)}] * 2)
    assert result.total.tolist() == [1.0, pytest.approx(1 / 3)]   # 0 is right for "0 0"


def test_validate_counts_the_cases_and_the_rows_that_would_be_skipped(tmp_path):
    """`lowmem-grpo validate` reads the local data's cases as the reward will: a row without usable cases (here an
    empty CodeContests field) or whose checker cannot run is skipped in training, said before it."""
    import subprocess
    import sys

    import yaml

    data = tmp_path / "problems.jsonl"
    rows = [{"prompt": "p", "private_tests": CASES}, {"prompt": "q", "private_tests": {"input": [], "output": []}},
            {"prompt": "r", "private_tests": {"fn_name": "f", "inputs": [["1"]], "outputs": [["1"]]}},
            {"prompt": "s", "private_tests": CASES, "checker": "print('ok')"},
            {"prompt": "t", "private_tests": CASES, "checker": "int main() { return 0; }"}]   # C++: skipped
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"model": {"name_or_path": "m"}, "data": {"train_path": str(data)},
                                    "rewards": {"functions": [{"function": "code_io_binary",
                                                               "kwargs": {"tests_field": "private_tests",
                                                                          "checker_field": "checker"}}]}}))
    out = subprocess.run([sys.executable, "-m", "lowmem_grpo", "validate", str(path)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (f"test cases in {data}: 7 cases in 3 rows, all judged outside the sandbox (2 rows of stdin/stdout, 1 rows "
            "of function calls; 1 rows by their checker, in a sandbox of its own); 1 rows without usable cases (skipped, not "
            "scored); 1 rows whose checker is not a Python program (skipped, not scored)") in out.stdout, out.stdout


# -- checkers (special judges) ----------------------------------------------------------------------------

# "print two non-negative numbers that sum to n": many right answers, the expected output is one of them.
PAIR_CHECKER = """import sys
n = int(open(sys.argv[1]).read())
got = open(sys.argv[3]).read().split()
ok = len(got) == 2 and all(t.isdigit() for t in got) and int(got[0]) + int(got[1]) == n
print("ok" if ok else "wrong answer")
"""
PAIR_CASES = [("5\n", "2 3\n"), ("10\n", "5 5\n"), ("1", "0 1\n")]


@pytest.mark.parametrize("status, stdout, accepted", [
    (0, "", True), (0, "\n  \n", True), (0, "ok\n", True), (0, " Accepted.\r\n", True),
    (0, "yes", True), (0, "1", True), (0, "1e0", True),
    (0, "0", False), (0, "0.5", False), (0, "0.9999", False), (0, "2", False), (0, "-1", False),
    (0, "0.99999999999999999", False), (0, "1.00000000000000001", False), (0, "1.000", True), (0, "10e-1", True),
    (0, "wrong answer", False), (0, "WA", False), (0, "no", False), (0, "okay", False), (0, "nan", False),
    (1, "", False), (1, "ok", False), (3, "1", False), (None, "", False),
    # Found by a red team: the verdict is the whole stdout, not its first word, which a checker's diagnostic
    # may take from the program's output; and no token raises (Decimal's exponents end near 1e18).
    (0, "ok is wrong, expected 1 2\n", False), (0, "1 is wrong\n", False), (0, "OK, 3 numbers\n", False),
    (0, "1.0 points", False), (0, "ok\nwrong answer\n", False), (0, "ok\u00a0wrong", False),
    (0, "0e9999999999999999999999999", False), (0, "0.0e-9999999999999999999999", False),
    (0, "1e9999999999999999999999999", False), (0, "1" + "0" * 5000 + "e-5000", True),
])
def test_a_checker_accepts_by_exit_0_with_silence_a_word_or_a_score_of_1(status, stdout, accepted):
    assert code_io.checker_accepts(status, stdout) is accepted


def test_a_checker_whose_diagnostic_starts_with_the_output_does_not_hand_over_the_verdict():
    """Found by a red team: an ordinary checker that prints `<the program's tokens> is wrong, expected ...` and exits
    0 accepted a program printing `ok` (its first word), and a program printing 0e9999999999999999999999999 made
    the reward call raise decimal.InvalidOperation."""
    checker = ("import sys\nexp = open(sys.argv[2]).read().split()\ngot = open(sys.argv[3]).read().split()\n"
               "if sorted(got) != sorted(exp):\n    print(' '.join(got), 'is wrong, expected', ' '.join(exp))\n")
    row = {"tests": [{"input": "2\n", "output": "1 2\n"}], "checker": checker}
    printed = ("2 1", "9 9", "ok", "1", "0e9999999999999999999999999")
    scores = code_io_reward([f"```python\nprint({p!r})\n```" for p in printed], rows=[row] * 5,
                            checker_field="checker", timeout=2)
    assert scores == [1.0, 0.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("value, usable, has_checker", [
    (None, True, False), ("", True, False), ("  \n", True, False), (PAIR_CHECKER, True, True),
    ("#include \"testlib.h\"\nint main() { registerTestlibCmd(); }", False, False),   # C++: cannot run here
    ({"code": "print('ok')"}, False, False), (3, False, False),
])
def test_a_rows_checker_is_python_source_or_nothing(value, usable, has_checker):
    assert code_io.row_checker({"checker": value}, "checker") == (usable, value if has_checker else None)
    assert code_io.row_checker({"checker": value}, None) == (True, None)    # no checker_field: never read


def test_a_checker_accepts_other_right_answers_and_rejects_wrong_ones():
    programs = {"the expected one": "n = int(input())\nprint(n // 2, n - n // 2)",
                "another right one": "n = int(input())\nprint(0, n)", "wrong": "n = int(input())\nprint(1, n)",
                "crashes": "raise SystemExit(3)"}
    got = {name: code_io.run_cases(p, PAIR_CASES, checker=PAIR_CHECKER) for name, p in programs.items()}
    assert got == {"the expected one": [True] * 3, "another right one": [True] * 3, "wrong": [False] * 3,
                   "crashes": [False] * 3}
    # without the checker, only the expected answer passes
    assert code_io.run_cases(programs["another right one"], PAIR_CASES) == [False, False, True]   # "0 1" is expected


# Checkers x programs, judged by run_cases (the checker's runs batched in one sandboxed program of their own) and by
# the reference run_cases_separately (one sandboxed program per program run and per checker run): the same verdicts.
PARITY_CHECKERS = {
    "pair": PAIR_CHECKER,
    "silent exit codes": PAIR_CHECKER.replace('print("ok" if ok else "wrong answer")', "sys.exit(0 if ok else 1)"),
    "score": PAIR_CHECKER.replace('print("ok" if ok else "wrong answer")', "print(1 if ok else 0)"),
    "partial score": PAIR_CHECKER.replace('print("ok" if ok else "wrong answer")', "print(1 if ok else 0.5)"),
    "reads the input on stdin": PAIR_CHECKER.replace("open(sys.argv[1]).read()", "sys.stdin.read()"),
    "files by name": PAIR_CHECKER.replace("sys.argv[1]", "'input.txt'").replace("sys.argv[3]", "'solution_output.txt'"),
    "compares with the answer file": ("import sys\nprint('ok' if sorted(open(sys.argv[2]).read().split()) == "
                                      "sorted(open(sys.argv[3]).read().split()) else 'no')"),
    "main guard": "def main():\n" + "".join("    " + line + "\n" for line in PAIR_CHECKER.splitlines())
                  + "if __name__ == '__main__':\n    main()",
    "raises": "raise ValueError('broken checker')",
    "too slow": "import time\ntime.sleep(5)",
    "says too much": "print('ok')\nprint('x' * 10000)",
}
PARITY_PAIR_PROGRAMS = {
    "expected": "n = int(input())\nprint(n // 2, n - n // 2)",
    "reversed": "n = int(input())\nprint(n - n // 2, n // 2)",
    "other": "n = int(input())\nprint(0, n)",
    "wrong": "n = int(input())\nprint(1, n)",
    "prints the verdict": "print('ok')",
    "exit 1": "n = int(input())\nprint(0, n)\nraise SystemExit(1)",
}


def test_checked_cases_run_together_are_judged_as_each_in_its_own():
    for cname, checker in PARITY_CHECKERS.items():
        for pname, program in PARITY_PAIR_PROGRAMS.items():
            together = code_io.run_cases(program, PAIR_CASES, checker=checker, checker_timeout=1.0)
            separately = code_io.run_cases_separately(program, PAIR_CASES, checker=checker, checker_timeout=1.0)
            assert together == separately, (cname, pname, together, separately)
    # (and the table holds both verdicts)
    assert code_io.run_cases(PARITY_PAIR_PROGRAMS["reversed"], PAIR_CASES, checker=PARITY_CHECKERS["score"]) == [True] * 3
    assert code_io.run_cases(PARITY_PAIR_PROGRAMS["wrong"], PAIR_CASES,
                             checker=PARITY_CHECKERS["partial score"]) == [False] * 3   # 0.5 is not accepted
    assert code_io.run_cases(PARITY_PAIR_PROGRAMS["other"], PAIR_CASES, checker=PARITY_CHECKERS["raises"]) == \
        [False, False, True]   # a broken checker: only the expected output passes


def test_the_checker_runs_apart_from_the_program_and_only_on_other_outputs(monkeypatch):
    calls = []
    real = code_io.run_python
    monkeypatch.setattr(code_io, "run_python", lambda *a, **k: calls.append(relay_job(k["stdin"])) or real(*a, **k))
    expected_program = "n = int(input())\nprint(n // 2, n - n // 2)"
    assert code_io.run_cases(expected_program, PAIR_CASES, checker=PAIR_CHECKER) == [True] * 3
    assert len(calls) == 1   # the expected outputs need no judge
    calls.clear()
    assert code_io.run_cases("n = int(input())\nprint(0, n)", PAIR_CASES, checker=PAIR_CHECKER) == [True] * 3
    program_job, checker_job = calls
    assert "print(0, n)" in program_job["code"] and "2 3" not in repr(program_job)   # the answers stay out of it
    assert "print(0, n)" not in checker_job["code"] and len(checker_job["inputs"]) == 2   # "0 1" is the expected one
    assert marshal.loads(checker_job["inputs"][0]) == (b"5\n", b"2 3\n", b"0 5\n")


def test_a_program_cannot_leave_files_for_the_checker():
    """The checker runs in a sandbox of its own: files the program writes under the checker's names (in its
    directory, /tmp) do not reach it."""
    forger = ("import os\nn = int(input())\nfor d in ('.', '/tmp'):\n"
              "    for name in ('input.txt', 'correct_output.txt', 'solution_output.txt'):\n"
              "        open(os.path.join(d, name), 'w').write('1 1\\n')\nprint(7, 7)")
    checker = "import sys\nprint('ok' if open(sys.argv[2]).read() == open(sys.argv[3]).read() else 'no')"
    assert code_io.run_cases(forger, PAIR_CASES, checker=checker) == [False] * 3


def test_rows_with_a_checker_are_scored_by_it_and_rows_whose_checker_cannot_run_are_skipped():
    rows = [{"tests": {"inputs": ["5\n"], "outputs": ["2 3\n"]}, "checker": PAIR_CHECKER},
            {"tests": {"inputs": ["5\n"], "outputs": ["2 3\n"]}, "checker": None},
            {"tests": {"inputs": ["5\n"], "outputs": ["2 3\n"]}, "checker": "int main() { return 0; }"}]
    other = "```python\nn = int(input())\nprint(0, n)\n```"
    assert code_io_reward([other] * 3, rows=rows, checker_field="checker") == [1.0, 0.0, None]
    assert code_io_binary_reward([other] * 3, rows=rows) == [0.0, 0.0, 0.0]   # no checker_field: plain comparison
    counts = code_io.count_cases(rows, "tests", "checker")
    assert (counts.cases, counts.checkers, counts.broken_checkers) == (2, 1, 1)
    assert counts.describe("d") == ("stdin/stdout cases in d: 2 cases in 2 rows, all judged outside the sandbox (1 rows "
                                    "by their checker, in a sandbox of its own); 1 rows whose checker is not a Python "
                                    "program (skipped, not scored)")
    assert not option_problems("code_io", {"checker_field": "generated_checker", "checker_timeout": 2.0})
    assert [k for k, _ in option_problems("code_io_binary", {"checker_timeout": 0})] == ["checker_timeout"]


# -- function-call problems -------------------------------------------------------------------------------

APPS_CALLS = {"fn_name": "two_sum", "inputs": [[[2, 7, 11, 15], 9], [[3, 2, 4], 6], [[3, 3], 6]],
              "outputs": [[[0, 1]], [[1, 2]], [0, 1]]}   # APPS/TACO wrap a return value in a list, mostly
LCB_CASES = [{"input": "[2,7,11,15]\n9", "output": "[0, 1]", "testtype": "functional"},
             {"input": "[3,2,4]\n6", "output": "[1,2]", "testtype": "functional"}]
LCB_ROW = {"tests": json.dumps(LCB_CASES), "metadata": json.dumps({"func_name": "twoSum"})}


def test_function_call_cases_are_read_from_apps_taco_and_livecodebench_rows():
    calls = code_io.get_calls({"tests": json.dumps(APPS_CALLS)})
    assert calls == code_io.Calls("two_sum", (([[2, 7, 11, 15], 9], [[0, 1]]), ([[3, 2, 4], 6], [[1, 2]]),
                                              ([[3, 3], 6], [0, 1])), unwrap=True)
    assert code_io.get_calls({"tests": {"test_cases": APPS_CALLS}}) == calls
    assert code_io.get_calls(LCB_ROW) == code_io.Calls("twoSum", (([[2, 7, 11, 15], 9], [0, 1]), ([[3, 2, 4], 6],
                                                                                                  [1, 2])), False)
    assert get_cases(LCB_ROW) is None and get_cases({"tests": APPS_CALLS}) is None   # not stdin


@pytest.mark.parametrize("row", [
    {"tests": {"fn_name": "f", "inputs": [[1]], "outputs": []}},                   # lengths differ
    {"tests": {"fn_name": "f", "inputs": [1], "outputs": [1]}},                    # arguments not a list
    {"tests": {"fn_name": "f x", "inputs": [[1]], "outputs": [1]}},                # not a name
    {"tests": {"fn_name": "__import__('os').f", "inputs": [[1]], "outputs": [1]}},
    {"tests": {"fn_name": "lambda", "inputs": [[1]], "outputs": [1]}},            # a keyword: "lambda(*[1])" cannot run
    {"tests": {"fn_name": "f", "inputs": [], "outputs": []}},                      # no case
    {"tests": '{"fn_name": "f", "inputs": [[NaN]], "outputs": [1]}'},              # not a literal
    {"tests": LCB_CASES},                                                          # no metadata.func_name
    {"tests": [{"input": "[1", "output": "1", "testtype": "functional"}], "metadata": {"func_name": "f"}},
    {"tests": LCB_CASES + [{"input": "1\n", "output": "1\n", "testtype": "stdin"}], "metadata": {"func_name": "f"}},
    {"tests": [{"type": "function_call", "fn_name": "f", "input": [1], "output": [1]}]},   # a shape not known
])
def test_function_call_cases_that_cannot_be_judged_are_none(row):
    assert code_io.get_calls(row) is None


@pytest.mark.parametrize("value, expected, unwrap, match", [
    ([0, 1], [0, 1], False, True), ((0, 1), [0, 1], False, True), ([(1, 2), (3,)], [[1, 2], [3]], False, True),
    ({"a": (1,)}, {"a": [1]}, False, True), (5, 5, False, True), ("x", "x", False, True), (None, None, False, True),
    (5, [5], True, True), (5, [5], False, False), ([0, 1], [[0, 1]], True, True), ([0, 1], [[0, 1]], False, False),
    (0, [0, 1], True, False), (5, [[5]], True, False), ([1, 0], [0, 1], False, False), (1.5, 1.5, False, True),
    ("5", 5, False, False),
])
def test_a_returned_value_matches_as_json_would_carry_it(value, expected, unwrap, match):
    assert code_io.returns_match(value, expected, unwrap) is match


CALL_PROGRAMS = {
    "function": ("def two_sum(nums, t):\n    seen = {}\n    for i, x in enumerate(nums):\n        if t - x in seen:\n"
                 "            return [seen[t - x], i]\n        seen[x] = i"),
    "returns a tuple": "def two_sum(nums, t):\n    return next((i, j) for j in range(len(nums)) for i in range(j) "
                       "if nums[i] + nums[j] == t)",
    "class Solution": ("class Solution:\n    def two_sum(self, nums, t):\n        return next([i, j] for j in "
                       "range(len(nums)) for i in range(j) if nums[i] + nums[j] == t)"),
    "wrong": "def two_sum(nums, t):\n    return [0, 1]",
    "raises on one": "def two_sum(nums, t):\n    assert len(nums) != 3\n    return [0, 1]",
    "loops on one": "def two_sum(nums, t):\n    while len(nums) == 3:\n        pass\n    return [0, 1]",
    "main guard reads stdin": ("import sys\ndef two_sum(nums, t):\n    return [0, 1]\nif __name__ == '__main__':\n"
                               "    sys.stdin.read()"),
    "misnamed": "def twosum(nums, t):\n    return [0, 1]",
    "syntax error": "def two_sum(:",
}


def _called_in_process(program: str, calls) -> list[bool]:
    """The plain reference for the test's own (trusted) programs: run here, call, compare."""
    namespace: dict = {"__name__": "__solution__"}
    try:
        exec(compile(program, "<p>", "exec"), namespace)
        f = (getattr(namespace["Solution"](), calls.fn_name) if "Solution" in namespace
             else namespace.get(calls.fn_name))
    except SyntaxError:
        return [False] * len(calls.cases)
    passed = []
    for args, out in calls.cases:
        try:
            passed.append(f is not None and code_io.returns_match(f(*args), out, calls.unwrap))
        except Exception:
            passed.append(False)
    return passed


def test_function_calls_are_judged_outside_as_a_plain_in_process_call_judges_them():
    calls = code_io.get_calls({"tests": APPS_CALLS})
    for name, program in CALL_PROGRAMS.items():
        expected = ([True, False, True] if name == "loops on one" else   # (the loop would hang the reference)
                    _called_in_process(program, calls))
        assert code_io.run_calls(program, calls, timeout=1.0) == expected, name
    assert code_io.run_calls(CALL_PROGRAMS["returns a tuple"], calls) == [True] * 3   # (not all failures)
    assert code_io.run_calls(CALL_PROGRAMS["raises on one"], calls) == [True, False, True]


def test_a_call_returning_what_is_not_plain_data_fails_and_the_expected_value_stays_out(monkeypatch):
    seen = []
    real = code_io.run_tests.__globals__["run_python"]
    monkeypatch.setitem(code_io.run_tests.__globals__, "run_python",
                        lambda *a, **k: seen.append(repr(marshal.loads(k["stdin"]))) or real(*a, **k))
    always = ("class Eq(list):\n    def __eq__(self, other):\n        return True\n"
              "def two_sum(nums, t):\n    return Eq()")
    rows = [{"tests": {"fn_name": "two_sum", "inputs": [[[5, 8], 13]], "outputs": [[[424242, 737373]]]}}]
    assert code_io_reward(["```python\n" + always + "\n```"], rows=rows) == [0.0]
    assert seen and "[5, 8]" in seen[0] and "424242" not in "".join(seen)


def test_function_call_rows_are_scored_and_counted():
    lcb_solution = ("```python\nclass Solution:\n    def twoSum(self, nums, t):\n        return next([i, j] for j in "
                    "range(len(nums)) for i in range(j) if nums[i] + nums[j] == t)\n```")
    assert code_io_reward([lcb_solution, "```python\nprint(1)\n```"], rows=[LCB_ROW] * 2) == [1.0, 0.0]
    assert code_io_binary_reward([lcb_solution], rows=[{"tests": APPS_CALLS}], max_cases=1) == [0.0]   # misnamed
    counts = code_io.count_cases([LCB_ROW, {"tests": APPS_CALLS}, {"tests": CASES}, {"tests": {}}])
    assert counts.describe("d") == ("test cases in d: 8 cases in 3 rows, all judged outside the sandbox "
                                    "(1 rows of stdin/stdout, 2 rows of function calls); 1 rows without usable cases (skipped, not scored)")


def test_function_calls_refuse_a_reporter_whose_pipe_the_program_could_reach(monkeypatch):
    from dataclasses import replace

    from lowmem_grpo.rewards.sandbox import SandboxError
    real = code_io.run_tests
    monkeypatch.setattr(code_io, "run_tests", lambda *a, **k: replace(real(*a, **k), channel_private=False))
    calls = code_io.get_calls({"tests": APPS_CALLS})
    with pytest.raises(SandboxError, match="code_io reward: .*allow_weak_sandbox"):
        code_io.run_calls(CALL_PROGRAMS["function"], calls)
    assert code_io.run_calls(CALL_PROGRAMS["function"], calls, allow_weak_sandbox=True) == [True] * 3


@pytest.mark.parametrize("seconds, passed", [(0.1, True), (2.0, False)])
def test_stopping_the_reporter_does_not_hide_a_slow_call(seconds, passed):
    """The call stops the reporting process (its parent, same uid), turns off its own alarm, works past its 1 s
    limit and has a process it left resume the reporter once the reply is in the pipe: that reply was read late
    and taken. A reply is in time only if the reporter reads it in time (the same trick within the limit passes)."""
    program = ("import os, signal, time\ndef slow(n):\n    signal.setitimer(signal.ITIMER_REAL, 0)\n"
               "    parent = os.getppid()\n    if os.fork() == 0:\n        os.setpgid(0, 0)\n"
               f"        time.sleep({seconds} + 0.2)\n        os.kill(parent, signal.SIGCONT)\n        os._exit(0)\n"
               f"    os.kill(parent, signal.SIGSTOP)\n    time.sleep({seconds})\n    return 2 * n")
    calls = code_io.Calls("slow", (([1], 2),), unwrap=False)
    assert code_io.run_calls(program, calls, timeout=1.0) == [passed]


@pytest.mark.parametrize("size, seconds, passed", [(1, 0.3, True), (1, 1.4, False), (400_000, 0.3, True),
                                                  (400_000, 1.4, False)])
def test_a_call_that_ignores_its_alarm_is_cut_off_near_its_limit(size, seconds, passed):
    """Found by a red team: a call that ignores SIGALRM answers to the reporter's deadline only, which allowed 0.5 s
    and 1 us per byte of the test's source (for compiling it off the clock): with 3 MB of arguments a 3.5 s call
    passed under a 1 s limit. The reporter compiles the test before the clock starts now, and allows 0.2 s and
    what loading the compiled test takes: a call 0.4 s past its limit fails, with few arguments or many."""
    program = ("import signal, time\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\n"
               "def f(xs, seconds):\n    time.sleep(seconds)\n    return len(xs)")
    calls = code_io.Calls("f", (([list(range(size)), seconds], size),), unwrap=False)
    assert code_io.run_calls(program, calls, timeout=1.0) == [passed]


@pytest.mark.parametrize("seconds, passed", [(0.0, True), (1.3, False)])
def test_a_relay_held_up_after_the_fork_still_times_the_case_from_its_start(monkeypatch, seconds, passed):
    """A case's clock starts before it can run. Taken after the fork, a case that stopped the relaying program
    before it read the clock (here: the relay held up 0.6 s right after the fork) worked past its limit unseen."""
    held = code_io._IO_HARNESS.replace("    os.close(in_r)\n    os.close(out_w)\n",
                                       "    time.sleep(0.6)\n    os.close(in_r)\n    os.close(out_w)\n")
    assert held != code_io._IO_HARNESS
    monkeypatch.setattr(code_io, "_IO_HARNESS", held)
    assert code_io.run_cases(f"import time\ntime.sleep({seconds})\nprint(1)", [("1\n", "1\n")], timeout=1.0) == [passed]


@pytest.mark.parametrize("seconds, passed", [(0.0, True), (1.8, False)])
def test_a_reporter_held_up_after_sending_the_solution_still_times_its_top_level(monkeypatch, seconds, passed):
    """The same for a function call's program: its top level's clock starts before the solver gets it (a reporter
    held up 0.6 s after sending it gave a 1 s limit 2.1 s)."""
    from lowmem_grpo.rewards import code
    held = code._HARNESS.replace("\n    got = receive(key, ", "\n    time.sleep(0.6)\n    got = receive(key, ", 1)
    assert held != code._HARNESS
    monkeypatch.setattr(code, "_HARNESS", held)
    program = (f"import signal, time\nsignal.setitimer(signal.ITIMER_REAL, 0)\ntime.sleep({seconds})\n"
               "def f(n):\n    return n")
    assert code_io.run_calls(program, code_io.Calls("f", (([1], 1),), unwrap=False), timeout=1.0) == [passed]


def test_the_cases_directory_carries_nothing_to_the_next():
    """Found by a red team: the relay emptied the case's directory between cases but kept the directory, whose
    times (and mode, and extended attributes) a case could set and the next read: each case 'remembered' the
    earlier ones, which cases run each in its own sandbox cannot. The directory is made anew now."""
    program = ("import os\nst = os.stat('.')\nseen = int(st.st_mtime) if st.st_mtime < 1000 else 0\n"
               "os.utime('.', (seen + 1, seen + 1))\ninput()\nprint(seen)\n")
    cases = [("a\n", "0\n"), ("b\n", "1\n"), ("c\n", "2\n")]
    assert code_io.run_cases(program, cases) == code_io.run_cases_separately(program, cases) == [True, False, False]


def test_a_case_that_closes_its_stdout_and_runs_on_does_not_hold_up_the_next():
    """Found by a red team: on the end of a case's output the relay waited for the program without a deadline, so
    a case that closed its stdout and ran on held the relay until the whole run's wall clock killed it, and every
    later case failed. It is waited for within its own limit now."""
    program = "import os, time\nn = int(input())\nif n == 1:\n    os.close(1)\n    time.sleep(30)\nprint(n)\n"
    cases = [("1\n", "1\n"), ("2\n", "2\n"), ("3\n", "3\n")]
    assert code_io.run_cases(program, cases, timeout=1.0) == code_io.run_cases_separately(program, cases, timeout=1.0) \
        == [False, True, True]


def test_an_output_of_nan_fails_before_a_checker_that_nan_would_fool():
    """The usual generated checker `if abs(expected - got) > eps: reject` accepts NaN (every comparison with it is
    false): a program printing nan passed every case. A NaN or infinity the expected output does not hold fails
    now without asking the checker; the checker still judges other outputs, and one where the expected output is
    itself inf."""
    checker = ("import sys\nexp = float(open(sys.argv[2]).read())\ngot = float(open(sys.argv[3]).read())\n"
               "sys.exit(1 if abs(exp - got) > 1e-6 else 0)\n")
    cases = [("1\n", "0.5\n"), ("2\n", "inf\n")]
    for program, expected in (("n = int(input())\nprint(float('nan'))", [False, False]),
                              ("n = int(input())\nprint(1 / n if n == 2 else 0.5000000001)", [True, False]),
                              ("n = int(input())\nprint(0.5 if n == 1 else float('inf'))", [True, True])):
        together = code_io.run_cases(program, cases, checker=checker)
        assert together == code_io.run_cases_separately(program, cases, checker=checker) == expected, program


def test_the_called_function_must_be_the_programs_own_and_future_imports_stay_first():
    """Found by a red team: the star imports were prepended to the program, so `pass` answered an APPS/Codewars row
    whose fn_name is lcm, factorial or gcd with math's own (and sum with the builtin), and a solution whose first
    line is `from __future__ import annotations` was a SyntaxError. The imported names sit with the builtins now:
    the called name must be defined by the program (an explicit `from math import lcm` is the program's own)."""
    rows = [{"tests": {"fn_name": name, "inputs": inputs, "outputs": outputs}} for name, inputs, outputs in (
        ("lcm", [[2, 5], [2, 3, 4]], [[10], [12]]), ("factorial", [[0], [5]], [[1], [120]]),
        ("sum", [[[1, 2]]], [[3]]))]
    assert code_io_reward(["```python\npass\n```"] * 3, rows=rows) == [0.0, 0.0, 0.0]
    imported = "```python\nfrom math import lcm\n```"
    defined = "```python\ndef factorial(n):\n    return prod(range(1, n + 1))\n```"   # prod: math's, unimported
    assert code_io_reward([imported, defined], rows=rows[:2]) == [1.0, 1.0]
    assert run_calls("x = 1", get_calls(rows[0]), timeout=2) == [False, False]
    future = {"tests": {"fn_name": "twoSum", "inputs": [[[2, 7, 11, 15], 9]], "outputs": [[[0, 1]]]}}
    honest = ("```python\n\"\"\"Two sum.\"\"\"\nfrom __future__ import annotations\n\nclass Solution:\n"
              "    def twoSum(self, nums: List[int], target: int) -> list[int]:\n        seen = {}\n"
              "        for i, x in enumerate(nums):\n            if target - x in seen:\n"
              "                return [seen[target - x], i]\n            seen[x] = i\n```")
    assert code_io_reward([honest], rows=[future]) == [1.0]


def test_the_nan_rule_reads_numbers_as_a_python_checker_does_and_spares_words():
    """Found by a red team: the NaN rule split on ASCII whitespace only, but a Python checker's float() strips any
    Unicode whitespace, so "nan\\u00a0" passed `if abs(exp - got) > eps: reject`; "1e999" (inf) passed a relative
    check. And it failed the right answer "nan" on a problem whose answers are words. Judged by _before_checker
    alone (no sandbox): False is a failure before any checker, None leaves the output to it."""
    before = code_io._before_checker
    for got in ("nan", "nan\u00a0", "\u2003nan", "nan\x85", "\x1cnan", "NaN\u3000", "1e999", "-inf", "1" * 400,
                "0.5,nan", "+nan\n"):
        assert before(got, "1.4142135624\n") is False, repr(got)
    assert before("inf", "inf\n") is True and before("1e999", "inf\n") is None   # the kind the expected one holds
    assert before("nan", "aba\n") is None and before("infinity", "word\n") is None
    assert before("1.41421356", "1.4142135624\n") is None


def test_the_relay_and_the_reference_agree_on_stderr_future_imports_and_large_inputs():
    """Found by a red team, each a difference between run_cases and its reference: the reference capped stderr
    (the relay drops it), so a right program's debug output failed it; its exit() line came before a
    `from __future__` import (a SyntaxError there only); and the relay held every case's input, which counted
    against each case's RLIMIT_AS (8 cases of 6 MB under memory_mb=256 failed a program using 200 MB).
    Each case's input is streamed to it now."""
    chatty = "import sys\nn = int(input())\nfor i in range(n):\n    print('debug', i, file=sys.stderr)\nprint(n * 2)\n"
    future = '"""Doubles."""\r\nfrom __future__ import annotations\nfrom __future__ import division\nprint(2 * int(input()))'
    cases = [("10\n", "20\n"), ("2000\n", "4000\n")]
    for program in (chatty, future):
        assert code_io.run_cases(program, cases) == code_io.run_cases_separately(program, cases) == [True, True]
    big = "x" * (6 << 20)
    cases = [(big[:-1] + str(i), f"{len(big) + 1}\n") for i in range(6)]
    program = "import sys\ndata = sys.stdin.buffer.read()\nbuf = bytearray(200 << 20)\nprint(len(data))\n"
    limits = SandboxLimits(memory_mb=256)
    assert code_io.run_cases(program, cases, limits=limits) == [True] * 6
    assert code_io.run_cases_separately(program, cases[:1], limits=limits) == [True]
    over = program.replace("200 << 20", "250 << 20")   # the limit is still there
    assert code_io.run_cases(over, cases[:2], limits=limits) == [False, False]


def test_function_call_problems_get_the_sites_imports_and_large_arguments_and_values():
    """Found by a red team, each failing an honest solution: LiveCodeBench's starter code annotates with List[int]
    and imports nothing (NameError: the datasets' own judges prepend star imports; CALL_PRELUDE gives the names,
    the builtins winning so that pow keeps its modulus); 300,000 argument pairs as a Python literal took the
    sandbox's whole memory to compile (they travel as JSON text now); a returned list of 100,000 ints was over the 1 MiB value cap."""
    row = {"tests": {"fn_name": "count", "inputs": [[[[i, i + 1] for i in range(300_000)]], [[[1, 2]]]],
                     "outputs": [[300_000], [1]]}}
    solution = ("```python\nclass Solution:\n    def count(self, edges: List[List[int]]) -> int:\n"
                "        return pow(len(edges), 1, 10**9 + 7) + len(deque())\n```")
    assert code_io_reward([solution], rows=[row]) == [1.0]
    big = {"tests": {"fn_name": "upto", "inputs": [[100_000]], "outputs": [[list(range(100_000))]]}}
    assert code_io_reward(["```python\ndef upto(n):\n    return list(range(n))\n```"], rows=[big]) == [1.0]
