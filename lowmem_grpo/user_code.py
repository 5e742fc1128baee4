"""User code named in a recipe as 'package.module:attr' (a reward function, an environment class): importing
it, checking the recipe's kwargs against its annotations, and running it with a deadline."""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import threading
import types
import typing
from typing import Any, Callable, Optional


# The largest magnitude a reward (a reward function's score, an environment's step or final reward) may have: its
# square and a group's sum of squares stay finite in float64 (max ~1.8e308); past it, the advantages' std overflowed
# and nothing was learned (found by audits)
MAX_SCORE = 1e100


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
        raise error(f"{label}: cannot import module {module_name!r}: {type(exc).__name__}: {exc}"
                    f"{_where_looked(module_name, exc)}") from None
    return module_name, attr, getattr(module, attr, None)


def _where_looked(module_name: str, exc: Exception) -> str:
    """Where Python looked and how to fix it, when the user's module itself (not one it imports) was not found;
    else ''. (An audit found a module next to the recipe, run from another folder, reported without a hint.)"""
    missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
    if not missing or not (module_name == missing or module_name.startswith(missing + ".")):
        return ""
    top = module_name.split(".")[0]
    return (f" (searched the Python path and the current folder {os.getcwd()}: run from the folder that holds "
            f"{top + '/' if '.' in module_name else top + '.py'}, or add that folder to PYTHONPATH)")


# Annotations whose values a recipe can hold and validate can check; anything else (unannotated, Any, a class,
# a Literal, a Union of other things) is left to the code. bool is no int or float here (YAML's `yes`).
_SIMPLE = {int: "int", float: "float", str: "str", bool: "bool", list: "list", dict: "dict", type(None): "null"}


def _accepts(kind: type, value) -> bool:
    if kind is float:   # a whole number in YAML is an int
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is list:
        return isinstance(value, (list, tuple))
    return isinstance(value, kind)


def _simple_kinds(annotation) -> Optional[tuple]:
    """The simple types an annotation allows (Optional/Union of them, list[...]/dict[...] as list/dict), or None
    when it is anything else (left unchecked)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        kinds = [_simple_kinds(a) for a in typing.get_args(annotation)]
        return None if any(k is None for k in kinds) else tuple(k for ks in kinds for k in ks)
    kind = origin if origin in (list, dict) else annotation
    return (kind,) if kind in _SIMPLE else None


def kwargs_type_problems(what: str, fn: Callable, kwargs: dict, key: str) -> list[tuple[str, str]]:
    """(f"{key}.{kwarg}", message) for each recipe kwarg whose value is not of fn's parameter's simple annotated
    type (int, float, str, bool, list, dict, Optional of those); other annotations are not checked. `fn`: a
    function or a class (its constructor's parameters); `what` names it in the message ("reward 'm:f'"). One rule
    for environment kwargs and reward-function kwargs alike."""
    try:
        params = inspect.signature(fn, eval_str=True).parameters
    except Exception:   # a name the annotations use cannot be resolved, or no signature to read: nothing to check
        return []
    problems = []
    for name, value in kwargs.items():
        p = params.get(name)
        if p is None or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.annotation is p.empty:
            continue
        kinds = _simple_kinds(p.annotation)
        if kinds is not None and not any(_accepts(kind, value) for kind in kinds):
            allowed = " or ".join(dict.fromkeys(_SIMPLE[k] for k in kinds))
            problems.append((f"{key}.{name}", f"{what} takes {name} as {allowed}, got {short_repr(value)} "
                                              f"({type(value).__name__})"))
    return problems


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
