"""Run metrics: one JSON object per step in RUN_DIR/metrics.jsonl, and a one-line summary on stdout."""

from __future__ import annotations

import contextlib
import json
import math
import time
from typing import Callable, Optional
from pathlib import Path

from .durable import replace_file


class MetricsWriter:
    def __init__(self, run_dir: Path, resume_step: int | None = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        if resume_step is not None:
            truncate_after(self.path, resume_step)
        self._file = open(self.path, "a")

    def write(self, row: dict) -> None:
        self._file.write(json_line(row))
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def truncate_after(path: Path, step: int) -> None:
    """On resume, drop a JSONL file's rows of steps after the checkpoint (they will be run again) and any
    line cut by a crash; the file is replaced atomically (flushed to disk first), and a copy that could not be
    written whole (a full disk) is removed. Copied a line at a time: read whole, a 100,000-step run's 190 MB
    metrics.jsonl took 520 MB more RAM at every resume (found by a soak run)."""
    if not path.exists():
        return
    def kept(out) -> None:
        with open(path, "rb") as src:
            for raw in src:
                # (a byte that is not UTF-8 is that line's damage, not the resume's traceback: found by a red team)
                line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                if (row := _row(line)) is not None and row["step"] <= step:
                    out.write(line + "\n")

    replace_file(path, path.with_suffix(".jsonl.tmp"), kept)


def _row(line: str) -> Optional[dict]:
    """A line of a metrics.jsonl as a row: a JSON object with an integer (not bool) step; None for anything else, a
    blank line, a line cut by a crash or still being written, a step of another type (a text "3": a red team found
    it raised TypeError in truncate_after)."""
    if not line.strip():
        return None
    try:
        row = json.loads(line)
    except ValueError:
        return None
    ok = isinstance(row, dict) and isinstance(row.get("step"), int) and not isinstance(row["step"], bool)
    return row if ok else None


def json_line(value) -> str:
    """One line of strict JSON (_jsonable's form); allow_nan=False: a NaN that got through fails here, loudly."""
    return json.dumps(_jsonable(value), allow_nan=False) + "\n"


def _jsonable(v):
    """v as strict JSON takes it, at any depth: NaN/inf as None (jq and JavaScript refuse them), numpy and torch arrays
    as lists and their scalars as numbers, tuples and sets as lists, and anything else JSON cannot hold (a datetime,
    an object) as its str(), so that a reward's log_extra values never stop a run (found by a red team)."""
    if v is None or isinstance(v, (str, bool, int)):
        return v
    if isinstance(v, float):
        return float(v) if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k if isinstance(k, str) else str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (set, frozenset)):
        try:
            v = sorted(v)   # (a set's own order differs between processes)
        except TypeError:
            v = list(v)
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    for method in ("tolist", "item"):   # numpy and torch: an array as (nested) lists, a scalar as a number
        try:
            out = getattr(v, method)()
        except Exception:   # no such method, or one that takes arguments or refuses (as .item() of an array)
            continue
        if out is None or isinstance(out, (str, bool, int, float, list)):
            return _jsonable(out)
    return str(v)


SAMPLE_ENDS = 1000   # characters a metrics row's `sample` keeps at each end of the step's first completion


def text_ends(text: str, keep: int = SAMPLE_ENDS) -> str:
    """`text`, or its first and last `keep` characters around a mark of how many were cut: a metrics row's `sample`
    was the whole completion, an environment's observations and all, in every row (found by a red team)."""
    if len(text) <= 2 * keep + 100:   # (a cut must save more than its mark takes)
        return text
    return f"{text[:keep]} [... {len(text) - 2 * keep} characters cut ...] {text[-keep:]}"


def read_metrics(run_dir, keep: Optional[Callable[[str], bool]] = None) -> list[dict]:
    """The rows of a run's metrics.jsonl ([] without one), each with the keys `keep` holds; see read_metrics_file."""
    path = Path(run_dir) / "metrics.jsonl"
    return read_metrics_file(path, keep)[0] if path.exists() else []


def read_metrics_file(path: Path, keep: Optional[Callable[[str], bool]] = None) -> tuple[list[dict], int]:
    """(rows, lines skipped) of a metrics.jsonl (_row: a JSON object with an integer step). A line cut by a crash
    (or still being written), or anything else, is skipped and counted rather than failing the reader. Read a line at
    a time; `keep`: which keys of each row to hold (the report's: a 100,000-step file of 250 MB took 1.6 GB held
    whole, found by a red team)."""
    rows, skipped = [], 0
    with open(path, "rb") as f:
        for raw in f:
            line = raw.decode("utf-8", "replace")
            if (row := _row(line)) is not None:
                rows.append(row if keep is None else {k: v for k, v in row.items() if keep(k)})
            elif line.strip():
                skipped += 1
    return rows, skipped


def summary_line(row: dict) -> str:
    def f(key, fmt, scale=1.0, suffix=""):
        v = row.get(key)
        return "-" if v is None else format(v * scale, fmt) + suffix
    return (f"step {row['step']:>5} | reward {f('reward/mean', '.3f')} | solved {f('success_rate', '.1f', 100, '%')}"
            f" | kl {f('kl', '.4f')} | clip {f('clip/fraction', '.3f')} | len {f('completion/mean_length', '.1f')}"
            f" | loss {f('loss', '+.4f')} | {f('time/step_s', '.2f', suffix='s')} | mem {f('memory/peak_mib', '.0f', suffix=' MiB')}")


# The phases of a step, as train.py times them (time/<phase>_s in every step row; None: not run). "gather":
# several processes exchanging their rollouts, waiting for the slowest (docs/algorithm.md §21).
PHASES = ("select", "rollout", "reward", "gather", "pack", "no_grad", "update", "diagnostics")


class PhaseTimer:
    """Wall-clock seconds per phase of one step: `with clock("rollout"): ...`; and the phase an exception
    left (`failed`, the innermost), for the trainer's out-of-memory error."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.failed: str | None = None
        self._t0 = time.perf_counter()

    @contextlib.contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        try:
            yield
        except BaseException:
            self.failed = self.failed or phase
            raise
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0

    def row(self) -> dict:
        """time/<phase>_s for every phase, and time/step_s since the timer was made."""
        return {**{f"time/{p}_s": self.seconds.get(p) for p in PHASES},
                "time/step_s": time.perf_counter() - self._t0}
