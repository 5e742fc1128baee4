"""Run metrics: one JSON object per step in RUN_DIR/metrics.jsonl, and a one-line summary on stdout."""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from pathlib import Path


class MetricsWriter:
    def __init__(self, run_dir: Path, resume_step: int | None = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        if resume_step is not None:
            truncate_after(self.path, resume_step)
        self._file = open(self.path, "a")

    def write(self, row: dict) -> None:
        self._file.write(json.dumps({k: _jsonable(v) for k, v in row.items()}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def truncate_after(path: Path, step: int) -> None:
    """On resume, drop a JSONL file's rows of steps after the checkpoint (they will be run again) and any
    line cut by a crash; the file is replaced atomically."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines()
            if line.strip() and _row_step(line) is not None and _row_step(line) <= step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)


def _row_step(line: str):
    try:
        return json.loads(line).get("step")
    except (json.JSONDecodeError, AttributeError):  # a line cut by a crash, or not an object
        return None


def _jsonable(v):
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def read_metrics(run_dir) -> list[dict]:
    """The rows of a run's metrics.jsonl ([] without one); see read_metrics_file."""
    path = Path(run_dir) / "metrics.jsonl"
    return read_metrics_file(path)[0] if path.exists() else []


def read_metrics_file(path: Path) -> tuple[list[dict], int]:
    """(rows, lines skipped) of a metrics.jsonl: a row is a JSON object with an integer step. A line cut by a crash
    (or still being written), or anything else, is skipped and counted rather than failing the reader."""
    rows, skipped = [], 0
    for line in Path(path).read_bytes().decode("utf-8", "replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if isinstance(row, dict) and isinstance(row.get("step"), int) and not isinstance(row["step"], bool):
            rows.append(row)
        else:
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
