"""User code named in a recipe as 'package.module:attr' (a reward function, an environment class)."""

from __future__ import annotations

import importlib
from typing import Any


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
