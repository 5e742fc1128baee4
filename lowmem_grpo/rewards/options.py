"""The built-in rewards and their options: one typed schema per built-in, declared once.

A recipe's `rewards.functions[].kwargs` for a built-in are checked against its schema when the recipe is
validated (recipe.py calls `option_problems`), again when `Rewards` loads them, and the README's reward
options table is generated from these schemas (scripts/gen_recipe_reference.py).

The reference answer is not an option of any reward: `math` and `exact` read the row field named by
data.answer_field, which `Rewards(..., answer_field=)` passes to them, so a recipe names it once.

This module stays light (pydantic and the standard library; the reward modules it reads defaults from
import nothing heavier at module level), so validating a recipe does not import torch or math-verify.
"""

from __future__ import annotations

import re
import types
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from . import code as _code
from . import math as _math
from .format import DEFAULT_PATTERN
from .sandbox import SandboxLimits


class _Options(BaseModel):
    # extra="forbid": a misspelt option is an error, not a silently ignored default.
    model_config = ConfigDict(extra="forbid", frozen=True)


class MathOptions(_Options):
    extract: Union[list[str], str] = Field(
        list(_math.DEFAULT_EXTRACT), description="Answer extractors, tried in order (a list, or a comma-separated "
        f"string); the first that finds an answer wins. Allowed: {', '.join(_math.EXTRACTORS)}.")
    timeout: float = Field(float(_math.TIMEOUT_S), gt=0, description="Seconds per math-verify parse or comparison (rounded up to whole seconds).")
    workers: int = Field(_math.DEFAULT_WORKERS, ge=0, description="math-verify worker processes; 0: inline in the main thread.")

    @field_validator("extract")
    @classmethod
    def _known_extractors(cls, value):
        try:
            _math._extract_order(value)
        except ValueError as exc:   # it names the unknown extractors and the allowed ones
            raise ValueError(str(exc).removeprefix("math reward: ")) from None
        return value


class FormatOptions(_Options):
    pattern: str = Field(DEFAULT_PATTERN, description="Regular expression (DOTALL) the completion must match for 1.0; "
                         "the default accepts a bare integer.")

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, value: str) -> str:
        try:
            re.compile(value, re.DOTALL)
        except re.error as exc:
            raise ValueError(f"not a valid regular expression: {exc}") from None
        return value


class ExactOptions(_Options):
    """No options: the completion is compared with the row's data.answer_field."""


class CountdownOptions(_Options):
    use_all: bool = Field(False, description="Require every number of the row exactly once (the TinyZero rule); "
                          "false: each at most once.")
    numbers_field: str = Field("numbers", description="Row field holding the list of numbers.")
    target_field: str = Field("target", description="Row field holding the target number.")


class CodeOptions(SandboxLimits):
    """The code rewards' own options, then every sandbox limit (SandboxLimits, run_python's options)."""

    tests_field: str = Field("tests", description="Row field holding the tests: a list of Python statements "
                             "(usually asserts), or a JSON string of one.")
    workers: int = Field(_code.DEFAULT_WORKERS, ge=1, description="Completions run in parallel (one sandboxed program each).")
    timeout: float = Field(_code.DEFAULT_TEST_TIMEOUT_S, gt=0, description="Seconds allowed for the solution's top level and for each test.")
    total_timeout: Optional[float] = Field(
        None, gt=0, description="Wall-clock seconds for one completion's whole program; null: timeout * (tests + 1) + 2.")
    allow_weak_sandbox: bool = Field(
        False, description="Run model-written code even where the sandbox lacks full isolation (namespaces, minimal "
        "root, uid drop; docs/sandbox.md); false: the reward refuses to start there, naming what is missing.")


@dataclass(frozen=True)
class Builtin:
    function: str                 # 'module:function' of the implementation
    options: type[BaseModel]      # the schema of its recipe kwargs
    reads_answer: bool = False    # called with answer_field=data.answer_field
    startup: Optional[str] = None  # 'module:function' called with the kwargs when loaded: lines to log; raises to refuse


BUILTINS: dict[str, Builtin] = {
    "math": Builtin("lowmem_grpo.rewards.math:math_reward", MathOptions, reads_answer=True),
    "format": Builtin("lowmem_grpo.rewards.format:format_reward", FormatOptions),
    "exact": Builtin("lowmem_grpo.rewards.format:exact_reward", ExactOptions, reads_answer=True),
    "code": Builtin("lowmem_grpo.rewards.code:code_reward", CodeOptions, startup="lowmem_grpo.rewards.code:startup_report"),
    "code_binary": Builtin("lowmem_grpo.rewards.code:code_binary_reward", CodeOptions,
                           startup="lowmem_grpo.rewards.code:startup_report"),
    "countdown": Builtin("lowmem_grpo.rewards.countdown:countdown_reward", CountdownOptions),
}


def option_names(model: type[BaseModel]) -> list[str]:
    """The model's fields, its own before inherited ones (the code rewards' own options before the sandbox's)."""
    own = [n for n in model.model_fields if n in vars(model).get("__annotations__", {})]
    return own + [n for n in model.model_fields if n not in own]


def type_name(ann: Any) -> str:
    """A field's type as a reader writes it: 'float | None', 'list[str] | str'."""
    if ann is type(None):
        return "None"
    origin, args = get_origin(ann), get_args(ann)
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin is not None:
        return f"{getattr(origin, '__name__', origin)}[{', '.join(type_name(a) for a in args)}]"
    return getattr(ann, "__name__", str(ann))


def _key(key: Any) -> str:
    return key if isinstance(key, str) and key.strip() else repr(key)


def option_problems(function: str, kwargs: dict) -> list[tuple[str, str]]:
    """(option, message) for each unknown or invalid option of a built-in reward; [] for a valid set, and
    for anything that is not a built-in (a user function's kwargs are checked against its signature)."""
    spec = BUILTINS.get(function)
    if spec is None or not isinstance(kwargs, dict):
        return []
    model = spec.options
    names = option_names(model)
    allowed = f"allowed: {', '.join(names)}" if names else "it takes no options"
    problems, known = [], {}
    for key, value in kwargs.items():
        if key == "answer_field":
            if spec.reads_answer:
                problems.append((key, f"reward {function!r} reads the reference answer from the row field "
                                      "data.answer_field: set it there, not in this reward's kwargs"))
            else:
                problems.append((key, f"unknown option of reward {function!r} (it does not read the reference "
                                      f"answer; {allowed})"))
        elif key not in model.model_fields:
            problems.append((_key(key), f"unknown option of reward {function!r} ({allowed})"))
        else:
            known[key] = value
    try:
        # strict: a YAML value of the wrong type is an error, not coerced ('false' is not a bool)
        model.model_validate(known, strict=True)
    except ValidationError as exc:
        problems += _type_problems(function, model, known, exc)
    return problems


def _type_problems(function: str, model: type[BaseModel], given: dict, exc: ValidationError) -> list[tuple[str, str]]:
    errors: dict[str, list[dict]] = {}
    for err in exc.errors():
        errors.setdefault(str(err["loc"][0]), []).append(err)
    out = []
    for name, errs in errors.items():
        value = given.get(name)
        expected = type_name(model.model_fields[name].annotation)
        first = errs[0]
        ctx = first.get("ctx") or {}
        if len(errs) == 1 and first["type"] == "value_error":    # a validator's own message (regex, extractor)
            msg = str(ctx.get("error", first["msg"]))
        elif len(errs) == 1 and {"ge", "gt", "le", "lt"} & set(ctx):
            msg = f"{first['msg'][0].lower()}{first['msg'][1:]} (got {value!r})"
        else:
            msg = f"must be {expected}, got {value!r} ({type(value).__name__})"
        out.append((name, f"reward {function!r}: {msg}"))
    return out


def option_reference() -> list[tuple[str, str, str, str, str]]:
    """(rewards, option, type, default, meaning) for every built-in's options: the README table. Built-ins
    sharing a schema (code, code_binary) share their rows."""
    groups: dict[type[BaseModel], list[str]] = {}
    for name, spec in BUILTINS.items():
        groups.setdefault(spec.options, []).append(name)
    rows = []
    for model, rewards in groups.items():
        label = ", ".join(f"`{r}`" for r in rewards)
        names = option_names(model)
        if not names:
            rows.append((label, "", "", "", (model.__doc__ or "").strip()))
        for n in names:
            field = model.model_fields[n]
            default = field.default
            shown = f"'{default}'" if isinstance(default, str) else repr(default)
            rows.append((label, n, type_name(field.annotation), shown, field.description or ""))
    return rows
