"""The live view of a run: a tqdm bar over steps (rate, ETA) on a terminal, plain summary lines in logs.

In a log file a bar would be a stream of carriage-return redraws, so off a terminal (output.progress:
auto) only the per-step summary lines are printed. With the bar on, log lines are written above it.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Callable, Optional


def use_bar(mode: str, stream=None) -> bool:
    if mode in ("bar", "lines"):
        return mode == "bar"
    stream = stream if stream is not None else sys.stderr
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # a closed or stream-less stderr
        return False


@contextlib.contextmanager
def library_bars(on: bool):
    """transformers' own progress bars (its "Loading weights" bar) on or off for the block, then as they were: off a
    terminal the log gets only the summary lines (found by a red team: that bar's redraws landed in logs)."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    if was and not on:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was and not on:
            hf_logging.enable_progress_bar()


class Progress:
    def __init__(self, total: int, initial: int, mode: str, log: Callable[[str], None], stream=None):
        self._log, self.bar = log, None
        stream = stream if stream is not None else sys.stderr
        if use_bar(mode, stream):
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", file=stream, dynamic_ncols=True,
                            desc="GRPO", smoothing=0.1)

    def log(self, message: str) -> None:
        if self.bar is None:
            self._log(message)
            return
        from tqdm import tqdm

        with tqdm.external_write_mode(file=self.bar.fp):  # clear the bar, print, redraw
            self._log(message)

    def update(self, row: Optional[dict] = None) -> None:
        if self.bar is None:
            return
        if row:
            parts = [f"{label} {row[k]:{fmt}}" for k, label, fmt in
                     (("reward/mean", "reward", ".3f"), ("success_rate", "solved", ".2f"), ("kl", "kl", ".4f"),
                      ("time/rollout_tokens_per_s", "gen tok/s", ".0f"))
                     if isinstance(row.get(k), (int, float))]
            self.bar.set_postfix_str(", ".join(parts), refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
