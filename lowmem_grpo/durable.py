"""Writing files so that a crash or a power cut leaves the old content or the new, never half of either: the new
content goes to a temporary file beside the target, is flushed to disk, and is renamed over it (a rename within
one filesystem is atomic); the folder's entry is flushed where the rename itself must last."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, TextIO


def replace_file(path: Path, tmp: Path, fill: Callable[[TextIO], None]) -> None:
    """path's content replaced by what fill() writes to the (text) file it is given, whole or not at all. A failure
    (a full disk, an exception in fill) leaves path as it was and removes tmp."""
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            fill(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def fsync_dir(path: Path) -> None:
    """Flush a folder's entries (the names in it) to disk: what makes a rename into it last."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """Flush every file under `path`, every folder below it and `path` itself to disk (before it is renamed into
    place: a checkpoint, an export)."""
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
        elif p.is_dir():
            fsync_dir(p)
    fsync_dir(path)
