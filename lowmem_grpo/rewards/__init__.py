"""Verifiable rewards: the interface, the built-ins, and loading user functions.

A reward function has one signature:

    def reward(completions: list[str], *, prompts: list[str], rows: list[dict], **kwargs) -> list[float | None]

`completions[i]` was sampled for `prompts[i]`, whose dataset row (with its answer, tests, ...) is
`rows[i]`. It returns one score per completion; None means "cannot be scored" (for example an
unparseable gold answer): the completion is skipped, counted, and takes no part in its group's advantage.
`kwargs` are the recipe's `rewards.functions[].kwargs`.

Built-ins are named by a short name (options.BUILTINS: `math`, `code`, `countdown`, ...); their kwargs follow
a typed schema each (rewards/options.py). Anything else is `package.module:function`, and each of its kwargs
must be a parameter of the function (or the function takes **kwargs). The reference answer's row field is
data.answer_field alone: the built-ins that read it (`math`, `exact`) get it as `answer_field=`.

torch is imported only when a batch is scored, so that validating a recipe (which checks the built-ins'
options) does not import it.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from math import isfinite  # (not `import math`: the submodule rewards.math would shadow it)
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

from .options import BUILTINS as _SPECS
from .options import option_problems

if TYPE_CHECKING:
    import torch

    from ..recipe import RewardsConfig

BUILTINS = {name: spec.function for name, spec in _SPECS.items()}   # name -> 'module:function'
_PASSED = ("prompts", "rows")   # keyword arguments every reward receives from the trainer


class RewardError(Exception):
    """A reward function that cannot be loaded, raised, or returned something unusable."""


def resolve(name: str) -> Callable:
    target = BUILTINS.get(name, name)
    if ":" not in target:
        raise RewardError(f"reward {name!r}: not a built-in ({', '.join(sorted(BUILTINS))}) "
                          f"and not of the form 'package.module:function'")
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import-time failure of user code is reported, not raised raw
        raise RewardError(f"reward {name!r}: cannot import module {module_name!r}: {type(exc).__name__}: {exc}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RewardError(f"reward {name!r}: module {module_name!r} has no callable {attr!r}")
    return fn


def check_scores(name: str, scores, n: int) -> list[Optional[float]]:
    """The scores as floats (None = skip), or a RewardError saying what is wrong with them."""
    torch = sys.modules.get("torch")   # a tensor exists only once torch is imported
    if torch is not None and isinstance(scores, torch.Tensor):
        scores = scores.tolist()
    try:
        scores = list(scores)
    except TypeError:
        raise RewardError(f"reward {name!r} returned {type(scores).__name__}, expected a list of {n} numbers") from None
    if len(scores) != n:
        raise RewardError(f"reward {name!r} returned {len(scores)} scores for {n} completions")
    out: list[Optional[float]] = []
    for i, s in enumerate(scores):
        if s is None:
            out.append(None)
            continue
        if isinstance(s, bool) or not isinstance(s, (int, float)) and not hasattr(s, "__float__"):
            raise RewardError(f"reward {name!r}: score {i} is {s!r} ({type(s).__name__}), expected a number or None")
        try:  # e.g. a numpy array of several numbers has __float__ but refuses it (found by fuzzing)
            v = float(s)
        except (TypeError, ValueError, OverflowError) as exc:
            raise RewardError(f"reward {name!r}: score {i} is {s!r} ({type(s).__name__}), not a number: {exc}") from None
        if not isfinite(v):
            raise RewardError(f"reward {name!r}: score {i} is {v}, expected a finite number or None")
        out.append(v)
    return out


@dataclass
class RewardResult:
    total: torch.Tensor                 # [n] weighted sum; NaN where any function skipped
    per_function: dict[str, torch.Tensor]  # name -> [n] (NaN = skipped)
    errors: dict[str, int] = field(default_factory=dict)  # name -> completions scored 0 after an error
    skipped: int = 0


def signature_problems(name: str, fn: Callable, kwargs: dict) -> list[tuple[str, str]]:
    """(key, message) for each keyword argument a user reward function cannot accept: the recipe's kwargs,
    and prompts/rows, which every call passes. [] when it takes **kwargs or cannot be inspected."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):   # some C callables: a bad call still fails, with the reward named
        return []
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    accepted = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    problems = []
    for key in kwargs:
        if key in _PASSED:
            problems.append((f"kwargs.{key}", f"reward {name!r}: {key!r} is passed by the trainer, not a kwarg"))
        elif not takes_any and key not in accepted:
            problems.append((f"kwargs.{key}", f"reward {name!r} has no parameter {key!r} and no **kwargs "
                                              f"(its keyword parameters: {', '.join(accepted) or 'none'})"))
    missing = [k for k in _PASSED if not takes_any and k not in accepted]
    if missing:
        problems.append(("function", f"reward {name!r} must accept the keyword arguments "
                                     f"{', '.join(missing)} (or **kwargs): every call passes prompts= and rows="))
    return problems


class Rewards:
    """The recipe's reward functions, loaded once, applied to a batch of completions.

    answer_field: the row field holding the reference answer (the recipe's data.answer_field), passed to
    the built-ins that read it."""

    def __init__(self, cfg: RewardsConfig, *, answer_field: str):
        if not isinstance(answer_field, str) or not answer_field:
            raise RewardError(f"answer_field must be a non-empty row field name (data.answer_field), got {answer_field!r}")
        self.cfg = cfg
        self.answer_field = answer_field
        self.functions = []
        self.notes: list[str] = []   # start-up lines of the built-ins (e.g. the code sandbox's protections), to log
        problems = []
        for i, spec in enumerate(cfg.functions):
            try:
                fn = resolve(spec.function)
            except RewardError as exc:
                problems.append(f"rewards.functions.{i}.function: {exc}")
                continue
            kwargs = dict(spec.kwargs)
            builtin = _SPECS.get(spec.function)
            if builtin is None:
                found = signature_problems(spec.function, fn, kwargs)
            else:  # checked again here: a RewardsConfig can be built, or changed, without validation
                found = [(f"kwargs.{k}", m) for k, m in option_problems(spec.function, kwargs)]
                if builtin.reads_answer:
                    kwargs["answer_field"] = answer_field
                if builtin.startup and not found:   # e.g. the code rewards refuse a weak sandbox here, at load
                    try:
                        self.notes += resolve(builtin.startup)(**dict(spec.kwargs))
                    except Exception as exc:
                        found.append(("function", f"{type(exc).__name__}: {exc}"))
            problems += [f"rewards.functions.{i}.{k}: {m}" for k, m in found]
            self.functions.append((self._label(spec.function, i), fn, spec.weight, kwargs))
        if problems:
            raise RewardError("\n".join(problems))

    def _label(self, name: str, i: int) -> str:
        short = name.rsplit(":", 1)[-1]
        taken = [f[0] for f in getattr(self, "functions", [])]
        return short if short not in taken else f"{short}_{i}"

    @property
    def names(self) -> list[str]:
        return [f[0] for f in self.functions]

    def __call__(self, completions: list[str], prompts: list[str], rows: list[dict]) -> RewardResult:
        import torch

        n = len(completions)
        total = torch.zeros(n, dtype=torch.float64)
        per_fn, errors = {}, {}
        for name, fn, weight, kwargs in self.functions:
            try:
                scores = check_scores(name, fn(completions, prompts=prompts, rows=rows, **kwargs), n)
            except Exception as exc:
                if self.cfg.on_error == "raise":
                    if isinstance(exc, RewardError):
                        raise
                    raise RewardError(f"reward {name!r} raised {type(exc).__name__}: {exc}") from exc
                errors[name] = n
                scores = [0.0] * n
            values = torch.tensor([float("nan") if s is None else s for s in scores], dtype=torch.float64)
            per_fn[name] = values
            total += weight * values
        skipped = int(torch.isnan(total).sum())
        return RewardResult(total, per_fn, errors, skipped)
