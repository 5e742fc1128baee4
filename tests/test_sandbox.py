"""The hostile-code suite: programs a policy may write during RL, run through the sandbox and the code reward.

Every case must (1) get its correct score (0 for all of these), (2) leave the host as it was, and
(3) let the caller carry on; after every test no process of the run may be left (`no_leftovers`).
The suite runs with the full sandbox and again without namespaces (the common situation in a
container that forbids unshare, accepted explicitly with allow_weak_sandbox), where only rlimits and the
unprivileged uid protect. Cases that depend on one layer skip, saying so, when this machine cannot
provide it. docs/sandbox.md maps each layer to the cases here that show it.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest

from conftest import one_cpu_shared_with
from lowmem_grpo.rewards import sandbox as sandbox_module
from lowmem_grpo.rewards.code import code_binary_reward, code_reward, run_tests
from lowmem_grpo.rewards.sandbox import (SANDBOX_UID_BASE, SANDBOX_UID_SPAN, SandboxError, missing_protections,
                                         run_python, sandbox_info, sandbox_summary)

ROOT = Path(__file__).resolve().parent.parent

MODES = [pytest.param(True, id="namespaces"), pytest.param(False, id="no-namespaces")]
ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-4, 4) == 0"]


def protections(namespaces: bool) -> set:
    return set(sandbox_info(namespaces=namespaces)["protections"])


def require_any(namespaces: bool, *layers: str) -> None:
    """Skip unless at least one of `layers` is active on this machine in this mode."""
    active = protections(namespaces)
    if not active.intersection(layers):
        pytest.skip(f"needs one of {layers}; active here: {sorted(active)}; "
                    f"unavailable: {sorted(sandbox_info(namespaces=namespaces)['unavailable'])}")


def score(solution: str, tests=ADD_TESTS, namespaces: bool = True, **kw) -> float:
    kw.setdefault("timeout", 0.5)
    return code_reward([solution], prompts=[""], rows=[{"tests": list(tests)}], workers=1,
                       namespaces=namespaces, allow_weak_sandbox=not namespaces, **kw)[0]


def world_dir() -> Path:
    """A fresh world-writable (1777) directory on the host, outside /tmp and every hidden path, whose
    ancestors every user may traverse: what a sandbox uid could write to on the host's own tree."""
    private = (Path("/tmp"), Path("/var/tmp"), Path("/dev/shm"))  # every run gets its own: not the host's
    for parent in (ROOT.parent, Path("/var"), Path("/srv"), Path("/opt")):  # (the checkout may be under /tmp)
        chain = [parent, *parent.parents]
        if any(parent.is_relative_to(p) for p in private) or not parent.is_dir():
            continue
        if all(os.stat(p).st_mode & stat.S_IXOTH for p in chain) and os.access(parent, os.W_OK):
            d = Path(tempfile.mkdtemp(prefix="lowmem-world-", dir=parent))
            d.chmod(0o1777)
            return d
    pytest.skip("no world-traversable directory outside /tmp to put a canary in")


def _live(procs):
    out = []
    for p in procs:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def sandbox_processes():
    """Live processes running as a sandbox uid (zombies are dead: they only wait for init to reap them)."""
    found = []
    for p in psutil.process_iter(["uids"]):
        uids = p.info["uids"]
        if uids and SANDBOX_UID_BASE <= uids.real < SANDBOX_UID_BASE + SANDBOX_UID_SPAN:
            found.append(p)
    return _live(found)


def sandbox_dirs() -> set:
    return {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("lowmem-sandbox-")}


@pytest.fixture(autouse=True)
def no_leftovers():
    """After each test: no new live descendant of this process, no process of a sandbox uid, no
    sandbox directory left; and the sandbox still works (the caller can carry on). The tests run in two
    pytest workers (README), so the other one may be in the middle of a sandboxed run: what it holds now
    is gone within its run's time limit, while a leftover stays. So: the sandbox processes and directories
    seen after the test must all be gone within 20 s."""
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    dirs_before = sandbox_dirs()
    yield
    deadline = time.monotonic() + 2.0
    while True:
        new = [p for p in _live(me.children(recursive=True)) if p.pid not in before]
        if not new or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not new, f"processes left behind: {[(p.pid, p.name()) for p in new]}"

    def seen():
        procs = set()
        for p in sandbox_processes():
            with contextlib.suppress(psutil.NoSuchProcess):
                procs.add((p.pid, p.create_time()))
        return procs, sandbox_dirs() - dirs_before

    stray, dirs = seen()
    deadline = time.monotonic() + 20.0
    while (stray or dirs) and time.monotonic() < deadline:
        time.sleep(0.1)
        procs_now, dirs_now = seen()
        stray, dirs = stray & procs_now, dirs & dirs_now
    assert not stray, f"sandbox-uid processes left behind: {sorted(pid for pid, _ in stray)}"
    assert not dirs, f"a sandbox directory was not removed: {sorted(dirs)}"
    after = run_python("print(6 * 7)", 10)
    assert after.ok and after.stdout.strip() == "42", after


# ---------------------------------------------------------------------------------------------
# The sandbox's own contract

def test_normal_program_output_status_and_stdin():
    res = run_python("import sys\ndata = sys.stdin.read()\nprint(data.upper())\nprint('err', file=sys.stderr)\n"
                     "sys.exit(3)", 10, stdin="hello")
    assert res.returncode == 3 and res.killed_reason is None and not res.timed_out
    assert res.stdout == "HELLO\n" and res.stderr == "err\n"
    assert res.protections, "the run must report which protections were active"


@pytest.mark.parametrize("namespaces", MODES)
def test_environment_is_minimal_and_identity_unprivileged(namespaces):
    res = run_python("import os, json\nprint(json.dumps({'env': sorted(os.environ), 'uid': os.getuid(), "
                     "'pid': os.getpid(), 'cwd': os.getcwd()}))", 10, namespaces=namespaces)
    import json
    info = json.loads(res.stdout)
    assert info["env"] == ["HOME", "LANG", "LC_ALL", "MALLOC_ARENA_MAX", "PATH", "TMPDIR"]   # (the last: sandbox.py)
    if "uid" in res.protections:
        assert SANDBOX_UID_BASE <= info["uid"] < SANDBOX_UID_BASE + SANDBOX_UID_SPAN or info["uid"] == 65534
    if "pidns" in res.protections:
        assert info["pid"] == 2     # PID 1 is the namespace's init; the program comes next
    if "private_tmp" in res.protections:
        assert info["cwd"] == "/tmp/sandbox"
    assert os.getcwd() != info["cwd"]


def test_timeout_kills_and_reports():
    res = run_python("import time\nprint('start', flush=True)\ntime.sleep(60)", 1.0)
    assert res.timed_out and res.killed_reason == "timeout" and res.returncode is not None and res.returncode < 0
    assert res.stdout == "start\n"        # output before the kill is kept
    assert res.duration_s < 10


def test_cpu_limit():
    res = run_python("while True:\n    pass", 20, cpu_s=1)
    assert res.killed_reason == "cpu_limit" and not res.timed_out


def test_output_cap_kills_an_endless_print():
    res = run_python("import os\nwhile True:\n    os.write(1, b'x' * 65536)", 20, max_output_bytes=100_000)
    assert res.killed_reason == "output_limit" and res.stdout_truncated
    assert len(res.stdout) == 100_000 and set(res.stdout) == {"x"}


def test_output_cap_can_truncate_instead_of_killing():
    res = run_python("import sys\nfor _ in range(200):\n    sys.stderr.write('y' * 1000)\nprint('done')", 20,
                     max_output_bytes=5000, kill_on_output_limit=False)
    assert res.ok and res.stdout == "done\n" and res.stderr_truncated and len(res.stderr) == 5000


def test_memory_limit():
    res = run_python("b = bytearray(512 * 2**20)\nprint('allocated')", 20, memory_mb=256)
    assert "allocated" not in res.stdout and "MemoryError" in res.stderr


def test_threads_are_not_refused_for_address_space_they_only_reserve():
    """Found by a red team: glibc's malloc gives each thread that allocates an arena of its own (up to 8 per CPU),
    each reserving 64 MiB of address space, which RLIMIT_AS counts: 20 threads holding 100 KB each could not start
    ("can't start new thread") under memory_mb=1024 while using ~25 MB. The program runs with MALLOC_ARENA_MAX=2 now."""
    prog = """
import threading
n = 20
barrier = threading.Barrier(n + 1, timeout=10)
held = []
def hold():
    held.append(bytearray(100_000))   # below malloc's mmap threshold: from this thread's arena
    barrier.wait()
threads = []
try:
    for _ in range(n):
        threads.append(threading.Thread(target=hold))
        threads[-1].start()
    barrier.wait()
except (RuntimeError, MemoryError, threading.BrokenBarrierError) as exc:
    barrier.abort()
    print('failed', type(exc).__name__)
for t in threads:
    t.join()
print(len(held))
"""
    res = run_python(prog, 30, memory_mb=512)
    assert res.ok and res.stdout.split() == ["20"], (res.stdout, res.stderr[-500:])


def test_file_size_limit():
    res = run_python("f = open('big', 'wb')\nf.write(b'0' * (3 * 2**20))\nf.close()\nprint('wrote')", 20, file_size_mb=1)
    assert "wrote" not in res.stdout and "File too large" in res.stderr


# ---------------------------------------------------------------------------------------------
# Hostile programs, through the code reward

@pytest.mark.parametrize("namespaces", MODES)
def test_correct_solution_still_scores(namespaces):
    assert score("def add(a, b):\n    return a + b", namespaces=namespaces) == 1.0
    assert score("def add(a, b):\n    return 3", namespaces=namespaces) == 0.5


@pytest.mark.parametrize("namespaces", MODES)
def test_fork_bomb(namespaces):
    require_any(namespaces, "pidns", "uid", "rlimit:nproc")
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n" \
           "def add(a, b):\n    return a + b"
    assert score(bomb, namespaces=namespaces, max_procs=16, total_timeout=3) == 0.0
    res = run_python("import os\nn = 0\nfor _ in range(200):\n    try:\n        pid = os.fork()\n    except OSError:\n"
                     "        break\n    if pid == 0:\n        import time; time.sleep(60)\n    n += 1\nprint(n)",
                     5, namespaces=namespaces, max_procs=16)
    assert int(res.stdout) <= 16      # RLIMIT_NPROC stopped it


@pytest.mark.parametrize("namespaces", MODES)
def test_infinite_loops(namespaces):
    assert score("def add(a, b):\n    while True:\n        pass", namespaces=namespaces) == 0.0
    # catches the harness's timeout exception and keeps looping: only the wall clock ends it
    stubborn = "def add(a, b):\n    while True:\n        try:\n            while True:\n                pass\n" \
               "        except BaseException:\n            pass"
    assert score(stubborn, namespaces=namespaces, total_timeout=1.5) == 0.0


@pytest.mark.parametrize("namespaces", MODES)
def test_ten_gigabyte_allocation(namespaces):
    before = psutil.virtual_memory().available
    assert score("def add(a, b):\n    x = bytearray(10 * 2**30)\n    return a + b", namespaces=namespaces) == 0.0
    assert score("x = [0] * (10 * 2**30 // 8)\ndef add(a, b):\n    return a + b", namespaces=namespaces) == 0.0
    assert psutil.virtual_memory().available > before - 2**30


@pytest.mark.parametrize("namespaces", MODES)
def test_huge_output(namespaces):
    assert score("def add(a, b):\n    while True:\n        print('x' * 10000)", namespaces=namespaces) == 0.0
    res = run_python("while True:\n    print('spam' * 1000)", 10, namespaces=namespaces)
    assert res.killed_reason == "output_limit" and len(res.stdout) <= 1 << 20


@pytest.mark.parametrize("namespaces", MODES)
def test_writing_and_deleting_files_outside(tmp_path, namespaces):
    require_any(namespaces, "uid", "private_tmp")
    canary = tmp_path / "canary.txt"
    canary.write_text("original")
    listing = sorted(os.listdir(tmp_path))
    vandal = f"""
import os, shutil
def attack():
    done = []
    for action in (lambda: open({str(canary)!r}, 'w').write('pwned'),
                   lambda: os.remove({str(canary)!r}),
                   lambda: open({str(tmp_path / 'new.txt')!r}, 'w').write('new'),
                   lambda: shutil.rmtree({str(tmp_path)!r}),
                   lambda: open('/etc/lowmem_pwned', 'w').write('x'),
                   lambda: os.chmod({str(canary)!r}, 0o777)):
        try:
            action()
            done.append(True)
        except Exception:
            done.append(False)
    return done
"""
    assert score(vandal, ["assert any(attack())"], namespaces=namespaces) == 0.0
    assert canary.read_text() == "original"
    assert sorted(os.listdir(tmp_path)) == listing
    assert not os.path.exists("/etc/lowmem_pwned")


def test_private_tmp_hides_host_tmp():
    require_any(True, "private_tmp")
    name = f"/tmp/lowmem-canary-{secrets.token_hex(8)}"
    res = run_python(f"open({name!r}, 'w').write('x')\nimport os\nprint(sorted(os.listdir('/tmp')))", 10)
    assert res.ok and res.stdout.strip() == str(sorted([name[5:], "sandbox"]))   # its own, empty /tmp
    assert not os.path.exists(name)


def test_trainer_directory_and_homes_are_hidden(monkeypatch):
    """The datasets (tests, reference solutions) in the trainer's working directory are out of sight."""
    require_any(True, "hidden_paths", "minimal_root")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.chdir(root)
    probe = f"import os\nprint(os.path.exists({os.path.join(root, 'data')!r}), " \
            f"os.listdir({root!r}) if os.path.isdir({root!r}) else [], " \
            f"os.listdir('/root') if os.path.isdir('/root') else [])"
    res = run_python(probe, 10)
    assert res.ok and res.stdout.strip() == "False [] []", res
    # the check can fail: without the minimal root and with nothing hidden, the directory is there
    shown = run_python(probe, 10, hide_paths=[], minimal_root=False)
    assert shown.ok and shown.stdout.startswith("True") or "Permission denied" in shown.stderr


@pytest.mark.parametrize("namespaces", MODES)
def test_parent_environment_is_not_readable(monkeypatch, namespaces):
    require_any(namespaces, "uid", "private_proc")
    token = secrets.token_hex(16)
    monkeypatch.setenv("LOWMEM_SECRET_CANARY", token)
    snoop = f"""
import os
def leak():
    found = [repr(dict(os.environ))]
    paths = ['/proc/self/environ', '/proc/1/environ', '/proc/{os.getpid()}/environ', '/proc/{os.getppid()}/environ']
    paths += ['/proc/%s/environ' % p for p in os.listdir('/proc') if p.isdigit()]
    for path in paths:
        try:
            with open(path, 'rb') as f:
                found.append(f.read().decode('latin-1'))
        except OSError:
            pass
    return '\\n'.join(found)
"""
    assert score(snoop, ["assert 'LOWMEM_SECRET_CANARY' in leak()"], namespaces=namespaces) == 0.0
    res = run_python(snoop + "\nprint(leak())", 10, namespaces=namespaces)
    assert res.ok and "'PATH'" in res.stdout      # it did run and print what it found
    assert token not in res.stdout and token not in res.stderr


@pytest.mark.parametrize("namespaces", MODES)
def test_no_network_to_loopback(namespaces):
    require_any(namespaces, "netns")
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    accepted, stop = [], threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            accepted.append(conn.recv(100))
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        client = f"""
import socket
def call():
    s = socket.create_connection(('127.0.0.1', {port}), timeout=0.5)
    s.sendall(b'exfiltrate')
    return True
"""
        assert score(client, ["assert call()"], namespaces=namespaces) == 0.0
        res = run_python(client + "\nprint(call())", 10, namespaces=namespaces)
        assert "Network is unreachable" in res.stderr
        # the server itself works: this process can connect
        socket.create_connection(("127.0.0.1", port), timeout=2).sendall(b"host")
        time.sleep(0.5)
    finally:
        stop.set()
        thread.join(5)
        server.close()
    assert accepted == [b"host"]


@pytest.mark.parametrize("namespaces", MODES)
def test_signalling_the_parent_and_the_test_process(namespaces):
    require_any(namespaces, "uid", "pidns")
    me = os.getpid()
    killer = f"""
import os, signal
def attack():
    for action in (lambda: os.kill(os.getppid(), signal.SIGKILL),
                   lambda: os.kill({me}, signal.SIGTERM),
                   lambda: os.killpg(os.getpgid({me}), signal.SIGKILL),
                   lambda: os.kill({os.getppid()}, signal.SIGKILL)):
        try:
            action()
        except Exception:
            pass
    return 'alive'
"""
    assert score(killer, ["assert attack() == 'the parent is dead'"], namespaces=namespaces) == 0.0
    # kill(-1): every process the program may signal (on Linux, not itself)
    res = run_python(killer + "\nprint(attack())\ntry:\n    os.kill(-1, signal.SIGKILL)\nexcept OSError:\n    pass\n"
                     "print('still here')", 10, namespaces=namespaces)
    assert res.stdout.splitlines() == ["alive", "still here"]
    assert psutil.pid_exists(me) and psutil.Process(os.getppid()).is_running()


@pytest.mark.parametrize("namespaces", MODES)
def test_sleeping_past_the_timeout(namespaces):
    assert score("import time\ndef add(a, b):\n    time.sleep(100)", namespaces=namespaces) == 0.0
    ignores_alarm = "import signal, time\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\ntime.sleep(100)\n" \
                    "def add(a, b):\n    return a + b"
    assert score(ignores_alarm, namespaces=namespaces, total_timeout=1.5) == 0.0


@pytest.mark.parametrize("namespaces", MODES)
def test_daemonized_child_is_killed(namespaces):
    """A child that leaves the process group (setpgid; setsid is denied) and outlives the program must still die."""
    require_any(namespaces, "pidns", "uid")
    escape = "import os, time\nif os.fork() == 0:\n    os.setpgid(0, 0)\n    if os.fork() == 0:\n        time.sleep(60)\n" \
             "    os._exit(0)\ndef add(a, b):\n    return a + b"
    assert score(escape, namespaces=namespaces) == 1.0     # the solution itself is right: full score
    # no_leftovers checks that the sleeping grandchild is gone


@pytest.mark.parametrize("namespaces", MODES)
def test_forging_the_harness_protocol(namespaces):
    forgers = [
        "import os\nos._exit(0)",
        "import sys\nsys.exit(0)",
        "print('0 pass')\nprint('1 pass')\nimport os\nos._exit(0)",
        # write fake verdicts to every descriptor it can find, then leave before the tests
        "import os\nfor fd in range(3, 64):\n    for i in range(2):\n        try:\n"
        "            os.write(fd, b'%d pass\\n' % i)\n        except OSError:\n            pass\nos._exit(0)",
        "import os\nos.close(1)\nos.close(2)\ndef add(a, b):\n    return 0",
        "def add(a, b):\n    raise SystemExit(0)",
    ]
    assert code_binary_reward(forgers, rows=[{"tests": ADD_TESTS}] * len(forgers), timeout=1, workers=2,
                              namespaces=namespaces, allow_weak_sandbox=not namespaces) == [0.0] * len(forgers)


# ---------------------------------------------------------------------------------------------
# The minimal root: what a program sees of the host's filesystem

_WALK = """
import json, os
stop = set(json.loads({bound!r}))
seen = {{}}
def walk(d):
    names = sorted(os.listdir(d))
    seen[d] = names
    if d in stop or d == "/proc":
        return
    for n in names:
        p = os.path.join(d, n)
        if os.path.isdir(p) and not os.path.islink(p):
            walk(p)
walk("/")
print(json.dumps(seen))
"""


def allowed_tree(layout: dict) -> dict:
    """Directory -> sorted entries that the minimal root must show, from the layout and the host."""
    tree: dict = {}

    def entry(path: str):
        parent, name = os.path.dirname(path), os.path.basename(path)
        tree.setdefault(parent, set()).add(name)
        if parent != "/":
            entry(parent)

    for path, kind in layout["binds"]:
        entry(path)
        if kind == "dir":
            tree[path] = set(os.listdir(path))
    for d, *_ in layout["dirs"]:
        entry(d)
        tree.setdefault(d, set())
    for link, _ in layout["links"]:
        entry(link)
    for name in ("dev", "etc", "proc", "tmp"):
        entry("/" + name)
    tree["/dev"] = {n for n in ("null", "zero", "full", "random", "urandom") if os.path.exists("/dev/" + n)} | \
        {"fd", "stdin", "stdout", "stderr", "shm"}
    tree["/dev/shm"] = set()
    tree["/etc"] = tree.get("/etc", set()) | {"passwd", "group", "hosts"}
    tree["/tmp"], tree["/tmp/sandbox"] = {"sandbox"}, {"main.py"}
    tree.pop("/proc", None)
    return {d: sorted(names) for d, names in tree.items()}


def test_walking_the_root_shows_only_the_allowed_tree():
    """Everything a sandboxed program can reach from / : the interpreter, its libraries, a minimal /dev,
    its own /etc, /proc and /tmp. Bound directories are compared by their listing (their content is the
    host's, read-only); everything else must match exactly."""
    require_any(True, "minimal_root")
    layout = sandbox_info()["root"]
    bound = [p for p, kind in layout["binds"] if kind == "dir"]
    res = run_python(_WALK.format(bound=json.dumps(bound)), 30)
    assert res.ok, res.stderr
    seen = json.loads(res.stdout)
    seen.pop("/proc")
    assert seen == allowed_tree(layout)
    # the project, its data and the homes are not in it (unless the interpreter itself lives there)
    assert not any(d == str(ROOT) or d.startswith(str(ROOT) + "/") for d in seen)
    needed = [p for p, _ in layout["binds"]] + [lk for lk, _ in layout["links"]]
    for d in ("/home", "/root", "/var", "/srv", "/mnt", "/media", "/run", "/sys", "/boot", "/opt", "/work"):
        if d in seen:   # only as a directory on the way to something the interpreter needs
            assert any(p.startswith(d + "/") for p in needed), d


def test_the_root_is_read_only_except_private_tmp():
    """The program tries to create a file in every directory it can reach: only its own tmpfs take one."""
    require_any(True, "minimal_root")
    prog = """
import os
ok = []
for top, dirs, files in os.walk('/'):
    if top.startswith('/proc'):
        dirs[:] = []
        continue
    try:
        with open(os.path.join(top, '.lowmem-probe'), 'w') as f:
            f.write('x')
        ok.append(top)
    except OSError:
        pass
print(sorted(ok))
"""
    res = run_python(prog, 60)
    assert res.ok, res.stderr
    assert eval(res.stdout) == ["/dev/shm", "/tmp", "/tmp/sandbox"]


def test_device_nodes_work_but_their_host_inodes_stay_unchanged():
    """Found by a red team: /dev/null and the other nodes were writable binds of the host's, so a program could
    utime() them (write permission suffices), setting the host inode's times: a write outside the sandbox that
    carried state to the next stdin/stdout case and to concurrent runs. The binds are read-only now; reading and
    writing the devices still work."""
    require_any(True, "minimal_root")
    nodes = ("null", "zero", "full", "random", "urandom")
    before = {n: os.stat("/dev/" + n).st_mtime_ns for n in nodes}
    prog = """
import errno, os
refused = []
for n in %r:
    try:
        os.utime('/dev/' + n)
    except OSError as exc:
        refused.append(exc.errno == errno.EROFS)
with open(os.devnull, 'w') as f:
    f.write('x' * 100000)
fd = os.open('/dev/full', os.O_WRONLY)
try:
    full = os.write(fd, b'x') < 0
except OSError as exc:
    full = exc.errno == errno.ENOSPC
print(refused, full, open('/dev/zero', 'rb').read(4) == bytes(4), len(open('/dev/urandom', 'rb').read(16)))
""" % (nodes,)
    res = run_python(prog, 10)
    assert res.ok, res.stderr
    assert res.stdout.split() == ["[True,", "True,", "True,", "True,", "True]", "True", "True", "16"], res.stdout
    assert {n: os.stat("/dev/" + n).st_mtime_ns for n in nodes} == before


def test_reading_files_outside_the_sandbox():
    """A world-readable file in a world-readable host directory, and the project's own data."""
    require_any(True, "minimal_root")
    d = world_dir()
    try:
        canary = d / "canary.txt"
        secret = secrets.token_hex(8)
        canary.write_text(secret)
        canary.chmod(0o644)
        reader = f"""
def leak():
    found = []
    for path in ({str(canary)!r}, {str(ROOT / "data" / "code_problems.jsonl")!r}, '/etc/shadow', '/etc/hostname'):
        try:
            found.append(open(path).read())
        except OSError:
            pass
    return '|'.join(found)
"""
        assert score(reader, [f"assert leak() == {secret!r}", f"assert {secret!r} in leak()"]) == 0.0
        res = run_python(reader + "\nprint(repr(leak()))", 10)
        assert res.ok and res.stdout.strip() == "''", res
        # the host's own account list stays out too: the program sees a two-line passwd
        res = run_python("print(open('/etc/passwd').read())", 10)
        assert res.ok and [line.split(":")[0] for line in res.stdout.split()] == ["root", "sandbox"]
    finally:
        canary.unlink(missing_ok=True)
        d.rmdir()


def test_writing_to_a_world_writable_host_directory():
    """Without the minimal root a sandbox uid may write into any 1777 directory of the host but /tmp,
    /var/tmp and /dev/shm; with it, no host directory is there to write to."""
    require_any(True, "minimal_root")
    d = world_dir()
    try:
        vandal = f"""
import os
def attack():
    done = []
    for path in ({str(d / "dropped")!r}, '/var/tmp/dropped', '/run/lock/dropped', '/usr/dropped', '/dropped'):
        try:
            with open(path, 'w') as f:
                f.write('x')
            done.append(path)
        except OSError:
            pass
    return done
"""
        assert score(vandal, ["assert attack() != []", "assert len(attack()) > 0"]) == 0.0
        res = run_python(vandal + "\nprint(attack())", 10)
        assert res.ok and res.stdout.strip() == "[]", res
        assert os.listdir(d) == []
        # the check can fail: the same program without the minimal root finds the directory writable
        weak = run_python(vandal + "\nprint(attack())", 10, minimal_root=False)
        assert str(d / "dropped") in weak.stdout
    finally:
        for f in d.iterdir():
            f.unlink()
        d.rmdir()


@pytest.mark.parametrize("namespaces", MODES)
def test_reading_other_processes_environments(namespaces):
    """Another host process holds a secret in its environment and its command line."""
    require_any(namespaces, "uid", "private_proc")
    token = secrets.token_hex(16)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", token],
                             env={**os.environ, "LOWMEM_OTHER_SECRET": token})
    try:
        snoop = """
import os
def leak(parts=('environ', 'cmdline')):
    out = []
    for pid in os.listdir('/proc'):
        for part in parts:
            try:
                with open('/proc/%s/%s' % (pid, part), 'rb') as f:
                    out.append(part + '=' + f.read().decode('latin-1'))
            except OSError:
                pass
    return '\\n'.join(out)
"""
        assert score(snoop, [f"assert {token!r} in leak(('environ',))"], namespaces=namespaces) == 0.0
        res = run_python(snoop + "\nprint(leak())", 10, namespaces=namespaces)
        assert res.ok and "cmdline=" in res.stdout          # it did read what it could
        environs = [line for line in res.stdout.split("\n") if line.startswith("environ=")]
        assert not any(token in e for e in environs)
        if "private_proc" in res.protections:
            # not even the command line: the process is not there (without a private /proc it is: weak mode)
            assert token not in res.stdout
            assert score(snoop, [f"assert {token!r} in leak()"], namespaces=namespaces) == 0.0
            pids = run_python("import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))", 10)
            # the program alone: nothing of the host, nor the namespace's init, which it may not trace (hidepid)
            assert pids.stdout.strip() == ("[2]" if "hidepid" in pids.protections else "[1, 2]")
    finally:
        other.kill()
        other.wait()


@pytest.mark.parametrize("namespaces", MODES)
def test_grandchild_in_its_own_session_outliving_the_run(namespaces):
    """A grandchild that leaves the process group and waits for the run to end, then writes into a
    world-writable host directory: it must be dead by then, and the directory untouched."""
    require_any(namespaces, "pidns", "uid")
    d = world_dir()
    try:
        late = d / "late"
        escape = f"""
import os, time
if os.fork() == 0:
    os.setpgid(0, 0)
    if os.fork() == 0:
        time.sleep(1.0)
        for path in ({str(late)!r}, '/tmp/late'):
            try:
                open(path, 'w').write('still alive')
            except OSError:
                pass
        time.sleep(60)
    os._exit(0)
def add(a, b):
    return a + b
"""
        assert score(escape, namespaces=namespaces) == 1.0    # the solution itself is right
        time.sleep(2.0)
        assert not late.exists()
        # no_leftovers checks that no process of the run is alive
    finally:
        for f in d.iterdir():
            f.unlink()
        d.rmdir()


def _sysv_ipc() -> set:
    found = set()
    for kind in ("shm", "msg", "sem"):
        with open(f"/proc/sysvipc/{kind}") as f:
            found |= {(kind, int(line.split()[1])) for line in list(f)[1:]}
    return found


def _remove_ipc(objects) -> None:
    import ctypes

    libc = ctypes.CDLL(None)
    for kind, ident in objects:   # IPC_RMID
        {"shm": libc.shmctl, "msg": libc.msgctl}.get(kind, lambda i, c, a: libc.semctl(i, 0, c))(ident, 0, None)


@pytest.mark.parametrize("namespaces", MODES)
def test_memory_outside_the_address_space_limit_and_ipc_left_behind(namespaces):
    """memfd_create with write(), and System V shared memory, message queues and semaphores, hold memory that
    RLIMIT_AS does not count (a process limited to 256 MiB held 1.9 GB in memfds); System V objects also
    outlived the run (256 MB of shm segments stayed on the host). The calls fail, and nothing is left."""
    require_any(namespaces, "seccomp", "netns")   # (an IPC namespace comes with the network namespace)
    hog = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
def hog():
    got = []
    try:
        fd = os.memfd_create('m')
        os.write(fd, b'x' * (8 << 20))
        got.append('memfd')
    except OSError:
        pass
    if libc.shmget(0, 64 << 20, 0o1600) >= 0:     # IPC_PRIVATE, IPC_CREAT | 0600, left behind
        got.append('shm')
    if libc.msgget(0, 0o1600) >= 0:
        got.append('msg')
    if libc.semget(0, 1000, 0o1600) >= 0:
        got.append('sem')
    return got
"""
    before = _sysv_ipc()
    try:
        res = run_python(hog + "print(hog())", 10, namespaces=namespaces, memory_mb=256)
        assert res.ok, res.stderr
        if "seccomp" in res.protections:
            assert res.stdout.strip() == "[]"
        assert score(hog, ["assert hog() == []"], namespaces=namespaces) == ("seccomp" in res.protections)
        assert _sysv_ipc() == before
    finally:
        _remove_ipc(_sysv_ipc() - before)


def test_kernel_keys_cannot_be_added():
    """Kernel keys are not namespaced: keys added to a uid's user keyring outlived the run (its fresh uid stayed
    in /proc/key-users with 20 KB of keys, for good). add_key, request_key and keyctl fail."""
    if os.uname().machine not in ("x86_64", "aarch64"):
        pytest.skip("the sandbox's seccomp filter is written for x86_64 and aarch64 only")
    prog = """
import ctypes, os, platform
nr = {'x86_64': 248, 'aarch64': 217}[platform.machine()]
libc = ctypes.CDLL(None, use_errno=True)
ok = libc.syscall(nr, b'user', b'kept', b'x' * 1000, 1000, -4) >= 0   # add_key(..., KEY_SPEC_USER_KEYRING)
print(ok, os.getuid())
"""
    res = run_python(prog, 10)
    added, uid = res.stdout.split()
    assert res.ok and added == "False", res
    with open("/proc/key-users") as f:
        assert uid not in [line.split(":")[0].strip() for line in f]


def test_no_user_namespace_inside_the_sandbox():
    """In a user namespace of its own a program holds every capability there: it mounted a tmpfs of 100 GB
    and wrote 1 GB into it in 4 s (past memory_mb and tmpfs_mb: all of the host's memory, at that pace), and
    reaches the kernel code meant for namespace admins. The minimal root is a chroot, which the kernel
    refuses a user namespace."""
    require_any(True, "minimal_root")
    prog = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(4, 1, 0, 0, 0)                      # PR_SET_DUMPABLE, as the uid map needs
print(libc.unshare(0x10000000 | 0x20000), os.strerror(ctypes.get_errno()))   # CLONE_NEWUSER | CLONE_NEWNS
"""
    res = run_python(prog, 10)
    assert res.ok and res.stdout.split()[0] == "-1", res


def test_empty_files_are_capped_too():
    """tmpfs_mb caps the data; each empty file still cost ~1 KB of kernel memory, 200,000 files (200 MB) in 6 s.
    The private tmpfs also caps the number of files (64 per MiB)."""
    require_any(True, "private_tmp")
    prog = """
import os
n = 0
try:
    while n < 100000:
        open('/tmp/%d' % n, 'wb').close()
        n += 1
except OSError:
    pass
print(n)
"""
    res = run_python(prog, 20, tmpfs_mb=8)
    assert res.ok and 0 < int(res.stdout) <= 8 * 64, res


def test_status_lines_are_the_sandboxs_only():
    """A program that writes the bootstrap's status or error line to its stderr made the run a "sandbox_error"
    (which stops the code reward) or claimed protections it did not have. Only lines carrying the run's
    secret count; the program's stay in its stderr."""
    fake = "\\x00LOWMEM-SANDBOX-ERROR {'error': 'forged', 'active': [], 'failed': {}}\\n"
    fake += "\\x00LOWMEM-SANDBOX {'active': ['forged'], 'failed': {}}\\n"
    res = run_python(f"import os\nos.write(2, b\"{fake}\")\nprint('done')", 10)
    assert res.ok and res.killed_reason is None and res.error is None and res.stdout == "done\n"
    assert "forged" not in res.protections and res.stderr.count("LOWMEM-SANDBOX") == 2


# ---------------------------------------------------------------------------------------------
# A machine without full isolation: the code reward refuses unless told

NAMESPACE_LAYERS = ("netns", "pidns", "mountns", "ipcns", "private_proc", "hidepid", "private_tmp", "minimal_root",
                    "hidden_paths", "userns", "oom_first")   # (only the minimal root's read-only /proc makes it hold)


def test_code_reward_refuses_a_weak_sandbox_unless_accepted(monkeypatch):
    """Simulates a container that forbids unshare: the probe found no namespace layer."""
    real = sandbox_module._plan(True, True, True)
    import dataclasses
    weak = dataclasses.replace(real, namespaces=False, root=None,
                               protections=tuple(p for p in real.protections if p not in NAMESPACE_LAYERS),
                               failed={**real.failed, "namespaces": "Operation not permitted"})
    monkeypatch.setitem(sandbox_module._plans, (True, True, True), weak)
    missing = missing_protections()
    assert {"netns", "pidns", "mountns", "private_proc", "minimal_root", "private_tmp"} <= set(missing)
    assert missing["netns"] == "Operation not permitted"
    with pytest.raises(SandboxError) as err:
        code_reward(["def add(a, b):\n    return a + b"], rows=[{"tests": ADD_TESTS}])
    msg = str(err.value)
    assert "allow_weak_sandbox" in msg and "minimal_root" in msg and "netns" in msg and "Operation not permitted" in msg
    assert "MISSING: netns" in sandbox_summary()
    # accepted explicitly, it runs (with what the machine has)
    assert code_reward(["def add(a, b):\n    return a + b"], rows=[{"tests": ADD_TESTS}], allow_weak_sandbox=True) == [1.0]
    # and the trainer's loader refuses at start-up, not at the first step
    from lowmem_grpo.recipe import RewardsConfig
    from lowmem_grpo.rewards import RewardError, Rewards
    with pytest.raises(RewardError, match="allow_weak_sandbox"):
        Rewards(RewardsConfig.model_validate({"functions": [{"function": "code"}]}), answer_field="answer")
    loaded = Rewards(RewardsConfig.model_validate(
        {"functions": [{"function": "code_binary", "kwargs": {"allow_weak_sandbox": True}}]}), answer_field="answer")
    assert loaded.notes and "MISSING" in loaded.notes[0]


def test_a_root_that_cannot_be_built_is_reported_and_refused(monkeypatch):
    """If the minimal root fails on this machine (here: a path to bind that does not exist), the probe says
    why, runs fall back to the weaker tree, and the code reward refuses until that is accepted."""
    require_any(True, "minimal_root")
    real = sandbox_module._root_layout

    def broken(python):
        layout = dict(real(python))
        layout["binds"] = layout["binds"] + [["/nonexistent-lowmem-sandbox", "dir"]]
        return layout

    monkeypatch.setattr(sandbox_module, "_root_layout", broken)
    monkeypatch.setattr(sandbox_module, "_plans", {})
    info = sandbox_info()
    assert "minimal_root" not in info["protections"] and "netns" in info["protections"]
    assert "nonexistent-lowmem-sandbox" in info["unavailable"]["minimal_root"]
    assert set(missing_protections()) == {"minimal_root"}
    res = run_python("import os\nprint(os.path.isdir('/usr/lib'))", 10)
    assert res.ok and "minimal_root" not in res.protections
    with pytest.raises(SandboxError, match="minimal_root .*nonexistent-lowmem-sandbox.*allow_weak_sandbox"):
        code_reward(["def add(a, b):\n    return a + b"], rows=[{"tests": ADD_TESTS}])


def test_switching_a_layer_off_counts_as_weak():
    with pytest.raises(SandboxError, match="namespaces: false"):
        code_reward(["def add(a, b):\n    return a + b"], rows=[{"tests": ADD_TESTS}], namespaces=False)
    require_any(True, "minimal_root")
    assert missing_protections() == {}
    line = sandbox_summary()
    assert "minimal_root" in line and "MISSING" not in line


@pytest.mark.parametrize("autogroup, cgroup, weighted, why", [
    ("1\n", "0::/\n", (), None),                                               # the root cgroup (v2)
    ("1\n", "4:memory:/x\n1:cpu,cpuacct:/\n0::/\n", (), None),                  # v1's cpu controller at its root
    ("1\n", "0::/user.slice/user-1000.slice/session-2.scope\n", (), None),      # no cpu controller on the way
    ("1\n", "1:cpu,cpuacct:/docker/abc\n0::/\n", (), "cpu cgroup /docker/abc"),   # docker on cgroup v1
    ("1\n", "0::/user.slice/user-1000.slice/session-2.scope\n", ("/user.slice",), "cpu cgroup /user.slice/"),
    ("1\n", "0::/kubepods/pod1/c2\n", ("/kubepods/pod1/c2",), "cpu cgroup /kubepods"),
    ("1\n", "0::/\n", ("/",), "container's cpu cgroup"),                           # a cgroup namespace's root
    ("0\n", "0::/\n", (), "sched_autogroup_enabled is '0'"),                       # noautogroup, or the sysctl
    (None, "0::/\n", (), "no autogroup"),                                         # CONFIG_SCHED_AUTOGROUP off
])
def test_the_fair_cpu_probe_says_where_autogroup_does_not_apply(autogroup, cgroup, weighted, why):
    """Found by a red team: that a program with many processes cannot starve the one judged beside it rests on the
    kernel's autogroup (one session per run, an equal share per session), which applies only with
    kernel.sched_autogroup_enabled = 1 and in the root cpu cgroup. The probe says where it does not."""
    got = sandbox_module.fair_cpu_missing(autogroup, cgroup, lambda path: path in weighted)
    assert got is None if why is None else why in got


def test_the_start_up_line_says_when_the_cpu_is_not_shared_fairly(monkeypatch):
    monkeypatch.setattr(sandbox_module, "_fair_cpu", [None])
    assert "fair CPU" not in sandbox_summary()
    monkeypatch.setattr(sandbox_module, "_fair_cpu", ["kernel.sched_autogroup_enabled is '0'"])
    line = sandbox_summary()
    assert "no fair CPU share between runs (kernel.sched_autogroup_enabled is '0')" in line and "workers: 1" in line


def test_probe_reports_layers():
    info = sandbox_info()
    assert info["python"] and os.path.isabs(info["python"])
    assert {"rlimit:cpu", "rlimit:as", "rlimit:fsize", "no_new_privs"} <= set(info["protections"])
    if os.geteuid() == 0 and "uid" not in info["protections"]:
        assert "uid" in info["unavailable"]
    run = run_tests("def f():\n    return 1", ["assert f() == 1"])
    assert run.passed == [True] and set(info["protections"]) <= set(run.sandbox.protections)


@pytest.mark.skipif(os.geteuid() != 0, reason="the uid drop only exists for root")
def test_root_never_falls_back_to_running_programs_as_root(tmp_path, monkeypatch):
    """If the sandbox uid cannot run any interpreter, the sandbox refuses instead of keeping root."""
    from lowmem_grpo.rewards import sandbox

    if sandbox_info()["uid_range"] is None:
        pytest.skip("no unprivileged uid available")
    private = tmp_path / "private"          # pytest's tmp dirs are 0700: the sandbox uid cannot enter
    private.mkdir(mode=0o700)
    (private / "python3").symlink_to(sandbox_info()["python"])
    monkeypatch.setattr(sandbox, "_plans", {})
    monkeypatch.setattr(sandbox, "_interpreter_candidates", lambda: [str(private / "python3")])
    with pytest.raises(sandbox.SandboxError, match="drop_privileges=False"):
        run_python("print('ran as root')", 10)
    assert run_python("import os\nprint(os.getuid())", 10, drop_privileges=False).stdout.strip() == "0"


def test_the_tests_docs_sandbox_md_names_exist():
    """docs/sandbox.md maps each layer to the tests that show it: those tests must exist."""
    import re

    doc = (ROOT / "docs" / "sandbox.md").read_text()
    named = set(re.findall(r"(tests/test_\w+\.py)::(test_\w+)", doc))
    named |= {("tests/test_sandbox.py", n) for n in re.findall(r"`(test_\w+)`", doc)}
    assert len(named) > 20
    for path, name in sorted(named):
        assert f"def {name}(" in (ROOT / path).read_text(), f"{path}::{name}"


@pytest.mark.parametrize("namespaces", MODES)
def test_setsid_message_queues_and_xattrs_are_denied_and_the_program_dies_first(namespaces):
    """Found by a red team: 28 spinning processes, each in a session of its own (the scheduler shares the CPU
    between sessions), starved the honest program judged beside them into a timeout; a POSIX message queue and an
    extended attribute on the case's directory carried state from one stdin/stdout case to the next. setsid,
    mq_open and setxattr fail now; and the program's oom_score_adj is 1000, so that the kernel's out-of-memory
    killer takes it, not the trainer."""
    if os.uname().machine not in ("x86_64", "aarch64"):
        pytest.skip("the sandbox's seccomp filter is written for x86_64 and aarch64 only")
    prog = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
got = []
child = os.fork()   # (not a process group leader, which setsid refuses anyway)
if child == 0:
    try:
        os.setsid()
        os._exit(0)
    except OSError:
        os._exit(1)
if os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) == 0:
    got.append('setsid')
if libc.mq_open(b'/carry', os.O_RDWR | os.O_CREAT, 0o600, None) >= 0:
    got.append('mq_open')
try:
    os.setxattr('.', 'user.carry', b'1')
    got.append('setxattr')
except OSError:
    pass
print(got, open('/proc/self/oom_score_adj').read().strip())
"""
    res = run_python(prog, 10, namespaces=namespaces)
    assert res.ok, res.stderr
    assert "seccomp" in res.protections, res.protections
    assert res.stdout.split() == ["[]", "1000"], res.stdout


@pytest.mark.parametrize("namespaces", MODES)
def test_the_program_cannot_lower_its_oom_score(namespaces):
    """Found by a red team: without CAP_SYS_RESOURCE (this machine's root lacks it) the kernel records no floor
    for oom_score_adj, and the program wrote 0 back, for itself and what it started, while "oom_first" was listed
    as active. The minimal root's /proc is read-only now; elsewhere the value is a hint, not a protection."""
    if namespaces:
        require_any(True, "minimal_root")
    prog = """
import os
try:
    open('/proc/self/oom_score_adj', 'w').write('0')
    wrote = True
except OSError:
    wrote = False
pid = os.fork()
if pid == 0:
    os._exit(int(open('/proc/self/oom_score_adj').read()) == 1000)
print(wrote, open('/proc/self/oom_score_adj').read().strip(), os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""
    res = run_python(prog, 10, namespaces=namespaces)
    assert res.ok, res.stderr
    if namespaces:
        assert "oom_first" in res.protections, res.unavailable
        assert res.stdout.split() == ["False", "1000", "1"], res.stdout
    else:   # the host's /proc: listed as unavailable, with the reason
        assert "oom_first" not in res.protections and "lower it" in res.unavailable["oom_first"]


@pytest.mark.parametrize("namespaces", MODES)
def test_a_program_changes_only_its_own_limits_and_priority(namespaces):
    """Found by a red team: a process may change the rlimits, nice value, CPU affinity and scheduling of another
    of its uid (prlimit, setpriority, sched_setaffinity, ...). A stdin/stdout case's fork changed its parent's,
    the relay's (code_io), which every later case inherited. The calls now act on the caller only; on itself a
    program keeps them (setrlimit, os.nice, sched_setaffinity(0)), and it may not raise its priority."""
    if os.uname().machine not in ("x86_64", "aarch64"):
        pytest.skip("the sandbox's seccomp filter is written for x86_64 and aarch64 only")
    prog = """
import ctypes, errno, multiprocessing, os, platform, resource, threading
libc = ctypes.CDLL(None, use_errno=True)
R = resource.RLIMIT_STACK
def state():
    return resource.getrlimit(R), os.getpriority(os.PRIO_PROCESS, 0), os.sched_getaffinity(0)
before = state()
child = os.fork()
if child == 0:
    ppid, refused = os.getppid(), []
    for call in (lambda: resource.prlimit(ppid, R, (1 << 20, resource.getrlimit(R)[1])),
                 lambda: os.setpriority(os.PRIO_PROCESS, ppid, 5),
                 lambda: os.setpriority(os.PRIO_USER, 0, 6),      # every process of the uid
                 lambda: os.setpriority(os.PRIO_PGRP, 0, 7),
                 lambda: os.sched_setaffinity(ppid, {0}),
                 lambda: os.sched_setscheduler(ppid, os.SCHED_IDLE, os.sched_param(0)),
                 lambda: os.sched_setparam(ppid, os.sched_param(0))):
        try:
            call()
            refused.append(False)
        except OSError as exc:
            refused.append(exc.errno == errno.EPERM)
    nr = {'x86_64': 251, 'aarch64': 30}[platform.machine()]   # ioprio_set(IOPRIO_WHO_PROCESS, ppid, idle)
    refused.append(libc.syscall(nr, 1, ppid, 3 << 13) == -1 and ctypes.get_errno() == errno.EPERM)
    os._exit(0 if all(refused) else 1 + refused.index(False))
print(os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]), state() == before)
resource.setrlimit(R, (1 << 20, resource.getrlimit(R)[1]))
os.nice(1)
os.sched_setaffinity(0, os.sched_getaffinity(0))
t = threading.Thread(target=print, args=('thread',))
t.start(); t.join()
p = multiprocessing.Process(target=print, args=('process',))
p.start(); p.join()
try:
    os.nice(-1)
    raised = True
except OSError:
    raised = False
print(state()[:2] == ((1 << 20, before[0][1]), 1), resource.getrlimit(resource.RLIMIT_NICE),
      resource.getrlimit(resource.RLIMIT_RTPRIO), raised)
"""
    res = run_python(prog, 20, namespaces=namespaces)
    assert res.ok, res.stderr
    assert {"seccomp", "rlimit:nice", "rlimit:rtprio"} <= set(res.protections), res.protections
    assert res.stdout.splitlines() == ["0 True", "thread", "process", "True (0, 0) (0, 0) False"], res.stdout


# ---------------------------------------------------------------------------------------------
# Time limits under load (docs/sandbox.md): run_python's load_allowance, for the Python tool and
# code_io.run_cases_separately

def test_the_run_clock_adds_up_the_waiting_of_the_runs_processes(monkeypatch):
    """The deadline of one run_python call, from injected readings: the bootstrap, init and the program run one
    after another, so their waiting for a CPU adds up; a process gone keeps what it waited; never more than
    load_allowance x the limit; load_allowance 1 is the plain wall clock; without namespaces the bootstrap execs
    into the program, and a child the program forks is not counted."""
    waits = {10: 1e8, 11: 2e8, 12: 5e8, 13: 7e9}
    children = {10: 11, 11: 12, 12: 13}
    monkeypatch.setattr(sandbox_module, "_waited", lambda pid: waits.get(pid))
    monkeypatch.setattr(sandbox_module, "_first_child", lambda pid: children.get(pid))

    def clock(load, namespaces=True):
        c = sandbox_module._RunClock(1.0, load, 100.0)
        c.follow(10, namespaces)
        return c

    loaded = clock(3.0)
    assert loaded.end() == pytest.approx(101.8)            # 1 s + 0.1 + 0.2 + 0.5 s waited; not 13's 7 s
    del waits[11]
    waits[12] = 9e8
    assert loaded.end() == pytest.approx(102.2)            # init gone: its 0.2 s still counted
    waits[12] = 1e10
    assert loaded.end() == pytest.approx(103.0)            # at most 3 x 1 s
    waits.update({11: 2e8, 12: 5e8})
    assert clock(3.0, namespaces=False).end() == pytest.approx(101.1)   # the bootstrap is the program
    assert clock(1.0).end() == pytest.approx(101.0)
    del waits[10]
    assert clock(3.0, namespaces=False).end() == pytest.approx(101.0)   # nothing readable: nothing forgiven


@pytest.mark.parametrize("namespaces", MODES)
def test_a_run_waiting_for_the_cpu_gets_more_time_up_to_its_allowance(monkeypatch, namespaces):
    """The parent reads the run's waiting and moves its deadline (injected here: every process of the run claims
    2 s of waiting, so no real contention is needed): a program sleeping 1.5 s of a 1 s limit passes with
    load_allowance=3, not without; the deadline still comes, at 3 x the limit."""
    monkeypatch.setattr(sandbox_module, "_waited", lambda pid: 2 * 10 ** 9)
    sleeper = "import time\ntime.sleep(1.5)\nprint('done')"
    assert run_python(sleeper, 1.0, namespaces=namespaces).killed_reason == "timeout"
    res = run_python(sleeper, 1.0, namespaces=namespaces, load_allowance=3)
    assert res.ok and res.stdout == "done\n", res
    res = run_python("import time\ntime.sleep(60)", 1.0, namespaces=namespaces, load_allowance=3)
    assert res.killed_reason == "timeout" and res.duration_s < 30
    with pytest.raises(ValueError, match="load_allowance must be a number >= 1"):
        run_python(sleeper, 1.0, load_allowance=0.5)


@pytest.mark.parametrize("namespaces", MODES)
def test_sleeping_and_looping_still_time_out_at_the_limit_with_an_allowance(namespaces):
    """Real readings: sleeping is no waiting for a CPU, so a program sleeping past its limit is stopped there even
    with a tenfold allowance; a loop is stopped at about its limit of CPU time, by the deadline, before RLIMIT_CPU
    (the limit rounded up, plus 1 s) would."""
    res = run_python("import time\ntime.sleep(4)\nprint('late')", 1.0, namespaces=namespaces, load_allowance=10)
    assert res.killed_reason == "timeout" and "late" not in res.stdout, res
    res = run_python("while True:\n    pass", 1.0, namespaces=namespaces, load_allowance=10)
    assert res.killed_reason == "timeout", res


def test_a_tool_call_waiting_for_the_cpu_is_not_a_timeout(monkeypatch):
    """Found by a red team: the Python tool's timeout_s was wall-clock time, so a call needing 0.4 s of CPU under
    timeout_s=1, next to two busy processes on its CPU, timed out every time (and so did each stdin/stdout case of
    code_io.run_cases_separately). Now its limit is the wall clock less what the run waited for a CPU, up to
    LOAD_ALLOWANCE x timeout_s (raised here to stay far from it on a loaded machine)."""
    from lowmem_grpo.environment import PythonTool
    from lowmem_grpo.rewards import code_io

    burn = "import time\nt = time.thread_time()\nwhile time.thread_time() - t < 0.4:\n    pass\nprint('done')\n"
    call = f"<python>{burn}</python>"
    io_cases = [("", "done\n")]
    with one_cpu_shared_with(2):
        tool = PythonTool(timeout_s=1.0)
        tool.load_allowance = 1.0   # the plain wall clock, as before
        monkeypatch.setattr(code_io, "LOAD_ALLOWANCE", 1.0)
        assert "timed out" in tool.step(call)[0] and tool.counters()["tool_timeouts"] == 1
        assert code_io.run_cases_separately(burn, io_cases, timeout=1.0) == [False]
        tool.load_allowance = 10.0
        monkeypatch.setattr(code_io, "LOAD_ALLOWANCE", 10.0)
        obs, _, _ = tool.step(call)
        separately = code_io.run_cases_separately(burn, io_cases, timeout=1.0)
    assert obs == "<output>\ndone\n</output>" and tool.counters()["tool_timeouts"] == 1, obs
    assert separately == [True]


def _runs_main_py(process) -> bool:
    try:
        return "main.py" in process.cmdline()
    except psutil.Error:   # gone, or a zombie
        return False


def _stop_a_trainer_during_a_run(program: str, namespaces: bool, sig, started_enough) -> tuple[list, str]:
    """A trainer (a Python process) whose daemon thread runs `program` in the sandbox (as rollout/turns.py runs an
    environment's step), stopped by `sig` once started_enough(its descendants) holds; then waited for (20 s) until
    none of those descendants lives. Returns (the descendants that did, the run's directory)."""
    # (the probe runs programs of its own, main.py too: done before the run the test stops)
    script = ("import signal, threading\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
              "from lowmem_grpo.rewards.sandbox import run_python, sandbox_info\n"
              f"sandbox_info(namespaces={namespaces!r})\nprint('probed', flush=True)\n"
              f"threading.Thread(target=run_python, args=({program!r}, 200), "
              f"kwargs={{'namespaces': {namespaces!r}}}, daemon=True).start()\n"
              "threading.Event().wait()\n")
    trainer = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True)
    started = []
    try:
        assert trainer.stdout.readline() == "probed\n", "the trainer did not start"
        deadline = time.monotonic() + 60
        while not started_enough(started):
            assert time.monotonic() < deadline and trainer.poll() is None, "the sandboxed program did not start"
            time.sleep(0.05)
            with contextlib.suppress(psutil.Error):
                started = psutil.Process(trainer.pid).children(recursive=True)
        # the run's directory: its bootstrap's working directory (other tests' runs may have theirs meanwhile)
        [workdir] = {p.cwd() for p in started if p.ppid() == trainer.pid}
        assert os.path.basename(workdir).startswith("lowmem-sandbox-"), workdir
        time.sleep(0.3)   # (what the program does right after it starts: a fork's setpgid)
        trainer.send_signal(sig)
        trainer.wait(60)
    finally:
        trainer.kill()
        trainer.wait()
        trainer.stdout.close()
    deadline = time.monotonic() + 20
    while _live(started) and time.monotonic() < deadline:
        time.sleep(0.05)
    return started, workdir


@pytest.mark.parametrize("namespaces", MODES)
def test_a_trainer_stopped_during_a_run_leaves_nothing_running(namespaces):
    """Found by a red team: Ctrl-C during a Python tool call (its run on a daemon thread, as rollout/turns.py runs an
    environment's step) ended the trainer, and the run's bootstrap, init and program went on (a program sleeping
    for ever would never end), its directory left in /tmp for good. The bootstrap now dies with the trainer, and
    each of the others with the one before it; at the interpreter's exit the runs under way are killed and their
    directories removed. A trainer killed outright (SIGKILL) runs no exit handler: its run's processes die with it,
    the directory stays."""
    import shutil
    import signal

    for sig in (signal.SIGINT, signal.SIGKILL):
        started, workdir = _stop_a_trainer_during_a_run("import time\ntime.sleep(300)", namespaces, sig,
                                                        lambda procs: any(_runs_main_py(p) for p in procs))
        assert not _live(started), (sig, [(p.pid, p.name()) for p in _live(started)])
        if sig == signal.SIGKILL:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            assert not os.path.exists(workdir), workdir


def test_a_trainer_stopped_during_a_run_also_ends_what_left_the_runs_process_group():
    """Found by a review: without a PID namespace the exit cleanup only killed the run's process group, where the
    run's own end also kills every process of its uid: a program's child that called setpgid(0, 0) (no parent-death
    signal reaches it) outlived the trainer's Ctrl-C. Needs the uid layer (the cleanup finds such a child by it)."""
    import signal

    require_any(False, "uid")
    program = "import os, time\nif os.fork() == 0:\n    os.setpgid(0, 0)\ntime.sleep(300)\n"
    # the program and its child, which left the group
    started, _ = _stop_a_trainer_during_a_run(program, False, signal.SIGINT,
                                              lambda procs: sum(_runs_main_py(p) for p in procs) >= 2)
    assert not _live(started), [(p.pid, p.name()) for p in _live(started)]
