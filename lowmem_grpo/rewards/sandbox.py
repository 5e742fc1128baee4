"""Run untrusted Python (model completions) in a throw-away, resource-limited child process.

Code rewards execute whatever the policy wrote. During RL the policy is *searching* for high reward, so
sooner or later it produces infinite loops, fork bombs, multi-GB allocations, endless prints, code
that deletes files or kills its parent. None of that may stop or damage the trainer. `run_python`
runs one program and always comes back with a `SandboxResult`, leaving no process behind.

How one run works (see docs/sandbox.md for what each layer does and does not protect against):

* The parent writes the program to a fresh `tempfile.mkdtemp` directory and starts a small *bootstrap*
  (`python -I -S -c _BOOTSTRAP`) there, in its own session/process group, with an environment reduced
  to PATH/LANG (no variable of the parent reaches the program; the program's adds MALLOC_ARENA_MAX=2).
* The bootstrap, best effort and in this order:
  - PR_SET_PDEATHSIG=SIGKILL: it dies with the trainer, and with it init and the program (each has its own
    parent-death signal), so that a trainer stopped during a run (Ctrl-C, kill) leaves nothing running;
  - oom_score_adj 1000 (the out-of-memory killer takes the program before the trainer), inherited by all
    that follows. Without CAP_SYS_RESOURCE the kernel keeps no floor: only the minimal root's read-only
    /proc stops the program writing 0 back, so only there is it reported as the protection "oom_first";
  - `unshare(CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC)` through libc (_ctypes; Python 3.11
    has no os.unshare). As root this needs no user namespace; as an ordinary user it retries with
    CLONE_NEWUSER. A new network namespace has only a loopback device that is down: no network at all,
    not even 127.0.0.1; System V IPC objects live and die with the run's own IPC namespace.
  - forks an "init", PID 1 of the new PID namespace, which builds the program's *minimal root*: a tmpfs
    mounted over the run's directory holding read-only binds of only what the interpreter needs (the
    interpreter, its sys.path, the directories of the libraries and data files it maps; `_root_layout`
    finds them once per interpreter), the host's symlinks on the way to them, a minimal /dev (null, zero,
    full, random, urandom: read-only binds, so that their host inodes' times stay unchanged), a fresh
    read-only /proc mounted hidepid=2 (other processes and their environments become invisible, and so does any
    process the program may not ptrace: a non-dumpable one, init),
    size-capped tmpfs /tmp and /dev/shm, a two-line /etc/passwd; the program is copied to /tmp/sandbox;
    then it pivot_roots into it, detaches the host's tree (nothing else of the host is reachable) and
    chroots into the tree's directory (a chrooted process may not create a user namespace).
    (With minimal_root=False, or where that fails and the weaker mode was accepted: the host's tree,
    with private /proc, /tmp, /var/tmp, /dev/shm, and hide_paths under empty tmpfs.) Init forks the
    program (PID 2) and waits for it, reaping orphans. When init exits — after the program, or killed
    with the bootstrap through PR_SET_PDEATHSIG — the kernel kills every process left in the namespace,
    including ones that called setsid(). (The program is not PID 1 itself: PID 1 ignores signals it has
    no handler for, RLIMIT_CPU's SIGXCPU among them.)
  - in the program's process: rlimits RLIMIT_CPU, RLIMIT_AS (memory), RLIMIT_FSIZE (largest file),
    RLIMIT_NOFILE, RLIMIT_CORE=0, RLIMIT_NPROC (processes and threads), RLIMIT_NICE=RLIMIT_RTPRIO=0;
  - when started as root: drops to an unprivileged uid/gid drawn at random per run from a reserved
    range (no supplementary groups). Root ignores RLIMIT_NPROC and may write anywhere; the unprivileged
    uid makes NPROC bite, makes the host's files read-only (or unreadable) to the program, forbids
    signalling the trainer, and — being unique to the run — lets the parent kill every process of that
    uid afterwards even without a PID namespace;
  - PR_SET_NO_NEW_PRIVS (no privilege gain through setuid binaries), a seccomp filter denying a few
    system calls (kernel keys; memfd_create and System V IPC, which hold memory RLIMIT_AS does not count;
    setsid, which would give a process its own share of the CPU; POSIX message queues and extended
    attributes, state that outlives a process) and limiting prlimit, setpriority, the sched_set* calls and
    ioprio_set to the calling process, PR_SET_PDEATHSIG=SIGKILL (the program dies with its parent);
  - execs `python -I -S -B main.py`.
* The bootstrap's status line (on stderr, before the exec) carries a per-run secret from its environment,
  so that the program cannot write one.
* The parent reads stdout/stderr incrementally with a byte cap, enforces the time limit (wall-clock; with
  load_allowance, less the time the run's processes waited for a CPU: `_RunClock`), and
  at the end *always* SIGKILLs the whole process group (and, without a PID namespace, every process of
  the run's uid), then deletes the directory; at the interpreter's exit, so do the runs still under way
  (`_end_runs_at_exit`: a run on a daemon thread never reaches its own cleanup).

Which of these layers are available depends on the machine (containers often forbid unshare; only root
can change uid). They are probed once per process (`sandbox_info()`), every run then *requires* the
layers the probe found (a run never silently gets weaker isolation than the probe reported), and each
`SandboxResult.protections` lists what was active for that run.

The code reward requires the full set (`FULL_ISOLATION`, and `uid` as root) unless told otherwise
(`missing_protections`, `sandbox_summary`). This is damage control for buggy and reward-hacking
programs, not a security boundary against a determined attacker: the seccomp filter denies only a few system
calls and the kernel is shared; see docs/sandbox.md.
"""

from __future__ import annotations

import ast
import atexit
import json
import marshal
import os
import random
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Optional, Union

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_MEMORY_MB = 1024
DEFAULT_FILE_SIZE_MB = 10
DEFAULT_MAX_PROCS = 32
DEFAULT_MAX_OPEN_FILES = 256
DEFAULT_OUTPUT_BYTES = 1 << 20      # per stream
DEFAULT_TMPFS_MB = 64

# Unprivileged uids handed to sandboxed programs when we are root: one drawn at random per run from
# [SANDBOX_UID_BASE, SANDBOX_UID_BASE + SANDBOX_UID_SPAN). Far above any real account, so no file on
# the host belongs to it, and unique per run, so RLIMIT_NPROC and the final "kill every process of this
# uid" sweep concern this run only.
SANDBOX_UID_BASE = 0x70000000
SANDBOX_UID_SPAN = 1 << 20
NOBODY_UID = 65534

_STATUS_MARK = b"\x00LOWMEM-SANDBOX "
_ERROR_MARK = b"\x00LOWMEM-SANDBOX-ERROR "
_STATUS_ALLOWANCE = 16384   # room for the status lines on stderr, on top of max_output_bytes
_MIN_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
            "HOME": "/nonexistent", "TMPDIR": "/tmp"}
# The program's environment adds one setting: glibc's malloc gives each thread that allocates an arena of its own, up to
# 8 per CPU, and each reserves 64 MiB of address space, which RLIMIT_AS counts whether used or not. 20 threads holding
# 100 KB each could not start under memory_mb=1024 (found by a red team: "can't start new thread", ~25 MB in use);
# with 2 arenas such a program peaks at ~250 MB.
_PROGRAM_ENV = {**_MIN_ENV, "MALLOC_ARENA_MAX": "2"}


# Time limits under load (docs/sandbox.md): a limit is wall-clock time less the time the program waited for a CPU, up
# to LOAD_ALLOWANCE x the limit, so that a machine loaded by the trainer or by the programs run beside it does not
# turn a correct program into a timeout (found by a red team: a program needing 0.6 s of a 1 s limit, next to two
# busy processes, failed every run).
LOAD_ALLOWANCE = 3.0

# The step clock, as source text: the harnesses that run inside the sandbox (code.py's reporter, code_io's relay)
# define it in their own program (code.HARNESS_COMMON), and run_python's parent uses it too (_RunClock): one
# definition. Needs `os` and `time`.
STEP_CLOCK = r"""
def waited(pid):
    # nanoseconds the main thread of process `pid` ("self": this one) has spent runnable but waiting for a CPU
    # (/proc/<pid>/schedstat, second field); None where that cannot be read (gone, hidden from us: not dumpable)
    try:
        fd = os.open("/proc/%s/schedstat" % (pid,), os.O_RDONLY)
        try:
            return int(os.read(fd, 256).split()[1])
        finally:
            os.close(fd)
    except (OSError, ValueError, IndexError):
        return None


class Clock:
    # A step's time limit, taken now: `limit` seconds of the wall clock, plus the time that the program's process
    # `pid` (its main thread) spends waiting for a CPU from now on, so that a loaded machine does not fail a program
    # that needs less than `limit`; never more than `load` x `limit` in all. Only the program's: the harness's own
    # waiting, while it polls (the relay wakes every 50 ms), overlaps the program's running and waiting (0.8 s of 5.4 s
    # beside a spinning case): added, a case needing 0.9 s of a 0.6 s limit would pass under load. What cannot be read
    # is not forgiven (a program that hides its waiting gets the plain wall clock). `pid` None: a process forked after
    # the start, set with fresh().
    def __init__(self, limit, load, pid):
        self.start = time.monotonic()
        self.limit, self.most = limit, limit * max(load, 1.0)
        self.pid = pid
        self.base = None if pid is None else self.waiting()
        self.forgiven = 0.0

    def waiting(self):
        # nanoseconds the program has waited for a CPU so far, or None
        return waited(self.pid)

    def fresh(self, pid):
        # the program's process, forked since the start: its waiting starts at 0
        self.pid, self.base = pid, 0

    def refresh(self):
        now = None if self.pid is None else self.waiting()
        if now is None:   # (gone: what was read before stays)
            return
        if self.base is None:   # (not readable when the step started: from the first reading on)
            self.base = now
        self.forgiven = max(self.forgiven, (now - self.base) / 1e9)

    def end(self, refresh=True):
        # when the step's time runs out, on time.monotonic()'s clock
        if refresh:
            self.refresh()
        return self.start + min(self.limit + self.forgiven, self.most)

    def left(self, slack=0.0):
        # seconds left before end() + slack; the waiting is read again only once the time seems to have run out
        # (and then at most every 10 ms)
        left = self.end(False) + slack - time.monotonic()
        if left <= 0:
            left = self.end() + slack - time.monotonic()
            if left > 0:
                left = max(left, 0.01)
        return left
"""
_step_clock: dict = {"os": os, "time": time}
exec(compile(STEP_CLOCK, "<STEP_CLOCK>", "exec"), _step_clock)
Clock, _waited = _step_clock["Clock"], _step_clock["waited"]


class SandboxError(RuntimeError):
    """The sandbox itself could not be set up (not the program's fault)."""


@dataclass(frozen=True)
class SandboxResult:
    returncode: Optional[int]       # exit status; negative: killed by that signal (as subprocess reports it)
    stdout: str                     # at most max_output_bytes of it, decoded UTF-8 (errors replaced)
    stderr: str
    timed_out: bool                 # its time limit passed and the program was killed (run_python's timeout_s)
    killed_reason: Optional[str]    # None, "timeout", "output_limit", "cpu_limit", "signal:NAME", "sandbox_error"
    duration_s: float = 0.0
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    protections: tuple = ()         # the layers that were active for this run, e.g. ("netns", "uid", ...)
    error: Optional[str] = None     # set with killed_reason == "sandbox_error"
    unavailable: dict = field(default_factory=dict, compare=False)  # layer -> why it could not be set up

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.killed_reason is None


class SandboxLimits(BaseModel):
    """The limits and isolation switches of one run, declared once: run_python's options, and the code
    rewards' sandbox options in a recipe (whose schema extends this one)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    memory_mb: int = Field(DEFAULT_MEMORY_MB, ge=1, description="RLIMIT_AS (address space) of each process, in MiB.")
    file_size_mb: int = Field(DEFAULT_FILE_SIZE_MB, ge=0, description="RLIMIT_FSIZE: the largest file the program may write, in MiB.")
    max_procs: int = Field(DEFAULT_MAX_PROCS, ge=1, description="RLIMIT_NPROC: processes and threads of the sandbox uid.")
    max_open_files: int = Field(DEFAULT_MAX_OPEN_FILES, ge=1, description="RLIMIT_NOFILE: open file descriptors per process.")
    max_output_bytes: int = Field(
        DEFAULT_OUTPUT_BYTES, ge=1, description="Output kept per stream (stdout, stderr); past it the program is killed.")
    cpu_s: Optional[int] = Field(
        None, ge=1, description="RLIMIT_CPU in seconds; null: the wall-clock limit rounded up, plus 1 (the wall clock normally strikes first).")
    tmpfs_mb: int = Field(DEFAULT_TMPFS_MB, ge=1, description="Size of each private tmpfs (/tmp, /dev/shm; and /var/tmp without the minimal root) when namespaces are available, in MiB.")
    hide_paths: Optional[list[str]] = Field(
        None, description="Without the minimal root (minimal_root: false): directories covered by an empty read-only "
        "tmpfs; null: the working directory, /home and /root. System directories and the interpreter's are never hidden.")
    namespaces: bool = Field(True, description="Use network/mount/PID namespaces when the machine allows; false skips that layer.")
    minimal_root: bool = Field(
        True, description="With namespaces: run in a read-only root holding only the interpreter, the libraries and "
        "files it needs, a minimal /dev, a private /proc and /tmp; false: the host's tree, minus hide_paths.")
    drop_privileges: bool = Field(True, description="When started as root, run as a fresh unprivileged uid; false skips that layer.")

    @classmethod
    def of(cls, base: Optional["SandboxLimits"] = None, **overrides) -> "SandboxLimits":
        """`base` (default: the defaults) with `overrides` by field name; an unknown name is a TypeError."""
        unknown = sorted(set(overrides) - set(cls.model_fields))
        if unknown:  # a misspelt limit must not silently leave the default in place
            raise TypeError(f"unknown sandbox option(s) {', '.join(unknown)}; allowed: {', '.join(cls.model_fields)}")
        if not overrides:
            return base or cls()
        return cls.model_validate({**(base.model_dump() if base else {}), **overrides})


# --------------------------------------------------------------------------------------------------
# The bootstrap: runs with the parent's privileges (often root), sets up the isolation, execs the program.
# Kept free of anything but the standard library; it is run with `python -I -S`.
_BOOTSTRAP = r'''
import _ctypes, _signal as signal, marshal, os, resource, select, sys

# The bare _ctypes, _signal and marshal: the ctypes and signal packages and json cost ~13 ms of
# start-up on every run.
cfg = marshal.loads(bytes.fromhex(sys.argv[1]))


class Int(_ctypes._SimpleCData):
    _type_ = "i"


class Fn(_ctypes.CFuncPtr):
    _flags_ = _ctypes.FUNCFLAG_CDECL | _ctypes.FUNCFLAG_USE_ERRNO
    _restype_ = Int


class Libc:
    _handle = _ctypes.dlopen(None)

    def __getattr__(self, name):
        fn = Fn((name, self))
        setattr(self, name, fn)
        return fn


libc = Libc()
active, failed = [], {}
# The bootstrap dies with the trainer (PR_SET_PDEATHSIG), and so, each with the one before, init and the program: a
# trainer stopped by Ctrl-C or killed during a run left them running, a program sleeping or waiting for ever (found
# by a red team: a tool call's sleep outlived the trainer). The trainer may have died before the prctl: then our
# parent is no longer the one that started us.
libc.prctl(1, signal.SIGKILL, 0, 0, 0)
if os.getppid() != cfg["parent"]:
    os._exit(125)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 16384, 1 << 18
MS_REMOUNT, MS_BIND, MS_NOATIME, MS_NODIRATIME, MS_RELATIME, MNT_DETACH = 32, 4096, 1024, 2048, 1 << 21, 2
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x10000000, 0x20000000, 0x40000000
CLONE_NEWIPC = 0x08000000
# glibc has no pivot_root wrapper: the raw syscall, by architecture
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "loongarch64": 41, "ppc64le": 203, "ppc64": 203,
              "s390x": 217, "i686": 217, "armv7l": 218}


def errno_text():
    return os.strerror(_ctypes.get_errno())


# The parent's secret for this run, on every status line: the program can write lines that look like ours to
# its stderr, but not this. It comes in the environment, which the program does not inherit (execve below).
SECRET = os.environ.get("LOWMEM_SANDBOX_SECRET", "").encode("ascii", "replace")


def emit(mark, payload):
    try:   # a Python literal of str, list and dict: the parent reads it with ast.literal_eval
        os.write(2, mark + SECRET + b" " + repr(payload).encode("ascii", "backslashreplace") + b"\n")
    except OSError:
        pass


def give_up(msg):
    emit(b"\x00LOWMEM-SANDBOX-ERROR ", {"error": msg, "active": active, "failed": failed})
    os._exit(125)


resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
my_uid, my_gid = os.getuid(), os.getgid()

# The kernel's out-of-memory killer picks the process with the highest score: this program and what it starts
# first, not the trainer (the largest process on the machine), should the runs' memory together exhaust the host.
# Written here, through the host's /proc: the program's own is read-only. Without CAP_SYS_RESOURCE (in
# init's user namespace) the kernel records no floor, so the program could write 0 back through any
# writable /proc: only the minimal root, where the read-only one is the only /proc, makes this a protection.
try:
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")
    oom_set = None
except OSError as exc:
    oom_set = str(exc)
run_uid = cfg["uid"]

# RLIMIT_NPROC counts every process of the (real) uid. For a fresh sandbox uid that is this run only;
# without a uid change it includes all of the user's processes, so allow that many plus max_procs.
nproc = cfg["max_procs"]
if run_uid is None and my_uid != 0:
    mine = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                mine += os.stat("/proc/" + name).st_uid == my_uid
            except OSError:
                pass
    nproc += mine

ns = False
if cfg["namespaces"]:
    # CLONE_NEWIPC: System V shared memory, message queues and semaphores outlive their process (a program
    # could leave GBs of shm segments behind); in an IPC namespace of its own they go with the run.
    flags = CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC
    if libc.unshare(flags) == 0:
        ns = True
    else:
        first = errno_text()
        if my_uid != 0 and libc.unshare(flags | CLONE_NEWUSER) == 0:
            try:  # map our own uid/gid onto themselves, so that file ownership keeps its meaning
                with open("/proc/self/setgroups", "w") as f:
                    f.write("deny")
                with open("/proc/self/uid_map", "w") as f:
                    f.write("%d %d 1" % (my_uid, my_uid))
                with open("/proc/self/gid_map", "w") as f:
                    f.write("%d %d 1" % (my_gid, my_gid))
                ns = True
                active.append("userns")
            except OSError as exc:
                give_up("user namespace set up but its uid map could not be written: %s" % exc)
        else:
            failed["namespaces"] = first
    if ns:
        active += ["netns", "pidns", "mountns", "ipcns"]
        # Nothing mounted in here may propagate back to the host.
        if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
            give_up("cannot make mounts private: " + errno_text())

# The size caps the data only: each empty file still costs ~1 KB of kernel memory (200,000 a second).
TMPFS_OPTS = ("size=%dm,nr_inodes=%d,mode=1777" % (cfg["tmpfs_mb"], 64 * cfg["tmpfs_mb"])).encode()


def sys_mount(src, dst, fstype, flags, data, what):
    if libc.mount(src, dst, fstype, flags, data) != 0:
        raise OSError("%s: %s" % (what, errno_text()))


def mount_proc(dst):
    # hidepid=2: a process sees only the processes it may ptrace. A non-dumpable one (code_io's relay) stays out of
    # sight, and with it its counters of reaped children's faults and CPU time, its context switches and its
    # run time, which each stdin/stdout case changed and the next could read (found by a red team).
    if libc.mount(b"proc", dst, b"proc", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, b"hidepid=2") == 0:
        if "hidepid" not in active:   # (mounted again by the fallback where the minimal root failed)
            active.append("hidepid")
        return
    failed["hidepid"] = errno_text()
    if "hidepid" in active:
        active.remove("hidepid")
    sys_mount(b"proc", dst, b"proc", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, None, "proc")


def bind(src, dst, device=False):
    sys_mount(src.encode(), dst.encode(), None, MS_BIND, None, "bind " + src)
    # Read-only remount. It must repeat the flags the source mount has that a user namespace locks
    # (noexec, nodev, atime); nosuid is always added, and nodev unless it is a device the program may use
    # (a device node on a read-only mount still reads and writes; only its inode, times included, is frozen).
    have = os.statvfs(src).f_flag
    flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | (0 if device else MS_NODEV)
    for st, ms in ((os.ST_NOEXEC, MS_NOEXEC), (os.ST_NODEV, MS_NODEV), (os.ST_NOATIME, MS_NOATIME),
                   (os.ST_NODIRATIME, MS_NODIRATIME), (os.ST_RELATIME, MS_RELATIME)):
        if have & st:
            flags |= ms
    sys_mount(None, dst.encode(), None, flags, None, "read-only " + src)


def build_root(spec, program):
    """Mount a tmpfs over the run's directory and make it the root: read-only binds of what the interpreter
    needs (spec, computed by the parent), a minimal /dev, a fresh read-only /proc, size-capped tmpfs /tmp and /dev/shm,
    the program in /tmp/sandbox; then pivot_root into it and detach the host's tree. Raises OSError before
    the pivot (nothing changed for the caller but extra mounts in this namespace)."""
    new = os.getcwd()
    sys_mount(b"tmpfs", new.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"size=1m,mode=755", "root tmpfs")
    try:
        # The tree goes in a directory of the tmpfs, and the program's root is that directory (a chroot below
        # the pivoted root): the kernel refuses a chrooted process a new user namespace, in which it would
        # hold every capability: mounting a tmpfs of any size (all of memory), reaching kernel code for
        # namespace admins.
        os.chdir(new)   # into the fresh tmpfs
        os.mkdir("r", 0o755)
        os.chdir("r")
        for d, mode, uid, gid in spec["dirs"]:
            os.mkdir("." + d)
            os.chmod("." + d, mode)
            try:
                os.chown("." + d, uid, gid)
            except OSError:   # an id not mapped in a user namespace: the mode still applies
                pass
        for path, kind in spec["binds"]:
            if kind == "dir":
                os.mkdir("." + path, 0o755)
            else:
                os.close(os.open("." + path, os.O_WRONLY | os.O_CREAT, 0o644))
            bind(path, "." + path)
        for path, target in spec["links"]:
            os.symlink(target, "." + path)
        for d in spec["cover"]:
            sys_mount(b"tmpfs", ("." + d).encode(), b"tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
                      b"size=4k,mode=755", "cover " + d)
        if not os.path.isdir("dev"):
            os.mkdir("dev", 0o755)
        # Read-only binds of the host's nodes: writable ones let the program set the host inodes' times
        # (utime needs only write permission), a write outside the sandbox that carried state between runs.
        for name in ("null", "zero", "full", "random", "urandom"):
            if os.path.exists("/dev/" + name):
                os.close(os.open("dev/" + name, os.O_WRONLY | os.O_CREAT, 0o666))
                bind("/dev/" + name, "dev/" + name, device=True)
        for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                             ("stderr", "/proc/self/fd/2")):
            os.symlink(target, "dev/" + name)
        opts = TMPFS_OPTS
        for d in ("dev/shm", "tmp"):
            os.mkdir(d, 0o755)
            sys_mount(b"tmpfs", d.encode(), b"tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, opts, "tmpfs /" + d)
        os.mkdir("proc", 0o555)
        # Read-only: the program may not write its own /proc files (oom_score_adj back to 0, for one).
        mount_proc(b"proc")
        if not os.path.isdir("etc"):
            os.mkdir("etc", 0o755)
        me = run_uid if run_uid is not None else os.getuid()
        for name, text in (("passwd", "root:x:0:0:root:/nonexistent:/nonexistent\n"
                                      "sandbox:x:%d:%d:sandbox:/tmp/sandbox:/nonexistent\n" % (me, me)),
                           ("group", "root:x:0:\nsandbox:x:%d:\n" % me),
                           ("hosts", "127.0.0.1 localhost\n::1 localhost\n")):
            if not os.path.lexists("etc/" + name):
                with open("etc/" + name, "w") as f:
                    f.write(text)
        os.mkdir("tmp/sandbox", 0o700)
        with open("tmp/sandbox/" + cfg["program"], "wb") as f:
            f.write(program)
        if run_uid is not None:
            os.chown("tmp/sandbox", run_uid, run_uid)
        os.chdir("..")
        sys_mount(None, b".", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, None, "read-only root")
        nr = PIVOT_ROOT.get(os.uname().machine)
        if nr is None:
            raise OSError("pivot_root: syscall number unknown on " + os.uname().machine)
        if libc.syscall(nr, b".", b".") != 0:
            raise OSError("pivot_root: " + errno_text())
    except BaseException:
        os.chdir("/")
        libc.umount2(new.encode(), MNT_DETACH)
        os.chdir(new)
        raise
    # The host's root now lies on top of ours at "/": detach it, with every mount below it.
    if libc.umount2(b".", MNT_DETACH) != 0:
        give_up("cannot detach the host root after pivot_root: " + errno_text())
    os.chroot("r")
    os.chdir("/tmp/sandbox")


def forward(code):
    """Exit like the program did: with its status, or killed by the same signal."""
    if code < 0:
        try:
            signal.signal(-code, signal.SIG_DFL)
        except (OSError, ValueError):
            pass
        os.kill(os.getpid(), -code)
        code = 128 - code
    os._exit(code)


if ns:
    # Three processes: this one (outside the new PID namespace) waits; its child is PID 1 ("init") of
    # the namespace and waits for the program, PID 2, reaping orphans; when init exits, the kernel kills
    # whatever is left in the namespace. The program is not PID 1 itself because PID 1 is immune to
    # signals it does not handle (RLIMIT_CPU's SIGXCPU, for one).
    alive_r, alive_w = os.pipe()     # init watches this to notice that we died
    status_r, status_w = os.pipe()   # init reports the program's wait status here
    init = os.fork()
    if init:
        os.close(alive_r)
        os.close(status_w)
        for fd in (0, 1, 2):
            os.close(fd)
        _, st = os.waitpid(init, 0)
        reported = os.read(status_r, 64)
        forward(os.waitstatus_to_exitcode(int(reported) if reported else st))
    os.close(alive_w)
    os.close(status_r)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)        # PR_SET_PDEATHSIG: init dies with us, and so the namespace
    if select.select([alive_r], [], [], 0)[0]:    # we died before the prctl: EOF on the pipe
        os._exit(125)
    os.close(alive_r)
    with open(cfg["program"], "rb") as f:
        program = f.read()
    rooted = False
    if cfg["root"] is not None:
        try:
            build_root(cfg["root"], program)
            rooted = True
            active += ["minimal_root", "private_proc", "private_tmp"]
        except OSError as exc:
            failed["minimal_root"] = str(exc)
            if "minimal_root" in cfg["require"]:
                give_up("cannot build the minimal root: %s" % exc)
    if oom_set is None and not rooted:
        oom_set = "set, but another /proc of the host's tree may let the program lower it (no minimal_root)"
    if not rooted:
        # The weaker fallback (minimal_root: false, or a machine where it fails): the host's tree stays,
        # with a private /proc and /tmp and some directories hidden.
        # A /proc that shows only this namespace: other processes (and their environ) become invisible.
        try:
            mount_proc(b"/proc")
            active.append("private_proc")
        except OSError as exc:
            failed["private_proc"] = str(exc)
        # the interpreter must stay reachable: by the path we exec and by the path it resolves to
        interp = (os.path.abspath(cfg["python"]), os.path.realpath(cfg["python"]))
        # Hide host directories the program has no business reading (the trainer's working directory, with
        # its datasets and reference solutions; home directories) under empty read-only tmpfs.
        hidden = True
        for d in cfg["hide"]:
            if not os.path.isdir(d):
                continue
            if any(p.startswith(d.rstrip("/") + "/") for p in interp):
                failed["hidden_paths:" + d] = "the interpreter lives there"
                continue
            if libc.mount(b"tmpfs", d.encode(), b"tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
                          b"size=16k,mode=755") != 0:
                failed["hidden_paths:" + d] = errno_text()
                hidden = False
        if hidden:
            active.append("hidden_paths")
        tmp_ok = []
        for d in ("/tmp", "/var/tmp", "/dev/shm"):
            if not os.path.isdir(d):
                continue
            if any(p.startswith(d + "/") for p in interp):
                failed["private_tmp:" + d] = "the interpreter lives there"
                continue
            opts = TMPFS_OPTS
            if libc.mount(b"tmpfs", d.encode(), b"tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, opts) == 0:
                tmp_ok.append(d)
            else:
                failed["private_tmp:" + d] = errno_text()
        if "/tmp" in tmp_ok:
            # Run in a directory on the fresh, size-capped /tmp: the host's directory is out of reach.
            os.mkdir("/tmp/sandbox", 0o700)
            with open("/tmp/sandbox/" + cfg["program"], "wb") as f:
                f.write(program)
            if run_uid is not None:
                os.chown("/tmp/sandbox", run_uid, run_uid)
            os.chdir("/tmp/sandbox")
            active.append("private_tmp")
    prog = os.fork()
    if prog:
        for fd in (0, 1, 2):
            os.close(fd)
        while True:
            try:
                pid, st = os.wait()
            except ChildProcessError:
                os._exit(125)
            if pid == prog:
                os.write(status_w, str(st).encode())
                os._exit(0)
    os.close(status_w)

# RLIMIT_NICE and RLIMIT_RTPRIO 0: no process of the run may raise its priority above the runs beside it.
limits = [("RLIMIT_CPU", cfg["cpu_s"], cfg["cpu_s"] + 1), ("RLIMIT_AS", cfg["memory_bytes"], None),
          ("RLIMIT_FSIZE", cfg["fsize_bytes"], None), ("RLIMIT_NOFILE", cfg["max_open_files"], None),
          ("RLIMIT_NPROC", nproc, None), ("RLIMIT_NICE", 0, None), ("RLIMIT_RTPRIO", 0, None)]
for name, soft, hard in limits:
    try:
        resource.setrlimit(getattr(resource, name), (soft, soft if hard is None else hard))
        active.append(name.lower().replace("rlimit_", "rlimit:"))
    except (ValueError, OSError) as exc:
        failed[name] = str(exc)

if run_uid is not None:
    try:
        os.setgroups([])
        os.setgid(run_uid)
        os.setuid(run_uid)
        if os.getresuid() != (run_uid,) * 3 or os.getresgid() != (run_uid,) * 3:
            raise OSError("uid change did not stick")
        active.append("uid")
    except OSError as exc:
        failed["uid"] = str(exc)

if not ns and oom_set is None:
    oom_set = "set, but the program may lower it through the host's /proc (no namespaces)"
if oom_set is None:
    active.append("oom_first")
else:
    failed["oom_first"] = oom_set

if os.getuid() == 0 and "rlimit:nproc" in active:
    active.remove("rlimit:nproc")
    failed["RLIMIT_NPROC"] = "not enforced for root"
if libc.prctl(38, 1, 0, 0, 0) == 0:          # PR_SET_NO_NEW_PRIVS
    active.append("no_new_privs")
else:
    failed["no_new_privs"] = errno_text()


class Char(_ctypes._SimpleCData):
    _type_ = "c"


# AUDIT_ARCH_* and the numbers of add_key, request_key, keyctl, memfd_create, shmget, msgget, semget, setsid,
# mq_open, setxattr, lsetxattr, fsetxattr, setxattrat
DENIED = {"x86_64": (0xC000003E, (248, 249, 250, 319, 29, 68, 64, 112, 240, 188, 189, 190, 463)),
          "aarch64": (0xC00000B7, (217, 218, 219, 279, 194, 186, 190, 157, 180, 5, 6, 7, 463))}
# Calls allowed on the calling process only: (number, ((argument, value it must have), ...)) of prlimit64
# (pid 0), setpriority (PRIO_PROCESS, 0), sched_setparam, sched_setscheduler, sched_setaffinity, sched_setattr
# (pid 0) and ioprio_set (IOPRIO_WHO_PROCESS, 0); otherwise EPERM.
_OWN = ((0, 0),)
SELF_ONLY = {"x86_64": ((302, _OWN), (141, ((0, 0), (1, 0))), (142, _OWN), (144, _OWN), (203, _OWN), (314, _OWN),
                        (251, ((0, 1), (1, 0)))),
             "aarch64": ((261, _OWN), (140, ((0, 0), (1, 0))), (118, _OWN), (119, _OWN), (122, _OWN), (274, _OWN),
                         (30, ((0, 1), (1, 0))))}


def deny_syscalls():
    """A seccomp filter: the system calls of DENIED fail with EPERM; other system-call ABIs (i386, x32 on
    x86_64) get ENOSYS for everything. Kernel keys (add_key, request_key, keyctl) are not namespaced: a
    uid's user keyrings outlive its last process, the program can make them unremovable, and every run
    has a fresh uid: kernel memory left behind for good (Docker's default profile denies them too).
    memfd_create, shmget, msgget, semget hold memory outside RLIMIT_AS and the tmpfs caps (memfds of
    file_size_mb each, as many as descriptors): GBs from a process limited to memory_mb. setsid: the scheduler
    gives each session an equal share of the CPU (autogroups), so 28 spinning processes in sessions of their own
    took 28/29 of it from the other programs judged beside them, which then timed out. mq_open and the setxattr
    calls: a POSIX message queue (the run's IPC namespace) and extended attributes carried state from one
    stdin/stdout case to the next, which are separate runs in the reference (code_io.run_cases_separately).
    The calls of SELF_ONLY act on the calling process only: a process of the same uid may change another's
    rlimits, nice value, CPU affinity, scheduling and I/O priority, and each stdin/stdout case's fork of the
    relay (code_io) changed the relay's, which every later case inherited."""
    arch, nrs = DENIED[os.uname().machine]
    bo = sys.byteorder

    def insn(code, jt, jf, k):
        return code.to_bytes(2, bo) + bytes((jt, jf)) + k.to_bytes(4, bo)

    deny, allow, enosys = 0x00050001, 0x7FFF0000, 0x00050026   # SECCOMP_RET_ERRNO | EPERM, ALLOW, ERRNO | ENOSYS
    lo, hi = (0, 4) if bo == "little" else (4, 0)   # the halves of a 64-bit argument (seccomp_data.args at 16)
    checked = []
    for nr, conds in SELF_ONLY[os.uname().machine]:
        n, body = len(conds), []
        for i, (arg, value) in enumerate(conds):   # both halves must match, else on to this block's deny
            body += [insn(0x20, 0, 0, 16 + 8 * arg + lo), insn(0x15, 0, 4 * (n - i) - 1, value),
                     insn(0x20, 0, 0, 16 + 8 * arg + hi), insn(0x15, 0, 4 * (n - i) - 3, 0)]
        # another call skips the block with its number still loaded
        checked += [insn(0x15, 0, len(body) + 2, nr)] + body + [insn(0x06, 0, 0, allow), insn(0x06, 0, 0, deny)]
    code = [insn(0x20, 0, 0, 4), insn(0x15, 1, 0, arch), insn(0x06, 0, 0, enosys),   # arch == ours, or ENOSYS
            insn(0x20, 0, 0, 0), insn(0x45, len(nrs) + len(checked) + 1, 0, 0x40000000)]   # nr; x32 ABI: denied
    code += [insn(0x15, len(nrs) - k + len(checked), 0, nr) for k, nr in enumerate(nrs)]
    code += checked + [insn(0x06, 0, 0, allow), insn(0x06, 0, 0, deny)]

    def buffer(data):
        class Buf(_ctypes.Array):
            _type_ = Char
            _length_ = len(data)
        return Buf.from_buffer_copy(data)

    prog = buffer(b"".join(code))
    fprog = buffer(len(code).to_bytes(2, bo) + bytes(6) + _ctypes.addressof(prog).to_bytes(8, bo))  # sock_fprog
    if libc.prctl(22, 2, fprog, 0, 0) != 0:   # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        raise OSError(errno_text())


if os.uname().machine not in DENIED:
    failed["seccomp"] = "no filter written for " + os.uname().machine
else:
    try:
        deny_syscalls()
        active.append("seccomp")
    except OSError as exc:
        failed["seccomp"] = str(exc)

# After the uid change: changing credentials clears the parent-death signal.
if libc.prctl(1, signal.SIGKILL, 0, 0, 0) == 0:   # PR_SET_PDEATHSIG
    active.append("pdeathsig")
if ns and os.getppid() != 1:   # init died before the prctl above
    os._exit(125)
os.umask(0o077)

missing = [p for p in cfg["require"] if p not in active]
if missing:
    give_up("required protections not available: " + ", ".join(missing))
emit(b"\x00LOWMEM-SANDBOX ", {"active": active, "failed": failed})
argv = [cfg["python"], "-I", "-S", "-B", cfg["program"]]
try:
    os.execve(cfg["python"], argv, cfg["env"])
except OSError as exc:
    give_up("cannot run %s: %s" % (cfg["python"], exc))
'''


# --------------------------------------------------------------------------------------------------
# Probing: which layers work on this machine, and which interpreter the sandboxed uid can run.

@dataclass(frozen=True)
class _Plan:
    python: str                 # interpreter for the program
    bootstrap_python: str       # interpreter for the bootstrap (runs with our own privileges)
    namespaces: bool
    drop_uid: bool
    uid_choice: Optional[tuple] # (low, high) range to draw a uid from, or None
    protections: tuple          # what the probe saw active; every run requires these
    failed: dict = field(default_factory=dict)
    rejected_interpreters: dict = field(default_factory=dict)
    root: Optional[dict] = None  # the minimal root's layout (_root_layout), or None: the host's tree
    switched_off: tuple = ()     # layers the caller turned off (namespaces, minimal_root, drop_privileges)


_plans: dict = {}
_plans_lock = threading.Lock()


def _mapped_ids(path: str) -> list:
    """The id ranges usable in our user namespace, from /proc/self/uid_map (or gid_map)."""
    try:
        with open(path) as f:
            return [(int(a), int(a) + int(n)) for a, _b, n in (line.split() for line in f if line.strip())]
    except OSError:
        return [(0, 1 << 32)]


def _uid_choice() -> Optional[tuple]:
    """A range of unused unprivileged uids we may switch to (as root), or None."""
    if os.geteuid() != 0:
        return None
    usable = _mapped_ids("/proc/self/uid_map")
    usable_g = [r for r in _mapped_ids("/proc/self/gid_map")]
    lo, hi = SANDBOX_UID_BASE, SANDBOX_UID_BASE + SANDBOX_UID_SPAN

    def covered(ranges, a, b):
        return any(x <= a and b <= y for x, y in ranges)

    if covered(usable, lo, hi) and covered(usable_g, lo, hi):
        return (lo, hi)
    if covered(usable, NOBODY_UID, NOBODY_UID + 1) and covered(usable_g, NOBODY_UID, NOBODY_UID + 1):
        return (NOBODY_UID, NOBODY_UID + 1)   # shared by concurrent runs: no per-run uid sweep then
    return None


def _interpreter_candidates() -> list:
    seen, out = set(), []
    for p in (sys.executable, getattr(sys, "_base_executable", None), shutil.which("python3"),
              "/usr/bin/python3", "/usr/local/bin/python3"):
        if not p:
            continue
        real = os.path.realpath(p)
        if real not in seen and os.path.isfile(real) and os.access(real, os.X_OK):
            seen.add(real)
            out.append(real)
    return out


# --------------------------------------------------------------------------------------------------
# The minimal root: what the interpreter needs, found once per interpreter by running it outside the
# sandbox (its sys.path, and every file it maps after importing all of its extension modules).

class RootUnavailable(Exception):
    """The minimal root cannot be laid out for this interpreter (the reason is the message)."""


_ROOT_SURVEY = r"""
import importlib, importlib.machinery, json, os, sys
names = set()
for d in sys.path:
    if os.path.isdir(d):
        for f in os.listdir(d):
            for suffix in importlib.machinery.EXTENSION_SUFFIXES:
                stem = f[:-len(suffix)]
                if f.endswith(suffix) and stem.isidentifier():
                    names.add(stem)
loaded = []
for name in sorted(names):
    if name.startswith(("_test", "xx", "_xx", "_ctypes_test")):
        continue
    try:
        importlib.import_module(name)
        loaded.append(name)
    except BaseException:
        pass
maps = set()
with open("/proc/self/maps") as f:
    for line in f:
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith("/"):
            maps.add(parts[5].rstrip("\n"))
sys.stdout.write("\n" + json.dumps({"path": sys.path, "maps": sorted(maps), "modules": loaded}) + "\n")
"""

# Directories never bound whole: a file the interpreter maps from one of them is bound alone.
_BROAD_DIRS = {"/", "/etc", "/usr", "/usr/local", "/usr/share", "/var", "/var/lib", "/opt", "/srv", "/home",
               "/root", "/run", "/mnt", "/media", "/boot", "/bin", "/sbin", "/usr/bin", "/usr/sbin",
               "/usr/local/bin", "/usr/local/sbin"}
# Provided by the sandbox itself: never taken from the host.
_OWN_DIRS = ("/tmp", "/dev", "/proc", "/sys", "/var/tmp")
_root_layouts: dict = {}


def _elf_interp(path: str) -> Optional[str]:
    """The program interpreter (PT_INTERP, e.g. /lib64/ld-linux-x86-64.so.2) of an ELF executable, or None."""
    import struct

    try:
        with open(path, "rb") as f:
            head = f.read(64)
            if head[:4] != b"\x7fELF" or len(head) < 64:
                return None
            end = "<" if head[5] == 1 else ">"
            wide = head[4] == 2
            phoff = struct.unpack_from(end + ("Q" if wide else "I"), head, 32 if wide else 28)[0]
            phentsize, phnum = struct.unpack_from(end + "HH", head, 54 if wide else 42)
            f.seek(phoff)
            table = f.read(phentsize * phnum)
            for k in range(phnum):
                entry = table[k * phentsize:(k + 1) * phentsize]
                if struct.unpack_from(end + "I", entry, 0)[0] == 3:   # PT_INTERP
                    off, size = (struct.unpack_from(end + "QQ", entry, 8)[0], struct.unpack_from(end + "Q", entry, 32)[0]) \
                        if wide else (struct.unpack_from(end + "I", entry, 4)[0], struct.unpack_from(end + "I", entry, 16)[0])
                    f.seek(off)
                    return f.read(size).rstrip(b"\0").decode() or None
    except (OSError, struct.error, UnicodeDecodeError):
        return None
    return None


def _within(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def _root_layout(python: str) -> dict:
    """What the minimal root holds for `python` (cached): {"binds": [[path, "dir"|"file"]], "dirs": [...],
    "links": [[path, target]], "modules": [...]}: the interpreter file, its sys.path directories, the
    directory of every shared library and data file it maps (a file alone where that directory is a broad
    one such as /etc), the host's symlinks on the way to them (/lib64 -> usr/lib64, ...) and the host's
    top-level symlinks; everything read-only. Raises RootUnavailable."""
    if python in _root_layouts:
        return _root_layouts[python]
    try:
        out = subprocess.run([python, "-I", "-S", "-B", "-c", _ROOT_SURVEY], env=dict(_MIN_ENV), cwd="/",
                             stdin=subprocess.DEVNULL, capture_output=True, timeout=60)
        survey = json.loads(out.stdout.decode("utf-8", "replace").rstrip("\n").rsplit("\n", 1)[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as exc:
        raise RootUnavailable(f"cannot survey what {python} needs: {exc}") from None
    broad, d = set(_BROAD_DIRS), os.path.realpath(os.getcwd())
    while d != "/":   # the trainer's directory and its parents are never bound whole either
        broad.add(d)
        d = os.path.dirname(d)
    links: dict = {}

    def resolve(path: str) -> str:
        """The canonical path of `path`, recording every host symlink met on the way."""
        comps, cur, hops = [c for c in path.split("/") if c], "/", 0
        while comps:
            nxt = os.path.join(cur, comps.pop(0))
            if os.path.islink(nxt):
                hops += 1
                if hops > 40:
                    raise RootUnavailable(f"too many symlinks resolving {path}")
                target = os.readlink(nxt)
                links[nxt] = target
                comps = [c for c in os.path.normpath(os.path.join(cur, target)).split("/") if c] + comps
                cur = "/"
            else:
                cur = nxt
        return cur

    wanted: dict = {}   # canonical path -> "dir" | "file"
    needed = [python] + [p for p in survey["path"] if os.path.exists(p)]
    interp = _elf_interp(python)
    if interp:
        needed.append(interp)
    if os.path.isfile("/etc/ld.so.cache"):   # the loader's index of library paths (read, then unmapped)
        needed.append("/etc/ld.so.cache")
    for p in needed:
        real = resolve(p)
        wanted[real] = "dir" if os.path.isdir(real) else "file"
    for m in survey["maps"]:
        if not os.path.isfile(m) or m.startswith(("/proc/", "/sys/", "/dev/")):
            continue   # "(deleted)" entries, memfd, devices
        real = resolve(m)
        parent = os.path.dirname(real)
        if real == os.path.realpath(python) or parent in broad or any(_within(parent, d) for d in _OWN_DIRS):
            wanted[real] = "file"
        else:
            wanted[parent] = "dir"
    for name in os.listdir("/"):
        if os.path.islink("/" + name):
            links["/" + name] = os.readlink("/" + name)
    for real in wanted:
        if any(_within(real, d) for d in _OWN_DIRS) or real == "/":
            raise RootUnavailable(f"{python} needs {real}, which the sandbox replaces with its own")
    # Bind the outermost trees only; directories and links inside a bound tree come with it.
    binds = sorted((p, k) for p, k in wanted.items()
                   if not any(q != p and wanted[q] == "dir" and _within(p, q) for q in wanted))
    bound_dirs = [p for p, k in binds if k == "dir"]
    inside = lambda p: any(_within(p, d) for d in bound_dirs)   # noqa: E731
    keep_links = sorted((p, t) for p, t in links.items() if not inside(p) and p not in wanted)
    dirs = set()
    for p in [b for b, _ in binds] + [lk for lk, _ in keep_links]:
        parent = os.path.dirname(p)
        while parent != "/" and not inside(parent):
            dirs.add(parent)
            parent = os.path.dirname(parent)
    if any(lk in dirs for lk, _ in keep_links):
        raise RootUnavailable("a path the interpreter needs is both a symlink and a directory")
    # Directories made on the way keep the host's mode and owner: a 0700 home stays closed to the sandbox uid.
    made = []
    for d in sorted(dirs, key=lambda d: (d.count("/"), d)):
        st = os.stat(d)
        made.append([d, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid])
    # Installed packages are not part of the standard library (the program runs with -I -S): covered.
    covered = sorted({os.path.join(os.path.realpath(p), sub) for p in survey["path"] for sub in ("site-packages", "dist-packages")
                      if os.path.isdir(os.path.join(p, sub)) and inside(os.path.realpath(p))})
    layout = {"binds": [list(b) for b in binds], "dirs": made, "links": [list(lk) for lk in keep_links],
              "cover": covered, "modules": survey["modules"]}
    _root_layouts[python] = layout
    return layout


def _plan(namespaces: bool, drop_privileges: bool, minimal_root: bool = True) -> _Plan:
    key = (namespaces, drop_privileges, minimal_root)
    with _plans_lock:
        if key not in _plans:
            _plans[key] = _probe(namespaces, drop_privileges, minimal_root)
        return _plans[key]


# Run by the probe in the minimal root: every extension module that loads outside must load inside.
_PROBE = """import importlib, json
bad = []
for name in {modules!r}:
    try:
        importlib.import_module(name)
    except BaseException as exc:
        bad.append(name)
print('sandbox-probe-ok', json.dumps(bad))
"""


def _probe(namespaces: bool, drop_privileges: bool, minimal_root: bool = True) -> _Plan:
    candidates = _interpreter_candidates()
    if not candidates:
        raise SandboxError("no Python interpreter found for the sandbox")
    bootstrap = candidates[0]
    uid_choice = _uid_choice() if drop_privileges else None
    off = tuple(name for name, on in (("namespaces", namespaces), ("minimal_root", minimal_root or not namespaces),
                                      ("drop_privileges", drop_privileges)) if not on)
    failures = {}
    # As root with a uid to drop to, there is no fallback to running the program as root: without an
    # interpreter the sandbox uid can run, the sandbox refuses (drop_privileges=False overrides).
    for python in candidates:
        root, root_failed = None, {}
        if namespaces and minimal_root:
            try:
                root = _root_layout(python)
            except RootUnavailable as exc:
                root_failed["minimal_root"] = str(exc)
        plan = _Plan(python, bootstrap, namespaces, uid_choice is not None, uid_choice, (), root=root)
        code = _PROBE.format(modules=root["modules"] if root else [])
        res = _run(plan, code, timeout_s=30.0, require=(), stdin=None,
                   memory_mb=DEFAULT_MEMORY_MB, file_size_mb=DEFAULT_FILE_SIZE_MB, max_procs=DEFAULT_MAX_PROCS,
                   max_open_files=DEFAULT_MAX_OPEN_FILES, max_output_bytes=65536, cpu_s=None,
                   tmpfs_mb=DEFAULT_TMPFS_MB, kill_on_output_limit=True)
        if res.ok and res.stdout.startswith("sandbox-probe-ok"):
            failed = {**root_failed, **res.unavailable}
            if drop_privileges and uid_choice is None:
                failed.setdefault("uid", "not root (nothing to drop)" if os.geteuid() != 0
                                  else "no unprivileged uid mapped in this user namespace")
            bad = json.loads(res.stdout.split(" ", 1)[1])
            if bad:   # not a missing protection: some standard-library modules will not import in there
                failed["minimal_root:modules"] = "cannot be imported in the minimal root: " + ", ".join(bad)
            protections = tuple(p for p in res.protections if p != "pdeathsig")
            return _Plan(python, bootstrap, namespaces and "netns" in protections, uid_choice is not None,
                         uid_choice, protections, failed, failures, root if "minimal_root" in protections else None,
                         off)
        failures[f"{python} (uid {'dropped' if uid_choice else 'kept'})"] = (
            res.error or res.stderr[-300:] or f"returncode {res.returncode}")
    hint = (" Install a Python 3 that every user may read and execute (e.g. /usr/bin/python3), or pass "
            "drop_privileges=False to run programs as root (unsafe)." if uid_choice is not None else "")
    raise SandboxError("the sandbox cannot run any interpreter: " + json.dumps(failures) + hint)


def sandbox_info(namespaces: bool = True, drop_privileges: bool = True, minimal_root: bool = True) -> dict:
    """What the sandbox does on this machine: interpreter, active protections, what failed and why, and the
    minimal root's layout (`root`: binds, dirs, links; None without one)."""
    p = _plan(namespaces, drop_privileges, minimal_root)
    root = None if p.root is None else {k: p.root[k] for k in ("binds", "dirs", "links")}
    return {"python": p.python, "protections": list(p.protections), "unavailable": dict(p.failed),
            "uid_range": p.uid_choice, "namespaces": p.namespaces, "drop_uid": p.drop_uid,
            "rejected_interpreters": dict(p.rejected_interpreters), "root": root,
            "switched_off": list(p.switched_off)}


# The layers the code reward needs before it runs model-written code ("uid" too when we are root: a
# program left as root could undo the others). docs/sandbox.md says what each one stops.
FULL_ISOLATION = ("netns", "pidns", "mountns", "ipcns", "private_proc", "minimal_root", "private_tmp",
                  "rlimit:cpu", "rlimit:as", "rlimit:fsize", "rlimit:nofile", "rlimit:nproc", "no_new_privs")
_WHY_KEYS = {"netns": "namespaces", "pidns": "namespaces", "mountns": "namespaces", "ipcns": "namespaces",
             "uid": "uid", "no_new_privs": "no_new_privs", "private_proc": "private_proc",
             "minimal_root": "minimal_root"}


def missing_protections(limits: Optional["SandboxLimits"] = None) -> dict:
    """{layer: why} for each layer of full isolation (FULL_ISOLATION, and "uid" as root) that runs with
    these limits would lack on this machine; {} when none is missing."""
    lim = limits or SandboxLimits()
    p = _plan(lim.namespaces, lim.drop_privileges, lim.minimal_root)
    needed = FULL_ISOLATION + (("uid",) if os.geteuid() == 0 else ())
    out = {}
    for layer in needed:
        if layer in p.protections:
            continue
        if layer in ("netns", "pidns", "mountns", "ipcns", "private_proc", "private_tmp", "minimal_root") \
                and not lim.namespaces:
            why = "namespaces: false"
        elif layer == "minimal_root" and not lim.minimal_root:
            why = "minimal_root: false"
        elif layer == "uid" and not lim.drop_privileges:
            why = "drop_privileges: false"
        elif layer.startswith("rlimit:"):
            why = p.failed.get("RLIMIT_" + layer.split(":")[1].upper(), "not available")
        else:
            why = p.failed.get(_WHY_KEYS.get(layer, layer)) or p.failed.get("namespaces") or "not available"
        out[layer] = why
    return out


def fair_cpu_missing(autogroup: Optional[str], cgroup: Optional[str],
                     has_cpu_weight=lambda path: False) -> Optional[str]:
    """Why the scheduler would not share the CPU equally between the runs judged side by side, or None where it does.
    Every process of a run stays in one session (setsid is denied), and the kernel's autogroup gives each session an
    equal share, but only with kernel.sched_autogroup_enabled = 1 and for a task of the root cpu cgroup
    (task_wants_autogroup): not under a container's CPU limit, Kubernetes, or a systemd slice with the cpu
    controller on. Elsewhere a run spinning 31 processes took ~31/32 of the CPU from the one beside it (found by a
    red team, by reasoning). `autogroup`: /proc/sys/kernel/sched_autogroup_enabled (None: absent); `cgroup`:
    /proc/self/cgroup; `has_cpu_weight(path)`: whether that cgroup v2 directory holds cpu.weight (the root has none:
    one at "/" is a cgroup namespace's, a container's cgroup)."""
    if autogroup is None:
        return "the kernel has no autogroup (no /proc/sys/kernel/sched_autogroup_enabled)"
    if autogroup.strip() != "1":
        return f"kernel.sched_autogroup_enabled is {autogroup.strip()!r}"
    unified = None
    for line in (cgroup or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if "cpu" in parts[1].split(","):   # cgroup v1's cpu controller
            return None if parts[2] == "/" else f"the trainer is in the cpu cgroup {parts[2]}, where autogroup does " \
                                                 "not apply"
        if parts[0] == "0" and not parts[1]:
            unified = parts[2]
    path = unified
    while path:   # cgroup v2: the cpu controller on the trainer's cgroup or an ancestor below the root
        if has_cpu_weight(path):
            where = "a container's cpu cgroup (its cgroup namespace shows it as /)" if unified == "/" \
                else f"the cpu cgroup {unified}"
            return f"the trainer is in {where}, where autogroup does not apply"
        path = "" if path == "/" else path.rsplit("/", 1)[0] or "/"
    return None


_fair_cpu: list = []


def fair_cpu() -> Optional[str]:
    """fair_cpu_missing for this process, probed once."""
    if not _fair_cpu:
        def read(path):
            try:
                with open(path) as f:
                    return f.read()
            except OSError:
                return None
        _fair_cpu.append(fair_cpu_missing(
            read("/proc/sys/kernel/sched_autogroup_enabled"), read("/proc/self/cgroup"),
            lambda path: os.path.exists("/sys/fs/cgroup" + path.rstrip("/") + "/cpu.weight")))
    return _fair_cpu[0]


def sandbox_summary(limits: Optional["SandboxLimits"] = None) -> str:
    """One line for a start-up log: the interpreter, the active protections, what full isolation lacks, and whether
    the runs judged side by side get equal shares of the CPU (fair_cpu)."""
    lim = limits or SandboxLimits()
    p = _plan(lim.namespaces, lim.drop_privileges, lim.minimal_root)
    missing = missing_protections(lim)
    who = "a fresh unprivileged uid per run" if p.drop_uid else "the trainer's uid"
    line = f"sandbox: {p.python} as {who}; active: {', '.join(p.protections) or 'none'}"
    if missing:
        line += "; MISSING: " + "; ".join(f"{k} ({v})" for k, v in missing.items())
    unfair = fair_cpu()
    if unfair is not None:
        line += (f"; no fair CPU share between runs ({unfair}): a program with many processes can starve the one "
                 "judged beside it into a timeout (workers: 1 avoids it; docs/sandbox.md)")
    return line


# --------------------------------------------------------------------------------------------------
# Running one program.

def _first_child(pid: int) -> Optional[int]:
    """The oldest living child of `pid` (the kernel lists children in the order they joined), or None."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            first = f.read().split()[:1]
    except OSError:   # gone, or a kernel without CONFIG_PROC_CHILDREN: that waiting is not forgiven
        return None
    return int(first[0]) if first else None


class _RunClock(Clock):
    """run_python's deadline (STEP_CLOCK's Clock): `timeout_s` of wall clock plus the time the run's processes
    waited for a CPU, up to `load` x `timeout_s`. Those run one after another, each forked by the one before while
    that one sleeps: the bootstrap (set-up), with namespaces init (the minimal root) and then the program (the
    bootstrap exec'd into it without), so their waiting adds up. Read from the host's /proc, where a process run as
    another uid, or non-dumpable, still shows its schedstat; what cannot be read (hidepid on the host's /proc, a
    process gone before it was seen) is not forgiven."""

    def __init__(self, limit: float, load: float, start: float):
        super().__init__(limit, load, None)
        self.start = start
        self.chain: list = []       # the pids found so far: bootstrap, init, program
        self.depth = 1
        self.seen: dict = {}        # pid -> the last waiting read from it (kept once it is gone)

    def follow(self, bootstrap: int, namespaces: bool) -> None:
        """Start reading the run's processes: the bootstrap, forked after the clock's start (so from 0)."""
        self.chain, self.depth = [bootstrap], 3 if namespaces else 1
        self.fresh(bootstrap)

    def waiting(self):
        while len(self.chain) < self.depth:   # init and the program, once each has been forked
            child = _first_child(self.chain[-1])
            if child is None:
                break
            self.chain.append(child)
        for pid in self.chain:
            now = _waited(pid)
            if now is not None:
                self.seen[pid] = max(now, self.seen.get(pid, 0))
        return sum(self.seen.values()) if self.seen else None


def run_python(code: str, timeout_s: float = DEFAULT_TIMEOUT_S, *, stdin: Union[str, bytes, None] = None,
               limits: Optional[SandboxLimits] = None, kill_on_output_limit: bool = True,
               load_allowance: float = 1.0, **overrides) -> SandboxResult:
    """Run `code` (Python source, standard library only: the interpreter runs with -I -S) in the sandbox.

    timeout_s: time limit (from the call, the sandbox's set-up included); the program and everything it started are
        then SIGKILLed.
    load_allowance: 1 (default): timeout_s is wall-clock time. More (LOAD_ALLOWANCE for one program's own limit,
        as the Python tool and code_io.run_cases_separately use it): wall-clock time less the time the run's
        processes waited for a CPU, up to load_allowance x timeout_s of wall-clock time (docs/sandbox.md, "Time
        limits under load"). Sleeping, blocking and computing count as before. RLIMIT_CPU is not stretched.
    stdin: data written to the program's stdin (then closed).
    limits: a SandboxLimits (memory, processes, output, hidden paths, layers); `overrides` replace its
        fields by name (run_python(code, 10, memory_mb=256)); an unknown name is a TypeError.
    kill_on_output_limit: past max_output_bytes, kill the program (the default, so an endless print
        cannot run until the deadline), or read and drop the rest.

    Never raises for anything the program does; raises SandboxError only if the sandbox cannot start at
    all. A run whose isolation could not be set up returns killed_reason="sandbox_error".
    """
    lim = SandboxLimits.of(limits, **overrides)
    plan = _plan(lim.namespaces, lim.drop_privileges, lim.minimal_root)
    if not load_allowance >= 1.0:   # (nan too)
        raise ValueError(f"load_allowance must be a number >= 1 (1: a plain wall clock), got {load_allowance!r}")
    return _run(plan, code, timeout_s=timeout_s, require=plan.protections, stdin=stdin, memory_mb=lim.memory_mb,
                file_size_mb=lim.file_size_mb, max_procs=lim.max_procs, max_open_files=lim.max_open_files,
                max_output_bytes=lim.max_output_bytes, cpu_s=lim.cpu_s, tmpfs_mb=lim.tmpfs_mb,
                kill_on_output_limit=kill_on_output_limit, hide_paths=lim.hide_paths, load=float(load_allowance))


def _run(plan: _Plan, code: str, *, timeout_s, require, stdin, memory_mb, file_size_mb, max_procs,
         max_open_files, max_output_bytes, cpu_s, tmpfs_mb, kill_on_output_limit, hide_paths=None,
         load: float = 1.0) -> SandboxResult:
    start = time.monotonic()
    timeout_s = max(0.05, float(timeout_s))
    clock = _RunClock(timeout_s, load, start)
    uid = random.randrange(*plan.uid_choice) if plan.drop_uid else None
    workdir = tempfile.mkdtemp(prefix="lowmem-sandbox-")
    secret = os.urandom(8).hex()   # marks the bootstrap's status lines on stderr (_split_status)
    proc = None
    try:
        with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        if uid is not None:
            os.chmod(os.path.join(workdir, "main.py"), 0o644)
            os.chown(workdir, uid, uid)
        cfg = {"uid": uid, "namespaces": plan.namespaces, "python": plan.python, "program": "main.py",
               "parent": os.getpid(),
               "cpu_s": int(cpu_s if cpu_s is not None else int(timeout_s + 0.999) + 1),
               "memory_bytes": int(memory_mb) << 20, "fsize_bytes": int(file_size_mb) << 20,
               "max_open_files": int(max_open_files), "max_procs": int(max_procs), "tmpfs_mb": int(tmpfs_mb),
               "require": list(require), "env": dict(_PROGRAM_ENV), "hide": _hide_list(hide_paths),
               "root": plan.root if plan.namespaces else None}
        argv = [plan.bootstrap_python, "-I", "-S", "-B", "-c", _BOOTSTRAP, marshal.dumps(cfg).hex()]
        try:
            proc = subprocess.Popen(argv, cwd=workdir, env={**_MIN_ENV, "LOWMEM_SANDBOX_SECRET": secret},
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True, close_fds=True)
        except OSError as exc:
            raise SandboxError(f"cannot start the sandbox bootstrap {plan.bootstrap_python}: {exc}") from exc
        with _runs_lock:
            _runs[workdir] = (proc, plan, uid)
        if load > 1.0:   # (1: a plain wall clock, no need to read /proc)
            clock.follow(proc.pid, plan.namespaces)
        data = stdin.encode() if isinstance(stdin, str) else (stdin or b"")
        out, err, timed_out, over = _communicate(proc, data, clock, max_output_bytes, kill_on_output_limit, plan,
                                                 uid)
        returncode = proc.returncode
    finally:
        if proc is not None:
            if proc.returncode is None:   # an exception on the way: make sure nothing survives
                _kill_all(proc, plan, uid)
                proc.wait()
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                try:
                    stream.close()
                except Exception:
                    pass
        with _runs_lock:
            _runs.pop(workdir, None)
        shutil.rmtree(workdir, ignore_errors=True)

    status, error, err_bytes = _split_status(bytes(err[0]), secret)
    if len(err_bytes) > max_output_bytes:
        err_bytes, err[1] = err_bytes[:max_output_bytes], True
    reason = None
    if error is not None:
        reason = "sandbox_error"
    elif timed_out:
        reason = "timeout"
    elif over:
        reason = "output_limit"
    elif returncode is not None and returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = str(-returncode)
        reason = "cpu_limit" if -returncode == signal.SIGXCPU else f"signal:{name}"
    return SandboxResult(returncode=returncode, stdout=out[0].decode("utf-8", "replace"),
                         stderr=err_bytes.decode("utf-8", "replace"), timed_out=timed_out,
                         killed_reason=reason, duration_s=time.monotonic() - start,
                         stdout_truncated=out[1], stderr_truncated=err[1],
                         protections=tuple(status.get("active", ())), error=error,
                         unavailable=dict(status.get("failed", {})))


_runs: dict = {}   # the runs under way: their directory -> (their bootstrap's Popen, plan, uid)
_runs_lock = threading.Lock()


def _end_runs_at_exit() -> None:
    """At the interpreter's exit, the runs still under way: their process groups killed, their directories removed.
    A run on a daemon thread (an environment's call, rollout/turns.py) never reaches its own cleanup when the trainer
    exits (Ctrl-C during a tool call: found by a red team, its directory was left in /tmp for good)."""
    with _runs_lock:
        runs = list(_runs.items())
    for workdir, (proc, plan, uid) in runs:
        if proc.returncode is None:   # (not reaped: its process group id is still its own)
            # as the run's own end does: without a PID namespace, also its uid's processes that left the group
            # (setpgid, setsid), which no parent-death signal reaches (found by a review)
            _kill_all(proc, plan, uid)
        shutil.rmtree(workdir, ignore_errors=True)


atexit.register(_end_runs_at_exit)


# Never hidden (the interpreter and the system need them); /tmp and /proc get their own fresh mounts.
_SYSTEM_DIRS = {"/", "/usr", "/etc", "/lib", "/lib32", "/lib64", "/bin", "/sbin", "/proc", "/sys", "/dev", "/var",
                "/run", "/tmp", "/boot", "/nix", "/opt"}


def _hide_list(hide_paths) -> list:
    """Absolute real paths to hide in the mount namespace; None: the trainer's cwd, /home and /root."""
    if hide_paths is None:
        try:
            hide_paths = [os.getcwd(), "/home", "/root"]
        except OSError:
            hide_paths = ["/home", "/root"]
    out = []
    for p in hide_paths:
        real = os.path.realpath(str(p))
        if real in _SYSTEM_DIRS or real.startswith(("/tmp/", "/proc/", "/sys/", "/dev/")) or real in out:
            continue
        out.append(real)
    return out


def _split_status(err: bytes, secret: str):
    """Strip the bootstrap's status/error lines from the start of stderr: those that carry this run's secret.
    A line the program wrote in their form stays part of its stderr (else it could fake a "sandbox_error",
    which stops the code reward, or the protections it ran under)."""
    status, error = {}, None
    ok, bad = _STATUS_MARK + secret.encode() + b" ", _ERROR_MARK + secret.encode() + b" "
    while err.startswith(ok) or err.startswith(bad):
        line, _, err = err.partition(b"\n")
        is_error = line.startswith(bad)
        try:
            payload = ast.literal_eval(line[len(bad if is_error else ok):].decode("ascii"))
            if not isinstance(payload, dict):
                raise ValueError(payload)
        except (ValueError, SyntaxError, UnicodeDecodeError, MemoryError, RecursionError):
            payload = {"error": line.decode("utf-8", "replace")}
        status = payload
        if is_error:
            error = payload.get("error", "sandbox setup failed")
    return status, error, err


def _exited(pid: int) -> bool:
    """Has `pid` exited? Does not reap it: while the zombie exists its pid, and so its process group id,
    cannot be reused, which makes the final killpg safe."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _communicate(proc, data: bytes, clock, cap: int, kill_on_cap: bool, plan, uid):
    """Feed stdin and read both pipes (keeping at most `cap` bytes each) until the program has exited
    and the pipes are closed, or the clock's time (a Clock) runs out; then kill everything of the run and reap it.
    Returns ([stdout, truncated], [stderr, truncated], timed_out, over_cap)."""
    out, err = [bytearray(), False], [bytearray(), False]
    bufs = {proc.stdout.fileno(): out, proc.stderr.fileno(): err}
    caps = {proc.stdout.fileno(): cap, proc.stderr.fileno(): cap + _STATUS_ALLOWANCE}   # stderr starts with our status
    sel = selectors.DefaultSelector()
    for fd in bufs:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    view = memoryview(data)
    if data:
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE)
    else:
        proc.stdin.close()
    timed_out = over = False

    def read(fd) -> bool:
        """Read what is there; False on EOF."""
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return True
        except OSError:
            return False
        if not chunk:
            return False
        buf = bufs[fd]
        room = caps[fd] - len(buf[0])
        if len(chunk) > room:
            buf[0] += chunk[:max(room, 0)]
            buf[1] = True
        else:
            buf[0] += chunk
        return True

    try:
        while sel.get_map():
            remaining = clock.left()
            if remaining <= 0:
                timed_out = True
                break
            events = sel.select(min(remaining, 0.1))
            for key, _ in events:
                fd = key.fd
                if fd in bufs:
                    if not read(fd):
                        sel.unregister(fd)
                    elif bufs[fd][1] and kill_on_cap:
                        over = True
                else:
                    try:
                        n = os.write(fd, view[:65536])
                        view = view[n:]
                    except OSError:   # BrokenPipeError included: the program closed its stdin
                        view = view[:0]
                    if not len(view):
                        sel.unregister(fd)
                        proc.stdin.close()
            if over:
                break
            if not events and _exited(proc.pid):
                break   # it exited, but something it started (outside its group) still holds the pipes
        # The pipes are closed: wait for the exit itself, until the deadline.
        while not (timed_out or over) and not _exited(proc.pid):
            if clock.left() <= 0:
                timed_out = True
                break
            time.sleep(0.005)
        # Always: kill the group (and the uid), whatever it left behind.
        _kill_all(proc, plan, uid)
        drain_until = time.monotonic() + 0.5   # the writers are dead: EOF comes at once
        while sel.get_map() and time.monotonic() < drain_until:
            for key, _ in sel.select(0.05):
                if key.fd not in bufs or not read(key.fd):
                    sel.unregister(key.fd)
        proc.wait()
    finally:
        sel.close()
    return out, err, timed_out, over


def _kill_all(proc, plan: _Plan, uid: Optional[int]) -> None:
    """SIGKILL the run's process group; without a PID namespace also every process of the run's uid
    (programs that called setsid() leave the group but not their uid). Call before reaping the leader."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if uid is not None and not plan.namespaces and plan.uid_choice and plan.uid_choice[1] - plan.uid_choice[0] > 1:
        _kill_uid(uid, plan.bootstrap_python)


def _kill_uid(uid: int, python: str) -> None:
    """kill(-1, SIGKILL) from a helper running as `uid`: the kernel delivers it, atomically with respect to
    fork, to every process of that uid (and not to the helper itself)."""
    helper = "import os,signal,sys\nu=int(sys.argv[1])\nos.setgroups([]);os.setgid(u);os.setuid(u)\ntry:\n" \
             " os.kill(-1,signal.SIGKILL)\nexcept ProcessLookupError:\n pass\n"
    try:
        subprocess.run([python, "-I", "-S", "-c", helper, str(uid)], env=dict(_MIN_ENV), timeout=10,
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        pass
