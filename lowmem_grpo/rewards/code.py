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

Who decides a verdict (docs/sandbox.md, "Verdicts"):

* A test of the form `assert <expr> <op> <literal>` (or `<literal> <op> <expr>`; op one of == != < <= >
  >= in, not in, and is / is not against None, True, False) is *judged outside*: only `<expr>` enters the
  sandbox; the program sends back its value as plain data (None, bool, int, float, complex, str, bytes
  and lists, tuples, dicts, sets of those, as tagged JSON, strings as hex UTF-8), and the trainer
  parses the literal with ast.literal_eval and compares. The expected value never reaches the program, and anything
  that is not plain data (an object whose __eq__ is always true, an int subclass with its own __eq__)
  fails. A program can only claim a value, never a verdict. That needs `<expr>` to be only a value: around
  the solution's calls (whose arguments are inputs) it may not compare, do arithmetic or call a module's
  function (`(f(x) == 2) is True`, `f(x) - 2 == 0`: the solution's objects answer those, and the expected
  value would be in the sandbox), else the test is judged inside. `abs(<expr> - <number>) < tol` is judged
  outside on the difference: only `<expr>` enters, the trainer subtracts.
* Any other test (a bare boolean assert, several statements) is *judged inside*: its pass/fail comes
  from the sandboxed program. Those verdicts can be forged by a solution that manipulates its own
  interpreter; `classify_tests` and `count_judging` count them so that a dataset's share is known. So can a
  test judged outside that comes after one judged inside (`unforgeable`): the inside test's literals entered
  the solver, which may keep an expected value seen there and claim it later; those count as inside too.

How a completion is run: one sandboxed program (see sandbox.py) that splits into two processes before
it reads anything:

1. the *reporter* makes itself non-dumpable (PR_SET_DUMPABLE 0: a process of the same uid can then
   neither ptrace it nor open its /proc entries: memory, descriptors), deletes its source file, forks
   the *solver*, then reads the job (a random nonce, the solution, the tests' sources) from stdin; it
   alone holds the pipe to the trainer and writes "<nonce> <i> value <data>|pass|fail <why>";
2. the solver makes itself dumpable again (so that the reporter may read its /proc/<pid>/schedstat), points
   stdin/stdout/stderr at /dev/null, keeps only its two pipes to the reporter, runs the solution, then each test
   when the reporter asks for it (compiled by the reporter), with a fresh random key per test, under a SIGALRM
   limit (`timeout`); it replies "<key> value <data>|pass|fail <why>";
3. the reporter attributes a reply to test i only if it carries test i's key and it reads it before test i's
   deadline, which holds where the solution ignores its alarm: `timeout` + 0.2 s, plus 20 ns per byte of
   the compiled test sent and 100 ns per byte of the reply (encoded off the clock), from before the solver
   gets the step, so a solver that stops the reporter gains no time; past it the solver is killed and the
   remaining tests fail. It exits when the tests are done (threads the solution left running do not hold it up).

Every step's `timeout` (the solver's alarm and the reporter's deadline, and code_io's cases) is wall-clock time
less the time the program's main thread waited for a CPU (`Clock`), up to LOAD_ALLOWANCE x
`timeout`: a machine loaded by the trainer or by the programs judged beside it does not fail a correct solution
as a timeout, while sleeping, looping and computing count as before (docs/sandbox.md, "Time limits under load").

So printing "PASS", exiting early, closing stdout, printing forever, catching the timeout, writing fake
report lines to every descriptor, or finding the nonce score nothing: the nonce and the trainer's pipe
never exist in the solver.

Completions run in parallel in a small thread pool (`workers`, 2 by default): the work happens in the
sandboxed child processes, the threads only wait on their pipes.
"""

from __future__ import annotations

import ast
import builtins
import json
import marshal
import operator
import re
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Iterable, Optional, Sequence

from .sandbox import (LOAD_ALLOWANCE, STEP_CLOCK, SandboxError, SandboxLimits, SandboxResult, missing_protections,
                      run_python, sandbox_summary)

DEFAULT_TEST_TIMEOUT_S = 3.0
DEFAULT_WORKERS = 2
VALUE_CAP = 4 << 20      # bytes of one test's encoded value (~12 a small int: a list of 300,000); a larger one fails
VALUES_CAP = 64 << 20    # bytes of all of a run's values: the trainer holds a few copies, per completion in flight
_MAX_DEPTH = 100         # nesting of a returned value
_MAX_SAME_HASH = 16      # elements of one decoded set (keys of one dict) that may share a hash
# A solution may ignore its SIGALRM: then the reporter's deadline is its limit, so it allows only scheduling's
# slack past `timeout`, plus what grows with data the solver must move, never with the time a test takes to
# compile (found by a red team: 1 us per byte of source let a call with 3 MB of arguments take 3.5 s of a 1 s limit).
_GRACE_S = 0.2           # past a step's own limit, the reporter stops waiting for the solver
# A step's limit is `timeout` of wall-clock time less the time the program's main thread waited for a CPU
# (sandbox.STEP_CLOCK), in all at most LOAD_ALLOWANCE x `timeout` of wall-clock time (sandbox.LOAD_ALLOWANCE).
_LOAD_S_PER_BYTE = 2e-8  # per byte of a compiled test sent (hex): ~3 ns to read and load it (6 MB: 20 ms)
_REPLY_S_PER_BYTE = 1e-7   # per byte of a reply: a returned value is encoded off its clock (~50 ns a byte)
_COMPILE_S_PER_BYTE = 1e-6   # the run's wall clock only: the reporter compiles each test before its clock starts
                             # (a literal of 400,000 pairs, 5.6 MB, compiled in 1.1 s: a 5x margin for load)

_PY_TAGS = {"python", "py", "python3", "py3"}

# What the sandboxed harnesses (this one and code_io's) share: their first act, making the process non-dumpable
# so that no process of the same uid (the solution's) can ptrace it or open its /proc entries (memory,
# descriptors); reading the job, all of stdin; and the step clock (sandbox.STEP_CLOCK).
HARNESS_COMMON = r"""
def prctl(option, arg):
    # prctl(2) through the bare _ctypes (the ctypes package costs ~4 ms to import)
    import _ctypes

    class Int(_ctypes._SimpleCData):
        _type_ = "i"

    class Fn(_ctypes.CFuncPtr):
        _flags_ = _ctypes.FUNCFLAG_CDECL
        _restype_ = Int

    class Libc:
        _handle = _ctypes.dlopen(None)

    return Fn(("prctl", Libc()))(option, arg, 0, 0, 0)


def make_private():
    # PR_SET_DUMPABLE 0
    try:
        return int(prctl(4, 0) == 0)
    except Exception:
        return 0


def start():
    # non-dumpable first, then its own source file deleted; whether it could be made non-dumpable
    private = make_private()
    try:
        os.unlink(sys.argv[0])
    except OSError:
        pass
    return private


def read_job():
    chunks = []
    while True:
        chunk = os.read(0, 1 << 20)
        if not chunk:
            break
        chunks.append(chunk)
    return marshal.loads(b"".join(chunks))


def show_waiting():
    # In a fork of the (non-dumpable) harness, first thing: where /proc shows a process only what it may ptrace (the
    # sandbox's own, hidepid=2; each run has its own PID namespace there), become dumpable again, so that the harness
    # may read how long this process waited for a CPU (Clock). It holds nothing the program does not get anyway.
    # Elsewhere (the host's /proc, which may show the processes of another run of the same uid) schedstat is readable
    # as it is, and the fork stays non-dumpable.
    if waited(os.getppid()) is None:
        try:
            prctl(4, 1)
        except Exception:
            pass
""" + STEP_CLOCK

# The harness. Constant text: everything run-specific (nonce, solution, tests) comes on stdin.
_HARNESS = r"""
import _signal as signal, marshal, os, select, sys, time

CAP = %(cap)d
GRACE = %(grace)r
LOAD_S_PER_BYTE = %(load)r
REPLY_S_PER_BYTE = %(reply)r
MAX_DEPTH = %(depth)d
# No json here, and the builtin _signal (json costs ~6 ms a run, the signal package ~3 ms): the job and
# the commands come as marshal (plain data from the trainer and the reporter), and values go out as ASCII
# JSON written by hand, strings as hex UTF-8.


%(common)s

class NotPlain(Exception):
    pass


def encode(value):
    # the value as tagged JSON of plain built-in data; a subclass counts as its base type's data only
    # if it compares like it (Counter, OrderedDict: dicts whose equality with a dict is dict equality)
    coll = sys.modules.get("collections")   # a Counter exists only if the solution imported collections
    dict_like = (coll.Counter, coll.OrderedDict, coll.defaultdict) if coll else ()
    bases = (int, float, complex, str, bytes, list, tuple, dict, set, frozenset)
    tags = {list: "L", tuple: "T", set: "E", frozenset: "Z"}
    out, size = [], [0]

    def base_of(t):
        if t in bases:
            return t
        if t in dict_like:
            return dict
        for b in bases:
            if issubclass(t, b):
                return b if t.__eq__ is b.__eq__ and t.__ne__ is b.__ne__ else None
        return None

    def put(piece):
        size[0] += len(piece)
        if size[0] > CAP:
            raise NotPlain("value_too_large")
        out.append(piece)

    def enc(v, depth):
        if depth > MAX_DEPTH:
            raise NotPlain("too_deep")
        t = type(v)
        if v is None:
            return put('["N"]')
        if t is bool:
            return put('["B",true]' if v else '["B",false]')
        b = base_of(t)
        if b is int:
            return put('["I","%%s"]' %% format(int.__index__(v), "x"))
        if b is float:
            return put('["F","%%s"]' %% float.hex(v))
        if b is complex:
            return put('["C","%%s","%%s"]' %% (float.hex(complex.real.__get__(v)), float.hex(complex.imag.__get__(v))))
        if b is str:
            if len(v) * 2 > CAP:
                raise NotPlain("value_too_large")
            return put('["S","%%s"]' %% str.encode(v, "utf-8", "surrogatepass").hex())
        if b is bytes:
            if len(v) * 2 > CAP:
                raise NotPlain("value_too_large")
            return put('["Y","%%s"]' %% bytes.hex(v))
        if b in tags:
            put('["%%s",[' %% tags[b])
            for k, x in enumerate(b.__iter__(v)):
                if k:
                    put(",")
                enc(x, depth + 1)
            return put("]]")
        if b is dict:
            put('["D",[')
            for k, (key, x) in enumerate(dict.items(v)):
                put(",[" if k else "[")
                enc(key, depth + 1)
                put(",")
                enc(x, depth + 1)
                put("]")
            return put("]]")
        raise NotPlain("not_plain_data:" + getattr(t, "__name__", "?"))

    enc(value, 0)
    return "".join(out)


def solver(cmd_r, rep_w):
    reader = os.fdopen(cmd_r, "rb")

    def reply(key, verdict, payload=""):
        data = memoryview(("%%s %%s %%s\n" %% (key, verdict, payload)).encode("utf-8", "replace"))
        while data:
            data = data[os.write(rep_w, data):]

    class _TestTimeout(BaseException):
        pass

    step = [None]   # the Clock of the step running

    def alarm(signum, frame):
        # at `limit` on the wall clock: more time where this process waited for a CPU meanwhile (Clock)
        clock = step[0]
        if clock is not None:
            left = clock.left()
            if left > 0:
                signal.setitimer(signal.ITIMER_REAL, left)
                return
        raise _TestTimeout()

    signal.signal(signal.SIGALRM, alarm)
    job = marshal.loads(bytes.fromhex(reader.readline().decode()))
    limit, load = job["timeout"], job["load"]
    namespace = {"__name__": "__solution__", "__builtins__": __builtins__}
    try:
        if job["prelude"]:
            # the prelude's names sit with the builtins (which win over them), not in the solution's globals:
            # a name the tests call must be one the solution defined, and its `from __future__` stays first
            names = {"__builtins__": __builtins__}
            exec(compile(job["prelude"], "<prelude>", "exec"), names)
            names = {k: v for k, v in names.items() if not k.startswith("__")}
            names.update(vars(__builtins__))   # (in __main__, __builtins__ is the module)
            namespace["__builtins__"] = names
        try:
            step[0] = Clock(limit, load, "self")
            signal.setitimer(signal.ITIMER_REAL, limit)
            exec(compile(job["solution"], "<solution>", "exec"), namespace)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            step[0] = None
    except BaseException as exc:
        reply(job["key"], "fail", type(exc).__name__)
        return
    missing = [name for name in job["defines"] if name not in namespace]
    if missing:
        reply(job["key"], "fail", "not_defined:" + missing[0])
        return
    reply(job["key"], "ok")
    while True:
        line = reader.readline()
        if not line:
            return
        cmd = marshal.loads(bytes.fromhex(line.decode()))
        value = cmd["kind"] == "value"
        try:
            # the test comes compiled (by the reporter, before its clock started), and the returned value is
            # encoded off the clock: neither is the solution's time
            try:
                step[0] = Clock(limit, load, "self")
                signal.setitimer(signal.ITIMER_REAL, limit)
                result = eval(cmd["code"], namespace) if value else exec(cmd["code"], namespace)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                step[0] = None
            payload = encode(result) if value else ""
        except NotPlain as exc:
            reply(cmd["key"], "fail", exc.args[0])
        except BaseException as exc:
            reply(cmd["key"], "fail", type(exc).__name__)
        else:
            reply(cmd["key"], "value" if cmd["kind"] == "value" else "pass", payload)


def reporter(child, cmd_w, rep_r, private):
    job = read_job()
    nonce = job["nonce"]

    def report(*words):
        data = memoryview((" ".join([nonce] + [str(w) for w in words]) + "\n").encode())
        while data:
            data = data[os.write(1, data):]

    def clean(detail):
        return "".join(c if c.isascii() and (c.isalnum() or c in "_.:-") else "?" for c in detail)[:120] or "failed"

    os.set_blocking(cmd_w, False)
    pending = bytearray()
    skipping = [False]

    def message(obj):
        return (marshal.dumps(obj).hex() + "\n").encode()

    def send(data, clock, slack):
        data = memoryview(data)
        while data:
            left = clock.left(slack)
            if left <= 0:
                return False
            if not select.select([], [cmd_w], [], left)[1]:
                continue
            try:
                data = data[os.write(cmd_w, data):]
            except BlockingIOError:
                continue
            except OSError:
                return False
        return True

    def receive(key, clock, slack, per_byte=0.0):
        # the first line that carries `key`, read by the end of `clock` plus `slack` plus `per_byte` a byte of it;
        # "timeout" or "gone" when none comes
        prefix = key.encode() + b" "
        most = slack + (CAP + 256) * per_byte
        while True:
            nl = pending.find(b"\n")
            while nl >= 0:
                line = bytes(pending[:nl])
                del pending[:nl + 1]
                if skipping[0]:
                    skipping[0] = False
                elif line.startswith(prefix):
                    # The deadline again: the solver may stop this process (SIGSTOP, its parent, same uid) while it
                    # waits, work past its limit, and have a process it left resume it once the reply is in the
                    # pipe. A reply is in time only if it is read in time.
                    if time.monotonic() > clock.end() + slack + len(line) * per_byte:
                        return "timeout"
                    return line[len(prefix):].decode("utf-8", "replace")
                nl = pending.find(b"\n")
            if len(pending) > CAP + 256:
                ours = pending.startswith(prefix) and not skipping[0]
                del pending[:]
                skipping[0] = True
                if ours:
                    return "fail value_too_large"
            left = clock.left(most)
            if left <= 0:
                return "timeout"
            if not select.select([rep_r], [], [], left)[0]:
                continue
            chunk = os.read(rep_r, 1 << 16)
            if not chunk:
                return "gone"
            pending.extend(chunk)

    report("ready", private)
    limit, load = job["timeout"], job["load"]
    key = os.urandom(8).hex()
    # one clock, taken before the solver can run the solution: taken after send(), a solver that stopped this
    # process first would have its time from whenever it let it go on. It allows the time the solver waits for a
    # CPU (Clock), up to load x limit; this process's own delays in reading the reply are what GRACE is for.
    clock = Clock(limit, load, child)
    sent = send(message({"key": key, "solution": job["solution"], "timeout": limit, "load": load,
                         "prelude": job["prelude"], "defines": job["defines"]}), clock, GRACE)
    got = receive(key, clock, GRACE) if sent else "gone"
    verdict, _, payload = got.partition(" ")
    if verdict != "ok":
        report("setup", "fail", "_TestTimeout" if got == "timeout" else clean(payload or got))
        return
    tests = job["tests"]
    for i, test in enumerate(tests):
        key = os.urandom(8).hex()
        # Compiled here, before the clock starts: the solver only loads it (a literal of 400,000 argument pairs
        # took 1.1 s to compile, 0.04 s to load), so its deadline needs no allowance for compiling, which a
        # solution that ignores its alarm took for its own time.
        try:
            code = compile(test["src"], "<test %%d>" %% i, "eval" if test["kind"] == "value" else "exec")
            data = message({"key": key, "i": i, "kind": test["kind"], "code": code})
        except Exception as exc:   # (SyntaxError, MemoryError, RecursionError: what the solver would have replied)
            report(i, "fail", clean(type(exc).__name__))
            continue
        clock, slack = Clock(limit, load, child), GRACE + len(data) * LOAD_S_PER_BYTE
        sent = send(data, clock, slack)
        code = data = None
        got = receive(key, clock, slack, REPLY_S_PER_BYTE) if sent else "gone"
        verdict, _, payload = got.partition(" ")
        if got in ("timeout", "gone"):
            report(i, "fail", "_TestTimeout" if got == "timeout" else "solver_died")
            for j in range(i + 1, len(tests)):
                report(j, "fail", "not_run")
            return
        if verdict == "value" and test["kind"] == "value":
            report(i, "value", payload)
        elif verdict == "pass" and test["kind"] == "exec":
            report(i, "pass")
        elif verdict == "fail":
            report(i, "fail", clean(payload))
        else:
            report(i, "fail", "protocol")


def main():
    private = start()
    cmd_r, cmd_w = os.pipe()
    rep_r, rep_w = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            show_waiting()
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            lo, hi = sorted((cmd_r, rep_w))
            os.closerange(3, lo)
            os.closerange(lo + 1, hi)
            os.closerange(hi + 1, 1 << 16)
            solver(cmd_r, rep_w)
        finally:
            os._exit(0)
    os.close(cmd_r)
    os.close(rep_w)
    try:
        reporter(child, cmd_w, rep_r, private)
    finally:
        try:
            os.kill(child, signal.SIGKILL)
        except OSError:
            pass
        os._exit(0)   # at once: what the solver left running must not keep the reward waiting


main()
""" % {"cap": VALUE_CAP, "grace": _GRACE_S, "load": _LOAD_S_PER_BYTE, "reply": _REPLY_S_PER_BYTE, "depth": _MAX_DEPTH,
       "common": HARNESS_COMMON}


# --------------------------------------------------------------------------------------------------
# Judging outside: which tests, and the comparison.

_OPS = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt,
        ast.GtE: operator.ge, ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b,
        ast.Is: operator.is_, ast.IsNot: operator.is_not}


@dataclass(frozen=True)
class Judging:
    """How one test is judged. kind "value": `src` is the expression the program evaluates, and the trainer
    compares its value (abs(value - c) when `around` is (c, False), abs(c - value) for (c, True)) with
    `expected` by `op` (the literal on the left when `literal_first`); kind "exec": `src` is the whole
    test, run inside, and its verdict is the program's."""
    kind: str
    src: str
    op: Optional[type] = None
    expected: Any = None
    literal_first: bool = False
    around: Optional[tuple] = None   # (c, c_first): the side was abs(src - c) (abs(c - src)), taken by the trainer
    matches: Optional[Any] = None    # in place of `op`: matches(value, expected) -> bool (code_io's function calls)

    @property
    def outside(self) -> bool:
        return self.kind == "value"


@lru_cache(maxsize=16384)
def judging(test: str) -> Judging:
    """How `test` is judged (see the module docstring); cached, since every completion of a row has the same tests."""
    inside = Judging("exec", test)
    try:
        tree = ast.parse(test)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return inside
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        return inside
    cmp = tree.body[0].test
    if not isinstance(cmp, ast.Compare) or len(cmp.ops) != 1 or type(cmp.ops[0]) not in _OPS:
        return inside
    op = type(cmp.ops[0])
    for literal_first, lit, expr in ((False, cmp.comparators[0], cmp.left), (True, cmp.left, cmp.comparators[0])):
        try:
            expected = ast.literal_eval(lit)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            continue
        if op in (ast.Is, ast.IsNot) and not (expected is None or expected is True or expected is False):
            return inside   # identity with any other literal is an implementation detail
        # abs(<expr> - <number>) < tol: the usual float check. The number is the expected value: only <expr>
        # enters the sandbox, the trainer takes the difference.
        around = _tolerance(expr)
        if around is not None:
            expr, around = around
        if not _only_a_value(expr):
            return inside
        return Judging("value", ast.unparse(expr), op, expected, literal_first, around)
    return inside


_BUILTIN_NAMES = frozenset(dir(builtins))


def _tolerance(expr) -> Optional[tuple]:
    """(X, (c, c_first)) when `expr` is abs(X - c) or abs(c - X) with c a number literal; else None."""
    if not (isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "abs"
            and len(expr.args) == 1 and not expr.keywords and isinstance(expr.args[0], ast.BinOp)
            and isinstance(expr.args[0].op, ast.Sub)):
        return None
    diff = expr.args[0]
    for c_first, lit, x in ((False, diff.right, diff.left), (True, diff.left, diff.right)):
        try:
            c = ast.literal_eval(lit)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            continue
        return (x, (c, c_first)) if type(c) in (int, float, complex) else None
    return None


def _solution_call(func) -> bool:
    """Is this the function of a call to the solution's code: a bare name that is not a builtin, or a method
    of what such a call returns (Solution().two_sum, f(x).count)? Its arguments are then the test's inputs."""
    if isinstance(func, ast.Name):
        return func.id not in _BUILTIN_NAMES
    if isinstance(func, ast.Attribute):
        root = func.value
        while isinstance(root, (ast.Attribute, ast.Subscript)):
            root = root.value
        return isinstance(root, ast.Call) and _solution_call(root.func)
    return False


def _only_a_value(expr) -> bool:
    """Can the value side be judged outside? The sandbox evaluates it with the solution's objects, which answer
    every operator and comparison as they like, and the solution can read its source. So around the
    solution's calls (their arguments are inputs: what they compute goes to the solution, which answers as it
    likes anyway; an index computed from the solution's objects is not) it must not compare (`(f(x) == 2) is True`),
    do arithmetic (`f(x) - 0.5 < 1e-9`: the expected value is in there) or call a module's function
    (`math.isclose(f(x), 0.5) is True`); such a test is judged inside, and counted so."""
    stack = [expr]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Compare, ast.BoolOp, ast.IfExp, ast.BinOp)):
            return False
        if isinstance(node, ast.Call):
            if _solution_call(node.func):
                stack.append(node.func)   # the receiver of a method; the arguments are inputs
                continue
            if isinstance(node.func, ast.Attribute) and not isinstance(node.func.value, ast.Constant):
                return False   # math.isclose(...), obj.method(...): may be a check of its own
        if isinstance(node, ast.Subscript):
            stack.append(node.value)
            if _names_the_solution(node.slice):
                # ['no', 'yes'][f(7) == True]: an index the solution's objects compute selects among the test's
                # own literals, and an __eq__ that always says yes selects the expected one
                stack.append(node.slice)
            continue
        stack.extend(ast.iter_child_nodes(node))
    return True


def _names_the_solution(expr) -> bool:
    """Does `expr` read a name other than a builtin or one it binds itself (a comprehension's or lambda's)?"""
    bound = {a.arg for n in ast.walk(expr) if isinstance(n, ast.Lambda) for a in ast.walk(n.args)
             if isinstance(a, ast.arg)}
    bound |= {n.id for n in ast.walk(expr) if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)}
    return any(isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id not in bound
               and n.id not in _BUILTIN_NAMES for n in ast.walk(expr))


def unforgeable(plans: Sequence[Judging]) -> list[bool]:
    """Per test: whether its verdict cannot be forged. A test judged outside is, unless a test judged inside came
    before it: that test's whole source, literals included, entered the solver, which can keep an expected value
    seen there and claim it for a later call on the same input (a test's order is the row's: a later test may
    use what an earlier one set up)."""
    out, seen_inside = [], False
    for p in plans:
        out.append(p.outside and not seen_inside)
        seen_inside = seen_inside or not p.outside
    return out


def classify_tests(tests: Iterable[str]) -> tuple[int, int]:
    """(judged outside and unforgeable, the others) among `tests`."""
    plans = [judging(t) for t in tests]
    outside = sum(unforgeable(plans))
    return outside, len(plans) - outside


@dataclass(frozen=True)
class JudgingCounts:
    rows: int                 # rows looked at
    rows_without_tests: int   # rows the code reward skips (no usable tests)
    outside: int              # tests judged outside the sandbox (unforgeable)
    inside: int               # tests whose verdict comes from the sandboxed program

    def describe(self, source: str = "the data") -> str:
        total = self.outside + self.inside
        line = (f"code tests in {source}: {total} tests in {self.rows - self.rows_without_tests} rows; "
                f"{self.outside} judged outside the sandbox (assert <expr> <op> <literal>)")
        if self.inside:
            line += (f"; {self.inside} judged inside (bare or multi-statement asserts, and any test after one): a "
                     f"solution that tampers with its own interpreter can forge those verdicts (docs/sandbox.md)")
        if self.rows_without_tests:
            line += f"; {self.rows_without_tests} rows without usable tests (skipped, not scored)"
        return line


def count_judging(rows: Iterable[dict], tests_field: str = "tests", limit: Optional[int] = None) -> JudgingCounts:
    """How the tests of `rows` (at most `limit` of them) would be judged."""
    n = missing = outside = inside = 0
    for row in rows:
        if limit is not None and n >= limit:
            break
        n += 1
        tests = get_tests(row, tests_field)
        if tests is None:
            missing += 1
            continue
        o, i = classify_tests(tests)
        outside, inside = outside + o, inside + i
    return JudgingCounts(n, missing, outside, inside)


class _Malformed(ValueError):
    pass


_HEX_INT = re.compile(r"-?[0-9a-f]+")


def decode_value(text: str):
    """The plain value of the program's tagged JSON; _Malformed (a ValueError) for anything else."""
    def reject(token):
        raise _Malformed(f"bare {token}")

    def hashed(items):
        # Distinct values of one hash (ints k * (2**61 - 1), tuples of them) make a set or dict cost quadratic
        # time to build: 1 MiB of them holds the trainer for many seconds. No honest value has many.
        seen: dict = {}
        for v in items:
            h = hash(v)
            seen[h] = seen.get(h, 0) + 1
            if seen[h] > _MAX_SAME_HASH:
                raise _Malformed("colliding hashes")
        return items

    def dec(x, depth):
        if depth > _MAX_DEPTH or type(x) is not list or not x or type(x[0]) is not str:
            raise _Malformed("not a tagged value")
        tag, args = x[0], x[1:]
        if tag == "N" and not args:
            return None
        if len(args) == 1:
            a = args[0]
            if tag == "B" and type(a) is bool:
                return a
            if tag == "I" and type(a) is str and _HEX_INT.fullmatch(a):
                return int(a, 16)
            if tag == "F" and type(a) is str:
                return float.fromhex(a)
            if tag == "S" and type(a) is str:
                return bytes.fromhex(a).decode("utf-8", "surrogatepass")
            if tag == "Y" and type(a) is str:
                return bytes.fromhex(a)
            if type(a) is list:
                if tag == "L":
                    return [dec(v, depth + 1) for v in a]
                if tag == "T":
                    return tuple(dec(v, depth + 1) for v in a)
                if tag == "E":
                    return set(hashed([dec(v, depth + 1) for v in a]))
                if tag == "Z":
                    return frozenset(hashed([dec(v, depth + 1) for v in a]))
                if tag == "D":
                    if not all(type(pair) is list and len(pair) == 2 for pair in a):
                        raise _Malformed("bad dict item")
                    keys = hashed([dec(pair[0], depth + 1) for pair in a])
                    return dict(zip(keys, [dec(pair[1], depth + 1) for pair in a]))
        if tag == "C" and len(args) == 2 and all(type(a) is str for a in args):
            return complex(float.fromhex(args[0]), float.fromhex(args[1]))
        raise _Malformed(f"bad tag {tag!r}")

    try:
        return dec(json.loads(text, parse_constant=reject), 0)
    except (_Malformed, ValueError, TypeError, RecursionError, OverflowError, MemoryError) as exc:
        raise _Malformed(str(exc)[:100]) from None


def judge_value(j: Judging, text: str) -> tuple[bool, str]:
    """(passed, detail) for a value the program reported for a test judged outside."""
    try:
        value = decode_value(text)
    except _Malformed:
        return False, "malformed value"
    try:
        if j.around is not None:   # abs(<value> - c): computed here, on plain data
            c, c_first = j.around
            value = abs(c - value) if c_first else abs(value - c)
        if j.matches is not None:
            ok = bool(j.matches(value, j.expected))
        else:
            ok = bool(_OPS[j.op](*((j.expected, value) if j.literal_first else (value, j.expected))))
    except (TypeError, ValueError, RecursionError, ArithmeticError, MemoryError) as exc:
        return False, type(exc).__name__
    return ok, "" if ok else "AssertionError"


@dataclass(frozen=True)
class SuiteRun:
    passed: list            # one bool per test
    details: list           # per test: "" when passed, else the exception name, "not run", ...
    sandbox: SandboxResult
    judged_outside: list = None   # per test: True when the trainer compared a value none could forge (`unforgeable`)
    channel_private: bool = False  # the reporter could make itself non-dumpable (its pipe out of the solver's reach)

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


def field_value(row, field: str):
    """A row's field, decoded when it is a JSON string (as some dataset exports store lists and mappings); None
    when it is missing or not valid JSON."""
    value = row.get(field) if isinstance(row, dict) else None
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return None
    return value


def get_tests(row: dict, tests_field: str = "tests") -> Optional[list]:
    """The row's tests as a list of non-empty strings, or None when missing or malformed. A JSON string
    holding such a list (as some dataset exports store it) is accepted too."""
    tests = field_value(row, tests_field)
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


def run_tests(code: str, tests: Sequence, *, timeout: float = DEFAULT_TEST_TIMEOUT_S,
              total_timeout: Optional[float] = None, limits: Optional[SandboxLimits] = None,
              prelude: str = "", defines: Sequence[str] = ()) -> SuiteRun:
    """Run `code`, then each of `tests` (sources, or how each is judged: a Judging), in one sandboxed program;
    report which tests passed.

    timeout: seconds allowed for the solution's top level and for each test, less the time spent waiting for a
        CPU, up to LOAD_ALLOWANCE x timeout of wall-clock time (SIGALRM inside the program; a solution that
        ignores it is cut off by the reporter 0.2 s later, plus 20 ns per byte of the compiled test and 100 ns per
        byte of its reply: the module docstring).
    total_timeout: wall-clock limit of the whole program, default LOAD_ALLOWANCE * timeout * (len(tests) + 1) + 2 s,
        plus 1 us per byte of the tests, which the reporter compiles off their clocks (the sum of the per-step
        limits, plus interpreter start-up); past it the program is killed and the tests that did not report count
        as failed.
    limits: the sandbox's limits (memory_mb, max_procs, namespaces, ...); default SandboxLimits().
    prelude: source run before the solution, whose names the solution sees as it sees the builtins (which
        win over them); none of them is the solution's own.
    defines: names the solution must define itself; where one is missing every test fails ("not_defined").
    """
    tests = list(tests)
    plans = [t if isinstance(t, Judging) else judging(t) for t in tests]
    nonce = secrets.token_hex(16)
    job = marshal.dumps({"nonce": nonce, "solution": code, "timeout": float(timeout), "load": float(LOAD_ALLOWANCE),
                         "prelude": prelude,
                         "defines": [str(name) for name in defines],
                         "tests": [{"kind": p.kind, "src": p.src} for p in plans]})
    compiling = sum(len(p.src) for p in plans) * _COMPILE_S_PER_BYTE
    wall = total_timeout if total_timeout is not None else \
        float(timeout) * LOAD_ALLOWANCE * (len(tests) + 1) + compiling + 2.0
    lim = limits or SandboxLimits()
    # stdout carries only the reporter's lines, values included; past VALUES_CAP the run stops (output_limit)
    room = min(len(tests) * (VALUE_CAP + 256), VALUES_CAP) + 4096
    if lim.max_output_bytes < room:
        lim = SandboxLimits.of(lim, max_output_bytes=room)
    result = run_python(_HARNESS, wall, stdin=job, limits=lim)
    if result.killed_reason == "sandbox_error":
        raise SandboxError(f"the sandbox could not be set up: {result.error}")
    verdicts: dict = {}
    setup_error, private = None, False
    for line in _each_line(result.stdout):
        parts = line.split(" ", 3)
        if len(parts) < 3 or parts[0] != nonce:
            continue
        if parts[1] == "ready":
            private = parts[2] == "1"
            continue
        if parts[1] == "setup":
            setup_error = parts[3].strip() if len(parts) > 3 else "error"
            continue
        if not parts[1].isdigit() or int(parts[1]) >= len(tests):
            continue
        i, kind, rest = int(parts[1]), parts[2], parts[3] if len(parts) > 3 else ""
        p = plans[i]
        if kind == "value" and p.outside:
            verdict = judge_value(p, rest)
        elif kind == "pass" and not p.outside:
            verdict = (True, "")
        elif kind == "fail":
            verdict = (False, rest.strip() or "failed")
        else:
            verdict = (False, "protocol")
        # one report per test comes from the reporter; a second means something wrote there: not a pass
        verdicts[i] = verdict if i not in verdicts else (False, "reported twice")
    passed, details = [], []
    for i in range(len(tests)):
        ok, detail = verdicts.get(i, (False, None))
        if detail is None:
            detail = (f"solution raised {setup_error}" if setup_error
                      else f"not run ({result.killed_reason or 'no report'})")
        passed.append(bool(ok))
        details.append(detail)
    return SuiteRun(passed, details, result, unforgeable(plans), private)


def _each_line(text: str):
    """The lines of `text`, one at a time: a run's output may be 64 MiB, and a list of its lines one more copy."""
    start = 0
    while start <= len(text):
        end = text.find("\n", start)
        end = len(text) if end < 0 else end
        yield text[start:end]
        start = end + 1


def sandbox_check(limits: Optional[SandboxLimits] = None, allow_weak_sandbox: bool = False) -> str:
    """The start-up line for the code rewards (sandbox_summary); raises SandboxError when full isolation
    is missing on this machine and `allow_weak_sandbox` is false, naming what is missing and the key."""
    lim = limits or SandboxLimits()
    missing = missing_protections(lim)
    if missing and not allow_weak_sandbox:
        raise SandboxError(
            "code reward: refusing to run model-written code with weaker isolation; missing: "
            + "; ".join(f"{k} ({v})" for k, v in missing.items())
            + ". Set allow_weak_sandbox: true in this reward's kwargs to accept that explicitly (docs/sandbox.md).")
    return sandbox_summary(lim)


def startup_report(*, allow_weak_sandbox: bool = False, tests_field: str = "tests", workers: int = DEFAULT_WORKERS,
                   timeout: float = DEFAULT_TEST_TIMEOUT_S, total_timeout: Optional[float] = None,
                   **sandbox_kwargs) -> list[str]:
    """Called once when a code reward is loaded with its recipe kwargs: the lines to log (which protections
    are active). Raises SandboxError as `sandbox_check` does, so that a trainer refuses to start."""
    return [sandbox_check(SandboxLimits.of(**sandbox_kwargs), allow_weak_sandbox)]


def score_in_sandbox(completions, rows, *, name: str, cases, score, workers: int, allow_weak_sandbox: bool,
                     sandbox_kwargs: dict) -> list:
    """The code rewards' common frame: the sandbox options checked before anything runs, each row's tests read
    by `cases(row)` (None: the row is skipped), the sandbox's isolation checked, then `score(code, tests, limits)`
    for each completion's extracted code, `workers` at a time (the threads only wait on sandboxed children)."""
    try:   # a misspelt option is a TypeError naming it and the allowed ones
        limits = SandboxLimits.of(**sandbox_kwargs)
    except TypeError as exc:
        raise TypeError(f"{name} reward: {exc}") from None
    if rows is None:
        raise ValueError(f"{name} reward needs the dataset rows (with their tests)")
    jobs = []
    for i, (completion, row) in enumerate(zip(completions, rows)):
        tests = cases(row)
        if tests is not None:
            jobs.append((i, extract_code(completion or ""), tests))
    scores: list = [None] * len(completions)
    if not jobs:
        return scores
    sandbox_check(limits, allow_weak_sandbox)

    def one(job):
        i, code, tests = job
        return i, score(code, tests, limits)

    workers = max(1, int(workers))
    if workers == 1 or len(jobs) <= 1:
        results = map(one, jobs)
    else:
        with ThreadPoolExecutor(max_workers=min(workers, len(jobs)), thread_name_prefix=f"{name}-reward") as pool:
            results = list(pool.map(one, jobs))
    for i, value in results:
        scores[i] = value
    return scores


def private_run(run: SuiteRun, allow_weak_sandbox: bool, name: str) -> SuiteRun:
    """`run`, once sure its reporter held its pipe out of the solution's reach (or weak isolation is accepted)."""
    if not run.channel_private and not allow_weak_sandbox and run.sandbox.stdout:
        raise SandboxError(f"{name} reward: the harness could not make its reporting process non-dumpable "
                           "(PR_SET_DUMPABLE), so the solution could reach its pipe; set allow_weak_sandbox: "
                           "true to accept that explicitly (docs/sandbox.md)")
    return run


def _score_all(completions, rows, *, tests_field, binary, workers, timeout, total_timeout, allow_weak_sandbox,
               sandbox_kwargs):
    def score(code, tests, limits):
        run = private_run(run_tests(code, tests, timeout=timeout, total_timeout=total_timeout, limits=limits),
                          allow_weak_sandbox, "code")
        return float(all(run.passed)) if binary else run.fraction

    return score_in_sandbox(completions, rows, name="code", cases=lambda row: get_tests(row, tests_field), score=score,
                            workers=workers, allow_weak_sandbox=allow_weak_sandbox, sandbox_kwargs=sandbox_kwargs)


def code_reward(completions, *, prompts=None, rows=None, tests_field: str = "tests", workers: int = DEFAULT_WORKERS,
                timeout: float = DEFAULT_TEST_TIMEOUT_S, total_timeout: Optional[float] = None,
                allow_weak_sandbox: bool = False, **sandbox_kwargs) -> list:
    """Fraction of the row's tests the completion's code passes; None when the row has no usable tests.
    The other keyword arguments are SandboxLimits fields (memory_mb, max_procs, max_output_bytes, ...).
    Raises SandboxError, before running anything, when this machine's sandbox lacks full isolation and
    allow_weak_sandbox is false."""
    return _score_all(completions, rows, tests_field=tests_field, binary=False, workers=workers, timeout=timeout,
                      total_timeout=total_timeout, allow_weak_sandbox=allow_weak_sandbox, sandbox_kwargs=sandbox_kwargs)


def code_binary_reward(completions, *, prompts=None, rows=None, tests_field: str = "tests",
                       workers: int = DEFAULT_WORKERS, timeout: float = DEFAULT_TEST_TIMEOUT_S,
                       total_timeout: Optional[float] = None, allow_weak_sandbox: bool = False,
                       **sandbox_kwargs) -> list:
    """1.0 when the completion's code passes every test of the row, else 0.0; None without usable tests."""
    return _score_all(completions, rows, tests_field=tests_field, binary=True, workers=workers, timeout=timeout,
                      total_timeout=total_timeout, allow_weak_sandbox=allow_weak_sandbox, sandbox_kwargs=sandbox_kwargs)
