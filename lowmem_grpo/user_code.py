"""User code named in a recipe as 'package.module:attr' (a reward function, an environment class)."""

from __future__ import annotations

import importlib
import sys
from typing import Any, Optional


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
