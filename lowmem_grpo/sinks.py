"""Where a run's metrics go: one small interface, several sinks.

    write(row)                 one metrics row (a step's, or an eval row), keyed by "step"
    samples(step, records)     a table of sample completions with their per-function rewards
    step_begin(step)           step `step` (1-based) is about to run (no-op but for the TRL API's callbacks)
    saved(step, path)          a checkpoint of step `step` was written at path (likewise)
    close()

JSONL (RUN/metrics.jsonl, RUN/samples.jsonl) always; TensorBoard (RUN/tensorboard) when installed or asked
for (`output.tensorboard`); Weights & Biases when `output.wandb_project` is set. `open_sinks` picks them
from the recipe; an explicitly requested sink that is not installed is a SinkError naming the field.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

from .metrics import MetricsWriter, _jsonable, truncate_after


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
        self.metrics = MetricsWriter(run_dir, resume_step=resume_step)
        self.samples_path = Path(run_dir) / "samples.jsonl"
        if resume_step is not None:  # tables of steps to be re-run go
            truncate_after(self.samples_path, resume_step)

    def write(self, row: dict) -> None:
        self.metrics.write(row)

    def samples(self, step: int, records: list[dict]) -> None:
        with open(self.samples_path, "a") as f:
            f.write(json.dumps({"step": step, "samples": [{k: _jsonable(v) for k, v in r.items()} for r in records]}) + "\n")

    def close(self) -> None:
        self.metrics.close()


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

        # purge_step: a resumed run drops the events of steps it is about to run again.
        self.writer = SummaryWriter(str(Path(run_dir) / "tensorboard"),
                                    purge_step=resume_step + 1 if resume_step is not None else None)

    def write(self, row: dict) -> None:
        step = int(row["step"])
        for k, v in scalars(row).items():
            self.writer.add_scalar(k, v, step)
        rates = [x for x in row.get("success_rate/per_prompt") or [] if x is not None]
        if rates:
            import numpy as np

            self.writer.add_histogram("success_rate/per_prompt", np.asarray(rates), step)
        self.writer.flush()

    def samples(self, step: int, records: list[dict]) -> None:
        self.writer.add_text("samples", samples_markdown(records), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink(Sink):
    def __init__(self, run_dir: Path, project: str, config: dict, resume_step: Optional[int]):
        import wandb

        self.wandb = wandb
        # One W&B run per run directory, found again on resume through the id kept beside the metrics.
        id_file = Path(run_dir) / "wandb_id.txt"
        run_id = id_file.read_text().strip() if id_file.exists() else wandb.util.generate_id()
        id_file.write_text(run_id)
        self.run = wandb.init(project=project, id=run_id, resume="allow", dir=str(run_dir), config=config,
                              name=Path(run_dir).name)

    def write(self, row: dict) -> None:
        self.run.log(scalars(row), step=int(row["step"]))

    def samples(self, step: int, records: list[dict]) -> None:
        if records:
            cols = list(records[0])
            table = self.wandb.Table(columns=cols, data=[[r.get(c) for c in cols] for r in records])
            self.run.log({"samples": table}, step=step)

    def close(self) -> None:
        self.run.finish()


class Sinks(Sink):
    """All of a run's sinks behind the one interface (what Trainer.metrics is)."""

    def __init__(self, sinks: list[Sink]):
        self.sinks = sinks
        self.closed = False

    @property
    def names(self) -> list[str]:
        return [type(s).__name__ for s in self.sinks]

    def write(self, row: dict) -> None:
        for s in self.sinks:
            s.write(row)

    def samples(self, step: int, records: list[dict]) -> None:
        for s in self.sinks:
            s.samples(step, records)

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
        for s in self.sinks:
            s.close()


def tensorboard_available() -> bool:
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:  # torch raises ImportError when the tensorboard package is missing
        return False
    return True


def open_sinks(run_dir: Path, output, config: dict, resume_step: Optional[int]) -> Sinks:
    """`output`: the recipe's OutputConfig; `config`: the recipe as a dict (for W&B)."""
    sinks: list[Sink] = [JsonlSink(run_dir, resume_step)]
    have_tensorboard = output.tensorboard is not False and tensorboard_available()
    if output.tensorboard is True and not have_tensorboard:
        raise SinkError("output.tensorboard is true but tensorboard is not installed: pip install tensorboard "
                        "(or pip install 'lowmem-grpo[plots]'), or set output.tensorboard: auto or false")
    if have_tensorboard and output.tensorboard in (True, "auto"):
        sinks.append(TensorBoardSink(run_dir, resume_step))
    if output.wandb_project:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise SinkError(f"output.wandb_project is {output.wandb_project!r} but wandb is not installed: "
                            "pip install wandb (and wandb login), or set output.wandb_project to empty") from None
        sinks.append(WandbSink(run_dir, output.wandb_project, config, resume_step))
    return Sinks(sinks)
