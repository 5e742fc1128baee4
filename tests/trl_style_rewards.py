"""Reward functions written as TRL's GRPOTrainer documentation writes them (keyword arguments, chat-format
completions, dataset columns by name), loaded the way users' are: 'trl_style_rewards:<name>'.

When the environment names a file in TRL_REWARDS_LOG, each call appends one JSON line describing what the
function received, so that tests can check the trainer called it as TRL would."""

import asyncio
import json
import os
import re


def _record(name, **got):
    path = os.environ.get("TRL_REWARDS_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"function": name, **got}, default=repr) + "\n")


_LOGGERS = ("log_metric", "log_extra")   # TRL's logging callables, passed with the columns


def _describe(prompts, completions, completion_ids, trainer_state, kwargs):
    kwargs = {k: v for k, v in kwargs.items() if k not in _LOGGERS}
    return dict(prompts=prompts, completions=completions, completion_ids=completion_ids,
                global_step=getattr(trainer_state, "global_step", None), columns=sorted(kwargs),
                column_lengths={k: len(v) for k, v in kwargs.items() if isinstance(v, list)})


def accuracy_reward(completions, solution, **kwargs):
    """1.0 when the completion's text equals the solution column; None when the row has no solution."""
    columns = {k: v for k, v in kwargs.items() if k not in ("prompts", "completion_ids", "trainer_state")}
    _record("accuracy_reward", solution=solution,
            **_describe(kwargs.get("prompts"), completions, kwargs.get("completion_ids"), kwargs.get("trainer_state"),
                        {**columns, "solution": solution}))
    contents = [completion[0]["content"] for completion in completions]
    return [None if sol is None else float(c.strip() == str(sol)) for c, sol in zip(contents, solution)]


def format_reward(completions, **kwargs):
    """1.0 when the completion is a bare number."""
    pattern = r"^\s*\d+\s*$"
    contents = [completion[0]["content"] for completion in completions]
    return [1.0 if re.match(pattern, c) else 0.0 for c in contents]


def text_length(prompts, completions, **kwargs):
    """TRL-shaped, text dataset: completions are strings."""
    return [float(len(c)) for c in completions]


def half_applies(completions, **kwargs):
    """TRL's 'does not apply': None for the completions at odd positions, 1.0 for the others."""
    return [None if i % 2 else 1.0 for i in range(len(completions))]


def verdicts(completions, **kwargs):
    """TRL-shaped, as TRL reads them: booleans (1.0 / 0.0) and NaN (does not apply) for the completions 'a', 'b', other."""
    return [c == "a" if c in ("a", "b") else float("nan") for c in completions]


def never_applies(completions, **kwargs):
    return [None] * len(completions)


def twos(completions, **kwargs):
    return [2.0] * len(completions)


async def slow_half(completions, delay: float = 0.2, **kwargs):
    """async, TRL-shaped: sleeps `delay` seconds, then 0.5 each."""
    await asyncio.sleep(delay)
    return [0.5] * len(completions)


async def slow_one(completions, *, prompts, rows, delay: float = 0.2, **kwargs):
    """async, lowmem-grpo-shaped."""
    await asyncio.sleep(delay)
    return [1.0] * len(completions)


async def async_raises(completions, **kwargs):
    await asyncio.sleep(0)
    raise ValueError("async boom")


def needs_column(completions, difficulty, **kwargs):
    return [float(d) for d in difficulty]


def reads_rows(completions, **kwargs):
    """Written for lowmem-grpo but without a `rows` parameter: the auto rule calls it TRL's way."""
    return [float(len(row)) for row in kwargs["rows"]]


def takes_texts(texts):
    return [0.0] * len(texts)


def positional_only(completions, prompts, /, **kwargs):
    return [0.0] * len(completions)


def with_option(completions, *, scale: float = 1.0, **kwargs):
    return [scale] * len(completions)


def strict_keywords(completions, prompts, scale: float = 1.0):
    """No **kwargs: it gets only what it names (TRL itself would pass every argument, and fail)."""
    return [scale] * len(completions)


ARRIVED: list = []   # meet()'s rendezvous: cleared by the test that uses it


async def meet(completions, **kwargs):
    """async: waits (up to 5 s) until a second meet() call has started, which only happens when the two run
    concurrently; run one after the other, the first times out and raises."""
    ARRIVED.append(len(completions))
    for _ in range(500):
        if len(ARRIVED) >= 2:
            return [1.0] * len(completions)
        await asyncio.sleep(0.01)
    raise TimeoutError("the other meet() never started: the async functions did not run concurrently")


def text_accuracy(prompts, completions, completion_ids, trainer_state, **kwargs):
    """A text dataset's accuracy reward, TRL-shaped: completions are strings; records what it got."""
    _record("text_accuracy", solution=kwargs.get("solution"),
            **_describe(prompts, completions, completion_ids, trainer_state, kwargs))
    return [float(c.strip() == str(s)) for c, s in zip(completions, kwargs["solution"])]


def logs_metric(completions, log_metric, **kwargs):
    """TRL 1.16's reward-side metric logging, required."""
    log_metric("mean_length", sum(len(c) for c in completions) / len(completions))
    return [0.0] * len(completions)


def logs_extra(completions, log_extra, **kwargs):
    """TRL 1.16's extra completions-table column, required."""
    log_extra("length", [len(c) for c in completions])
    return [0.0] * len(completions)


def reads_environments(completions, environments, **kwargs):
    """TRL's environment_factory instances, one per completion."""
    return [float(env.reward) for env in environments]


def logs_metric_if_given(completions, log_metric=None, **kwargs):
    """Uses log_metric only when the trainer passes it."""
    if log_metric is not None:
        log_metric("calls", 1.0)
    return [1.0] * len(completions)


class LengthPenalty:
    """A callable instance without __name__, as TRL's reward factories return (get_soft_overlong_punishment):
    reads completion_ids only. -1 past `limit` tokens, else 0."""

    def __init__(self, limit: int):
        self.limit = limit

    def __call__(self, completion_ids, **kwargs):
        return [-1.0 if len(ids) > self.limit else 0.0 for ids in completion_ids]


class AsyncJudge:
    async def __call__(self, prompts, completions, **kwargs):
        await asyncio.sleep(0)
        return [0.5] * len(completions)


length_penalty = LengthPenalty(limit=2)   # named in a recipe as 'trl_style_rewards:length_penalty'
async_judge = AsyncJudge()


def logs_extra_wrong(completions, log_extra, **kwargs):
    log_extra("length", [0] * (len(completions) + 1))
    return [0.0] * len(completions)


def curriculum(completions, trainer_state, **kwargs):
    """A curriculum weight: the fraction of the run done (TrainerState.global_step / max_steps)."""
    return [trainer_state.global_step / trainer_state.max_steps] * len(completions)


def updates_done(completions, trainer_state, **kwargs):
    """TrainerState.global_step and max_steps as scores (global_step + max_steps / 1000)."""
    return [trainer_state.global_step + trainer_state.max_steps / 1000] * len(completions)
