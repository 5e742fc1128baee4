"""Code rewards: run the completion's Python against the row's assert-tests in the sandbox.

    code         score = fraction of the row's tests that pass (partial credit, a denser signal)
    code_binary  score = 1.0 only if every test passes, else 0.0

A row carries its tests as a list of Python statements, usually asserts:

    {"prompt": "...", "tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]}

(the field is `tests_field=`). A row without a usable list of tests cannot be scored: None (skip),
never 0, so that a broken dataset row does not punish the model.

The code is the last ```python (or ```py) fenced block of the completion; else the last untagged
``` block; else, if the completion opens a ```python block and never closes it (cut off by the
length limit), what follows the opening fence; else the whole completion.

How a completion is run: one sandboxed program per completion (see sandbox.py), which

1. reads a random nonce and the solution/tests from stdin (so they are not in any file the program
   could read, and the nonce is not in the program text), deletes its own source file;
2. points the program's stdout/stderr at /dev/null and keeps a private duplicate of the real stdout;
3. execs the solution in a fresh namespace, then each test in turn in that namespace, each under a
   SIGALRM time limit (`timeout`), and after each test writes "<nonce> <i> pass|fail" to its private
   stdout; then exits at once (threads the solution left running do not hold it up).

A test counts as passed only if its line with the right nonce says so. Generic tricks therefore score
nothing: printing "PASS", `sys.exit(0)` / `os._exit(0)` before the tests (unreported tests fail),
closing stdout, printing forever (it goes to /dev/null; the deadline ends it), catching the timeout.
It does not stop a program that reads the harness's own memory for the nonce, nor objects that
override __eq__ to always be equal: see docs/sandbox.md.

Completions run in parallel in a small thread pool (`workers`, 2 by default): the work happens in the
sandboxed child processes, the threads only wait on their pipes.
"""

from __future__ import annotations

import json
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional, Sequence

from .sandbox import SandboxError, SandboxResult, run_python

DEFAULT_TEST_TIMEOUT_S = 3.0
DEFAULT_WORKERS = 2

_PY_TAGS = {"python", "py", "python3", "py3"}

# The harness. Constant text: everything run-specific (nonce, solution, tests) comes on stdin.
_HARNESS = r'''
import json, os, signal, sys


def _lowmem_harness():
    job = json.loads(sys.stdin.readline())
    nonce = job.pop("nonce")
    try:
        os.unlink(sys.argv[0])
    except OSError:
        pass
    results = os.dup(1)
    sink = os.open(os.devnull, os.O_WRONLY)
    os.dup2(sink, 1)
    os.dup2(sink, 2)
    os.close(sink)

    def report(i, verdict, detail=""):
        try:
            os.write(results, ("%s %s %s %s\n" % (nonce, i, verdict, detail)).encode())
        except OSError:
            pass

    class _TestTimeout(BaseException):
        pass

    def _alarm(signum, frame):
        raise _TestTimeout()

    limit = job["timeout"]
    signal.signal(signal.SIGALRM, _alarm)
    namespace = {"__name__": "__solution__", "__builtins__": __builtins__}
    try:
        signal.setitimer(signal.ITIMER_REAL, limit)
        exec(compile(job["solution"], "<solution>", "exec"), namespace)
        signal.setitimer(signal.ITIMER_REAL, 0)
    except BaseException as exc:
        signal.setitimer(signal.ITIMER_REAL, 0)
        report("setup", "fail", type(exc).__name__)
        return
    for i, test in enumerate(job["tests"]):
        try:
            try:
                signal.setitimer(signal.ITIMER_REAL, limit)
                exec(compile(test, "<test %d>" % i, "exec"), namespace)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except BaseException as exc:
            report(i, "fail", type(exc).__name__)
        else:
            report(i, "pass")


_lowmem_harness()
os._exit(0)   # at once: threads the solution started must not keep the program (and the reward) waiting
'''


@dataclass(frozen=True)
class SuiteRun:
    passed: list            # one bool per test
    details: list           # per test: "" when passed, else the exception name, "not run", ...
    sandbox: SandboxResult

    @property
    def fraction(self) -> float:
        return sum(self.passed) / len(self.passed) if self.passed else 0.0


def _fenced_blocks(completion: str):
    """([(tag, body)] of the closed ``` blocks, (tag, body) of a block left open or None), in one pass over
    the lines. A fence is a line that starts (after indentation) with ```; its tag is the first word."""
    blocks, open_tag, body = [], None, []
    for line in completion.splitlines(keepends=True):
        stripped = line.strip()
        if stripped.startswith("```"):
            if open_tag is None:
                words = stripped[3:].split()
                open_tag, body = (words[0].lower() if words else ""), []
            else:
                blocks.append((open_tag, "".join(body)))
                open_tag = None
        elif open_tag is not None:
            body.append(line)
    return blocks, (None if open_tag is None else (open_tag, "".join(body)))


def extract_code(completion: str) -> str:
    """The Python code of a completion (see the module docstring for the rules)."""
    blocks, unclosed = _fenced_blocks(completion)
    tagged = [body for tag, body in blocks if tag in _PY_TAGS]
    if tagged:
        return tagged[-1]
    untagged = [body for tag, body in blocks if not tag]
    if untagged:
        return untagged[-1]
    if unclosed is not None and unclosed[0] in _PY_TAGS:
        return unclosed[1]
    return completion


def get_tests(row: dict, tests_field: str = "tests") -> Optional[list]:
    """The row's tests as a list of non-empty strings, or None when missing or malformed. A JSON string
    holding such a list (as some dataset exports store it) is accepted too."""
    tests = row.get(tests_field) if isinstance(row, dict) else None
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except ValueError:
            return None
    if not isinstance(tests, (list, tuple)) or not tests:
        return None
    if not all(isinstance(t, str) and t.strip() for t in tests):
        return None
    for t in tests:   # a test that does not even compile is the dataset's fault, not the model's
        try:
            compile(t, "<test>", "exec")
        except (SyntaxError, ValueError):
            return None
    return list(tests)


def run_tests(code: str, tests: Sequence[str], *, timeout: float = DEFAULT_TEST_TIMEOUT_S,
              total_timeout: Optional[float] = None, **sandbox_kwargs) -> SuiteRun:
    """Run `code`, then each of `tests`, in one sandboxed program; report which tests passed.

    timeout: seconds allowed for the solution's top level and for each test (SIGALRM inside the program).
    total_timeout: wall-clock limit of the whole program, default timeout * (len(tests) + 1) + 2 s
        (the sum of the per-step limits, plus interpreter start-up); past it the program is killed
        and the tests that did not report count as failed.
    sandbox_kwargs: passed to sandbox.run_python (memory_mb, max_procs, namespaces, ...).
    """
    tests = list(tests)
    nonce = secrets.token_hex(16)
    job = json.dumps({"nonce": nonce, "solution": code, "tests": tests, "timeout": float(timeout)})
    wall = total_timeout if total_timeout is not None else float(timeout) * (len(tests) + 1) + 2.0
    result = run_python(_HARNESS, wall, stdin=job + "\n", **sandbox_kwargs)
    if result.killed_reason == "sandbox_error":
        raise SandboxError(f"the sandbox could not be set up: {result.error}")
    verdicts: dict = {}
    setup_error = None
    for line in result.stdout.splitlines():
        parts = line.split(" ", 3)
        if len(parts) < 3 or parts[0] != nonce:
            continue
        if parts[1] == "setup":
            setup_error = parts[3].strip() if len(parts) > 3 else "error"
            continue
        if parts[1].isdigit() and int(parts[1]) < len(tests):
            i = int(parts[1])
            ok = parts[2] == "pass"
            # A "fail" for a test always wins: a pass must be the only verdict for its test.
            if i not in verdicts or not ok:
                verdicts[i] = (ok, "" if ok else (parts[3].strip() if len(parts) > 3 else "failed"))
    passed, details = [], []
    for i in range(len(tests)):
        ok, detail = verdicts.get(i, (False, None))
        if detail is None:
            detail = (f"solution raised {setup_error}" if setup_error
                      else f"not run ({result.killed_reason or 'no report'})")
        passed.append(bool(ok))
        details.append(detail)
    return SuiteRun(passed, details, result)


_SANDBOX_KWARGS = {"memory_mb", "file_size_mb", "max_procs", "max_open_files", "max_output_bytes", "cpu_s",
                   "tmpfs_mb", "hide_paths", "namespaces", "drop_privileges"}


def _score_all(completions, rows, *, tests_field, binary, workers, timeout, total_timeout, sandbox_kwargs):
    unknown = sorted(set(sandbox_kwargs) - _SANDBOX_KWARGS)
    if unknown:   # a typo in a recipe's kwargs should not pass silently
        raise TypeError(f"code reward: unknown keyword argument(s) {', '.join(unknown)}; "
                        f"sandbox options are {', '.join(sorted(_SANDBOX_KWARGS))}")
    if rows is None:
        raise ValueError("code reward needs the dataset rows (with their tests)")
    jobs = []
    for i, (completion, row) in enumerate(zip(completions, rows)):
        tests = get_tests(row, tests_field)
        if tests is not None:
            jobs.append((i, extract_code(completion or ""), tests))
    scores: list = [None] * len(completions)

    def one(job):
        i, code, tests = job
        run = run_tests(code, tests, timeout=timeout, total_timeout=total_timeout, **sandbox_kwargs)
        return i, (float(all(run.passed)) if binary else run.fraction)

    workers = max(1, int(workers))
    if workers == 1 or len(jobs) <= 1:
        results = map(one, jobs)
    else:
        with ThreadPoolExecutor(max_workers=min(workers, len(jobs)), thread_name_prefix="code-reward") as pool:
            results = list(pool.map(one, jobs))
    for i, score in results:
        scores[i] = score
    return scores


def code_reward(completions, *, prompts=None, rows=None, tests_field: str = "tests", workers: int = DEFAULT_WORKERS,
                timeout: float = DEFAULT_TEST_TIMEOUT_S, total_timeout: Optional[float] = None,
                **sandbox_kwargs) -> list:
    """Fraction of the row's tests the completion's code passes; None when the row has no usable tests.
    Extra keyword arguments go to the sandbox (memory_mb, max_procs, max_output_bytes, ...)."""
    return _score_all(completions, rows, tests_field=tests_field, binary=False, workers=workers, timeout=timeout,
                      total_timeout=total_timeout, sandbox_kwargs=sandbox_kwargs)


def code_binary_reward(completions, *, prompts=None, rows=None, tests_field: str = "tests",
                       workers: int = DEFAULT_WORKERS, timeout: float = DEFAULT_TEST_TIMEOUT_S,
                       total_timeout: Optional[float] = None, **sandbox_kwargs) -> list:
    """1.0 when the completion's code passes every test of the row, else 0.0; None without usable tests."""
    return _score_all(completions, rows, tests_field=tests_field, binary=True, workers=workers, timeout=timeout,
                      total_timeout=total_timeout, sandbox_kwargs=sandbox_kwargs)
