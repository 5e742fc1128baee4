"""Ctrl-C and SIGTERM during training: the first ends the run after its current step, checkpointed."""

from __future__ import annotations

import signal
import sys
from typing import Optional


class StopFlag:
    """First Ctrl-C (or SIGTERM: what docker stop, Slurm and Kubernetes send): finish the step, checkpoint, exit
    cleanly. Second: abort at once. (SIGTERM ended the run at once, losing every step since the last checkpoint.)"""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, log=print):
        self.requested = False
        self.signal: Optional[int] = None
        self._previous: dict = {}
        self._log = log

    def __enter__(self):
        self._previous = {sig: signal.signal(sig, self._handler) for sig in self.SIGNALS}
        return self

    def _handler(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested, self.signal = True, signum
        what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        self._log(f"\n[lowmem-grpo] {what}: stopping after this step, checkpointed ({what} again to abort now)")
        sys.stdout.flush()

    def __exit__(self, *exc):
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        return False
