"""Where a run's metrics go: one small interface, several sinks.

    write(row)                 one metrics row (a step's, or an eval row), keyed by "step"
    samples(step, records)     a table of sample completions with their per-function rewards
    step_begin(step)           step `step` (1-based) is about to run (no-op but for the TRL API's callbacks)
    saved(step, path)          a checkpoint of step `step` was written at path (likewise)
    close()

JSONL (RUN/metrics.jsonl, RUN/samples.jsonl) always; TensorBoard (RUN/tensorboard) when installed or asked
for (`output.tensorboard`); Weights & Biases when `output.wandb_project` is set. `open_sinks` picks them
from the recipe; an explicitly requested sink that is not installed, or one that cannot be opened, is a SinkError
naming the field.

A write that fails (a full disk), or a run folder deleted or moved while the run trains, is a SinkError too: one
sentence naming the file and the checkpoint kept (a red team's find: a full disk ended the run in three chained OSError
tracebacks; a deleted run folder was trained on to the end, its metrics written into a deleted file and its
checkpoints into a new bare folder that neither --resume nor export accepted).
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import math
import os
import shutil
from pathlib import Path
from typing import Callable, Optional

from .metrics import MetricsWriter, _jsonable, json_line, truncate_after


class SinkError(Exception):
    pass


def scalars(row: dict) -> dict:
    """The row's plottable numbers (bools as 0/1; None, NaN, strings and lists left out), without "step"."""
    out = {}
    for k, v in row.items():
        if k == "step" or v is None or isinstance(v, (str, list, dict)):
            continue
        if hasattr(v, "item"):
            v = v.item()
        if isinstance(v, (bool, int, float)) and math.isfinite(float(v)):
            out[k] = float(v)
    return out


class Sink:
    def write(self, row: dict) -> None:
        raise NotImplementedError

    def samples(self, step: int, records: list[dict]) -> None:
        pass

    def step_begin(self, step: int) -> None:
        pass

    def saved(self, step: int, path: Path) -> None:
        pass

    def close(self) -> None:
        pass


class JsonlSink(Sink):
    def __init__(self, run_dir: Path, resume_step: Optional[int]):
        self.run_dir = Path(run_dir)
        self.samples_path = self.run_dir / "samples.jsonl"
        self.metrics: Optional[MetricsWriter] = None
        writing = self.run_dir / "metrics.jsonl"
        try:
            self.metrics = MetricsWriter(run_dir, resume_step=resume_step)
            writing = self.samples_path
            if resume_step is not None:  # tables of steps to be re-run go
                truncate_after(self.samples_path, resume_step)
        except OSError as exc:   # a resume on a full disk: the trimmed copy of metrics.jsonl could not be written
            for name in ("metrics.jsonl", "samples.jsonl"):   # (truncate_after's temp copy, cut short)
                _unlink(self.run_dir / f"{name}.tmp")
                _unlink(self.run_dir / f".tmp-{name}")
            if self.metrics is not None:
                self.metrics.close()
            raise SinkError(f"cannot write {writing} ({_os_reason(exc, self.run_dir)}); nothing was trained: fix that "
                            "(free some space there), then run the same command again") from None
        self.folder = _identity(self.run_dir)
        self.broken = False

    def write(self, row: dict) -> None:
        self._write(self.metrics.path, lambda: self.metrics.write(row), row.get("step"))

    def samples(self, step: int, records: list[dict]) -> None:
        def append():
            with open(self.samples_path, "a") as f:
                f.write(json_line({"step": step, "samples": records}))

        self._write(self.samples_path, append, step)

    def _write(self, path: Path, write: Callable[[], None], step) -> None:
        """write(), or a SinkError where the run folder is gone or the write failed."""
        if (gone := self._folder_gone()) is not None:
            self.broken = True
            raise SinkError(f"the run folder {self.run_dir} {gone} while the run trained: stopped at step {step}, "
                            "as nothing more of it could be kept there" + (
                                ". If it was moved, continue the run from its new place: lowmem-grpo train --resume "
                                "NEW_FOLDER" if "moved" in gone else ""))
        try:
            write()
        except OSError as exc:
            self.broken = True
            raise SinkError(f"cannot write {path} ({_os_reason(exc, self.run_dir)}): the run stopped at step {step}; "
                            + _kept(self.run_dir)) from None

    def _folder_gone(self) -> Optional[str]:
        """How the run folder went since the sink opened, or None while it is there."""
        try:
            if os.fstat(self.metrics._file.fileno()).st_nlink == 0:
                return "was deleted (its metrics.jsonl with it)"
            here = _identity(self.run_dir)
        except FileNotFoundError:
            return "was deleted or moved"
        except OSError:   # (cannot tell: the write says what is wrong)
            return None
        return None if here == self.folder else "was deleted or moved (another folder is at its path now)"

    def close(self) -> None:
        try:
            self.metrics.close()
        except OSError:   # (only after a failed write: every row is flushed as it is written)
            if not self.broken:
                raise


def _identity(folder: Path) -> tuple:
    st = os.stat(folder)
    return st.st_dev, st.st_ino


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def _os_reason(exc: OSError, run_dir: Path) -> str:
    """An OSError as a reason: its text, and on a full disk the space left there."""
    reason = exc.strerror or str(exc)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        try:
            reason += f"; {shutil.disk_usage(run_dir).free // 1024} KiB free on that filesystem"
        except OSError:
            pass
    return reason


def _kept(run_dir: Path) -> str:
    """What a run stopped by a failed write keeps, and how to go on."""
    from . import checkpoint as ckpt
    from .distributed import launched_size
    from .resume import resume_command

    last = ckpt.latest(run_dir)
    if last is None:
        return "no checkpoint was written yet: fix that (free some space there), then start the run again"
    return (f"its last checkpoint, {last}, is kept: fix that (free some space there), then resume with: "
            f"{resume_command(run_dir, launched_size())}")


def samples_markdown(records: list[dict]) -> str:
    if not records:
        return "(no samples)"
    cols = list(records[0])
    cell = lambda v: (f"{v:.3f}" if isinstance(v, float) else str(v)).replace("|", "\\|").replace("\n", " ")
    return "\n".join(["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
                     + ["| " + " | ".join(cell(r.get(c)) for c in cols) + " |" for r in records])


class TensorBoardSink(Sink):
    def __init__(self, run_dir: Path, resume_step: Optional[int]):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: a resumed run drops the events of steps it is about to run again. A fresh run passes 0: torch
        # writes the session start that purges only with one, and TensorBoard's server purges only at a start after
        # the first (found by a red team: without it the server showed a re-run step twice)
        self.writer = SummaryWriter(str(Path(run_dir) / "tensorboard"),
                                    purge_step=0 if resume_step is None else resume_step + 1)
        self.folder, self.broken = Path(run_dir) / "tensorboard", False

    def write(self, row: dict) -> None:
        step = int(row["step"])
        with self._failing(step):
            for k, v in scalars(row).items():
                self.writer.add_scalar(k, v, step)
            rates = [x for x in row.get("success_rate/per_prompt") or [] if x is not None]
            if rates:
                import numpy as np

                self.writer.add_histogram("success_rate/per_prompt", np.asarray(rates), step)
            self.writer.flush()

    def samples(self, step: int, records: list[dict]) -> None:
        with self._failing(step):
            self.writer.add_text("samples", samples_markdown(records), step)
            self.writer.flush()

    @contextlib.contextmanager
    def _failing(self, step: int):
        """A failed write of the events file (a full disk, a deleted folder) as a SinkError, not tensorboard's
        traceback."""
        try:
            yield
        except OSError as exc:
            self.broken = True
            raise SinkError(f"output.tensorboard: cannot write {self.folder} ({_os_reason(exc, self.folder.parent)}): "
                            f"the run stopped at step {step}; {_kept(self.folder.parent)}") from None

    def close(self) -> None:
        try:
            self.writer.close()
        except OSError:   # (after a failed write; a folder deleted meanwhile: events lost, the run's metrics.jsonl says)
            if not self.broken:
                raise


class WandbSink(Sink):
    def __init__(self, run_dir: Path, project: str, config: dict, resume_step: Optional[int],
                 log: Callable[[str], None]):
        import wandb

        self.wandb = wandb
        # One W&B run per run directory, found again on resume through the id kept beside the metrics (written once
        # wandb.init has taken it); a restart (resume_step -1), whose metrics go, starts a new one.
        id_file = Path(run_dir) / "wandb_id.txt"
        known = id_file.read_text().strip() if id_file.exists() and resume_step != -1 else ""
        run_id = known or wandb.util.generate_id()
        kwargs = dict(project=project, id=run_id, dir=str(run_dir), config=config, name=Path(run_dir).name)
        self.run = self._rewound(kwargs, resume_step, log) if known and resume_step is not None else None
        if self.run is None:
            self.run = wandb.init(**kwargs, resume="allow")
        id_file.write_text(run_id)

    def _rewound(self, kwargs: dict, step: int, log: Callable[[str], None]):
        """The run rewound to the checkpoint's step (wandb.init's resume_from): W&B ignores a step at or below the last
        it holds, so a plain resume kept the stopped run's values of the steps run again (found by a red team). None
        where W&B cannot rewind (offline, an older wandb, a server without the feature): then resumed as it is."""
        lost = (f"W&B may keep the values the stopped run logged after step {step} instead of their re-run "
                "(metrics.jsonl and TensorBoard hold the re-run's)")
        if os.environ.get("WANDB_MODE") in ("offline", "dryrun"):
            log(f"[lowmem-grpo] W&B offline mode (WANDB_MODE) cannot rewind run {kwargs['id']} to step {step}: {lost}")
            return None
        try:
            return self.wandb.init(**kwargs, resume_from=f"{kwargs['id']}?_step={step}")
        except Exception as exc:
            log(f"[lowmem-grpo] W&B could not rewind run {kwargs['id']} to step {step} ({_one_line(exc)}), so it is "
                f"resumed as it is: {lost}")
            return None

    def write(self, row: dict) -> None:
        self.run.log(scalars(row), step=int(row["step"]))

    def samples(self, step: int, records: list[dict]) -> None:
        if records:
            cols = list(records[0])
            table = self.wandb.Table(columns=cols, data=[[_jsonable(r.get(c)) for c in cols] for r in records])
            self.run.log({"samples": table}, step=step)

    def close(self) -> None:
        self.run.finish()


class Sinks(Sink):
    """All of a run's sinks behind the one interface (what Trainer.metrics is)."""

    def __init__(self, sinks: list[Sink]):
        self.sinks = sinks
        self.closed = False
        self.failed = False   # a write failed (a SinkError): the run is ending on that error, which close keeps

    @property
    def names(self) -> list[str]:
        return [type(s).__name__ for s in self.sinks]

    def write(self, row: dict) -> None:
        with self._failing():
            for s in self.sinks:
                s.write(row)

    def samples(self, step: int, records: list[dict]) -> None:
        with self._failing():
            for s in self.sinks:
                s.samples(step, records)

    @contextlib.contextmanager
    def _failing(self):
        try:
            yield
        except SinkError:
            self.failed = True
            raise

    def step_begin(self, step: int) -> None:
        for s in self.sinks:
            s.step_begin(step)

    def saved(self, step: int, path: Path) -> None:
        for s in self.sinks:
            s.saved(step, path)

    def close(self) -> None:
        """Close every sink once (the trainer closes on every way out, possibly twice)."""
        if self.closed:
            return
        self.closed = True
        first = None
        for s in self.sinks:   # each of them, whatever one raises; after a failed write, quietly (a red team's find:
            try:               # a deleted run folder's SinkError was replaced by TensorBoard's traceback from close)
                s.close()
            except Exception as exc:
                first = first or exc
        if first is not None and not self.failed:
            raise first


def tensorboard_available() -> bool:
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:  # torch raises ImportError when the tensorboard package is missing
        return False
    return True


def wandb_available() -> bool:
    """Whether wandb can be imported (without importing it: it is slow)."""
    return importlib.util.find_spec("wandb") is not None


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def open_sinks(run_dir: Path, output, config: dict, resume_step: Optional[int],
               log: Callable[[str], None] = print) -> Sinks:
    """`output`: the recipe's OutputConfig; `config`: the recipe as a dict (for W&B). A sink that cannot be opened
    (wandb.init without a login or a network, a TensorBoard folder that cannot be written) is a SinkError naming its
    setting; the JSONL sink opens last, so that such a failure leaves no metrics.jsonl to refuse the next start."""
    have_tensorboard = output.tensorboard is not False and tensorboard_available()
    if output.tensorboard is True and not have_tensorboard:
        raise SinkError("output.tensorboard is true but tensorboard is not installed: pip install tensorboard "
                        "(or pip install 'lowmem-grpo[plots]'), or set output.tensorboard: auto or false")
    if output.wandb_project:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise SinkError(f"output.wandb_project is {output.wandb_project!r} but wandb is not installed: "
                            "pip install wandb (and wandb login), or set output.wandb_project to empty") from None
    opened: list[Sink] = []
    try:
        if output.wandb_project:
            try:
                opened.append(WandbSink(run_dir, output.wandb_project, config, resume_step, log))
            except Exception as exc:
                raise SinkError(f"output.wandb_project={output.wandb_project!r}: wandb.init failed: {_one_line(exc)} "
                                "(wandb login, or WANDB_MODE=offline, or set output.wandb_project to empty)") from None
        if have_tensorboard and output.tensorboard in (True, "auto"):
            try:
                opened.append(TensorBoardSink(run_dir, resume_step))
            except Exception as exc:
                raise SinkError(f"output.tensorboard={output.tensorboard!r}: cannot open a TensorBoard writer in "
                                f"{Path(run_dir) / 'tensorboard'}: {_one_line(exc)} (train into another output.dir, "
                                "or set output.tensorboard: false)") from None
        jsonl = JsonlSink(run_dir, resume_step)
    except BaseException:
        Sinks(opened).close()
        raise
    return Sinks([jsonl, *reversed(opened)])   # (in the order JSONL, TensorBoard, W&B)
