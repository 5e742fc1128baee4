"""Verifiable rewards: the interface, the built-ins, and loading user functions.

A reward function is called in one of two conventions, lowmem-grpo's own or TRL's (GRPOTrainer, TRL 1.x),
so that reward code written for TRL runs unchanged; rewards/conventions.py says which and how (the rule
of `rewards.functions[].convention`). lowmem-grpo's:

    def reward(completions: list[str], *, prompts: list[str], rows: list[dict], tolerance: int = 5) -> list[float | None]

`completions[i]` (text) was sampled for `prompts[i]` (the prompt text the model saw), whose dataset row is
`rows[i]`; None means "cannot be scored": the completion is skipped. A TRL-shaped function's None means
"does not apply": the weighted sum leaves it out. A function of either convention may be `async def`: the
coroutines of one batch are awaited together, concurrently, on an event loop.

Either way `kwargs` are the recipe's `rewards.functions[].kwargs` (`tolerance` above): each must be a parameter of
the function, or it takes **kwargs (which lowmem-grpo's convention does not need; without it a mistyped key is an
error).

Built-ins are named by a short name (options.BUILTINS: `math`, `code`, `countdown`, ...); their kwargs follow
a typed schema each (rewards/options.py) and they are called lowmem-grpo's way. The reference answer's row
field is data.answer_field alone: the built-ins that read it (`math`, `exact`) get it as `answer_field=`.

torch is imported only when a batch is scored, so that validating a recipe (which checks the built-ins'
options and the user functions' conventions) does not import it.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import sys
from concurrent.futures import ThreadPoolExecutor
from math import ceil, isfinite  # (not `import math`: the submodule rewards.math would shadow it)
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

from ..user_code import MAX_SCORE, import_named  # (MAX_SCORE: imported from here by tests and scripts too)
from .conventions import (CONVENTIONS, TRL_PASSED, _keywords, _parameters, _required_columns,  # noqa: F401
                          calling_convention, signature_problems, trl_signature_problems)
from .options import BUILTINS as _SPECS
from .options import first_function_problem, option_problems

if TYPE_CHECKING:
    import torch

    from ..recipe import RewardsConfig

BUILTINS = {name: spec.function for name, spec in _SPECS.items()}   # name -> 'module:function'
# reward/<x> keys of a metrics row that are the total's, not a function's (diagnostics.rollout_stats): no function is
# labelled so (Rewards._label; found by a red team: a function called mean overwrote the total's reward/mean)
ROW_REWARD_KEYS = ("mean", "std", "skipped")


class RewardError(Exception):
    """A reward function that cannot be loaded, raised, or returned something unusable."""


def resolve(name: str) -> Callable:
    target = BUILTINS.get(name, name)
    if ":" not in target:
        raise RewardError(f"reward {name!r}: not a built-in ({', '.join(sorted(BUILTINS))}) "
                          f"and not of the form 'package.module:function'")
    module_name, attr, fn = import_named(target, f"reward {name!r}", RewardError)
    if not callable(fn):
        raise RewardError(f"reward {name!r}: module {module_name!r} has no callable {attr!r}")
    return fn




def check_scores(name: str, scores, n: int, trl: bool = False) -> list[Optional[float]]:
    """The scores as floats (None = skip), or a RewardError saying what is wrong with them. trl: a TRL-shaped
    function's scores, read as TRL 1.16 reads them (a red team's find: they were refused): a boolean (Python's,
    numpy's, torch's) as 1.0 or 0.0, and NaN as None (TRL turns None into NaN: both say "does not apply").
    lowmem-grpo's own functions get neither: a boolean there is most likely a verdict meant as a number."""
    torch = sys.modules.get("torch")   # a tensor exists only once torch is imported
    if torch is not None and isinstance(scores, torch.Tensor):
        scores = scores.tolist()
    try:
        if isinstance(scores, (dict, str, bytes)):   # iterable, but its keys or characters are no scores
            raise TypeError
        scores = list(scores)
    except TypeError:
        raise RewardError(f"reward {name!r} returned {type(scores).__name__}, expected a list of {n} numbers (one "
                          "per completion)") from None
    if len(scores) != n:
        raise RewardError(f"reward {name!r} returned {len(scores)} scores for {n} completions")
    out: list[Optional[float]] = []
    for i, s in enumerate(scores):
        if s is None:
            out.append(None)
            continue
        if trl and (isinstance(s, bool) or _not_real(s) == "a boolean"):
            s = float(s)   # (TRL's torch.tensor(scores, dtype=float32))
        if isinstance(s, bool) or not isinstance(s, (int, float)) and not hasattr(s, "__float__"):
            raise RewardError(f"reward {name!r}: score {i} is {s!r} ({type(s).__name__}), expected a number or None")
        kind = _not_real(s)
        if kind:   # numpy's and torch's bools and complex numbers have __float__ too (found by a red team)
            raise RewardError(f"reward {name!r}: score {i} is {s!r} ({type(s).__name__}, {kind}), expected a real "
                              "number or None")
        try:  # e.g. a numpy array of several numbers has __float__ but refuses it (found by fuzzing)
            v = float(s)
        except (TypeError, ValueError, OverflowError) as exc:
            raise RewardError(f"reward {name!r}: score {i} is {s!r} ({type(s).__name__}), not a number: {exc}") from None
        if trl and v != v:
            out.append(None)
            continue
        if not isfinite(v):
            raise RewardError(f"reward {name!r}: score {i} is {v}, expected a finite number or None")
        if abs(v) > MAX_SCORE:   # (an audit: rewards of +-1e200 overflowed the group std, and nothing was learned)
            raise RewardError(f"reward {name!r}: score {i} is {v:g}, beyond +-{MAX_SCORE:g}: its square overflows "
                              "the advantages' standard deviation; rescale the reward")
        out.append(v)
    return out


def _not_real(s) -> Optional[str]:
    """'a boolean' or 'a complex number' for a score of that kind that float() would take (a numpy bool is 1.0, a
    complex its real part with a ComplexWarning), as a Python bool is refused; else None."""
    if isinstance(s, complex):   # (numpy's complex128 is one)
        return "a complex number"
    dtype = getattr(s, "dtype", None)   # numpy scalars and 0-d arrays: dtype.kind; torch: torch.bool, is_complex
    if getattr(dtype, "kind", None) == "b" or str(dtype) == "torch.bool":
        return "a boolean"
    if getattr(dtype, "kind", None) == "c" or getattr(dtype, "is_complex", False):
        return "a complex number"
    return None


@dataclass
class RewardResult:
    total: torch.Tensor                 # [n] weighted sum; NaN where the completion is skipped
    per_function: dict[str, torch.Tensor]  # name -> [n] (NaN = skipped, or not applicable for a TRL-shaped function)
    errors: dict[str, int] = field(default_factory=dict)  # name -> completions scored 0 after an error
    skipped: int = 0
    metrics: dict[str, list] = field(default_factory=dict)  # TRL's log_metric(name, value): name -> the values logged
    extra: dict[str, list] = field(default_factory=dict)    # TRL's log_extra(column, values): one value per completion


def epochs_done(steps: int, prompts_per_step: int, train_rows: int) -> float:
    """Epochs through a train set of `train_rows` rows after `steps` steps of `prompts_per_step` prompts each (TRL's
    epoch: trainer_state.epoch, log_history's epoch)."""
    return steps * prompts_per_step / max(1, train_rows)


# ----------------------------------------------------------------------------------------------------
# Signatures: which convention a function is called in, and whether the recipe's kwargs fit it
# ----------------------------------------------------------------------------------------------------

def function_problems(cfg: RewardsConfig, conventions: Optional[dict] = None,
                      environment: bool = False) -> list[tuple[str, str]]:
    """(recipe key, message) for each user reward function that cannot be loaded or called as its recipe entry
    says (module, callable, convention, kwargs; `environment`: whether the recipe names one, which some TRL-shaped
    arguments need); built-ins are checked by the recipe's own validation.
    `conventions`, when given, gets {recipe key of the function: 'lowmem' | 'trl'} for each usable one.
    Imports the users' modules, not torch: `lowmem-grpo validate` calls it."""
    problems = []
    for i, spec in enumerate(cfg.functions):
        if spec.function in _SPECS:
            continue
        try:
            fn = resolve(spec.function)
        except RewardError as exc:
            problems.append((f"rewards.functions.{i}.function", str(exc)))
            continue
        convention, found = calling_convention(spec.function, fn, getattr(spec, "convention", "auto"), dict(spec.kwargs),
                                               environment)
        problems += [(f"rewards.functions.{i}.{k}", m) for k, m in found]
        if conventions is not None and not found:
            conventions[f"rewards.functions.{i}"] = convention
    return problems


# ----------------------------------------------------------------------------------------------------
# Calling the functions
# ----------------------------------------------------------------------------------------------------

def _own_copies(values):
    """A copy of a batch's argument for one user function: deep, so that a function that changes a row, a chat message
    or a list in it changes nothing the next function reads, nor the dataset's rows (found by a red team: a function
    that set rows[0]['answer'] changed the next function's reference answer, and the dataset's). Token id lists are
    copied one level down (ints: a deep copy of every id would cost seconds a step on long completions); a value that
    cannot be deep-copied is copied one level down too (a row as dict(row), as rollout/turns.py's _own_row does)."""
    if isinstance(values, list) and all(isinstance(v, list) and all(type(t) is int for t in v) for v in values):
        return [list(v) for v in values]
    try:
        return copy.deepcopy(values)
    except Exception:
        if not isinstance(values, list):
            return values
        return [dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else v for v in values]


# TRL's arguments each TRL-shaped function shares with the others rather than getting its own copy: the logging
# callbacks, and each episode's environment instance (the reward's to read; a copy could not hold what it holds)
_SHARED = ("log_metric", "log_extra", "environments")


@dataclass
class _Raised:
    """What a reward function raised (kept apart from what it returned)."""
    exc: BaseException


def _await_all(awaitables: list) -> list:
    """The results of the awaitables (an exception as _Raised), awaited concurrently on one event loop: a fresh
    one, or, when this thread already runs a loop (a notebook), a fresh one on a helper thread."""
    async def gather():
        return await asyncio.gather(*awaitables, return_exceptions=True)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        results = asyncio.run(gather())
    else:
        with ThreadPoolExecutor(1) as pool:
            results = pool.submit(asyncio.run, gather()).result()
    return [_Raised(r) if isinstance(r, BaseException) else r for r in results]


def _outputs(calls: list[tuple[Callable, tuple, dict]]) -> list:
    """Each call's return value, or _Raised. Every function is called first; then the coroutines of the
    async ones are awaited together, so that several async functions of a recipe run concurrently."""
    outs, pending = [], {}
    for i, (fn, args, kwargs) in enumerate(calls):
        try:
            out = fn(*args, **kwargs)
        except Exception as exc:  # any failure of user code is reported with the reward named, not raised raw
            out = _Raised(exc)
        except SystemExit as exc:   # it ended the whole trainer, silently, with its code
            out = _Raised(RuntimeError(f"sys.exit({exc.code!r}) was called (a reward function returns its scores)"))
        if inspect.isawaitable(out):
            pending[i] = out
        outs.append(out)
    if pending:
        for i, out in zip(pending, _await_all(list(pending.values()))):
            outs[i] = out
    return outs


class Rewards:
    """The recipe's reward functions, loaded once, applied to a batch of completions.

    answer_field: the row field holding the reference answer (the recipe's data.answer_field), passed to
    the built-ins that read it. max_new_tokens: generation.max_new_tokens, passed to the built-ins that read
    it, and max_total_tokens: environment.max_total_tokens with an environment on. prompt_field:
    data.prompt_field, the one dataset column TRL-shaped functions do not get by name (they get it as prompts=). Rewards.from_recipe passes them all, and what TRL-shaped functions' trainer_state
    reads (train.steps, the updates a step makes, train.prompts_per_step); the trainer sets train_rows, the train set's size,
    once it has loaded it."""

    def __init__(self, cfg: RewardsConfig, *, answer_field: str, max_new_tokens: Optional[int] = None,
                 prompt_field: str = "prompt", environment_weight: Optional[float] = None,
                 max_steps: Optional[int] = None, updates_per_step: int = 1, prompts_per_step: int = 0,
                 max_total_tokens: Optional[int] = None):
        if not isinstance(answer_field, str) or not answer_field:
            raise RewardError(f"answer_field must be a non-empty row field name (data.answer_field), got {answer_field!r}")
        self.cfg = cfg
        self.answer_field, self.max_new_tokens, self.prompt_field = answer_field, max_new_tokens, prompt_field
        # environment.max_total_tokens with an environment on (else None): overlong's default L_max then, since a
        # completion's token ids are its whole episode, which that limits (docs/algorithm.md §19)
        self.max_total_tokens = max_total_tokens
        self.max_steps = max_steps or 0          # trainer_state.max_steps of TRL-shaped functions
        # TRL's trainer_state counts optimizer updates; a step here makes algorithm.updates_per_step of them
        self.updates_per_step = updates_per_step
        # trainer_state.epoch and .num_train_epochs: the train set's rows are known only once the trainer has loaded
        # it, which sets train_rows (None: those fields keep transformers' defaults, 0)
        self.prompts_per_step, self.train_rows = prompts_per_step, None
        # environment.reward_weight when the recipe names an environment (docs/algorithm.md §20), else None
        self.environment_weight = environment_weight
        self.functions = []                      # (label, fn, weight, kwargs it is always called with)
        self.conventions: dict[str, str] = {}    # label -> 'lowmem' | 'trl'
        self.notes: list[str] = []   # start-up lines (the code sandbox's protections, TRL-shaped functions), to log
        self._index: dict[str, int] = {}         # label -> its rewards.functions index, for errors
        self._columns_read: dict[str, list[str]] = {}   # TRL-shaped label -> dataset columns it requires
        self._accepts: dict[str, Optional[set]] = {}    # TRL-shaped label -> the names it takes (None: **kwargs)
        self._auto_trl: set = set()              # TRL-shaped by the auto rule (for hints when they fail)
        self._wants_ids: set = set()             # built-ins called with completion_ids=
        self._builtins: set = set()              # labels of the built-ins (they read model_completions)
        self._reads_answer = False
        problems = []
        for i, spec in enumerate(cfg.functions):
            try:
                fn = resolve(spec.function)
            except RewardError as exc:
                problems.append(f"rewards.functions.{i}.function: {exc}")
                continue
            label = self._label(spec.function, i)
            kwargs, convention, found = self._load(label, spec, fn, max_new_tokens)
            problems += [f"rewards.functions.{i}.{k}: {m}" for k, m in found]
            self.functions.append((label, fn, spec.weight, kwargs))
            self.conventions[label], self._index[label] = convention, i
        if problems:
            raise RewardError("\n".join(problems))
        _, first = first_function_problem([spec.function for spec in cfg.functions], environment_weight is not None)
        if first:   # (the recipe refuses the orders it can tell are wrong)
            self.notes.append(first)

    @classmethod
    def from_recipe(cls, recipe) -> "Rewards":
        """The recipe's rewards, with every field they read from the rest of the recipe."""
        env = getattr(recipe, "environment", None)
        return cls(recipe.rewards, answer_field=recipe.data.answer_field,
                   max_new_tokens=recipe.generation.max_new_tokens, prompt_field=recipe.data.prompt_field,
                   environment_weight=env.reward_weight if env is not None and env.name else None,
                   max_steps=recipe.train.steps, updates_per_step=recipe.algorithm.updates_per_step,
                   prompts_per_step=recipe.train.prompts_per_step,
                   max_total_tokens=env.max_total_tokens if env is not None and env.name else None)

    def _load(self, label: str, spec, fn: Callable, max_new_tokens: Optional[int]) -> tuple[dict, str, list]:
        """(the kwargs it is called with, its convention, (key, message) problems) of one recipe entry."""
        kwargs = dict(spec.kwargs)
        convention = getattr(spec, "convention", "auto")
        builtin = _SPECS.get(spec.function)
        if builtin is None:
            convention, found = calling_convention(spec.function, fn, convention, kwargs,
                                                   environment=self.environment_weight is not None)
            if convention == "trl":
                self._columns_read[label] = _required_columns(fn)
                params = _parameters(fn)
                accepted, takes_any = _keywords(params) if params is not None else ([], True)
                self._accepts[label] = None if takes_any else set(accepted)
                if getattr(spec, "convention", "auto") == "auto":
                    self._auto_trl.add(label)
                self.notes.append(f"reward {label!r}: called as TRL's GRPOTrainer calls reward functions "
                                  "(keyword arguments; dataset columns by name)")
            return kwargs, convention, found
        # a built-in: checked again here, as a RewardsConfig can be built, or changed, without validation
        self._builtins.add(label)
        found = [(f"kwargs.{k}", m) for k, m in option_problems(spec.function, kwargs)]
        if convention == "trl":
            found.append(("convention", f"built-in reward {spec.function!r} takes lowmem-grpo's convention; "
                                        "allowed here: auto, lowmem"))
        if builtin.reads_answer:
            kwargs["answer_field"] = self.answer_field
            self._reads_answer = True
        if getattr(builtin, "reads_max_new_tokens", False):
            if max_new_tokens is None:
                found.append(("function", f"reward {spec.function!r} reads generation.max_new_tokens, which was not "
                                          "given (Rewards(..., max_new_tokens=))"))
            kwargs["max_new_tokens"] = max_new_tokens
            if self.max_total_tokens is not None:
                kwargs["max_total_tokens"] = self.max_total_tokens
        if getattr(builtin, "reads_completion_ids", False):
            self._wants_ids.add(label)
        if builtin.startup and not found:   # e.g. the code rewards refuse a weak sandbox here, at load
            try:
                self.notes += resolve(builtin.startup)(**dict(spec.kwargs))
            except Exception as exc:
                found.append(("function", f"{type(exc).__name__}: {exc}"))
        return kwargs, "lowmem", found

    def _label(self, name: str, i: int) -> str:
        """The function's name in the metrics (reward/<label>, per_function's key): its own, or <name>_<i> where that
        is an earlier function's, the total's (ROW_REWARD_KEYS) or, with an environment on, its column's. The one rule
        for the recipe's functions and the TRL API's."""
        short = name.rsplit(":", 1)[-1]
        taken = [*ROW_REWARD_KEYS, *(["environment"] if self.environment_weight is not None else []),
                 *(f[0] for f in getattr(self, "functions", []))]
        return short if short not in taken else f"{short}_{i}"

    @property
    def names(self) -> list[str]:
        """The columns of a RewardResult's per_function: the functions', then "environment" when one is on."""
        return [f[0] for f in self.functions] + (["environment"] if self.environment_weight is not None else [])

    @property
    def weights(self) -> list[float]:
        """The weight of each of `names`, in order."""
        return [f[2] for f in self.functions] + ([self.environment_weight] if self.environment_weight is not None else [])

    @property
    def reads_answer(self) -> bool:
        """Whether a configured built-in reads the reference answer (data.answer_field) from every row."""
        return self._reads_answer

    # -- one batch ---------------------------------------------------------------------------------------

    def __call__(self, completions: list[str], prompts: list[str], rows: list[dict], *,
                 completion_ids: Optional[list[list[int]]] = None, step: int = 0,
                 prompt_messages: Optional[list[Optional[list[dict]]]] = None,
                 environment: Optional[list[Optional[float]]] = None,
                 completion_messages: Optional[list[Optional[list[dict]]]] = None,
                 environments: Optional[list] = None,
                 model_completions: Optional[list[str]] = None) -> RewardResult:
        """Score completions[i], sampled for prompts[i] (the text the model saw) of dataset row rows[i].
        completion_ids[i]: its token ids; step: the steps done (TRL-shaped functions' trainer_state: global_step
        step x updates_per_step, epoch);
        prompt_messages[i]: the prompt as chat messages when its row held them (else None); environment[i]: the
        environment's summed reward of completion i (None: it gave none), with an environment on;
        completion_messages[i]: an environment's episode as chat messages (rollout/turns.completion_messages), what
        TRL-shaped functions get as completions[i] where its prompt is chat messages (else None);
        environments[i]: TRL's environments= (its episode's environment instance), with an environment on;
        model_completions[i]: the model's own words in completions[i], what the built-ins read in its place
        (rollout/turns.model_texts: an environment's observations are not the model's answer)."""
        import torch

        n = len(completions)
        any_trl = any(self._is_trl(name) for name, *_ in self.functions)
        logged: tuple[dict, dict] = ({}, {})        # what TRL-shaped functions log: (metrics, extra columns)
        trl_args = (self._trl_arguments(completions, prompts, rows, completion_ids, step, prompt_messages, logged,
                                        completion_messages, environments) if any_trl else {})
        calls = [self._call(name, fn, kwargs, trl_args,
                            model_completions if name in self._builtins and model_completions is not None
                            else completions, prompts, rows, completion_ids)
                 for name, fn, _, kwargs in self.functions]
        outputs = _outputs(calls)
        chat = prompt_messages is not None and any(m is not None for m in prompt_messages)
        total = torch.zeros(n, dtype=torch.float64)
        trl_scored = torch.zeros(n, dtype=torch.bool)
        any_lowmem = False
        per_fn, errors = {}, {}
        for (name, fn, weight, kwargs), out in zip(self.functions, outputs):
            try:
                if isinstance(out, _Raised):
                    raise out.exc
                scores = check_scores(name, out, n, trl=self._is_trl(name))
            except Exception as exc:
                if self.cfg.on_error == "raise":
                    if isinstance(exc, RewardError):
                        raise
                    raise RewardError(f"reward {name!r} raised {type(exc).__name__}: {exc}"
                                      f"{self._hint(name, exc, chat)}") from exc
                errors[name] = n
                scores = [0.0] * n
            values = torch.tensor([float("nan") if s is None else s for s in scores], dtype=torch.float64)
            per_fn[name] = values
            if self._is_trl(name):                    # None: does not apply; the sum leaves it out
                scored = ~torch.isnan(values)
                total += torch.where(scored, weight * values, torch.zeros_like(values))
                trl_scored |= scored
            else:                                      # None: cannot be scored; the completion is skipped
                total += weight * values
                any_lowmem = True
        if self.environment_weight is not None:
            trl_scored |= self._add_environment(environment, n, total, per_fn)
            any_trl = True                            # its None means "does not apply", as a TRL-shaped function's
        if any_trl and not any_lowmem:
            total[~trl_scored] = float("nan")         # every function returned None: no reward at all
        skipped = int(torch.isnan(total).sum())
        metrics, extra = logged
        for column, values in extra.items():
            if len(values) != n:
                raise RewardError(f"log_extra({column!r}, ...) was given {len(values)} values for {n} completions: "
                                  "one per completion")
        return RewardResult(total, per_fn, errors, skipped, metrics, extra)

    def _add_environment(self, rewards: Optional[list], n: int, total, per_fn: dict):
        """docs/algorithm.md §20: the environment's rewards as one more column, "environment", added to `total`
        with its weight where it gave one; returns where it did ([n] bool)."""
        import torch

        if rewards is None or len(rewards) != n:
            raise RewardError(f"an environment is on: the call must pass environment= with one reward (or None) "
                              f"per completion ({n}), got {'none' if rewards is None else len(rewards)}")
        values = torch.tensor([float("nan") if r is None else float(r) for r in rewards], dtype=torch.float64)
        per_fn["environment"] = values
        scored = ~torch.isnan(values)
        total += torch.where(scored, self.environment_weight * values, torch.zeros_like(values))
        return scored

    def _call(self, name: str, fn: Callable, kwargs: dict, trl_args: dict, completions, prompts, rows,
              completion_ids) -> tuple[Callable, tuple, dict]:
        """(fn, positional args, keyword args) of one function's call, in its convention."""
        if not self._is_trl(name):
            extra = {}
            if name in self._wants_ids:
                if completion_ids is None:
                    raise RewardError(f"reward {name!r} reads the completions' token ids, and this call passed "
                                      "none (Rewards(...)(..., completion_ids=))")
                extra["completion_ids"] = completion_ids
            if name not in self._builtins:   # a user function gets its own copies (_own_copies)
                completions, prompts, rows = list(completions), list(prompts), _own_copies(rows)
            return fn, (completions,), {"prompts": prompts, "rows": rows, **kwargs, **extra}
        where = f"rewards.functions.{self._index[name]}"
        clash = sorted(set(kwargs) & set(trl_args))
        if clash:
            raise RewardError(f"{where}.kwargs.{clash[0]}: {clash[0]!r} is also a dataset column, and a TRL-shaped "
                              f"reward gets every column as a keyword argument: rename the kwarg or the column")
        missing = [p for p in self._columns_read.get(name, []) if p not in trl_args and p not in kwargs]
        if missing:
            columns = [c for c in trl_args if c not in TRL_PASSED]
            raise RewardError(f"{where}.function: reward {name!r} requires the argument {missing[0]!r}, which is not "
                              f"one TRL passes ({', '.join(TRL_PASSED)}), a dataset column (columns: "
                              f"{', '.join(columns) or 'none'}; the prompt field {self.prompt_field!r} comes as "
                              f"prompts=) or one of its kwargs")
        accepts = self._accepts.get(name)   # without **kwargs: only what it names (TRL would pass it all)
        passed = trl_args if accepts is None else {k: v for k, v in trl_args.items() if k in accepts}
        return fn, (), {**{k: v if k in _SHARED else _own_copies(v) for k, v in passed.items()}, **kwargs}

    def _is_trl(self, name: str) -> bool:
        return self.conventions.get(name) == "trl"   # (a function put in .functions by hand is lowmem-grpo's)

    def _trl_arguments(self, completions, prompts, rows, completion_ids, step, prompt_messages,
                       logged: tuple[dict, dict], completion_messages=None, environments=None) -> dict:
        """TRL's keyword arguments for a batch: prompts, completions (chat messages where the row's prompt was
        a message list: an environment's episode as its turns, [assistant, tool, ..., assistant], as TRL gives a
        tool-calling completion, else one assistant message), completion_ids, trainer_state, log_metric and
        log_extra (which fill `logged`: (metrics, extra columns)), environments (with an environment on), and one
        list per dataset column."""
        def chat(i: int) -> bool:
            return prompt_messages is not None and prompt_messages[i] is not None

        def completion(i: int, text: str):
            if not chat(i):
                return text
            if completion_messages is not None and completion_messages[i] is not None:
                return completion_messages[i]
            return [{"role": "assistant", "content": text}]

        metrics, extra = logged

        def log_metric(name: str, value: float) -> None:
            metrics.setdefault(str(name), []).append(float(value))

        def log_extra(column: str, values: list) -> None:
            extra.setdefault(str(column), []).extend(values)

        args = {
            "prompts": [prompt_messages[i] if chat(i) else p for i, p in enumerate(prompts)],
            "completions": [completion(i, c) for i, c in enumerate(completions)],
            "completion_ids": None if completion_ids is None else [list(ids) for ids in completion_ids],
            "trainer_state": self._trainer_state(step),
            "log_metric": log_metric,
            "log_extra": log_extra,
        }
        if environments is not None:
            args["environments"] = list(environments)
        for column in self._columns(rows):
            args[column] = [row.get(column) if isinstance(row, dict) else None for row in rows]
        return args

    def _trainer_state(self, step: int):
        """TRL's trainer_state after `step` steps: transformers' TrainerState (imported here, for TRL-shaped functions
        only) with global_step and max_steps in optimizer updates, and, once train_rows is known, epoch (epochs
        through the train set so far) and num_train_epochs (the run's, rounded up, as transformers counts them).
        Its log_history stays empty: the run's metrics are in metrics.jsonl."""
        from transformers import TrainerState

        state = TrainerState(global_step=step * self.updates_per_step, max_steps=self.max_steps * self.updates_per_step)
        if self.train_rows:
            state.epoch = epochs_done(step, self.prompts_per_step, self.train_rows)
            state.num_train_epochs = ceil(epochs_done(self.max_steps, self.prompts_per_step, self.train_rows))
        return state

    def _columns(self, rows) -> list[str]:
        """The dataset columns passed by name: every string field of the batch's rows (first seen first) but
        the prompt field; one with the name of TRL's own arguments is an error naming it."""
        seen: dict[str, None] = {}
        for row in rows:
            if isinstance(row, dict):
                seen.update((k, None) for k in row if isinstance(k, str) and k != self.prompt_field)
        clash = [c for c in seen if c in TRL_PASSED]
        if clash:
            raise RewardError(f"dataset column {clash[0]!r} has the name of an argument the trainer passes to "
                              f"TRL-shaped reward functions ({', '.join(TRL_PASSED)}; here: "
                              f"{', '.join(n for n, c in self.conventions.items() if c == 'trl')}): rename the column")
        return list(seen)

    def _hint(self, name: str, exc: Exception, chat: bool) -> str:
        """What to try when a function the auto rule called TRL's way fails as if it expected lowmem-grpo's."""
        if name not in self._auto_trl:
            return ""
        if isinstance(exc, KeyError) and exc.args and exc.args[0] == "rows":
            return (f" (it has no `rows` parameter, so it was called TRL's way, without rows=; for prompts= and rows= "
                    f"set convention: lowmem in rewards.functions.{self._index[name]})")
        if chat and isinstance(exc, (AttributeError, TypeError)) and ("'list'" in str(exc) or "'dict'" in str(exc)):
            return (" (it has no `rows` parameter, so it was called TRL's way: on chat prompts its completions are "
                    "[{'role': 'assistant', 'content': text}] lists; for text set convention: lowmem in "
                    f"rewards.functions.{self._index[name]})")
        return ""
