"""User code named in a recipe as 'package.module:attr' (a reward function, an environment class), and running it
with a deadline."""

from __future__ import annotations

import importlib
import sys
import threading
from typing import Any, Callable, Optional


def short_repr(value, n: int = 60) -> str:
    """A user-supplied value (a reward's output, an environment's, a dataset field) for an error message: its
    repr, cut to n characters."""
    text = repr(value)
    return text if len(text) <= n else text[: n - 3] + "..."


def import_named(target: str, label: str, error: type[Exception]) -> tuple[str, str, Any]:
    """(module name, attribute name, the attribute or None) for target 'package.module:attr'. Any failure of
    the module's import (user code) becomes error(f"{label}: cannot import module ...")."""
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import-time failure of user code is reported, not raised raw
        raise error(f"{label}: cannot import module {module_name!r}: {type(exc).__name__}: {exc}") from None
    return module_name, attr, getattr(module, attr, None)


def importable_name(obj) -> Optional[str]:
    """'module:name' when `obj` imports back by its module and name (defined at a module's top level, not in a
    script's __main__), so that a recipe can name it; else None (a lambda, a partial, a callable instance, a
    script's function: lowmem_grpo.trl puts those in a module made for the run)."""
    name = getattr(obj, "__name__", None)
    owner = sys.modules.get(getattr(obj, "__module__", None) or "")
    if isinstance(name, str) and name.isidentifier() and owner is not None and owner.__name__ != "__main__" \
            and getattr(owner, name, None) is obj:
        return f"{owner.__name__}:{name}"
    return None


class HungCalls:
    """Calls to user code run on a daemon thread each, with a deadline; a call past it is given up on, and its
    thread (Python cannot stop one) is left running and counted here, so that the caller can stop the run before
    such threads pile up (rollout/turns.py: an environment's calls; tool_calls.py: a tool's)."""

    def __init__(self):
        self._calls: list = []   # (thread, label) of the calls past their deadline
        self._lock = threading.Lock()

    def run(self, call: Callable[[], Any], timeout_s: float, label: str, thread_name: str) -> tuple[bool, Any]:
        """(True, what call() returned), or (False, None) where it had not returned after timeout_s (or raised:
        call() should catch what it means to report). RuntimeError where no thread can be started."""
        box: list = []
        worker = threading.Thread(target=lambda: box.append(call()), daemon=True, name=thread_name)
        worker.start()
        worker.join(timeout_s)
        if not box:
            with self._lock:
                self._calls.append((worker, label))
            return False, None
        return True, box[0]

    def running(self) -> list[str]:
        """The labels of the calls past their deadline whose threads still run, one per call."""
        with self._lock:
            self._calls[:] = [(t, label) for t, label in self._calls if t.is_alive()]
            return [label for _, label in self._calls]

    def threads(self) -> list:
        with self._lock:
            return [t for t, _ in self._calls]
