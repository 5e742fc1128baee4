"""Multi-turn rollouts: the trainer drives one environment per completion (docs/algorithm.md §20).

A completion becomes segments: tokens the model sampled, then tokens the environment wrote (an observation,
formatted by environment.observation_template), then the model again, and so on. All completions of a step
decode together: each round is one engine.generate call over the episodes still running (prompt = their
prompt + everything so far, n = 1 each); a model turn ends at EOS, at one of the environment's stop strings,
or at generation.max_new_tokens. Then env.step(turn text: its special tokens kept but EOS, BOS and pad, so that
tags a tokenizer marks special reach the environment, turn_text) gives (observation, reward, done), and the episode
goes on until the environment says done, max_turns model turns were taken, or max_total_tokens tokens
(model + environment) fill the completion; or fewer, where the model's context (prompt + completion: vLLM's
max_model_len, else max_position_embeddings) ends first.

An observation is appended only when a model turn follows it: not after the last turn, and not when it would
leave no room for one (the reward functions would read the environment's text as the model's last words; and
where the model's turn after it is empty, EOS alone, the text they read ends before it: completion_texts). It
is tokenized without special tokens (text in it that spells one, say EOS, stays text) and cut to
observation_max_tokens in its middle: its end (a tool's closing tag, the template's tail) stays, so that what
the environment printed is never read as what follows its output. A `Rendered` observation (a chat template's
tool messages and next assistant header, lowmem_grpo/tool_calls.py) is appended as it is, without the
observation_template: its markup's special tokens stay tokens, its content's stay text, and observation_max_tokens
cuts its contents alone (one whose markup alone is longer is not appended: a limit ends the episode).
Environment tokens carry env_mask True and a NaN sampler log-prob: context for the model, never trained
(batch.pack).

A completion is `truncated` when its last model turn was cut (no EOS or stop string within its budget), or a
limit (max_turns, max_total_tokens) ended the episode before the environment said done. A cut turn goes to step()
as any other, but where the environment has `ends_at_cut_turn` (ToolCalls): then it ends the episode, unstepped.
An environment that raises (SystemExit too; an EnvError stops the run: the environment says it cannot go on)
or returns the wrong types ends its episode there, with the error recorded
(EnvRecord.error) and counted, and `score` skips the episode (no verdict on the model). Its constructor, reset(),
counters() and final_reward() are bounded by environment.step_timeout_s as step() is, and reset() gets a copy of
the row (the reward functions read the example's). final_reward(), where the environment has one, is read once
at the end of an episode no error ended and added to its rewards. A round's steps of an environment with parallel_steps (the Python tool: a sandboxed
subprocess each) run together on a thread pool, others one after another; results keep the episodes' order.

Sampling is the engine's, on torch's RNG, and the rounds run in a fixed order: a resumed run replays them.
"""

from __future__ import annotations

import copy
import functools
import math
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

from ..data import chars_within
from ..environment import (USER_ERRORS, EnvError, EnvOutputError, Rendered, checked_counters, checked_final_reward,
                           checked_reset, checked_step, flag, for_rewards, hook, said)
from ..user_code import HungCalls, short_repr
from .base import Completion, EnvRecord, SamplingParams

STEP_WORKERS = 8   # threads running a round's parallel_steps calls (the Python tool's each wait on a subprocess)
MAX_HUNG_CALLS = 64   # environment calls past step_timeout_s whose threads still run: past this, the run stops
_CUT_MARK = "..."   # where an observation's middle was cut (left out where the tokenizer cannot spell it)
_MARK = "\x00\x01observation\x01\x00"   # stands for the observation in the template (no template holds it)
_unseen_warned = False   # an observation that encoded to no tokens was warned about (_warn_if_unseen)


@dataclass(frozen=True)
class TurnLimits:
    max_turns: int = 4
    max_total_tokens: int = 512
    observation_max_tokens: int = 128
    observation_template: str = "\n{observation}\n"
    step_timeout_s: float = 60.0

    @classmethod
    def from_recipe(cls, cfg) -> "TurnLimits":
        """The limits of an EnvironmentConfig."""
        return cls(cfg.max_turns, cfg.max_total_tokens, cfg.observation_max_tokens, cfg.observation_template,
                   cfg.step_timeout_s)


@dataclass
class _Episode:
    prompt_index: int
    prompt_ids: list
    env: object = None
    own_prompt: bool = False         # reset() gave the first message: prompt_ids are its, not the example's
    prompt_text: Optional[str] = None
    prompt_messages: Optional[list] = None   # reset()'s chat messages, as rendered, when it gave them
    tokens: list = field(default_factory=list)
    env_mask: list = field(default_factory=list)
    logprobs: Optional[list] = field(default_factory=list)   # None once a turn came without (greedy)
    turns: int = 0
    rewards: list = field(default_factory=list)
    error: Optional[str] = None
    done: bool = False
    truncated: bool = False
    stopped_by: Optional[str] = None
    counters: dict = field(default_factory=dict)
    exchanges: list = field(default_factory=list)   # per observation appended: its Rendered.messages (or ())
    cap: int = 0                     # the most completion tokens: max_total_tokens, less where the context ends
    parallel: bool = False           # the environment's parallel_steps, ends_at_cut_turn and whether it has a
    ends_at_cut: bool = False        # final_reward: read once, at its start (flag, hook: user code that may raise)
    has_final_reward: bool = False
    own_instance: bool = False       # its own_for_rewards: for_rewards is an object made for this episode alone
    instance: object = None          # its for_rewards (read after reset, and at the end: a property is user code too)

    def end(self, truncated: bool = False, error: Optional[str] = None) -> None:
        self.done, self.truncated, self.error = True, self.truncated or truncated, error

    def completion(self) -> Completion:
        record = EnvRecord(turns=self.turns, env_tokens=sum(self.env_mask), error=self.error,
                           reward=sum(self.rewards) if self.rewards else None,
                           prompt_text=self.prompt_text if self.own_prompt else None,
                           prompt_messages=self.prompt_messages if self.own_prompt else None,
                           counters=tuple(sorted(self.counters.items())), exchanges=tuple(self.exchanges),
                           instance=self.instance)
        return Completion(self.prompt_index, self.tokens, self.truncated, self.logprobs, stopped_by=self.stopped_by,
                          env_mask=self.env_mask, prompt_ids=self.prompt_ids if self.own_prompt else None, env=record)


def _start(prompt_index: int, example, factory, render: Optional[Callable], timeout_s: float) -> _Episode:
    """A new episode: its own environment, reset on a copy of the example's row (its first message rendered as
    the dataset prompt would be). The constructor and reset() are bounded by timeout_s as step() is."""
    ep = _Episode(prompt_index, list(example.prompt_ids))
    row = _own_row(example.row)

    def begin():
        # every read of the user's object here, bounded: a property may raise or hang as a method may
        ep.env = factory.make()
        ep.parallel, ep.ends_at_cut = flag(ep.env, "parallel_steps"), flag(ep.env, "ends_at_cut_turn")
        ep.has_final_reward = hook(ep.env, "final_reward") is not None
        ep.own_instance = flag(ep.env, "own_for_rewards")
        first = checked_reset(ep.env, row)
        ep.instance = for_rewards(ep.env)   # (after reset: ToolCalls' is then the environment the row picked)
        return first, (_template_kwargs(ep.env) if first is not None else None)

    try:
        started = _bounded(begin, timeout_s, "the constructor or reset()")
        if isinstance(started, EnvOutputError):
            raise started
        first, extra = started
        if extra is not None and not isinstance(extra, dict):
            raise EnvOutputError(f"template_kwargs is {type(extra).__name__}; allowed: a dict of the chat template's "
                                 "variables, or None")
        if first is not None:
            if render is None:
                raise EnvOutputError("reset() returned a first message, and this rollout cannot render prompts")
            try:
                rendered = render(example.row, first, extra)
            except USER_ERRORS as exc:  # e.g. over data.max_prompt_tokens: that completion's outcome
                raise EnvOutputError(f"reset()'s first message cannot be rendered as a prompt: {exc}") from None
            ep.prompt_ids, ep.prompt_text, ep.own_prompt = list(rendered.prompt_ids), rendered.prompt_text, True
            ep.prompt_messages = getattr(rendered, "messages", None)
        elif _awaits_reset(example):
            raise EnvOutputError("the row's last user message is empty, the slot reset()'s first message fills, and "
                                 "reset() returned none")
    except EnvOutputError as exc:
        ep.end(error=str(exc))
    return ep


def _template_kwargs(env) -> Optional[dict]:
    """The environment's optional template_kwargs (a copy), or None; an EnvOutputError for what is wrong with it."""
    try:
        extra = getattr(env, "template_kwargs", None)
        if extra is None or not isinstance(extra, dict):
            return extra
        return dict(extra)
    except USER_ERRORS as exc:   # the user's property (or dict subclass)
        raise EnvOutputError(f"reading template_kwargs raised {type(exc).__name__}: {said(exc)}") from None


def _awaits_reset(example) -> bool:
    """The example's chat prompt ends with an empty user message (TRL's placeholder row, data.chat_messages):
    the model would be asked nothing unless reset() gives the message."""
    last = (getattr(example, "messages", None) or [{}])[-1]
    return last.get("role") == "user" and last.get("content") == ""


def _own_row(row: dict) -> dict:
    """A copy of the row for reset(): the example's row is shared by its n episodes and later read by the reward
    functions, so what an environment changes in it must stay its own."""
    try:
        return copy.deepcopy(row)
    except Exception:   # a value that cannot be deep-copied: the top level at least stays the example's
        return dict(row)


def _room(ep: _Episode) -> int:
    return ep.cap - len(ep.tokens)


def context_tokens(engine) -> Optional[int]:
    """The most tokens (prompt + completion) the engine's model takes, or None when it does not say: vLLM's
    max_model_len (it refuses a longer prompt: a later round would raise), the transformers engine's
    max_position_embeddings (past it the model reads positions it never saw, and the two engines would no longer
    give the same episodes)."""
    own = getattr(engine, "context_tokens", None)
    return own() if callable(own) else None


def _cap(ep: _Episode, limits: TurnLimits, context: Optional[int]) -> int:
    """max_total_tokens, or less where the model's context ends first (its prompt: the example's or reset()'s)."""
    return limits.max_total_tokens if context is None else min(limits.max_total_tokens, context - len(ep.prompt_ids))


def _model_turn(ep: _Episode, c: Completion, limits: TurnLimits) -> tuple[list, bool]:
    """Append the engine's turn (cut to the room left); (its tokens, whether it was cut)."""
    room = _room(ep)
    turn = list(c.token_ids[:room])
    cut = c.truncated or len(c.token_ids) > room
    ep.tokens += turn
    ep.env_mask += [False] * len(turn)
    if ep.logprobs is not None:
        ep.logprobs = ep.logprobs + list(c.logprobs[: len(turn)]) if c.logprobs is not None else None
    ep.turns += 1
    ep.stopped_by = c.stopped_by if len(c.token_ids) <= room else None
    return turn, cut


def turn_text(tokenizer, turn: list, ended_at_eos: bool) -> str:
    """A model turn's text, as env.step() reads it: decoded with its special tokens kept, but for the token that
    ended it (EOS, or another of the model's stop tokens) and the tokenizer's BOS, EOS and pad, which frame a
    sequence and say nothing. Not skip_special_tokens=True: a tokenizer may mark an environment's own tags special
    (<tool_call>, a stop string), and the turn would reach step() without them, the call unseen. Both engines
    stop at such a tag (their stop strings match with special tokens), so one decoding here serves both."""
    ids = list(turn[:-1] if ended_at_eos and turn else turn)
    framing = {getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "pad")} - {None}
    return tokenizer.decode([t for t in ids if t not in framing], skip_special_tokens=False)


def _observe(ep: _Episode, observation: Optional[str], tokenizer, limits: TurnLimits) -> None:
    """Append the observation as environment tokens (template, observation_max_tokens, the room left)."""
    if observation is None:
        return
    room = _room(ep)
    most = min(limits.observation_max_tokens, room)
    try:
        if isinstance(observation, Rendered):   # its own markup: no observation_template
            ids = _rendered_ids(tokenizer, observation.parts, most)
        else:
            # cut to what `most` tokens could cover at either end before tokenizing: a megabyte costs no seconds
            ids = _observation_ids(tokenizer, limits.observation_template, cut_to_ends(observation, most))
            _warn_if_unseen(tokenizer, limits.observation_template, observation, ids)
            ids = _cut_middle(tokenizer, ids, most)
    except Exception as exc:  # the tokenizer refused it: that episode's error, not the run's
        ep.end(error=f"the observation cannot be tokenized: {type(exc).__name__}: {exc}")
        return
    if ids is None or len(ids) >= room:
        # It would fill the completion (or its markup alone is past observation_max_tokens): no model turn could
        # follow it, and the completion would end in the environment's text, which reward functions read as the
        # model's last words. Not appended; a limit ended the episode.
        ep.end(truncated=True)
        return
    ep.tokens += ids
    ep.env_mask += [True] * len(ids)
    ep.exchanges.append(getattr(observation, "messages", ()))
    if ep.logprobs is not None:
        ep.logprobs = ep.logprobs + [math.nan] * len(ids)


def _warn_if_unseen(tokenizer, template: str, observation: str, ids: list) -> None:
    """Warns once per process when a non-blank observation adds no tokens to its template's: the tokenizer drops
    its text, and the model never sees the environment's feedback (found by an audit: the tiny tokenizer, loaded
    from its folder, drops "higher"; 3 turns of env/tokens 0, without a word)."""
    global _unseen_warned
    if _unseen_warned or not observation.strip():
        return
    if len(ids) > _template_tokens(tokenizer, template):
        return
    _unseen_warned = True
    warnings.warn(f"[lowmem-grpo] the environment's observation {short_repr(observation)} encodes to no tokens with "
                  "this tokenizer, so the model never sees it: use a tokenizer that covers the environment's text "
                  "(for the tiny model: lowmem_grpo.tiny.build_tool_tokenizer). Said once.", stacklevel=2)


@functools.lru_cache(maxsize=16)
def _template_tokens(tokenizer, template: str) -> int:
    """The observation template's own tokens (with an empty observation): counted once, not per observation."""
    return len(tokenizer(template.format(observation=""), add_special_tokens=False)["input_ids"])


def cut_to_ends(text: str, tokens: int) -> str:
    """`text` cut to what `tokens` tokens could cover at either end (data.chars_within each), its middle dropped:
    no more than an observation cut to `tokens` tokens could keep, without tokenizing megabytes."""
    keep = chars_within(tokens)
    return text if len(text) <= 2 * keep else text[:keep] + text[-keep:]


def _cut_middle(tokenizer, ids: list, most: int) -> list:
    """`ids` cut to `most` tokens in the middle: its first three quarters and its last quarter (at least one
    token) around _CUT_MARK. Cut at the end, the observation lost its closing tag (</output>), and a tool's
    output read as the model's answer after it (found by a red team: tiny.final_answer gave a forged 1.0)."""
    if len(ids) <= most:
        return ids
    if most <= 0:
        return []
    mark = tokenizer(_CUT_MARK, add_special_tokens=False)["input_ids"]
    if tokenizer.decode(mark) != _CUT_MARK or len(mark) + 2 > most:   # (<unk>s: a tokenizer without '.')
        mark = []
    tail = max(1, (most - len(mark)) // 4)
    return ids[: most - len(mark) - tail] + mark + ids[len(ids) - tail:]


def _observation_ids(tokenizer, template: str, observation: str) -> list:
    """The template around the observation, tokenized without special tokens. Text in the observation that
    spells a special token (EOS, a chat turn marker: a tool's output may print one) stays plain text: the
    environment writes text, never control tokens. Only the template's own text can hold those."""
    text = template.format(observation=observation)
    special = _special_texts(tokenizer)
    if not any(s in observation for s in special):
        return tokenizer(text, add_special_tokens=False)["input_ids"]   # as ever: one string, one tokenization
    head, *tail = template.format(observation=_MARK).split(_MARK)
    if len(tail) != 1:   # {observation} more than once: all of it as plain text
        return tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    middle = text[len(head): len(text) - len(tail[0])]   # the observation as the template wrote it
    return (tokenizer(head, add_special_tokens=False)["input_ids"]
            + tokenizer(middle, add_special_tokens=False, split_special_tokens=True)["input_ids"]
            + tokenizer(tail[0], add_special_tokens=False)["input_ids"])


def _rendered_ids(tokenizer, parts: tuple, most: int) -> Optional[list]:
    """A Rendered observation's tokens, at most `most`, or None where its markup alone takes more. Its content
    parts (odd places) are each cut first to what `most` tokens could cover (cut_to_ends); all of it tokenized as
    one string, as the chat template's text would be, unless a content part spells a special token: then each
    part on its own, the content's special-token text as plain text (a tool's output never writes control tokens;
    only the template's markup holds them). Past `most`, the contents are cut in their middles and the markup
    kept whole (found by a red team: cut as one, the next assistant header was cut)."""
    parts = [cut_to_ends(p, most) if i % 2 else p for i, p in enumerate(parts)]
    special = _special_texts(tokenizer)
    text = "".join(parts)
    # (longer than `most` tokens can cover: cut, part by part, never all of it tokenized at once: 30 results
    # took +250 MB so)
    if len(text) <= chars_within(most) and not any(s in p for p in parts[1::2] for s in special):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) <= most:
            return ids
    pieces = [_part_ids(tokenizer, p, content=bool(i % 2)) for i, p in enumerate(parts)]
    markup = sum(len(p) for p in pieces[0::2])
    if markup > most:
        return None
    shares = _shares([len(p) for p in pieces[1::2]], most - markup)
    return [t for i, p in enumerate(pieces) for t in (p if i % 2 == 0 else _cut_middle(tokenizer, p, shares[i // 2]))]


def _part_ids(tokenizer, part: str, content: bool) -> list:
    """One part of a Rendered observation tokenized: a content's special-token text as plain text."""
    if not part:
        return []
    return tokenizer(part, add_special_tokens=False, **({"split_special_tokens": True} if content else {}))["input_ids"]


def _shares(sizes: list, budget: int) -> list:
    """Each size cut to its share of `budget`: the smaller ones kept whole, the rest splitting what is left
    evenly."""
    out, left = [0] * len(sizes), budget
    for k, i in enumerate(sorted(range(len(sizes)), key=sizes.__getitem__)):
        out[i] = min(sizes[i], left // (len(sizes) - k))
        left -= out[i]
    return out


def _special_texts(tokenizer) -> list:
    """The text of each of the tokenizer's special tokens (none for a tokenizer that lists none)."""
    texts = set(getattr(tokenizer, "all_special_tokens", None) or ())
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    texts.update(t.content for t in added.values() if getattr(t, "special", False))
    return [t for t in texts if t]


_HUNG = HungCalls()   # the environment's calls that did not return in time (_bounded)


def _bounded(call: Callable, timeout_s: float, what: str):
    """call()'s result, or the EnvOutputError it raised (returned, so that a pool can carry it). A call that has
    not returned after timeout_s is an error too: its thread (a daemon: Python cannot stop it) is left behind
    with its instance, and the run goes on instead of hanging on user code; past MAX_HUNG_CALLS such threads
    still running, the run stops (EnvError): each holds its instance, and the machine's threads run out. An
    EnvError the call raised (an environment that says the run cannot go on: ToolCalls' hung tools) is raised
    here, on the driver's thread: the run stops."""
    def run():
        try:
            return call()
        except (EnvOutputError, EnvError) as exc:
            return exc
        except BaseException as exc:   # user code the checks let through (on this thread, no Ctrl-C: the user's own)
            # found by a red team: a reward whose __float__ raised, or a step raising KeyboardInterrupt, ended this
            # thread with a traceback and read as a call that "did not return within step_timeout_s"
            text = said(exc)
            return EnvOutputError(f"{what} raised {type(exc).__name__}{': ' + text if text else ''}")

    hung = len(_HUNG.running())
    if hung >= MAX_HUNG_CALLS:
        raise EnvError(f"{hung} environment calls did not return within environment.step_timeout_s and "
                       "are still running: the environment hangs (fix it, or raise step_timeout_s)")
    try:
        done, out = _HUNG.run(run, timeout_s, what, "lowmem-grpo-env")
    except RuntimeError as exc:   # can't start new thread: the machine's limit, not user code's error
        raise EnvError(f"cannot start a thread for {what}: {exc} ({hung} hung environment calls hold "
                       "threads)") from None
    if not done:
        return EnvOutputError(f"{what} did not return within environment.step_timeout_s={timeout_s:g} s")
    if isinstance(out, EnvError):
        raise out
    return out


def _step(env, text: str, timeout_s: float):
    """checked_step(env, text) through _bounded."""
    return _bounded(lambda: checked_step(env, text), timeout_s, "step()")


def _step_all(envs: list, texts: list, timeout_s: float, parallel: list) -> list:
    """_step over one round's episodes, in their order. Steps of environments that declare parallel_steps (the
    Python tool: a sandboxed subprocess each; `parallel`, per episode) run together on a thread pool; any other's one
    after another (its instances may share state). Each result lands at its episode's place: a run replays the
    same."""
    together = [i for i, together in enumerate(parallel) if together]
    out = [None] * len(envs)
    if len(together) > 1:
        with ThreadPoolExecutor(max_workers=min(STEP_WORKERS, len(together))) as pool:
            for i, result in zip(together, pool.map(_step, [envs[i] for i in together], [texts[i] for i in together],
                                                    [timeout_s] * len(together))):
                out[i] = result
    for i, env in enumerate(envs):
        if out[i] is None:
            out[i] = _step(env, texts[i], timeout_s)
    return out


def _steps_turn(ep: _Episode, cut: bool) -> bool:
    """Whether env.step() reads this turn: not a cut one where the environment ends at a cut turn."""
    return not (cut and ep.ends_at_cut)


def _after_turn(ep: _Episode, cut: bool, stepped, tokenizer, limits: TurnLimits) -> None:
    """With env.step's result on the turn's text (`stepped`: its output or the EnvOutputError; None: the turn was
    not stepped, _steps_turn): end the episode (done, error, a limit) or append the observation."""
    ep.truncated = cut   # the last model turn so far was cut; a later turn that ends on its own clears it
    if stepped is None:
        ep.end(truncated=True)
        return
    if isinstance(stepped, EnvOutputError):
        ep.end(error=str(stepped))
        return
    observation, reward, done = stepped
    if reward is not None:
        ep.rewards.append(reward)
    if done:
        ep.end()
    elif ep.turns >= limits.max_turns or _room(ep) <= 0:
        ep.end(truncated=True)
    else:
        _observe(ep, observation, tokenizer, limits)


def run_episodes(engine, tokenizer, examples: list, params: SamplingParams, factory, limits: TurnLimits,
                 render: Optional[Callable] = None) -> list[Completion]:
    """params.n completions per example, each one environment episode; example i's at [i*n, (i+1)*n).
    `factory.make()` builds an environment, `factory.stop` its turn-ending strings, `factory.counter_names` keeps
    the run's counters() names within their cap (environment.EnvironmentFactory); `render(row, message,
    template_kwargs)` renders reset()'s first message as the dataset prompt would be (an Example), with the
    environment's template_kwargs, when one is given."""
    episodes = [_start(i, e, factory, render, limits.step_timeout_s) for i, e in enumerate(examples)
                for _ in range(params.n)]
    _end_shared(episodes)
    context = context_tokens(engine)
    for ep in episodes:
        ep.cap = _cap(ep, limits, context)
        if not ep.done and ep.cap <= 0:   # an error, not a limit: it would pass as a silent zero-turn episode
            ep.end(error=f"the prompt is {len(ep.prompt_ids)} tokens and fills the model's context ({context} tokens): "
                         "no model turn fits; shorten reset()'s first message or lower data.max_prompt_tokens")
    while True:
        active = [ep for ep in episodes if not ep.done]
        if not active:
            break
        budget = min(params.max_new_tokens, max(_room(ep) for ep in active))
        turn_params = replace(params, n=1, max_new_tokens=budget, stop=tuple(factory.stop))
        outs = engine.generate([ep.prompt_ids + ep.tokens for ep in active], turn_params)
        turns = [_model_turn(ep, c, limits) for ep, c in zip(active, outs)]
        texts = [turn_text(tokenizer, turn, ended_at_eos=not cut and ep.stopped_by is None)
                 for ep, (turn, cut) in zip(active, turns)]
        read = [i for i, (ep, (_, cut)) in enumerate(zip(active, turns)) if _steps_turn(ep, cut)]
        stepped = [None] * len(active)
        for i, result in zip(read, _step_all([active[i].env for i in read], [texts[i] for i in read],
                                             limits.step_timeout_s, [active[i].parallel for i in read])):
            stepped[i] = result
        for ep, (_, cut), result in zip(active, turns, stepped):
            _after_turn(ep, cut, result, tokenizer, limits)
    for ep in episodes:
        _read_final_reward(ep, limits.step_timeout_s)
        _read_counters(ep, limits.step_timeout_s, factory.counter_names)
        _read_for_rewards(ep, limits.step_timeout_s)
    return [ep.completion() for ep in episodes]


def _end_shared(episodes: list) -> None:
    """Ends, as an error, the episodes whose environment (or its for_rewards instance: a ToolCalls' environment_factory
    instance) another episode has too: a class that hands out one instance (a singleton __new__), a factory that
    returns the same object. Their resets and steps overwrite each other's state, and every reward would score the
    last reset's row (found by a red team: a singleton's episodes were all scored on one row's answer, silently)."""
    owners: dict = {}
    for ep in episodes:
        if ep.env is None:
            continue
        # By identity, never hashed (a @dataclass environment is unhashable, a user __hash__ is unbounded code); the
        # for_rewards instance only where it is one made per episode (own_for_rewards: ToolCalls'): another
        # environment's may be a shared value by design (a bool, a class constant), found by a review
        mine = {id(ep.env)}
        if ep.own_instance and ep.instance is not None:
            mine.add(id(ep.instance))
        for key in mine:
            owners.setdefault(key, []).append(ep)
    for sharing in owners.values():
        if len(sharing) < 2:
            continue
        for ep in sharing:
            if ep.error is None:
                ep.end(error=f"its environment instance ({type(ep.env).__name__}) is also another episode's: each "
                             f"episode needs its own (a constructor or environment_factory that returns one shared "
                             f"object mixes the episodes' states); return a new instance from each call")


def _read_final_reward(ep: _Episode, timeout_s: float) -> None:
    """The environment's optional final_reward() at the end of an episode that no error ended, bounded as step()
    is, added to its rewards (a bad one is that episode's error)."""
    if ep.env is None or ep.error is not None or not ep.has_final_reward:
        return
    env = ep.env
    reward = _bounded(lambda: checked_final_reward(env), timeout_s, "final_reward()")
    if isinstance(reward, EnvOutputError):
        ep.error = str(reward)
    elif reward is not None:
        ep.rewards.append(reward)


def _read_counters(ep: _Episode, timeout_s: float, names) -> None:
    """The environment's optional counters() at the episode's end, bounded as step() is (a bad one is that
    episode's error), less the names past the run's cap (`names`: the factory's environment.CounterNames)."""
    if ep.env is None:
        return
    env = ep.env
    counters = _bounded(lambda: checked_counters(env), timeout_s, "counters()")
    if isinstance(counters, EnvOutputError):
        ep.error = ep.error or str(counters)
    else:
        ep.counters = names.kept(counters)


def _read_for_rewards(ep: _Episode, timeout_s: float) -> None:
    """What the reward functions get for the episode (its for_rewards), read again at its end, bounded as step() is:
    the instance as the episode left it (a property that sums up the episode gave its state after reset() when it
    was read only there: found by a review); None where it cannot be read."""
    if ep.env is None:
        return
    env = ep.env
    instance = _bounded(lambda: for_rewards(env), timeout_s, "for_rewards")
    ep.instance = None if isinstance(instance, EnvOutputError) else instance


def runner(engine, tokenizer, factory, limits: TurnLimits, render: Optional[Callable] = None) -> Callable:
    """`generate(examples, params) -> completions` through episodes: what the trainer and eval call in place
    of engine.generate when the recipe names an environment."""
    def generate(examples: list, params: SamplingParams) -> list[Completion]:
        return run_episodes(engine, tokenizer, examples, params, factory, limits, render)
    return generate


# -- what the rest of the step reads from an episode's completion ------------------------------------------

def prompt_ids(c: Completion, example) -> list:
    """The prompt completion `c` was sampled from: reset()'s first message when it gave one, else the example's."""
    return c.prompt_ids if c.prompt_ids is not None else example.prompt_ids


def prompt_text(c: Completion, example) -> str:
    """The prompt text completion `c` was sampled from (as prompt_ids): reset()'s first message rendered, when it
    gave one, else the example's. The reward functions and the sample tables read this one."""
    return c.env.prompt_text if c.env is not None and c.env.prompt_text is not None else example.prompt_text


def prompt_messages(c: Completion, example) -> Optional[list]:
    """The example's chat messages; where the environment's reset() replaced its prompt, the messages it gave
    (None for a first message given as text)."""
    if c.prompt_ids is not None:
        return c.env.prompt_messages if c.env is not None else None
    return getattr(example, "messages", None)


def environment_rewards(completions: list) -> Optional[list]:
    """Each completion's environment reward (None: it gave none); None when no environment drove them."""
    if all(c.env is None for c in completions):
        return None
    return [c.env.reward if c.env is not None else None for c in completions]


def score(rewards, texts: list, completions: list, examples: list, step: int = 0, *, tokenizer):
    """The RewardResult of completions[j] (decoded: texts[j]), sampled for examples[j], as training and eval both
    score them; `step`: the optimizer steps done (a TRL-shaped reward's trainer_state.global_step). With an
    environment, the built-in rewards read the model's own words (model_texts), TRL-shaped functions get each
    episode's environment instance as environments[j] (environment.for_rewards) and, with chat prompts, its
    completion as messages (completion_messages: `tokenizer`).

    An episode that an environment error ended (EnvRecord.error: it raised, returned the wrong types or hung)
    has no verdict: whatever its rewards would say, they would score the environment's failure, not the model.
    So no reward function sees it (a TRL-shaped one would read a broken environment instance), and it is
    skipped: out of its group's statistics, the update and the success rate, counted in success_rate/skipped
    (and env/errors) (docs/algorithm.md §20). Once scored, the completions no longer hold their environment
    instances: those are not kept past the step, nor sent to other processes (distributed.gather pickles them)."""
    try:
        return _score(rewards, texts, completions, examples, step, tokenizer)
    finally:
        for c in completions:
            if c.env is not None and c.env.instance is not None:
                c.env = replace(c.env, instance=None)


def _score(rewards, texts: list, completions: list, examples: list, step: int, tokenizer):
    ok = [j for j, c in enumerate(completions) if c.env is None or not c.env.error]
    if len(ok) < len(completions):
        scored = (_score(rewards, [texts[j] for j in ok], [completions[j] for j in ok], [examples[j] for j in ok],
                         step, tokenizer) if ok else None)
        return _spread(rewards.names, scored, ok, len(completions))
    chats = [prompt_messages(c, e) for c, e in zip(completions, examples)]
    driven = any(c.env is not None for c in completions)
    instances = [c.env.instance if c.env is not None else None for c in completions]
    return rewards(texts, [prompt_text(c, e) for c, e in zip(completions, examples)], [e.row for e in examples],
                   completion_ids=[c.token_ids for c in completions], step=step, prompt_messages=chats,
                   environment=environment_rewards(completions),
                   # (TRL's tools without an environment_factory: no instances, and TRL passes none)
                   environments=instances if any(i is not None for i in instances) else None,
                   model_completions=model_texts(tokenizer, completions) if driven else None,
                   completion_messages=[completion_messages(tokenizer, c) if m is not None else None
                                        for c, m in zip(completions, chats)])


def _spread(names: list, scored, ok: list, n: int):
    """The RewardResult of n completions from `scored`, that of those at `ok` (None: no completion was scored):
    NaN (skipped) elsewhere, and None in TRL's log_extra columns."""
    import torch

    from ..rewards import RewardResult

    at = torch.tensor(ok, dtype=torch.long)

    def full(values=None):
        out = torch.full((n,), math.nan, dtype=torch.float64)
        if values is not None:
            out[at] = values
        return out

    if scored is None:
        return RewardResult(full(), {name: full() for name in names}, {}, n)
    extra = {}
    for column, values in scored.extra.items():
        extra[column] = [None] * n
        for j, value in zip(ok, values):
            extra[column][j] = value
    total = full(scored.total)
    return RewardResult(total, {k: full(v) for k, v in scored.per_function.items()}, dict(scored.errors),
                        int(total.isnan().sum()), scored.metrics, extra)


def completion_texts(tokenizer, completions: list) -> list[str]:
    """The completions as the reward functions read them: decoded without special tokens, ending with the model's
    own words. An observation after which the model said nothing (its last turn EOS alone) is left out: the
    rewards read the last text as the model's answer, and it was the environment's (found by a red team)."""
    return tokenizer.batch_decode([_to_last_words(tokenizer, c) for c in completions], skip_special_tokens=True)


def model_texts(tokenizer, completions: list) -> list[str]:
    """What the built-in rewards (math, code, ...) read: the model's own turns, each decoded as completion_texts
    decodes, joined by a newline; the environment's observations left out, since an answer or a code block in a
    tool's output is not the model's (a red team's leftover: a \\boxed{} a tool printed was read as the model's
    answer when its last turn had none). A completion no environment drove: its text."""
    runs = [[ids for by_env, ids in _runs(c.token_ids, c.env_mask) if not by_env] if c.env_mask is not None
            else [c.token_ids] for c in completions]
    flat = tokenizer.batch_decode([ids for r in runs for ids in r], skip_special_tokens=True)
    texts, at = [], 0
    for r in runs:
        texts.append("\n".join(flat[at:at + len(r)]))
        at += len(r)
    return texts


def _to_last_words(tokenizer, c: Completion) -> list:
    """c.token_ids without the environment's segments that only blank model text follows."""
    ids, mask = c.token_ids, c.env_mask
    end = len(ids)
    while mask and any(mask[:end]):
        last = max(i for i in range(end) if mask[i])
        if tokenizer.decode(ids[last + 1:end], skip_special_tokens=True).strip():
            break
        while last > 0 and mask[last - 1]:
            last -= 1
        end = last
    return ids if end == len(ids) else list(ids[:end])


def completion_messages(tokenizer, c: Completion) -> Optional[list]:
    """An episode's completion as chat messages, as TRL gives a tool-calling one to its reward functions: each run
    of the model's tokens an assistant message, each of the environment's a tool message, decoded as
    completion_texts decodes (the same text, ending with the model's last words); None for a completion no
    environment drove. So completion[-1]["content"] is the model's last turn, not a tool's output as well (found
    by a red team: one assistant message holding it all scored add()'s "42" as the model's answer). Where an
    observation came with its exchange's messages (Rendered.messages: TRL's tools), the turn before it is that
    assistant message, with its tool_calls, and the observation is one tool message per call, as in TRL."""
    if c.env_mask is None:
        return None
    exchanges = c.env.exchanges if c.env is not None else ()
    kept = len(_to_last_words(tokenizer, c))   # past it: observations the model said nothing after, left out
    messages: list = []
    at = seen = 0   # tokens, observations so far
    for by_env, run in _runs(c.token_ids, c.env_mask):
        if at >= kept and not by_env:
            break
        at += len(run)
        if not by_env:
            messages.append({"role": "assistant", "content": tokenizer.decode(run, skip_special_tokens=True)})
            continue
        exchange = exchanges[seen] if seen < len(exchanges) else ()
        seen += 1
        if exchange and messages and messages[-1]["role"] == "assistant":
            messages[-1] = dict(exchange[0])    # the turn as TRL parses it: its text, its tool_calls
            if at <= kept:
                messages += [dict(m) for m in exchange[1:]]
        elif at <= kept:
            messages.append({"role": "tool", "content": tokenizer.decode(run, skip_special_tokens=True)})
    return messages


def _runs(ids: list, mask: list) -> list:
    """(by the environment, its tokens) for each run of `ids` one author wrote, in order."""
    runs: list = []
    for token, by_env in zip(ids, mask):
        if runs and runs[-1][0] == by_env:
            runs[-1][1].append(token)
        else:
            runs.append((by_env, [token]))
    return runs


def model_tokens(c: Completion) -> int:
    """|o_i| (docs/algorithm.md §20): the tokens the model sampled, the environment's left out."""
    return len(c.token_ids) - (sum(c.env_mask) if c.env_mask is not None else 0)


def segments(completion: Completion, tokenizer) -> Optional[list]:
    """The completion as [who, text] runs, who "model" or "environment", for the sample table; None for a
    completion without environment tokens' bookkeeping (no environment)."""
    if completion.env_mask is None:
        return None
    return [["environment" if by_env else "model", tokenizer.decode(ids, skip_special_tokens=True)]
            for by_env, ids in _runs(completion.token_ids, completion.env_mask)]
