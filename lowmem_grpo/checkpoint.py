"""Checkpoints that a crash cannot half-write.

A checkpoint is a folder `checkpoints/step-NNNNNN/` holding the LoRA adapter (peft format) and
`trainer_state.pt` (optimizer, scheduler, RNG states, step; under torchrun, every process's RNG states). It is written under a temporary name
(`.tmp-step-NNNNNN`), flushed to disk, and renamed: a rename within one filesystem is atomic, so resume
only ever sees complete checkpoints. Older checkpoints are deleted only after the new one is in place.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Optional

import numpy as np
import torch

PREFIX = "step-"


def write_text_atomic(path: Path, text: str) -> None:
    """path's content replaced whole or not at all (a crash mid-write leaves the old file)."""
    tmp = path.with_name(f".tmp-{path.name}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(run_dir: Path, step: int, model, optimizer, scheduler, extra: Optional[dict] = None, keep_last: int = 2,
         rng: Optional[list] = None) -> Path:
    """rng: every process's rng_state(), in rank order, when several train together (docs/algorithm.md §21);
    None: this process's."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step:06d}"
    tmp = root / f".tmp-{PREFIX}{step:06d}"
    for stale in root.glob(".tmp-*"):  # saves cut short by a crash
        shutil.rmtree(stale, ignore_errors=True)
    for stale in root.glob(".old-*"):  # deletions cut short by a crash
        shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir()
    model.save_pretrained(tmp / "adapter")
    rng = rng or [rng_state()]
    torch.save({"step": step, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "rng": rng[0], "rng_per_process": rng, "extra": extra or {}}, tmp / "trainer_state.pt")
    _fsync_tree(tmp)
    if final.exists():  # a re-save of the same step (e.g. after a resume): replace it whole
        _remove(final)
    os.replace(tmp, final)
    _fsync_tree(root)
    for old in complete_checkpoints(run_dir)[:-keep_last]:
        _remove(old)
    return final


def _remove(ckpt: Path) -> None:
    """Delete a checkpoint folder so that a crash midway never leaves a half-deleted one that still looks
    complete (trainer_state.pt kept, adapter gone): first an atomic rename out of the step- namespace."""
    doomed = ckpt.with_name(f".old-{ckpt.name}")
    shutil.rmtree(doomed, ignore_errors=True)
    os.replace(ckpt, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def complete_checkpoints(run_dir) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit()
             and (p / "trainer_state.pt").is_file() and (p / "adapter").is_dir()]   # (not a copy, step-3-old)
    return sorted(found, key=step_of)


def step_of(ckpt: Path) -> int:
    """The step a checkpoint folder holds, from its name (step-000042: 42)."""
    return int(Path(ckpt).name[len(PREFIX):])


def latest(run_dir) -> Optional[Path]:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def earlier_run(run_dir) -> Optional[str]:
    """What of a run `run_dir` already holds ("checkpoints up to step-000040", "its metrics.jsonl"), or None: a
    fresh run there would append to its metrics and resume or export from its checkpoints."""
    last = latest(run_dir)
    if last is not None:
        return f"checkpoints up to {last.name}"
    return "its metrics.jsonl" if (Path(run_dir) / "metrics.jsonl").is_file() else None


LOCK_NAME = ".lock"


class RunInUse(Exception):
    """Another live process trains in the run folder (it holds the folder's lock)."""


_HELD: dict = {}   # run folder -> [its locked lock file, holders in this process]


def lock_run(run_dir) -> Path:
    """An exclusive lock on the run folder until unlock_run: two processes writing one run interleave its metrics
    and checkpoints. flock: the kernel releases it when the process dies (kill -9 included), so a crashed run never
    stays locked. Within one process it is shared (a test, or the TRL API, may hold two trainers on one run).
    RunInUse names the holder's pid. Returns the key for unlock_run."""
    import fcntl

    key = Path(run_dir).resolve()
    if key in _HELD:
        _HELD[key][1] += 1
        return key
    f = open(key / LOCK_NAME, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "?"
        f.close()
        raise RunInUse(holder) from None
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    _HELD[key] = [f, 1]
    return key


def unlock_run(key: Path) -> None:
    held = _HELD.get(key)
    if held is None:
        return
    held[1] -= 1
    if held[1] <= 0:
        held[0].close()   # (closing the file releases the flock)
        del _HELD[key]


def rng_states(saved: dict) -> list:
    """The RNG states of a loaded trainer state, one per process that wrote it (older checkpoints: one)."""
    return saved.get("rng_per_process") or [saved["rng"]]


def load_trainer_state(ckpt: Path) -> dict:
    # weights_only=False: the state holds Python RNG tuples and numpy arrays that we wrote ourselves.
    return torch.load(Path(ckpt) / "trainer_state.pt", map_location="cpu", weights_only=False)


def adapter_problem(folder: Path) -> Optional[str]:
    """What makes a peft adapter folder unloadable (a missing or corrupt config or weights file: a copy cut short,
    a full disk), or None; checked before any model is loaded, so it is one clear line, not peft's traceback."""
    folder = Path(folder)
    cfg = folder / "adapter_config.json"
    if not cfg.is_file():
        return f"{folder}: no adapter_config.json (not a peft adapter folder)"
    try:
        parsed = json.loads(cfg.read_text(encoding="utf-8"))
    except (ValueError, OSError) as exc:
        return f"{cfg}: not a readable JSON file ({exc})"
    if not isinstance(parsed, dict):
        return f"{cfg}: expected a JSON object, got {type(parsed).__name__}"
    weights = folder / "adapter_model.safetensors"
    if not weights.is_file():
        if (folder / "adapter_model.bin").is_file():
            return None
        return f"{folder}: no adapter_model.safetensors (the adapter's weights)"
    try:
        from safetensors import safe_open

        with safe_open(str(weights), framework="pt") as f:  # reads the header, which also checks the file's length
            f.keys()
    except Exception as exc:  # safetensors raises its own error types
        return f"{weights}: unreadable, truncated or corrupt ({exc})"
    return None
