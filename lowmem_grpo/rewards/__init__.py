"""Verifiable rewards: the interface, the built-ins, and loading user functions.

A reward function has one signature:

    def reward(completions: list[str], *, prompts: list[str], rows: list[dict], **kwargs) -> list[float | None]

`completions[i]` was sampled for `prompts[i]`, whose dataset row (with its answer, tests, ...) is
`rows[i]`. It returns one score per completion; None means "cannot be scored" (for example an
unparseable gold answer): the completion is skipped, counted, and takes no part in its group's advantage.
`kwargs` are the recipe's `rewards.functions[].kwargs`.

Built-ins are named by a short name (`math`, `format`, `exact`); anything else is `package.module:function`.
"""

from __future__ import annotations

import importlib
from math import isfinite  # (not `import math`: the submodule rewards.math would shadow it)
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ..recipe import RewardsConfig

BUILTINS = {
    "math": "lowmem_grpo.rewards.math:math_reward",
    "format": "lowmem_grpo.rewards.format:format_reward",
    "exact": "lowmem_grpo.rewards.format:exact_reward",
    "code": "lowmem_grpo.rewards.code:code_reward",
    "code_binary": "lowmem_grpo.rewards.code:code_binary_reward",
    "countdown": "lowmem_grpo.rewards.countdown:countdown_reward",
}


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
    if isinstance(scores, torch.Tensor):
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


class Rewards:
    """The recipe's reward functions, loaded once, applied to a batch of completions."""

    def __init__(self, cfg: RewardsConfig):
        self.cfg = cfg
        self.functions = []
        problems = []
        for i, spec in enumerate(cfg.functions):
            try:
                self.functions.append((self._label(spec.function, i), resolve(spec.function), spec.weight, spec.kwargs))
            except RewardError as exc:
                problems.append(f"rewards.functions.{i}.function: {exc}")
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
