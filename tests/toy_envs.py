"""Toy environments for the tests (docs/algorithm.md §20), importable as 'toy_envs:<Class>' (tests/ is on the path).

The tiny model's tokenizer knows only "0123456789+-*=() ", so observations use those characters.
"""

from __future__ import annotations

import copy
import sys
import threading
from dataclasses import dataclass
from typing import Literal, Optional


class TwoTurns:
    """Two model turns, rewards from the environment alone: after turn 1 it asks for more ("+1="), after turn 2
    it scores that turn by its share of digits (1.0: all digits) and ends the episode."""

    stop = ()

    def __init__(self, ask: str = "+1="):
        self.ask, self.turn = ask, 0

    def reset(self, row: dict):
        self.turn = 0
        return None

    def step(self, model_text: str):
        self.turn += 1
        if self.turn == 1:
            return self.ask, None, False
        digits = sum(ch.isdigit() for ch in model_text)
        return None, digits / max(1, len(model_text)), True


class Scripted:
    """Replays `replies`, a list of [observation, reward, done] per turn (the last repeats), recording the texts
    it was shown in `seen` (a class-level list, for the tests to read)."""

    seen: list = []
    stop = ("=",)

    def __init__(self, replies=(("+1", None, False), (None, 1.0, True)), first_message=None):
        self.replies, self.first_message, self.turn = [tuple(r) for r in replies], first_message, 0

    def reset(self, row):
        return self.first_message

    def step(self, model_text):
        Scripted.seen.append(model_text)
        reply = self.replies[min(self.turn, len(self.replies) - 1)]
        self.turn += 1
        return reply


class NeverDone:
    """Answers every turn with an observation and a reward of 1, never ends: the limits must."""

    stop = ()

    def __init__(self, observation: str = "00000"):
        self.observation = observation

    def reset(self, row):
        return None

    def step(self, model_text):
        return self.observation, 1.0, False


class Faulty:
    """Fails in the way `how` names, at turn `at` (1-based) or in reset/__init__ (how "init...", "reset...")."""

    stop = ()

    def __init__(self, how: str = "raise", at: int = 1):
        if how == "init":
            raise RuntimeError("cannot start")
        if how == "init_exit":
            sys.exit(3)
        if how == "init_hang":
            threading.Event().wait()
        self.how, self.at, self.turn = how, at, 0

    def reset(self, row):
        if self.how == "reset_raise":
            raise ValueError("no such game")
        if self.how == "reset_type":
            return 42
        if self.how == "reset_exit":
            sys.exit("bye")
        if self.how == "reset_hang":
            threading.Event().wait()
        if self.how == "reset_surrogate":   # bytes decoded with surrogateescape
            return b"12\xff".decode("utf-8", "surrogateescape")
        return None

    def step(self, model_text):
        self.turn += 1
        if self.turn < self.at:
            return "1", 0.5, False
        if self.how == "hang":   # a step that never returns (the driver gives up after step_timeout_s)
            threading.Event().wait()
        if self.how == "exit":
            sys.exit(1)
        return {"raise": lambda: 1 / 0,
                "not_a_tuple": lambda: "oops",
                "short": lambda: ("1", 1.0),
                "obs_type": lambda: (7, 1.0, False),
                "reward_type": lambda: (None, "high", True),
                "reward_nan": lambda: (None, float("nan"), True),
                "done_type": lambda: (None, 1.0, "yes"),
                "obs_surrogate": lambda: (b"1\xff".decode("utf-8", "surrogateescape"), None, False)}[self.how]()

    def counters(self):
        if self.how == "counters_hang":
            threading.Event().wait()
        return {}


class EveryOtherFails:
    """Of every two instances made, the second's step() raises and the first's ends its episode (reward 1.0): a step
    of an even number of episodes has both kinds."""

    made = 0
    stop = ()

    def __init__(self):
        EveryOtherFails.made += 1
        self.fails = EveryOtherFails.made % 2 == 0

    def reset(self, row):
        return None

    def step(self, model_text):
        if self.fails:
            raise ValueError("a flaky step")
        return None, 1.0, True


class RowThief:
    """Changes the row it is reset on (drops the answer, rewrites the prompt), as a careless environment might;
    records the rows it was given in `seen` (class-level)."""

    seen: list = []
    stop = ()

    def reset(self, row):
        RowThief.seen.append(copy.deepcopy(row))
        row.pop("answer", None)
        row["prompt"] = "0="
        row.setdefault("tags", []).append("seen")
        return None

    def step(self, model_text):
        return None, 1.0, True


class NoStep:
    def reset(self, row):
        return None


class Typed:
    """Annotated constructor options, for validate's kwargs type check (`anything` and `choice` go unchecked)."""

    stop = ()

    def __init__(self, n: int = 1, rate: float = 0.5, name: str = "x", flag: bool = False,
                 items: Optional[list[int]] = None, table: dict | None = None, anything=None,
                 choice: Literal["a", "b"] = "a"):
        pass

    def reset(self, row):
        return None

    def step(self, model_text):
        return None, None, True


class AsyncStep:
    """A step written with async def (as some agent frameworks have it): a load error, not a coroutine per turn."""

    def reset(self, row):
        return None

    async def step(self, model_text):
        return None, 1.0, True


class _FloatRaises:
    def __float__(self):
        raise RuntimeError("no number here")


class _ReprRaises:
    def __repr__(self):
        raise RuntimeError("no repr here")


class _SlyText(str):
    """A str whose unknown attributes raise KeyError (a careless proxy), as an observation."""

    def __getattr__(self, name):
        raise KeyError(name)


class _BrokenTuple(tuple):
    def __len__(self):
        raise RuntimeError("no length")

    def __iter__(self):
        raise RuntimeError("no items")


class Careless:
    """Returns values that are user code themselves, in the way `how` names (found by a red team: each one raised in
    the driver's checks, read as a step that never returned, or crashed the run)."""

    stop = ()

    def __init__(self, how: str = "float"):
        self.how = how

    def reset(self, row):
        return _ReprRaises() if self.how == "reset_repr" else None

    def step(self, model_text):
        if self.how == "interrupt":
            raise KeyboardInterrupt()
        return {"float": lambda: (None, _FloatRaises(), True),
                "repr": lambda: (_ReprRaises(), None, False),
                "tuple": lambda: _BrokenTuple(("1", None, False)),
                "sly": lambda: (_SlyText("1"), 1.0, False)}[self.how]()


class DictAttributes:
    """Attributes from a dict: one it lacks raises KeyError, not AttributeError (a careless proxy); `getattr(env,
    'parallel_steps', False)` raised out of the driver."""

    stop = ()

    def __init__(self):
        self.__dict__["state"] = {}

    def __getattr__(self, name):
        return self.__dict__["state"][name]

    def reset(self, row):
        return None

    def step(self, model_text):
        return None, 1.0, True


class ExitingFlag:
    """A property for an optional flag that calls sys.exit()."""

    stop = ()

    @property
    def ends_at_cut_turn(self):
        sys.exit(2)

    def reset(self, row):
        return None

    def step(self, model_text):
        return None, 1.0, True


_THE_ONE = None


class Singleton:
    """Hands out one instance (__new__), as a careless 'shared state' environment might; rewards its row's answer."""

    stop = ()

    def __new__(cls):
        global _THE_ONE
        if _THE_ONE is None:
            _THE_ONE = super().__new__(cls)
        return _THE_ONE

    def reset(self, row):
        self.answer = float(row["answer"])
        return None

    def step(self, model_text):
        return None, self.answer, True


@dataclass
class DataclassCounter:
    """A @dataclass environment (eq=True: unhashable) whose for_rewards sums up the episode as a dict (unhashable too):
    two turns, the second scored 1."""

    stop = ()
    turns: int = 0

    def reset(self, row):
        self.turns = 0
        return None

    def step(self, model_text):
        self.turns += 1
        return ("+1=", None, False) if self.turns == 1 else (None, 1.0, True)

    @property
    def for_rewards(self):
        return {"turns": self.turns}


class ConstantForRewards:
    """for_rewards a class constant, one object for every instance, as a tag might be; one turn scored 1."""

    stop = ()
    for_rewards = "calc"

    def reset(self, row):
        return None

    def step(self, model_text):
        return None, 1.0, True


class SlowForRewards:
    """Its for_rewards, a property, takes `seconds` (as a lazy one that connects somewhere might)."""

    stop = ()

    def __init__(self, seconds: float = 2.0):
        self.seconds = seconds

    @property
    def for_rewards(self):
        import time

        time.sleep(self.seconds)
        return self

    def reset(self, row):
        return None

    def step(self, model_text):
        return None, 1.0, True


class Words:
    """Names a counter after the row's prompt (word_<prompt>): a new name per row, as a counter made from data
    would; and one fixed counter, steps."""

    stop = ()

    def __init__(self):
        self.word = ""

    def reset(self, row):
        self.word = row["prompt"]
        return None

    def step(self, model_text):
        return None, 1.0, True

    def counters(self):
        return {"steps": 1, f"word_{self.word}": 1}
