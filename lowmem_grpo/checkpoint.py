"""Checkpoints that a crash cannot half-write.

A checkpoint is a folder `checkpoints/step-NNNNNN/` holding the LoRA adapter (peft format) and
`trainer_state.pt` (optimizer, scheduler, RNG states, step; under torchrun, every process's RNG states). It is written under a temporary name
(`.tmp-step-NNNNNN`), flushed to disk, and renamed: a rename within one filesystem is atomic, so resume
only ever sees complete checkpoints. Older checkpoints are deleted only after the new one is in place.
A write that fails (a full disk) removes its partial folder and raises CheckpointWriteError; the earlier
checkpoints are untouched. trainer_state.pt carries a format number (FORMAT); load_trainer_state checks what it
reads (entries, types, format, loop fields, the optimizer state's shapes) so that resume fails at once, in one
line, instead of with a KeyError or, after a whole rollout, a shape mismatch in the first update.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Iterable, Optional

import numpy as np
import torch

from .durable import fsync_dir, fsync_tree, replace_file

PREFIX = "step-"
FORMAT = 1   # trainer_state.pt's layout; raise it when a change would break an older reader (checkpoints without
             # "format" predate it and are format 1)


class CheckpointWriteError(Exception):
    """A checkpoint could not be written (a full disk, a lost mount): its partial folder was removed, and the
    checkpoints before it are intact. folder: the checkpoint it was writing; cause: the underlying error."""

    def __init__(self, message: str, folder: Path, cause: BaseException):
        super().__init__(message)
        self.folder, self.cause = folder, cause


class TrainerStateError(ValueError):
    """A trainer_state.pt that this code cannot resume from: an entry missing or of the wrong type, a newer
    format, a loop field this version does not know, or an optimizer state for other trainable tensors."""


class NewerFormat(TrainerStateError):
    """trainer_state.pt was written by a newer lowmem-grpo (its format is above FORMAT)."""


def write_text_atomic(path: Path, text: str) -> None:
    """path's content replaced whole or not at all (a crash mid-write leaves the old file), flushed to disk before
    the rename (else a power cut can leave it empty: a run's recipe.yaml, which resume and export need). A failed
    write (a full disk) leaves no temp file; the same text is not written again (a plain resume on a full disk)."""
    path = Path(path)
    tmp = path.with_name(f".tmp-{path.name}")
    try:
        if path.is_file() and path.read_text() == text:
            tmp.unlink(missing_ok=True)   # a write cut short by a kill -9, else kept for good (found by a soak run)
            return
    except (OSError, UnicodeDecodeError):
        pass
    replace_file(path, tmp, lambda f: f.write(text))
    fsync_dir(path.parent)


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def seed_all(seed: int) -> None:
    """torch's, Python's and numpy's streams (those rng_state keeps) from one seed: a reward or environment that
    draws from random or numpy draws alike in two runs of a seed, and differently in each process (§21)."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(run_dir: Path, step: int, model, optimizer, scheduler, extra: Optional[dict] = None, keep_last: int = 2,
         rng: Optional[list] = None, adapter_files: Optional[dict] = None) -> Path:
    """rng: every process's rng_state(), in rank order, when several train together (docs/algorithm.md §21);
    None: this process's. adapter_files: {name: text} written into the adapter's folder beside its weights (they
    travel with it: exports copy the folder). A failed write (a full disk): CheckpointWriteError, its partial
    folder removed."""
    root = Path(run_dir) / "checkpoints"
    final = root / f"{PREFIX}{step:06d}"
    tmp = root / f".tmp-{PREFIX}{step:06d}"
    if not Path(run_dir).is_dir():   # (made again, it held checkpoints alone: no recipe.yaml, so no resume, no export)
        raise CheckpointWriteError(f"could not write the checkpoint {final}: the run folder {run_dir} is gone (deleted "
                                   "or moved while the run trained?)", final, FileNotFoundError(str(run_dir)))
    try:
        root.mkdir(exist_ok=True)
    except OSError as exc:   # (a full disk, a read-only one)
        raise CheckpointWriteError(_write_failure(final, root.parent, exc, run_dir), final, exc) from exc
    for stale in root.glob(".tmp-*"):  # saves cut short by a crash (kill -9 mid-save)
        shutil.rmtree(stale, ignore_errors=True)
    for stale in root.glob(".old-*"):  # deletions cut short by a crash
        shutil.rmtree(stale, ignore_errors=True)
    rng = rng or [rng_state()]
    state = {"format": FORMAT, "step": step, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
             "rng": rng[0], "rng_per_process": rng, "extra": extra or {}}
    try:
        tmp.mkdir()
        model.save_pretrained(tmp / "adapter")
        for name, text in (adapter_files or {}).items():
            (tmp / "adapter" / name).write_text(text, encoding="utf-8")
        torch.save(state, tmp / "trainer_state.pt")
        fsync_tree(tmp)
    except BaseException as exc:
        failure = _write_failure(final, root, exc, run_dir) if isinstance(exc, WRITE_ERRORS) else None
        shutil.rmtree(tmp, ignore_errors=True)   # a partial folder on a full disk would keep it full
        if failure is not None:
            raise CheckpointWriteError(failure, final, exc) from exc
        raise
    if final.exists():  # a re-save of the same step (e.g. after a resume): replace it whole
        _remove(final)
    os.replace(tmp, final)
    fsync_dir(root)   # the rename (tmp's files are flushed already; the earlier checkpoints' were at their save)
    for old in complete_checkpoints(run_dir)[:-keep_last]:
        _remove(old)
    return final


def _write_errors() -> tuple:
    errors = [OSError, RuntimeError]   # torch.save on a full disk: RuntimeError "[enforce fail ...] unexpected pos"
    try:
        from safetensors import SafetensorError   # peft's adapter weights on a full disk

        errors.append(SafetensorError)
    except ImportError:
        pass
    return tuple(errors)


WRITE_ERRORS = _write_errors()


def _write_failure(final: Path, root: Path, exc: BaseException, run_dir) -> str:
    """CheckpointWriteError's text: which checkpoint, why (with the disk's free space, taken before the partial
    folder is removed), and what is intact."""
    lines = str(exc).strip().splitlines()
    cause = f"{type(exc).__name__}: {lines[0][:300] if lines else ''}".rstrip(": ")
    try:
        free = shutil.disk_usage(root).free
        cause += (f"; {f'{free / 2**20:.1f} MiB' if free >= 2**20 else f'{free // 1024} KiB'} free on that filesystem"
                  + (" (full?)" if free < 2**30 else ""))
    except OSError:
        pass
    last = latest(run_dir)
    return (f"could not write the checkpoint {final} ({cause}). Its partial folder was removed; "
            + (f"the earlier checkpoints are intact (latest: {last})" if last else "no checkpoint was written before it"))


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


def load_trainer_state(ckpt: Path, loop_fields: Optional[Iterable[str]] = None,
                       params: Optional[list] = None) -> dict:
    """A checkpoint's trainer state, checked (trainer_state_problem): TrainerStateError (NewerFormat for a newer
    format) when it cannot be resumed from. loop_fields: the loop-state fields this trainer knows (unknown ones
    are refused); params: the trainable parameters the optimizer state must fit (optimizer_state_problem)."""
    # weights_only=False: the state holds Python RNG tuples and numpy arrays that we wrote ourselves.
    saved = torch.load(Path(ckpt) / "trainer_state.pt", map_location="cpu", weights_only=False)
    problem = trainer_state_problem(saved, loop_fields)
    if problem is not None and problem.startswith(_NEWER):
        raise NewerFormat(problem)
    if problem is None and params is not None:
        problem = optimizer_state_problem(saved["optimizer"], params)
    if problem is None and Path(ckpt).name.startswith(PREFIX) and Path(ckpt).name[len(PREFIX):].isdigit() \
            and saved["step"] != step_of(ckpt):
        problem = (f"it holds step {saved['step']}, its folder is {Path(ckpt).name} (the trainer_state.pt of another "
                   "checkpoint?)")
    if problem is not None:
        raise TrainerStateError(problem)
    return saved


_NEWER = "written by a newer lowmem-grpo"


def trainer_state_problem(saved, loop_fields: Optional[Iterable[str]] = None) -> Optional[str]:
    """What makes a loaded trainer_state.pt unusable by this code (an entry missing or of the wrong type, a format
    it does not know, a loop field it does not know), or None. A state without "format" predates it: format 1."""
    if not isinstance(saved, dict):
        return f"expected a dict of the trainer's state, got {type(saved).__name__}"
    fmt = saved.get("format", 1)
    if isinstance(fmt, bool) or not isinstance(fmt, int) or fmt < 1:
        return f"its 'format' entry is {fmt!r}, not a format number (1..{FORMAT})"
    if fmt > FORMAT:
        return (f"{_NEWER} (format {fmt}; this one reads up to {FORMAT}): upgrade lowmem-grpo to resume it (the "
                "checkpoints before it are likely of that format too)")
    expected = {"optimizer": dict, "scheduler": dict, "step": int, "extra": dict, "rng": dict}
    for key, kind in expected.items():
        if key not in saved:
            return f"no {key!r} entry (not a lowmem-grpo trainer state, or one cut short)"
        if not isinstance(saved[key], kind) or (kind is int and isinstance(saved[key], bool)):
            return f"its {key!r} entry is a {type(saved[key]).__name__}, not a {kind.__name__}"
    if saved["step"] < 0:
        return f"its step is {saved['step']}"
    optimizer = saved["optimizer"]
    if not isinstance(optimizer.get("state"), dict) or not isinstance(optimizer.get("param_groups"), list) or not all(
            isinstance(g, dict) and isinstance(g.get("params"), list) for g in optimizer["param_groups"]):
        return "its optimizer state is not a torch optimizer's state_dict (no 'state' and 'param_groups')"
    per_process = saved.get("rng_per_process")
    for state in [saved["rng"]] + (per_process if isinstance(per_process, list) else []):
        if not isinstance(state, dict) or not {"torch", "python", "numpy"} <= set(state):
            return "its RNG state is incomplete (needs the torch, python and numpy states)"
    if per_process is not None and (not isinstance(per_process, list) or not per_process):
        return "its 'rng_per_process' entry is not a list of RNG states"
    loop = saved["extra"].get("loop", {})
    if not isinstance(loop, dict):
        return f"its loop state is a {type(loop).__name__}, not a dict"
    if loop_fields is not None:
        unknown = sorted(set(map(str, loop)) - set(loop_fields))
        if unknown:
            return (f"{_NEWER}? its loop state has field(s) this one does not know ({', '.join(unknown)}): upgrade "
                    "lowmem-grpo to resume it")
    return None


def _shapes(shapes: list, at_most: int = 4) -> str:
    distinct = list(dict.fromkeys("x".join(map(str, s)) or "scalar" for s in shapes))
    return ", ".join(distinct[:at_most]) + (", ..." if len(distinct) > at_most else "")


def optimizer_state_problem(saved_optimizer_state: dict, params: list) -> Optional[str]:
    """Whether a saved optimizer state_dict fits the trainable parameters `params` (in the optimizer's order): the
    number of tensors, and each one's moment shape (AdamW's exp_avg, bitsandbytes' state1) against its
    parameter's. A sentence saying how they differ, or None. (torch's load_state_dict checks only the count; a
    shape mismatch failed in the first update, after a whole rollout.)"""
    groups = saved_optimizer_state.get("param_groups") or []
    indices = [i for g in groups for i in g.get("params", [])]
    state = saved_optimizer_state.get("state") or {}
    here = [tuple(p.shape) for p in params]
    there = []
    for i in indices:
        moment = next((state.get(i, {}).get(k) for k in ("exp_avg", "state1")
                       if isinstance(state.get(i, {}).get(k), torch.Tensor)), None)
        there.append(tuple(moment.shape) if moment is not None else None)
    known = [s for s in there if s is not None]
    hint = "(a checkpoint of another run, or lora.r or lora.target_modules changed?)"
    if len(indices) != len(here):
        return (f"the optimizer state is for {len(indices)} tensors" + (f" of shapes {_shapes(known)}" if known else "")
                + f" and this run trains {len(here)} of shapes {_shapes(here)} {hint}")
    for k, (a, b) in enumerate(zip(there, here)):
        if a is not None and a != b:
            return (f"the optimizer state is for {len(indices)} tensors of shapes {_shapes(known)} and this run "
                    f"trains {len(here)} of shapes {_shapes(here)} (tensor {k}: {'x'.join(map(str, a))} there, "
                    f"{'x'.join(map(str, b))} here) {hint}")
    return None


def safetensors_problem(path: Path) -> Optional[str]:
    """Why safetensors cannot read a file's header (which also checks the file's length: one cut short), or None."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
    except Exception as exc:  # safetensors raises its own error types
        return str(exc)
    return None


def trainer_state_file_problem(path: Path) -> Optional[str]:
    """Why a trainer_state.pt is not a whole file (missing, or cut short: torch's zip archive without its end), or
    None; read from its ends only, so that resume says it before loading any model (torch.load said "OSError:
    [Errno 22] Invalid argument", after the model had loaded). What is inside is load_trainer_state's to check."""
    import zipfile

    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(4)
        if head != b"PK\x03\x04":   # not torch's zip format (an old pickle-format save): torch.load judges it
            return None if head else "an empty file (a write cut short)"
        with zipfile.ZipFile(path) as z:
            size = path.stat().st_size
            cut = [i.filename for i in z.infolist() if i.header_offset + i.compress_size > size]
    except FileNotFoundError:
        return "missing"
    except (OSError, zipfile.BadZipFile, ValueError) as exc:
        return f"truncated or corrupt: {exc} (a copy or a write cut short?)"
    return f"truncated: {cut[0]} runs past its end" if cut else None


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
    if not isinstance(parsed.get("peft_type"), str):
        return f"{cfg}: no peft_type (not a peft adapter's config)"
    weights = folder / "adapter_model.safetensors"
    if not weights.is_file():
        if (folder / "adapter_model.bin").is_file():
            return None
        return f"{folder}: no adapter_model.safetensors (the adapter's weights)"
    if (why := safetensors_problem(weights)) is not None:
        return f"{weights}: unreadable, truncated or corrupt ({why})"
    return None


def adapter_mismatch(folder: Path, lora) -> Optional[str]:
    """How a loadable adapter's rank and alpha differ from the recipe's `lora`, or None: peft loads a checkpoint's
    adapter whatever the recipe says (found by a red team: an edited lora.r trained on at the old rank)."""
    parsed = json.loads((Path(folder) / "adapter_config.json").read_text(encoding="utf-8"))
    made, wanted = {"r": parsed.get("r"), "alpha": parsed.get("lora_alpha")}, {"r": lora.r, "alpha": lora.alpha}
    changed = [f"lora.{k} ({made[k]!r} -> {wanted[k]!r})" for k in made if made[k] != wanted[k]]
    return f"its adapter was made with other settings than the recipe says: {'; '.join(changed)}" if changed else None
