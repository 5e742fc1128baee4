"""Calling conventions of user reward functions: which one a function is called in, and whether the recipe's
kwargs fit it (rewards/__init__.py calls the functions; this module only reads signatures).

A reward function is called in one of two conventions: lowmem-grpo's own, or TRL's (GRPOTrainer, TRL 1.x),
so that reward code written for TRL runs unchanged.

lowmem-grpo's:

    def reward(completions: list[str], *, prompts: list[str], rows: list[dict], tolerance: int = 5) -> list[float | None]

`completions[i]` (text) was sampled for `prompts[i]` (the prompt text the model saw), whose dataset row (with
its answer, tests, ...) is `rows[i]`. It returns one score per completion; None means "cannot be scored"
(for example an unparseable gold answer): the completion is skipped, counted, and takes no part in its
group's advantage, whatever the other functions say.

TRL's: every argument by keyword: prompts=, completions=, completion_ids= (each completion's token ids),
trainer_state= (transformers' TrainerState: .global_step and .max_steps in optimizer updates, .epoch and
.num_train_epochs where the train set's size is known, an empty .log_history), log_metric=, log_extra=, and every
dataset column but the prompt field, each a keyword holding one value per completion (solution=[...]). For a row
whose prompt is a list of chat messages, prompts[i] is that list (as given to the chat template: with
data.system_prompt when it was added) and completions[i] is [{"role": "assistant", "content": text}]; else both are
text (the prompt as the model saw it, templates applied). None means "this function does not apply to this
completion": the weighted sum leaves it out, and only a completion that every function returned None for has no
reward (it is skipped).

Which convention is `rewards.functions[].convention`; `auto` (the default) follows one rule: a function with a
parameter named `rows` is lowmem-grpo's; else one that accepts `completions` by keyword (a parameter of that
name, or **kwargs) is TRL's, its other required parameters being what TRL passes or dataset columns (one that
is neither is an error naming it at the first batch; a function without **kwargs gets only the arguments it
names); anything else fits neither, an error naming the function and what each convention needs. So a function
without `rows`, like f(completions, **kwargs), is called TRL's way: for a text dataset that passes the same
text completions and prompts, but no rows=, so one that reads kwargs["rows"] needs `convention: lowmem`. A
function of either convention may be `async def`: the coroutines of one batch are awaited together,
concurrently, on an event loop.

TRL's way also passes log_metric(name, value) (a scalar, averaged over the step's calls: the metrics row's
reward_metric/<name>) and log_extra(column, values) (one value per completion: a column of the sample table).
With an environment on (environment.name; TRL's environment_factory=), it also passes environments= (TRL 1.16's
name): one per completion, its episode's environment instance (environment.for_rewards: for TRL's tools, the
environment_factory's instance), held until the batch is scored. Without one, a TRL-shaped function that
requires it is an error naming it when the run starts (and in `lowmem-grpo validate`); one that gives it a
default runs without it. What TRL passes and this trainer does not would be in TRL_NOT_PASSED (none today).
"""

from __future__ import annotations

import inspect
from typing import Callable, Optional

from ..user_code import kwargs_type_problems

_PASSED = ("prompts", "rows")   # keyword arguments every lowmem-grpo-convention reward receives from the trainer
TRL_PASSED = ("prompts", "completions", "completion_ids", "trainer_state", "log_metric", "log_extra",
              "environments")  # (+ columns)
# Of TRL_PASSED, those passed only with an environment on: name -> what it is
WITH_ENVIRONMENT = {"environments": "the episodes' environment instances, one per completion"}
# What TRL's GRPOTrainer (1.16) passes to reward functions as well, and this trainer does not (yet): name -> what it is
TRL_NOT_PASSED: dict[str, str] = {}
CONVENTIONS = ("auto", "lowmem", "trl")
_LOWMEM_NEEDS = "a parameter named `rows`: f(completions, *, prompts, rows, each recipe kwarg)"
_TRL_NEEDS = ("`completions` accepted by keyword, every other required parameter too (prompts, completion_ids, "
              "trainer_state or a dataset column): f(completions, **kwargs)")


def _parameters(fn: Callable):
    """The function's parameters, or None when it cannot be inspected (some C callables: a bad call still
    fails, with the reward named)."""
    try:
        return inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None


def _keywords(params) -> tuple[list[str], bool]:
    """(parameters that can be passed by keyword, whether it takes **kwargs)."""
    names = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return names, any(p.kind is p.VAR_KEYWORD for p in params.values())


def _kwarg_problems(name: str, fn: Callable, params, kwargs: dict, passed: tuple) -> list[tuple[str, str]]:
    """(key, message) for each recipe kwarg the function cannot take, that the trainer passes itself, or whose
    value is not of its parameter's annotated type (the environment kwargs' rule: user_code.kwargs_type_problems)."""
    accepted, takes_any = _keywords(params) if params is not None else ([], True)
    problems = []
    for key in kwargs:
        if key in passed:
            problems.append((f"kwargs.{key}", f"reward {name!r}: {key!r} is passed by the trainer, not a kwarg"))
        elif not takes_any and key not in accepted:
            problems.append((f"kwargs.{key}", f"reward {name!r} has no parameter {key!r} and no **kwargs "
                                              f"(its keyword parameters: {', '.join(accepted) or 'none'})"))
    fits = {k: v for k, v in kwargs.items() if k not in passed}
    return problems + kwargs_type_problems(f"reward {name!r}", fn, fits, "kwargs")


def signature_problems(name: str, fn: Callable, kwargs: dict) -> list[tuple[str, str]]:
    """(key, message) for each keyword argument a lowmem-grpo-convention function cannot accept: the recipe's
    kwargs, and prompts/rows, which every call passes. [] when it takes **kwargs or cannot be inspected."""
    params = _parameters(fn)
    if params is None:
        return []
    problems = _kwarg_problems(name, fn, params, kwargs, _PASSED)
    accepted, takes_any = _keywords(params)
    missing = [k for k in _PASSED if not takes_any and k not in accepted]
    if missing:
        problems.append(("function", f"reward {name!r} must accept the keyword arguments "
                                     f"{', '.join(missing)} (or **kwargs): every call passes prompts= and rows="))
    # what no call gives: the completions come first, by position, then prompts=, rows= and the recipe's kwargs
    # (an audit found `def f(completions, *, prompts, rows, alpha)` validated ok, then failed the first step)
    unfilled = [n for i, (n, p) in enumerate(params.items()) if i and p.default is p.empty and n not in _PASSED
                and n not in kwargs and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if unfilled:
        problems.append(("kwargs", f"reward {name!r} requires {', '.join(unfilled)}, which no call passes: give "
                                   f"{'it' if len(unfilled) == 1 else 'them'} in this function's kwargs, or a default"))
    return problems


def _trl_misfit(params) -> list[str]:
    """Why TRL's call (every argument by keyword, completions among them) cannot reach these parameters."""
    accepted, takes_any = _keywords(params)
    why = []
    if "completions" not in accepted and not (takes_any and "completions" not in params):
        why.append("it takes no `completions` by keyword" + (" (it is positional-only)" if "completions" in params else ""))
    positional = [n for n, p in params.items() if p.kind is p.POSITIONAL_ONLY and p.default is p.empty]
    if positional:
        why.append(f"it requires the positional-only parameter(s) {', '.join(positional)}")
    return why


def _not_passed_problems(name: str, params, environment: bool) -> list[tuple[str, str]]:
    """("function", message) for each argument the function requires that TRL passes and this trainer does not,
    or not without an environment (`environment`: whether the recipe names one)."""
    required = [n for n, p in params.items()
                if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return ([("function", f"reward {name!r} requires `{n}` ({TRL_NOT_PASSED[n]}), which TRL's GRPOTrainer passes and "
                          f"lowmem-grpo does not: give the parameter a default ({n}=None) and skip its use without it")
             for n in required if n in TRL_NOT_PASSED]
            + [("function", f"reward {name!r} requires `{n}` ({WITH_ENVIRONMENT[n]}), passed only when the recipe "
                            "names an environment (environment.name; TRL's environment_factory=): name one, or give the "
                            f"parameter a default ({n}=None)")
               for n in required if n in WITH_ENVIRONMENT and not environment])


def trl_signature_problems(name: str, fn: Callable, kwargs: dict, environment: bool = False) -> list[tuple[str, str]]:
    """(key, message) for what keeps a function from being called TRL's way: it must take completions= and
    every argument by keyword, and each recipe kwarg (none of TRL's own names), and require only what is passed
    (`environment`: whether the recipe names one). [] when it cannot be inspected."""
    params = _parameters(fn)
    if params is None:
        return []
    why = _trl_misfit(params)
    if why:
        return [("function", f"reward {name!r}{_signature(fn)} cannot be called TRL's way (convention: trl), which "
                             f"needs {_TRL_NEEDS}: {'; '.join(why)}")]
    return _not_passed_problems(name, params, environment) + _kwarg_problems(name, fn, params, kwargs, TRL_PASSED)


def _signature(fn: Callable) -> str:
    """' (its parameters)' for messages; '' when it cannot be inspected."""
    try:
        return f" {inspect.signature(fn)}"
    except (TypeError, ValueError):
        return ""


def calling_convention(name: str, fn: Callable, convention: str = "auto", kwargs: Optional[dict] = None,
                       environment: bool = False) -> tuple[str, list[tuple[str, str]]]:
    """('lowmem' or 'trl', problems) of a user function under rewards.functions[].convention, by the module
    docstring's rule; `environment`: whether the recipe names one. problems are (key, message), the key relative
    to the function's recipe entry."""
    kwargs = kwargs or {}
    if convention not in CONVENTIONS:
        return "lowmem", [("convention", f"{convention!r} is unknown; allowed: {', '.join(CONVENTIONS)}")]
    params = _parameters(fn)
    if convention == "lowmem" or (convention == "auto" and (params is None or "rows" in params)):
        return "lowmem", signature_problems(name, fn, kwargs)
    if convention == "trl":
        return "trl", trl_signature_problems(name, fn, kwargs, environment)
    why = _trl_misfit(params)
    if why:
        return "lowmem", [("function", f"reward {name!r}{_signature(fn)} fits neither calling convention: "
                                       f"lowmem-grpo's needs {_LOWMEM_NEEDS}; TRL's needs {_TRL_NEEDS}; but "
                                       f"{'; '.join(why)}")]
    return "trl", _not_passed_problems(name, params, environment) + _kwarg_problems(name, fn, params, kwargs,
                                                                                   TRL_PASSED)


def _required_columns(fn: Callable) -> list[str]:
    """A TRL-shaped function's required parameters that TRL does not pass itself: dataset columns it reads."""
    params = _parameters(fn)
    if params is None:
        return []
    accepted, _ = _keywords(params)
    return [n for n in accepted if params[n].default is params[n].empty and n not in TRL_PASSED]
