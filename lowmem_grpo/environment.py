"""Environments: what answers the model between its turns (docs/algorithm.md §20).

An environment is any class with this shape (subclassing `Environment` is optional):

    class MyEnv:
        stop = ("</call>",)          # strings that end a model turn besides EOS (optional; default none)

        def __init__(self, **kwargs): ...                  # the recipe's environment.kwargs
        def reset(self, row: dict) -> str | list | None: ... # the first user message (or the prompt's chat
                                                           # messages); None: the dataset prompt
        def step(self, model_text: str) -> tuple[str | None, float | None, bool]: ...
            # (observation appended as environment tokens or None, a reward for this turn or None, done)

Optional extras: a classmethod `startup(**kwargs) -> list[str]`, run once when the trainer loads the
environment (lines to log; what it raises stops the run: e.g. a sandbox too weak to run model-written code);
a classmethod `longest_step_s(**kwargs) -> float`, the longest a step may rightly take (an
environment.step_timeout_s below it is refused: a step cut there would read as the environment hanging, and its
episode be skipped, not scored); a method `counters() -> dict[str, number]`, read when an episode ends and
summed over the step's completions into the row as env/<name> (e.g. the Python tool's tool_calls, tool_errors,
tool_timeouts; a fixed set of names: a run logs its first MAX_COUNTER_NAMES, a later new name is dropped, said
once); an attribute `trainer_settings`, names of environment.* settings the constructor (and startup,
longest_step_s, stop_for) gets as kwargs of the same name, passed by the trainer (ToolCalls: observation_max_tokens,
to cut a tool's result to it at once; the Python tool: step_timeout_s, to keep a call's time within it); a
method `final_reward() -> float | None`, read once when an episode ends without an error (whatever ended it:
done, or a limit), added to the rewards its steps gave (TRL's environment get_reward());
an attribute `ends_at_cut_turn = True`, for an environment whose turns are finished only at their end of
turn: a model turn cut short then ends the episode, truncated, without step() (ToolCalls); and an attribute
`for_rewards`, what TRL-shaped reward functions get as environments[i] in its place (default: the instance
itself; ToolCalls: the environment_factory's instance, as TRL passes it, with `own_for_rewards = True`: made
for its episode alone, which the driver checks as it checks the environment).

An observation is text, written into the completion through environment.observation_template; or a `Rendered`
(a str with its chat markup already in it, e.g. a chat template's tool message and the next assistant header:
lowmem_grpo/tool_calls.py), appended as it is, its markup's special tokens kept as tokens.

The recipe names it as 'package.module:Class' (environment.name), or a built-in by its short name. The
trainer builds one instance per completion and drives it (rollout/turns.py): reset once, then step after
every model turn.

Whatever an environment does wrong (its constructor, reset or step raises, or returns the wrong types; reading an
optional attribute raises; one instance is handed to several episodes) ends that completion's episode and is
counted (env/errors), never a crashed run: `checked_reset` and
`checked_step` say what is wrong in a sentence that names the method and what was allowed. An EnvError that
reset or step raises is the exception: the environment says the run cannot go on, and the run stops. So does a
training step whose every episode ended in an error while none of the run has yet ended without one
(train.py's _check_env_errors: an environment that always fails).

Built-ins: `python` (PythonTool): code between <python> and </python> runs in the sandbox
(rewards/sandbox.py), its output comes back as the observation.
"""

from __future__ import annotations

import inspect
import json
import warnings
from math import isfinite
from typing import Any, Optional

from .user_code import MAX_SCORE, import_named, short_repr
from .user_code import kwargs_type_problems as check_kwarg_types

# Distinct counters() names a run logs: each is a metric column (env/<name>) in the metrics file, TensorBoard and the
# report; past these, new names are dropped (CounterNames)
MAX_COUNTER_NAMES = 64

# Built-in environments by short name -> 'module:Class'.
BUILTINS: dict[str, str] = {"python": "lowmem_grpo.environment:PythonTool"}


class EnvError(Exception):
    """An environment that cannot be loaded or built as the recipe names it, or that cannot go on: raised by its
    reset() or step() (ToolCalls, when its tools hang), it stops the run instead of ending one episode."""


class EnvOutputError(Exception):
    """What one environment call returned or raised; it ends that completion's episode and is counted."""


# What user code may raise and we report as its error: SystemExit too (sys.exit() in an environment would
# otherwise end the trainer, or, on a step thread, end that thread silently and read as a hang).
USER_ERRORS = (Exception, SystemExit)


def shown(value) -> str:
    """A user's value for an error message (short_repr), or what it is where its repr raises: an error message must
    not raise (found by a red team: a reward whose __repr__ raised read as a step that never returned)."""
    try:
        return short_repr(value)
    except BaseException as exc:   # user code
        return f"<a {type(value).__name__} whose repr raised {type(exc).__name__}>"


def said(exc: BaseException) -> str:
    """What user code raised, as text (its str, or its type's name where that raises)."""
    try:
        return str(exc)
    except BaseException:   # user code
        return f"<{type(exc).__name__} whose str raised>"


class Rendered(str):
    """An observation already rendered with its chat markup: `parts` alternate markup (even places: the chat
    template's own text, whose special tokens stay tokens) and content (odd places: what a tool returned, in
    which text that spells a special token stays text). The str is the parts joined. rollout/turns.py appends it
    without environment.observation_template, as the chat template would write it. `messages` (optional): the
    chat messages of the exchange it answers, as TRL gives them to reward functions (the assistant turn with its
    tool_calls, then one tool message per call: ToolCalls); () when it has none."""

    parts: tuple
    messages: tuple

    def __new__(cls, parts, messages=()):
        parts = tuple(parts)
        if not parts or not all(isinstance(p, str) for p in parts):
            raise TypeError("Rendered(parts): a non-empty sequence of str")
        self = super().__new__(cls, "".join(parts))
        self.parts, self.messages = parts, tuple(messages)
        return self

    def __reduce__(self):   # (a str subclass with state: pickled with its parts and messages)
        return (Rendered, (self.parts, self.messages))


class Environment:
    """The interface, as a base class to subclass (optional: any class with these methods works)."""

    stop: tuple[str, ...] = ()
    # True: instances share no state, so one round's step() calls may run together on threads (rollout/turns.py)
    parallel_steps: bool = False
    # True: a model turn cut short (generation.max_new_tokens, or the room left) ends the episode there, truncated,
    # without step() (a chat template's turn is finished only at its end of turn: ToolCalls); False: step() reads it
    ends_at_cut_turn: bool = False
    # The chat template's variables for this episode's prompt, over data.chat_template_kwargs, when reset() gives
    # the prompt (ToolCalls with several environments: each episode's prompt shows its own environment's tools)
    template_kwargs: Optional[dict] = None
    # Names of environment.* settings the constructor (and startup, longest_step_s, stop_for) also gets as kwargs of
    # the same name, set by the trainer, not in environment.kwargs: ToolCalls takes observation_max_tokens (to cut a
    # huge output as soon as it has it), the Python tool step_timeout_s (to keep a call within a step's limit)
    trainer_settings: tuple[str, ...] = ()
    # True: for_rewards is an object made for this episode alone (ToolCalls' environment_factory instance), which
    # the driver checks no other episode holds, as it checks the environment itself
    own_for_rewards: bool = False

    def reset(self, row: dict) -> Optional[str]:
        """The first user message for this dataset row (or the whole prompt as chat messages, [{role, content},
        ...]); None: the dataset prompt, rendered as without an environment."""
        return None

    def step(self, model_text: str) -> tuple[Optional[str], Optional[float], bool]:
        """After a model turn (its text, special tokens kept but EOS, BOS and pad: a tool tag that the tokenizer
        marks special is there): (observation or None, reward or None, done)."""
        raise NotImplementedError


def for_rewards(env) -> Any:
    """What TRL-shaped reward functions get as environments[i] for an episode of `env`: its `for_rewards` attribute
    where it has one, else `env` itself (None: it could not be read, or no environment was built)."""
    try:
        return getattr(env, "for_rewards", env)
    except USER_ERRORS:   # a property that raises: the functions get None there
        return None


# ----------------------------------------------------------------------------------------------------
# Loading: 'package.module:Class' -> a class, its kwargs checked against its constructor
# ----------------------------------------------------------------------------------------------------

def resolve(name: str) -> type:
    """The class `name` names (a built-in's short name or 'package.module:Class'), or an EnvError saying why
    not."""
    target = BUILTINS.get(name, name)
    if ":" not in target:
        known = f"a built-in ({', '.join(sorted(BUILTINS))}) or " if BUILTINS else ""
        raise EnvError(f"environment {name!r}: expected {known}'package.module:Class'")
    module_name, attr, cls = import_named(target, f"environment {name!r}", EnvError)
    if not isinstance(cls, type):
        raise EnvError(f"environment {name!r}: module {module_name!r} has no class {attr!r}")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise EnvError(f"environment {name!r}: class {attr!r} has no {' and no '.join(missing)} method; an environment "
                       "has reset(row) -> first message or None and step(model_text) -> (observation, reward, done)")
    # An `async def` method returns a coroutine the driver never awaits: every episode would end in a type
    # error (and a "never awaited" warning) instead of one clear load error.
    asynchronous = [m for m in ("reset", "step", "counters") if inspect.iscoroutinefunction(getattr(cls, m, None))]
    if asynchronous:
        raise EnvError(f"environment {name!r}: class {attr!r} defines {' and '.join(asynchronous)} with async def; the "
                       "trainer calls an environment's methods as plain functions (each on a thread, bounded by "
                       "environment.step_timeout_s): write them with def")
    return cls


def stop_strings(name: str, cls: type, kwargs: Optional[dict] = None) -> tuple[str, ...]:
    """The class's stop strings as a tuple of non-empty strings, or an EnvError: its optional classmethod
    `stop_for(**kwargs)` (stop strings that depend on its options), else its `stop` attribute."""
    stop = getattr(cls, "stop", ())
    if callable(getattr(cls, "stop_for", None)):
        try:
            stop = cls.stop_for(**(kwargs or {}))
        except USER_ERRORS as exc:  # user code: reported as the environment's, not raised raw
            raise EnvError(f"environment {name!r}: stop_for raised {type(exc).__name__}: {exc}") from None
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (tuple, list)) or not all(isinstance(s, str) and s for s in stop):
        raise EnvError(f"environment {name!r}: its `stop` attribute is {stop!r}; expected a tuple of non-empty strings")
    return tuple(stop)


def kwargs_problem(name: str, cls: type, kwargs: dict) -> Optional[str]:
    """Why cls(**kwargs) cannot be called (a kwarg it does not take, a required one missing), or None. Names
    the keyword arguments it does take: a misspelled key (timeout for timeout_s) is fixed at a glance."""
    try:
        signature = inspect.signature(cls)
        signature.bind(**kwargs)
    except TypeError as exc:
        takes = [p.name for p in signature.parameters.values()
                 if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        return (f"environment {name!r} cannot be built with these kwargs ({', '.join(kwargs) or 'none'}): {exc}; "
                f"it takes: {', '.join(takes) or 'no keyword arguments'}")
    except ValueError:   # no signature to read (a C class): it is tried at the first rollout
        return None
    return None


def kwargs_type_problems(name: str, cls: type, kwargs: dict) -> list[tuple[str, str]]:
    """(recipe key, message) for each kwarg whose value is not of its constructor parameter's simple annotated type
    (user_code.kwargs_type_problems: the rule reward functions' kwargs follow too)."""
    return check_kwarg_types(f"environment {name!r}", cls, kwargs, "environment.kwargs")


def environment_problems(cfg) -> list[tuple[str, str]]:
    """(recipe key, message) for each reason the recipe's environment (an EnvironmentConfig) cannot be used;
    [] when it can, or when there is none. Imports the user's module and runs its startup hook, as the
    trainer's load does: `lowmem-grpo validate` calls it."""
    if not cfg.name:
        return []
    return _load(cfg)[0]


def constructor_kwargs(cfg, cls: type) -> tuple[dict, Optional[str]]:
    """(the kwargs each instance is built with, or why they cannot be): environment.kwargs, plus each
    environment.<name> the class's trainer_settings names, as <name>= (ToolCalls: observation_max_tokens, to cut a
    result at once rather than hold megabytes until the driver's cut; the Python tool: step_timeout_s)."""
    kwargs = dict(cfg.kwargs)
    try:
        names = tuple(getattr(cls, "trainer_settings", ()) or ())
    except USER_ERRORS as exc:   # (a class attribute is user code where a metaclass makes it so)
        return kwargs, f"environment {cfg.name!r}: trainer_settings raised {type(exc).__name__}: {said(exc)}"
    unknown = [n for n in names if not isinstance(n, str) or n not in type(cfg).model_fields or n in ("name", "kwargs")]
    if unknown:
        return kwargs, (f"environment {cfg.name!r}: trainer_settings names {', '.join(map(repr, unknown))}, which are "
                        f"no environment settings (allowed: the environment section's fields but name and kwargs)")
    given = [n for n in names if n in kwargs]
    if given:
        return kwargs, (f"environment {cfg.name!r}: {', '.join(given)} is passed by the trainer from "
                        f"{', '.join('environment.' + n for n in given)}; set it there, not in environment.kwargs")
    return {**kwargs, **{n: getattr(cfg, n) for n in names}}, None


def _load(cfg) -> tuple[list[tuple[str, str]], Optional[tuple[type, dict, tuple, list]]]:
    """(problems, None), or ([], (class, its constructor's kwargs, stop strings, startup's notes)): each check once,
    in the order that names the clearest problem first."""
    try:
        cls = resolve(cfg.name)
    except EnvError as exc:
        return [("environment.name", str(exc))], None
    kwargs, problem = constructor_kwargs(cfg, cls)
    problem = problem or kwargs_problem(cfg.name, cls, kwargs)
    if problem:
        return [("environment.kwargs", problem)], None
    typed = kwargs_type_problems(cfg.name, cls, kwargs)
    if typed:   # (before stop_for and startup, which would fail on the same values less clearly)
        return typed, None
    # stop_for and startup read the kwargs (the python tool's call_format, timeout_s): what they refuse is a
    # kwargs problem, and validate refuses what the trainer's load would.
    kwargs_key = "environment.kwargs" if callable(getattr(cls, "stop_for", None)) else "environment.name"
    try:
        stop = stop_strings(cfg.name, cls, kwargs)
    except EnvError as exc:
        return [(kwargs_key, str(exc))], None
    try:
        notes = startup_notes(cfg.name, cls, kwargs)
    except EnvError as exc:
        return [("environment.kwargs", str(exc))], None
    longest = getattr(cls, "longest_step_s", None)
    if callable(longest):
        try:
            need = float(longest(**kwargs))
        except USER_ERRORS as exc:
            return [("environment.name", f"environment {cfg.name!r}: longest_step_s raised {type(exc).__name__}: "
                                         f"{exc}")], None
        if not cfg.step_timeout_s >= need:   # (nan too)
            # found by a red team: a tool call looping to its own 3 s limit past a 1 s step limit was an
            # environment error, its episode skipped where a zero was due (a model could learn to stall)
            return [("environment.step_timeout_s", f"{cfg.step_timeout_s:g} s is shorter than one {cfg.name!r} step "
                     f"may rightly take ({need:g} s); a step cut there counts as the environment hanging, and its "
                     "episode is skipped, not scored: raise it, or lower the environment's own limit")], None
    return [], (cls, kwargs, stop, notes)


def startup_notes(name: str, cls: type, kwargs: dict) -> list[str]:
    """The class's optional startup(**kwargs) hook, run once at load: its lines to log, or an EnvError with
    what it raised (the run does not start)."""
    hook = getattr(cls, "startup", None)
    if hook is None:
        return []
    try:
        notes = hook(**kwargs)
    except USER_ERRORS as exc:  # user code: reported as the environment's, not raised raw
        raise EnvError(f"environment {name!r}: startup raised {type(exc).__name__}: {exc}") from None
    return [str(n) for n in notes or []]


class CounterNames:
    """The counters() names a run logs, the first `most` it meets. Names made from data (word_<w>) made a new
    metric column per word, without end (found by a red team). Past the cap a new name's value is dropped, said
    once; the episode stays scored: a column too many is no reason to skip the model's work, while an episode's
    error would skip it."""

    def __init__(self, most: int = MAX_COUNTER_NAMES):
        self.most, self.names, self.warned = most, set(), False

    def kept(self, counters: dict) -> dict:
        """`counters` less the names past the cap (the names kept so far are kept for the run)."""
        out = {}
        for name, value in counters.items():
            if name not in self.names and len(self.names) < self.most:
                self.names.add(name)
            if name in self.names:
                out[name] = value
            elif not self.warned:
                self.warned = True
                warnings.warn(f"[lowmem-grpo] the environment's counters() gave more than {self.most} distinct names "
                              f"in this run; {short_repr(name)} and any later new name are not logged (the first "
                              f"{self.most} still are): counters are for a fixed set of names, each a metric column "
                              "env/<name>, not for names made from data. Said once.", stacklevel=2)
        return out


class EnvironmentFactory:
    """The recipe's environment, loaded once per run: `make()` builds one instance (one per completion);
    `counter_names` bounds the run's counters() names (the driver reads counters through it)."""

    def __init__(self, cfg):
        problems, loaded = _load(cfg)
        if problems:
            raise EnvError("\n".join(f"{key}: {message}" for key, message in problems))
        self.name = cfg.name
        self.cls, self.kwargs, self.stop, self.notes = loaded
        self.counter_names = CounterNames()

    def make(self) -> Any:
        """A new instance; what its constructor raises is an EnvOutputError (counted for that completion)."""
        try:
            return self.cls(**self.kwargs)
        except USER_ERRORS as exc:  # user code: counted for the completion, not raised raw
            raise EnvOutputError(f"{self.name}(**kwargs) raised {type(exc).__name__}: {said(exc)}") from None


# ----------------------------------------------------------------------------------------------------
# Calling an instance: what it returns, checked
# ----------------------------------------------------------------------------------------------------

def flag(env, name: str) -> bool:
    """An optional flag of the environment's (parallel_steps, ends_at_cut_turn), False where it has none; an
    EnvOutputError where reading it raises (a property, or a __getattr__ that raises other than AttributeError:
    found by a red team, a proxy's KeyError for parallel_steps crashed the run)."""
    try:
        return bool(getattr(env, name, False))
    except USER_ERRORS as exc:  # user code: counted for the completion, not raised raw
        raise EnvOutputError(f"reading its {name} raised {type(exc).__name__}: {said(exc)} (an optional attribute "
                             "it lacks must raise AttributeError)") from None


def hook(env, name: str):
    """An optional method of the environment's (counters, final_reward), None where it has none; an EnvOutputError
    where reading it raises (as flag)."""
    try:
        return getattr(env, name, None)
    except USER_ERRORS as exc:  # user code: counted for the completion, not raised raw
        raise EnvOutputError(f"reading its {name} raised {type(exc).__name__}: {said(exc)} (an optional attribute "
                             "it lacks must raise AttributeError)") from None


def _call(env, method: str, arg):
    try:
        return getattr(env, method)(arg)
    except EnvError:   # the environment says the run cannot go on (ToolCalls: its tools hang): the run stops
        raise
    except USER_ERRORS as exc:  # user code: counted for the completion, not raised raw
        raise EnvOutputError(f"{method}() raised {type(exc).__name__}: {said(exc)}") from None


_RESET_ALLOWED = ("allowed: a str (the first user message), a list of chat messages ({'role': str, 'content': str} "
                  "each: the whole prompt) or None (the dataset prompt)")


def checked_reset(env, row: dict):
    """env.reset(row): the first user message (a str), the prompt as chat messages (a list of {role, content}
    dicts with str values) or None, else an EnvOutputError."""
    out = _call(env, "reset", row)
    if isinstance(out, list):
        if not out or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                              and isinstance(m.get("content"), str) for m in out):
            raise EnvOutputError(f"reset() returned the list {shown(out)}; {_RESET_ALLOWED}")
        # plain dicts of plain str: what the driver reads later, on its own thread, is no user code (a str subclass's
        # methods, a dict subclass's lookups)
        out = [{**m, "role": str.__str__(m["role"]), "content": str.__str__(m["content"])} for m in out]
        for m in out:
            _check_text(m["content"], "reset() returned a message")
        return out
    if out is not None and not isinstance(out, str):
        raise EnvOutputError(f"reset() returned {type(out).__name__} {shown(out)}; {_RESET_ALLOWED}")
    out = None if out is None else str.__str__(out)
    _check_text(out, "reset() returned a first message")
    return out


def _check_text(text: Optional[str], what: str) -> None:
    """A str the tokenizer can take: a lone surrogate (bytes decoded with surrogateescape) makes it raise a
    bare TypeError mid-rollout, so it is named here instead."""
    if text is None:
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise EnvOutputError(f"{what} that is not valid text ({exc.reason}: {text[exc.start:exc.end]!r} at "
                             f"character {exc.start}); allowed: a str that encodes as UTF-8") from None


def _is_bool(x) -> bool:
    return isinstance(x, bool) or (type(x).__module__ == "numpy" and type(x).__name__ in ("bool", "bool_"))  # numpy's too


def checked_step(env, model_text: str) -> tuple[Optional[str], Optional[float], bool]:
    """env.step(model_text) as (observation or None, a finite reward or None, done), else an EnvOutputError
    naming the part that is wrong."""
    out = _call(env, "step", model_text)
    try:   # (a tuple subclass is user code too: its __len__ or __iter__ may raise)
        parts = tuple(out) if isinstance(out, (tuple, list)) else ()
    except Exception:
        parts = ()
    if len(parts) != 3:
        raise EnvOutputError(f"step() returned {type(out).__name__} {shown(out)}; allowed: a tuple "
                             "(observation: str or None, reward: number or None, done: bool)")
    observation, reward, done = parts
    if observation is not None and not isinstance(observation, str):
        raise EnvOutputError(f"step() returned observation {shown(observation)} ({type(observation).__name__}); "
                             "allowed: a str or None")
    # a plain str (or a Rendered of plain str parts): the driver tokenizes it on its own thread, where a str
    # subclass's methods or attribute lookups (user code) that raise would stop the run (found by a red team)
    if isinstance(observation, Rendered):
        observation = Rendered([str.__str__(p) for p in observation.parts], observation.messages)
    elif observation is not None:
        observation = str.__str__(observation)
    _check_text(observation, "step() returned an observation")
    if reward is not None:
        if _is_bool(reward) or not isinstance(reward, (int, float)) and not hasattr(reward, "__float__"):
            raise EnvOutputError(f"step() returned reward {shown(reward)} ({type(reward).__name__}); allowed: a "
                                 "number or None")
        try:
            reward = float(reward)
        except Exception:   # (its own __float__ may raise anything)
            raise EnvOutputError(f"step() returned reward {shown(reward)}, not a number; allowed: a number or None") from None
        if not isfinite(reward) or abs(reward) > MAX_SCORE:   # (beyond it: as a reward function's score, a red team)
            raise EnvOutputError(f"step() returned reward {reward:g}; allowed: a number within +-{MAX_SCORE:g}, or None")
    if not _is_bool(done):
        raise EnvOutputError(f"step() returned done {shown(done)} ({type(done).__name__}); allowed: True or False")
    return observation, reward, bool(done)


def checked_counters(env) -> dict:
    """env.counters() when it has one, as {name: number}; {} without; else an EnvOutputError."""
    fn = hook(env, "counters")
    if fn is None:
        return {}
    try:
        out = fn()
    except USER_ERRORS as exc:  # user code: counted for the completion, not raised raw
        raise EnvOutputError(f"counters() raised {type(exc).__name__}: {said(exc)}") from None
    numbers = {k: _finite(v) for k, v in out.items()} if isinstance(out, dict) else None
    if numbers is None or not all(isinstance(k, str) and k and v is not None for k, v in numbers.items()):
        raise EnvOutputError(f"counters() returned {shown(out)}; allowed: a dict of names to finite numbers")
    taken = sorted(set(numbers) & set(_reserved_counters()))
    if taken:   # the row's own env/turns etc. win: such a counter would vanish from the log without a word
        raise EnvOutputError(f"counters() returned {', '.join(map(repr, taken))}: the names of the trainer's own "
                             f"{', '.join('env/' + t for t in taken)}, which a counter cannot replace; allowed: names "
                             f"other than {', '.join(_reserved_counters())}")
    return numbers


def checked_final_reward(env) -> Optional[float]:
    """env.final_reward() when it has one, as a finite float or None; None without; else an EnvOutputError."""
    fn = hook(env, "final_reward")
    if fn is None:
        return None
    try:
        out = fn()
    except USER_ERRORS as exc:  # user code: counted for the completion, not raised raw
        raise EnvOutputError(f"final_reward() raised {type(exc).__name__}: {said(exc)}") from None
    if out is None:
        return None
    value = _finite(out)
    if value is None or abs(value) > MAX_SCORE:   # (its square overflowed the group's std as a score's did)
        raise EnvOutputError(f"final_reward() returned {shown(out)} ({type(out).__name__}); allowed: a number "
                             f"within +-{MAX_SCORE:g}, or None")
    return value


def _reserved_counters() -> tuple[str, ...]:
    """The env/<name> metrics every row has (diagnostics.STEP_KEYS): a counter may not take their names."""
    from .diagnostics import STEP_KEYS   # (here: it imports torch, which loading an environment need not)

    return tuple(k[len("env/"):] for k in STEP_KEYS if k.startswith("env/"))


def _finite(x) -> Optional[float]:
    """x as a float when it is a finite real number (numpy's integers too: they are no int subclass), else None."""
    if _is_bool(x) or not isinstance(x, (int, float)) and not type(x).__module__ == "numpy":
        return None
    try:
        x = float(x)
    except Exception:   # (a subclass's own __float__ may raise anything)
        return None
    return x if isfinite(x) else None


# ----------------------------------------------------------------------------------------------------
# The built-in Python tool
# ----------------------------------------------------------------------------------------------------

def load_allowance(timeout_s: float, step_timeout_s: Optional[float]) -> float:
    """The Python tool's load allowance (sandbox.run_python's): LOAD_ALLOWANCE, less where a call stretched so far,
    with the sandbox's 2 s, would pass environment.step_timeout_s and be cut as a hanging step (its episode skipped
    where the model's call earned a timeout); never below 1 (the plain wall clock). So a recipe with timeout_s up to
    step_timeout_s - 2 keeps running, stretched only as far as its step limit allows (found by a review: timeout_s 20
    under the default step_timeout_s 60 was refused)."""
    from .rewards.sandbox import LOAD_ALLOWANCE

    if step_timeout_s is None:
        return LOAD_ALLOWANCE
    return min(LOAD_ALLOWANCE, max(1.0, (float(step_timeout_s) - 2.0) / float(timeout_s)))


class PythonTool(Environment):
    """environment.name: python. A model turn that ends with a tool call's closing tag runs the call's code in
    the sandbox (rewards/sandbox.py; standard library only, no network), and its output, cut to
    max_output_chars, comes back as the observation. Two call formats (kwarg call_format):

      tags       <python>CODE</python>, answered <output>\nOUTPUT</output> (a ``` fence inside is dropped)
      tool_call  the Hermes/Qwen chat templates' format: <tool_call>{"name": "python", "arguments": {"code":
                 CODE}}</tool_call>, answered <tool_response>\nOUTPUT</tool_response>, as those templates
                 render a tool message

    Code that does not parse, a call that is not valid (a closing tag without its opening one, tool_call JSON
    that is not {"name": "python", "arguments": {"code": str}}), a run past timeout_s or killed by a limit: a
    tool error, counted (tool_errors, tool_timeouts), with an observation that says so, and the episode goes
    on. A turn that ends without a tool call ends the episode. Gives no reward: the recipe's reward functions
    score the completion (its text holds the calls and their outputs)."""

    parallel_steps = True   # each call is its own sandboxed subprocess
    FORMATS = {   # call_format -> (opening tag, closing tag, observation around the output)
        "tags": ("<python>", "</python>", "<output>\n{}</output>"),
        "tool_call": ("<tool_call>", "</tool_call>", "<tool_response>\n{}</tool_response>"),
    }
    stop = ("</python>",)   # the tags format's (a subclass may change it); stop_for gives each format's

    # the step's limit: a call's allowance for a loaded machine stops where the step would be cut (load_allowance)
    trainer_settings = ("step_timeout_s",)

    def __init__(self, timeout_s: float = 5.0, max_output_chars: int = 1000, memory_mb: int = 512,
                 allow_weak_sandbox: bool = False, call_format: str = "tags", step_timeout_s: Optional[float] = None):
        self.timeout_s, self.max_output_chars, self.memory_mb = float(timeout_s), int(max_output_chars), int(memory_mb)
        self.load_allowance = load_allowance(self.timeout_s, step_timeout_s)
        self.call_format = call_format
        self.OPEN, self.CLOSE, self.ANSWER = self.FORMATS[call_format]
        self.calls = self.errors = self.timeouts = 0

    @classmethod
    def stop_for(cls, call_format: str = "tags", **_) -> tuple[str, ...]:
        if call_format not in cls.FORMATS:
            raise ValueError(f"call_format {call_format!r} is unknown; allowed: {', '.join(cls.FORMATS)}")
        return tuple(cls.stop) if call_format == "tags" else (cls.FORMATS[call_format][1],)

    @classmethod
    def longest_step_s(cls, timeout_s: float = 5.0, **_) -> float:
        """The call's own limit on an idle machine, plus the sandbox's start and teardown (~0.1 s each; a margin).
        On a loaded one a call may take more (load_allowance), as far as the step's limit leaves room."""
        return float(timeout_s) + 2.0

    @classmethod
    def startup(cls, timeout_s: float = 5.0, max_output_chars: int = 1000, memory_mb: int = 512,
                allow_weak_sandbox: bool = False, call_format: str = "tags",
                step_timeout_s: Optional[float] = None) -> list[str]:
        """Refuse a sandbox weaker than full isolation unless allow_weak_sandbox (as the code rewards do)."""
        from .rewards.sandbox import SandboxLimits, missing_protections, run_python, sandbox_summary

        # (not `timeout_s <= 0`: nan passes that, and inf would fail each call in the sandbox's int(cpu_s))
        if not (isfinite(timeout_s) and timeout_s > 0) or max_output_chars < 1 or memory_mb < 1:
            raise ValueError(f"timeout_s must be a finite number > 0, max_output_chars and memory_mb >= 1 (got "
                             f"{timeout_s}, {max_output_chars}, {memory_mb})")
        cls.stop_for(call_format)
        limits = SandboxLimits.of(memory_mb=memory_mb)
        missing = missing_protections(limits)
        if missing and not allow_weak_sandbox:
            raise ValueError("refusing to run model-written code with weaker isolation; missing: "
                             + "; ".join(f"{k} ({v})" for k, v in missing.items())
                             + ". Set allow_weak_sandbox: true in environment.kwargs to accept that (docs/sandbox.md).")
        # Under too small a memory_mb Python itself cannot start, and every call's "output" would be the loader's
        # error, read by the model as its code's (found by a red team: 8 MiB passed validate)
        probe = run_python("print(6 * 7)", max(timeout_s, 5.0), limits=limits)
        if probe.stdout.strip() != "42":
            why = (probe.error or probe.stderr.strip().splitlines()[-1:] or [probe.killed_reason or "no output"])
            raise ValueError(f"memory_mb={memory_mb}: the sandbox's Python cannot run a line under it "
                             f"({why if isinstance(why, str) else why[0]}); raise it (the default is 512)")
        return [f"environment python: {sandbox_summary(limits)}; tool calls in the {call_format!r} format"]

    def reset(self, row: dict) -> Optional[str]:
        return None

    def counters(self) -> dict:
        return {"tool_calls": self.calls, "tool_errors": self.errors, "tool_timeouts": self.timeouts}

    def step(self, model_text: str) -> tuple[Optional[str], Optional[float], bool]:
        text = model_text.rstrip()
        if not text.endswith(self.CLOSE):
            return None, None, True                     # no tool call: the model is done
        self.calls += 1
        body = text[: -len(self.CLOSE)]
        if self.OPEN not in body:
            return self._error(f"{self.CLOSE} without {self.OPEN}: nothing was run"), None, False
        # The call starts at the first opening tag, unless what follows it does not parse: then at the last (the
        # turn mentioned the tag before its call). Not always the last: the code may quote the tag itself.
        for start in dict.fromkeys((body.find(self.OPEN), body.rfind(self.OPEN))):
            code, problem = self._parsed(body[start + len(self.OPEN):])
            if problem is None:
                return self._run(code), None, False
        return self._error(problem), None, False

    def _parsed(self, call: str) -> tuple[str, Optional[str]]:
        """(the code of a call's body, or why it has none or does not parse)."""
        code, problem = self._code(call)
        if problem:
            return code, problem
        try:
            compile(code, "<python>", "exec")
        except (SyntaxError, ValueError, MemoryError, RecursionError) as exc:   # deep nesting: the last two
            return code, f"the code does not parse: {type(exc).__name__}: {exc}"
        return code, None

    def _run(self, code: str) -> str:
        from .rewards import sandbox

        # timeout_s is the call's time less what it waited for a CPU, up to load_allowance x timeout_s: a call next
        # to the trainer and the other calls is not stopped for their load (found by a red team: 0.6 s of work under
        # timeout_s=1 beside two busy processes timed out every time; docs/sandbox.md, "Time limits under load")
        result = sandbox.run_python(code, self.timeout_s, memory_mb=self.memory_mb,
                                    load_allowance=self.load_allowance)
        if result.killed_reason == "sandbox_error":   # the machine's failure, not the model's: the episode is skipped
            raise EnvOutputError(f"the sandbox could not run the call: {result.error}")
        output = (result.stdout + result.stderr)[: self.max_output_chars]
        if result.timed_out:
            self.timeouts += 1
            return self._error(f"timed out after {self.timeout_s:g} s and was stopped", output)
        if result.killed_reason is not None:
            return self._error(f"stopped ({result.killed_reason})", output)
        return self.ANSWER.format(output)

    def _code(self, call: str) -> tuple[str, Optional[str]]:
        """(the code of a call's body, or why it has none)."""
        if self.call_format == "tags":
            return _unfenced(call), None
        try:
            parsed = json.loads(call)
        except (ValueError, RecursionError) as exc:   # deeply nested brackets: RecursionError
            return "", f"the tool call is not JSON: {exc}"
        args = parsed.get("arguments") if isinstance(parsed, dict) else None
        if not isinstance(parsed, dict) or parsed.get("name") != "python" or not isinstance(args, dict) \
                or not isinstance(args.get("code"), str):
            return "", 'the tool call must be {"name": "python", "arguments": {"code": "..."}}'
        return args["code"], None

    def _error(self, what: str, output: str = "") -> str:
        self.errors += 1
        return self.ANSWER.format(f"{output}error: {what}\n")


def _unfenced(code: str) -> str:
    """The code inside a ```python ... ``` fence when the tool call holds one, else the code as it is."""
    stripped = code.strip()
    if stripped.startswith("```") and stripped.endswith("```") and len(stripped) >= 6:
        inner = stripped[3:-3]
        first, _, rest = inner.partition("\n")
        return rest if first.strip().isidentifier() or not first.strip() else inner
    return code
