"""Environments and multi-turn rollouts (docs/algorithm.md §20): stop strings in the transformers engine, the
driver's turns, limits and counted errors, environment tokens out of the loss, rewards from the environment,
and a toy two-turn environment through train and eval."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

from dataclasses import replace as dataclasses_replace

import pytest
import torch

from conftest import QUIET, recipe_dict, write_recipe
from lowmem_grpo import tiny
from lowmem_grpo.data import Example
from lowmem_grpo.environment import (EnvError, EnvironmentFactory, checked_step, environment_problems)
from lowmem_grpo.recipe import EnvironmentConfig, RecipeError, recipe_from_dict
from lowmem_grpo.rollout.base import Completion, SamplingParams
from lowmem_grpo.rollout.turns import TurnLimits, run_episodes
from lowmem_grpo.user_code import HungCalls

TOK = tiny.build_tokenizer()
EOS = TOK.eos_token_id


def ids(text: str) -> list:
    return TOK(text, add_special_tokens=False)["input_ids"]


class FakeEngine:
    """Scripted turns: every sequence gets `turn` (token ids) then EOS, cut at params.max_new_tokens (then
    truncated); `eos=False` never ends a turn. Records each call's prompts and params."""

    def __init__(self, turn="12", eos=True):
        self.turn, self.eos, self.calls = ids(turn), eos, []

    def generate(self, prompts, params):
        self.calls.append(([list(p) for p in prompts], params))
        out = []
        for i in range(len(prompts)):
            for _ in range(params.n):
                full = self.turn + ([EOS] if self.eos else [])
                tokens = full[: params.max_new_tokens]
                out.append(Completion(i, tokens, tokens != full or not self.eos, [-0.5] * len(tokens)))
        return out


def examples(n=2):
    return [Example({"prompt": f"{i}+{i}=", "answer": str(2 * i)}, f"{i}+{i}=", [TOK.bos_token_id] + ids(f"{i}+{i}="))
            for i in range(n)]


def factory(name="toy_envs:Scripted", **kwargs):
    return EnvironmentFactory(EnvironmentConfig(name=name, kwargs=kwargs))


LIMITS = TurnLimits(max_turns=4, max_total_tokens=64, observation_max_tokens=16, observation_template=" {observation} ")


# -- the transformers engine's stop strings ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_engine(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from lowmem_grpo.rollout.hf import HFEngine

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return HFEngine(model, TOK)


def test_stop_strings_end_a_completion_right_after_the_stop(hf_engine):
    """Same seed with and without stop strings: the RNG draws are the same, so each completion with them is
    the prefix of its twin that ends with the token completing the first stop string (none earlier)."""
    prompts = [[TOK.bos_token_id] + ids("12+34="), [TOK.bos_token_id] + ids("5+6=")]
    torch.manual_seed(0)
    free = hf_engine.generate(prompts, SamplingParams(n=6, max_new_tokens=16))
    torch.manual_seed(0)
    stopped = hf_engine.generate(prompts, SamplingParams(n=6, max_new_tokens=16, stop=("5", "+")))
    assert any(c.stopped_by for c in stopped) and any(not c.stopped_by for c in stopped)
    for a, b in zip(free, stopped):
        assert a.token_ids[: len(b.token_ids)] == b.token_ids and a.logprobs[: len(b.logprobs)] == b.logprobs
        text = TOK.decode(b.token_ids)
        if b.stopped_by is not None:
            assert text.endswith(b.stopped_by) and not b.truncated
            assert "5" not in TOK.decode(b.token_ids[:-1]) and "+" not in TOK.decode(b.token_ids[:-1])
        else:
            assert b.token_ids == a.token_ids and b.truncated == a.truncated
            assert "5" not in text and "+" not in text


def test_a_stop_string_never_met_changes_nothing(hf_engine):
    prompts = [[TOK.bos_token_id] + ids("7+8=")]
    torch.manual_seed(1)
    a = hf_engine.generate(prompts, SamplingParams(n=4, max_new_tokens=10))
    state_a = torch.get_rng_state()
    torch.manual_seed(1)
    b = hf_engine.generate(prompts, SamplingParams(n=4, max_new_tokens=10, stop=("zz",)))
    assert torch.equal(state_a, torch.get_rng_state())
    assert [(c.token_ids, c.logprobs, c.truncated) for c in a] == [(c.token_ids, c.logprobs, c.truncated) for c in b]
    assert all(c.stopped_by is None for c in a + b)


# -- the driver ----------------------------------------------------------------------------------------------------

def test_driver_pauses_appends_the_observation_as_environment_tokens_and_resumes():
    from toy_envs import Scripted

    Scripted.seen = []
    engine = FakeEngine("12")
    out = run_episodes(engine, TOK, examples(2), SamplingParams(n=3, max_new_tokens=8), factory(), LIMITS)
    assert [c.prompt_index for c in out] == [0, 0, 0, 1, 1, 1]
    assert len(engine.calls) == 2                                  # one generate call per round, all together
    (p1, params1), (p2, _) = engine.calls
    assert params1.n == 1 and params1.stop == ("=",) and len(p1) == 6
    turn, obs = ids("12") + [EOS], ids(" +1 ")
    assert p2[0] == examples(2)[0].prompt_ids + turn + obs         # prompt + everything so far
    for c in out:
        assert c.token_ids == turn + obs + turn
        assert c.env_mask == [False] * 3 + [True] * 4 + [False] * 3
        assert all(math.isnan(x) for x in c.logprobs[3:7]) and c.logprobs[:3] == [-0.5] * 3
        assert (c.env.turns, c.env.env_tokens, c.env.reward, c.env.error, c.truncated) == (2, 4, 1.0, None, False)
    assert Scripted.seen == ["12"] * 12                            # the turn's text, special tokens dropped


def test_driver_limits_turns_tokens_and_observation_length():
    # never done: max_turns ends it, truncated; the observation is cut to observation_max_tokens
    limits = TurnLimits(max_turns=3, max_total_tokens=64, observation_max_tokens=2, observation_template="{observation}")
    out = run_episodes(FakeEngine("12"), TOK, examples(1), SamplingParams(n=2, max_new_tokens=8),
                       factory("toy_envs:NeverDone"), limits)
    for c in out:
        assert c.token_ids == (ids("12") + [EOS] + ids("00")) * 2 + ids("12") + [EOS]   # no observation after the last turn
        assert (c.env.turns, c.env.reward, c.truncated) == (3, 3.0, True)
    # max_total_tokens: the engine is asked for no more than the room left, and the completion stops there
    engine = FakeEngine("123456", eos=False)
    limits = TurnLimits(max_turns=9, max_total_tokens=10, observation_max_tokens=16, observation_template="{observation}")
    out = run_episodes(engine, TOK, examples(1), SamplingParams(n=1, max_new_tokens=4),
                       factory("toy_envs:NeverDone", observation="00"), limits)
    assert [p.max_new_tokens for _, p in engine.calls] == [4, 4]
    c = out[0]
    assert c.token_ids == ids("1234") + ids("00") + ids("1234") and len(c.token_ids) == 10
    assert c.truncated and c.env.turns == 2
    # a model turn cut at max_new_tokens leaves the completion truncated when it is the last
    out = run_episodes(FakeEngine("123456", eos=False), TOK, examples(1), SamplingParams(n=1, max_new_tokens=3),
                       factory(replies=[[None, 1.0, True]]), LIMITS)
    assert out[0].truncated and out[0].env.turns == 1 and out[0].token_ids == ids("123")


@pytest.mark.parametrize("how, at, words", [
    ("init", 1, "raised RuntimeError: cannot start"),
    ("reset_raise", 1, "reset() raised ValueError: no such game"),
    ("reset_type", 1, "reset() returned int 42"),
    ("raise", 1, "step() raised ZeroDivisionError"),
    ("raise", 2, "step() raised ZeroDivisionError"),
    ("not_a_tuple", 1, "step() returned str 'oops'"),
    ("short", 1, "step() returned tuple"),
    ("obs_type", 1, "observation 7 (int)"),
    ("reward_type", 1, "reward 'high' (str)"),
    ("reward_nan", 1, "reward nan"),
    ("done_type", 1, "done 'yes' (str)"),
    # sys.exit() in user code is its error too: not the trainer's exit, nor (on a step thread) a fake hang
    ("init_exit", 1, "raised SystemExit: 3"),
    ("reset_exit", 1, "reset() raised SystemExit: bye"),
    ("exit", 2, "step() raised SystemExit: 1"),
    # text the tokenizer cannot take (a lone surrogate) is named, not a TypeError out of the rollout
    ("obs_surrogate", 1, "step() returned an observation that is not valid text"),
    ("reset_surrogate", 1, "reset() returned a first message that is not valid text"),
])
def test_environment_errors_end_that_episode_and_are_counted(how, at, words):
    import dataclasses

    limits = dataclasses.replace(LIMITS, step_timeout_s=5)
    out = run_episodes(FakeEngine("12"), TOK, examples(2), SamplingParams(n=2, max_new_tokens=8),
                       factory("toy_envs:Faulty", how=how, at=at), limits)
    assert len(out) == 4
    for c in out:
        assert c.env.error is not None and words in c.env.error, c.env.error
        started = not how.startswith(("init", "reset"))
        assert c.env.turns == (at if started else 0) and len(c.token_ids) == len(c.env_mask)
        assert c.env.reward == (0.5 if at == 2 else None)    # the rewards given before the error stay
    from lowmem_grpo.diagnostics import environment_stats

    stats = environment_stats([c.env for c in out], torch.tensor([c.truncated for c in out]))
    assert stats["env/errors"] == 4


def test_step_outputs_checked():
    class Env:
        def __init__(self, out):
            self.out = out

        def step(self, text):
            return self.out

    import numpy as np

    assert checked_step(Env(("a", np.float64(0.5), np.bool_(True))), "") == ("a", 0.5, True)
    assert checked_step(Env([None, 2, False]), "") == (None, 2.0, False)
    # beyond a reward score's bound (MAX_SCORE) an episode's reward overflowed the group's std (a red team's find)
    from lowmem_grpo.environment import EnvOutputError, checked_final_reward
    from lowmem_grpo.rewards import MAX_SCORE

    assert checked_step(Env(("a", MAX_SCORE, True)), "")[1] == MAX_SCORE
    with pytest.raises(EnvOutputError, match=r"step\(\) returned reward 1e\+200; allowed: a number within \+-1e\+100"):
        checked_step(Env(("a", 1e200, True)), "")

    class Final:
        def __init__(self, value):
            self.value = value

        def final_reward(self):
            return self.value

    assert checked_final_reward(Final(-MAX_SCORE)) == -MAX_SCORE
    with pytest.raises(EnvOutputError, match=r"final_reward\(\) returned -1e\+200 \(float\); allowed: a number within"):
        checked_final_reward(Final(-1e200))


def test_counters_take_numpy_numbers_and_refuse_the_rest():
    """numpy's integers are no int subclass: counters() returning them (a count kept in an array) is no error."""
    import numpy as np

    from lowmem_grpo.environment import EnvOutputError, checked_counters

    class Env:
        def __init__(self, out):
            self.out = out

        def counters(self):
            return self.out

    assert checked_counters(Env({"calls": np.int64(3), "share": np.float32(0.5), "n": 2})) == \
        {"calls": 3.0, "share": 0.5, "n": 2.0}
    for bad in ({"calls": np.bool_(True)}, {"calls": float("inf")}, {"calls": "3"}, {1: 2}, [("calls", 1)]):
        with pytest.raises(EnvOutputError, match="allowed: a dict of names to finite numbers"):
            checked_counters(Env(bad))


@pytest.mark.parametrize("how", ["init_hang", "reset_hang", "counters_hang"])
def test_a_constructor_reset_or_counters_that_never_returns_ends_its_episode(how):
    """environment.step_timeout_s bounds every call into the environment, not only step(): a hanging
    constructor, reset() or counters() is that episode's counted error, and the run goes on."""
    import dataclasses
    import time

    limits = dataclasses.replace(LIMITS, step_timeout_s=0.5)   # (steps that return take ~1 ms: ample on a loaded CI machine)
    t0 = time.monotonic()
    out = run_episodes(FakeEngine("12"), TOK, examples(1), SamplingParams(n=2, max_new_tokens=8),
                       factory("toy_envs:Faulty", how=how, at=9), limits)
    assert time.monotonic() - t0 < 10 and len(out) == 2
    what = "counters()" if how == "counters_hang" else "the constructor or reset()"
    for c in out:
        assert f"{what} did not return within environment.step_timeout_s=0.5 s" in c.env.error, c.env.error
        assert c.env.turns == (4 if how == "counters_hang" else 0)


def test_a_row_awaiting_resets_message_that_reset_leaves_empty_is_that_episodes_error():
    """A chat row ending with an empty user message (TRL's placeholder) is accepted in a run with an environment, for
    reset() to fill: a reset() that gives no message left the model asked nothing. That episode's counted error; a
    row with a question of its own runs as before."""
    placeholder = Example({"prompt": [{"role": "user", "content": ""}], "answer": "2"}, "", [TOK.bos_token_id],
                          messages=[{"role": "user", "content": ""}])
    asked = Example({"prompt": [{"role": "user", "content": "1+1="}], "answer": "2"}, "1+1=",
                    [TOK.bos_token_id] + ids("1+1="), messages=[{"role": "user", "content": "1+1="}])
    out = run_episodes(FakeEngine("12"), TOK, [placeholder, asked], SamplingParams(n=1, max_new_tokens=8), factory(),
                       LIMITS)
    assert "the row's last user message is empty, the slot reset()'s first message fills, and reset() returned none" \
        in out[0].env.error and out[0].env.turns == 0
    assert out[1].env.error is None and out[1].env.turns >= 1


def test_reset_gets_its_own_copy_of_the_row():
    """The example's row is shared by its n episodes and read by the reward functions afterwards: an
    environment that changes the row it is given changes only its copy."""
    from toy_envs import RowThief

    RowThief.seen = []
    ex = examples(1)
    ex[0].row["tags"] = ["a"]
    before = {**ex[0].row, "tags": ["a"]}
    run_episodes(FakeEngine("12"), TOK, ex, SamplingParams(n=3, max_new_tokens=8), factory("toy_envs:RowThief"), LIMITS)
    assert ex[0].row == before
    assert RowThief.seen == [before] * 3                # each episode saw the row as the dataset has it


def test_special_token_text_in_an_observation_stays_text():
    """An observation that spells EOS/BOS/PAD (a tool's output can print anything) becomes plain-text tokens,
    never control tokens in the middle of the completion; the template's own special tokens stay special."""
    unk, eos, bos = TOK.unk_token_id, TOK.eos_token_id, TOK.bos_token_id
    limits = TurnLimits(max_turns=2, max_total_tokens=64, observation_max_tokens=32,
                        observation_template="</s>{observation}<s>")
    out = run_episodes(FakeEngine("12"), TOK, examples(1), SamplingParams(n=1, max_new_tokens=8),
                       factory("toy_envs:NeverDone", observation="1</s>2<pad>"), limits)
    env_ids = [t for t, e in zip(out[0].token_ids, out[0].env_mask) if e]
    assert env_ids == [eos] + ids("1") + [unk] * 4 + ids("2") + [unk] * 5 + [bos]
    # an observation without such text is tokenized as one string, as ever
    limits = dataclasses_replace(limits, observation_template=" {observation} ")
    out = run_episodes(FakeEngine("12"), TOK, examples(1), SamplingParams(n=1, max_new_tokens=8),
                       factory("toy_envs:NeverDone", observation="3+4"), limits)
    assert [t for t, e in zip(out[0].token_ids, out[0].env_mask) if e] == ids(" 3+4 ")


def test_an_observation_the_tokenizer_drops_is_warned_about_once(tiny_model_dir, monkeypatch):
    """Found by an audit: the tiny tokenizer, loaded from its folder, encodes "higher" to no tokens; the episodes
    ran with env/tokens 0 and the model never saw the feedback, without a word. Now a warning says so, once; an
    observation that has tokens, or is blank, says nothing."""
    import warnings

    from transformers import AutoTokenizer

    from lowmem_grpo.rollout import turns

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tok("higher", add_special_tokens=False)["input_ids"] == []   # (what the warning is about)

    def run(observation):
        run_episodes(FakeEngine("12"), tok, examples(1), SamplingParams(n=1, max_new_tokens=8),
                     factory("toy_envs:NeverDone", observation=observation), LIMITS)

    monkeypatch.setattr(turns, "_unseen_warned", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run("3+4")
        run("\n")
    with pytest.warns(UserWarning, match=r"the environment's observation 'higher' encodes to no tokens with this "
                                         r"tokenizer, so the model never sees it: .*build_tool_tokenizer\)"):
        run("higher")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run("lower")                      # said once


def test_a_huge_observation_is_cut_before_it_is_tokenized():
    """A megabyte observation (a careless environment dumping a file) costs the tokenizer only what
    observation_max_tokens can use: the text is cut first, and the tokens kept are the same."""
    seen = []

    class Spy:
        eos_token_id = EOS

        def __call__(self, text, **kwargs):
            seen.append(len(text))
            return TOK(text, **kwargs)

        def decode(self, token_ids, **kwargs):
            return TOK.decode(token_ids, **kwargs)

    limits = TurnLimits(max_turns=2, max_total_tokens=64, observation_max_tokens=8, observation_template="{observation}")
    out = run_episodes(FakeEngine("12"), Spy(), examples(1), SamplingParams(n=1, max_new_tokens=8),
                       factory("toy_envs:NeverDone", observation="1234567890" * 1_000_000), limits)
    assert max(seen) < 100_000, seen
    # cut in its middle, its end kept (_cut_middle): this tokenizer cannot spell the mark, so none
    assert [t for t, e in zip(out[0].token_ids, out[0].env_mask) if e] == ids("123456") + ids("90")


def test_an_observation_that_would_fill_the_completion_is_not_appended():
    """An observation that leaves no room for a model turn ends the episode (truncated) without being appended:
    else the completion would end in the environment's text, which a reward function reads as the model's last
    words (here a number, as the math reward reads one)."""
    limits = TurnLimits(max_turns=4, max_total_tokens=10, observation_max_tokens=16, observation_template="{observation}")
    out = run_episodes(FakeEngine("12"), TOK, examples(1), SamplingParams(n=2, max_new_tokens=8),
                       factory("toy_envs:NeverDone", observation="4242424242"), limits)
    for c in out:
        assert c.token_ids == ids("12") + [EOS] and not any(c.env_mask), TOK.decode(c.token_ids)
        assert (c.env.turns, c.env.env_tokens, c.truncated, c.env.error) == (1, 0, True, None)
    # one token of room left after it: appended, and the model's turn follows
    limits = dataclasses_replace(limits, max_total_tokens=9, observation_max_tokens=5)
    out = run_episodes(FakeEngine("12"), TOK, examples(1), SamplingParams(n=1, max_new_tokens=8),
                       factory("toy_envs:NeverDone", observation="4242424242"), limits)
    # (cut in its middle: its first 4 tokens and its last)
    assert out[0].token_ids == ids("12") + [EOS] + ids("4242") + ids("2") + ids("1") and out[0].truncated


class _ContextEngine(FakeEngine):
    """FakeEngine over a model whose context is `context` tokens (as the engines say: context_tokens())."""

    def __init__(self, context, **kwargs):
        super().__init__(**kwargs)
        self.context = context

    def context_tokens(self):
        return self.context


def test_episodes_end_where_the_models_context_ends():
    """max_total_tokens may exceed what the model takes after its prompt: the episode ends (truncated) where the
    context does, never asking the engine past it (vLLM refuses such a prompt with a traceback mid-run; the
    transformers engine would read positions the model never saw)."""
    limits = TurnLimits(max_turns=9, max_total_tokens=64, observation_max_tokens=16, observation_template="{observation}")
    engine = _ContextEngine(16, turn="12")
    out = run_episodes(engine, TOK, examples(2), SamplingParams(n=2, max_new_tokens=8),
                       factory("toy_envs:NeverDone", observation="00"), limits)
    for prompts, params in engine.calls:
        assert all(len(p) + params.max_new_tokens <= 16 for p in prompts), [len(p) for p in prompts]
    for c, e in zip(out, [e for e in examples(2) for _ in range(2)]):
        assert len(e.prompt_ids) + len(c.token_ids) == 16 and c.truncated and c.env.turns == 3
        assert c.token_ids == (ids("12") + [EOS] + ids("00")) * 2 + ids("1")
    # a prompt that fills the context: no turn at all, an error that says why (not a silent empty episode)
    out = run_episodes(_ContextEngine(5), TOK, examples(1), SamplingParams(n=1, max_new_tokens=8),
                       factory("toy_envs:NeverDone"), limits)
    assert (out[0].token_ids, out[0].env.turns) == ([], 0)
    assert "the prompt is 5 tokens and fills the model's context (5 tokens)" in out[0].env.error


def test_counters_may_not_take_the_name_of_a_built_in_env_metric():
    """A counter named turns (or tokens, errors, truncated) would vanish from the row, whose own env/turns wins:
    an error naming it, not a silently missing metric."""
    from lowmem_grpo.environment import EnvOutputError, checked_counters

    class Env:
        def counters(self):
            return {"turns": 9, "calls": 1}

    with pytest.raises(EnvOutputError, match="counters\\(\\) returned 'turns': the names of the trainer's own env/turns, "
                                             "which a counter cannot replace; allowed: names other than turns, tokens, "
                                             "errors, truncated"):
        checked_counters(Env())


def test_counter_names_made_from_data_stop_at_the_runs_cap_said_once():
    """An environment naming counters after its rows (word_<w>) made a metric column per row, without end (found
    by a red team). A run keeps its first MAX_COUNTER_NAMES names; a new name past them is dropped, said once, and
    the episode still scored."""
    from lowmem_grpo import environment
    from lowmem_grpo.diagnostics import environment_stats

    words = factory("toy_envs:Words")   # one per run: its names are the run's
    assert words.counter_names.most == environment.MAX_COUNTER_NAMES == 64
    words.counter_names = environment.CounterNames(most=5)
    rows = [Example({"prompt": f"{i}="}, f"{i}=", [TOK.bos_token_id] + ids(f"{i}=")) for i in range(9)]
    limits = TurnLimits(max_turns=2, max_total_tokens=16, observation_max_tokens=4)
    with pytest.warns(UserWarning) as said:
        first = run_episodes(FakeEngine("1"), TOK, rows[:6], SamplingParams(n=1, max_new_tokens=4), words, limits)
    [warning] = [w for w in said if "counters()" in str(w.message)]
    assert ("gave more than 5 distinct names in this run; 'word_4=' and any later new name are not logged (the first "
            "5 still are): counters are for a fixed set of names") in str(warning.message)
    kept = ["steps", "word_0=", "word_1=", "word_2=", "word_3="]
    assert [sorted(dict(c.env.counters)) for c in first] == [sorted(kept[:1] + kept[1 + i:2 + i]) for i in range(4)] \
        + [["steps"]] * 2
    assert all(c.env.error is None and c.env.reward == 1.0 for c in first)   # still scored
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")   # said once a run: a later step says nothing more
        later = run_episodes(FakeEngine("1"), TOK, [rows[6], rows[0]], SamplingParams(n=1, max_new_tokens=4), words,
                             limits)
    assert [dict(c.env.counters) for c in later] == [{"steps": 1.0}, {"steps": 1.0, "word_0=": 1.0}]
    row = environment_stats([c.env for c in first + later], torch.zeros(8, dtype=torch.bool))
    assert sorted(k for k in row if k.startswith("env/") and k[4:] not in ("turns", "tokens", "errors", "truncated")) \
        == ["env/" + k for k in sorted(kept)]


def test_first_message_replaces_the_prompt():
    from toy_envs import Scripted

    def render(row, message, template_kwargs):
        assert template_kwargs is None   # (the environment sets none)
        return Example(row, "Q:" + message, [TOK.bos_token_id] + ids(message))

    engine = FakeEngine("1")
    out = run_episodes(engine, TOK, examples(1), SamplingParams(n=2, max_new_tokens=4),
                       factory(first_message="9*9=", replies=[[None, 1.0, True]]), LIMITS, render=render)
    assert engine.calls[0][0][0] == [TOK.bos_token_id] + ids("9*9=")
    assert out[0].prompt_ids == [TOK.bos_token_id] + ids("9*9=") and out[0].env.prompt_text == "Q:9*9="
    Scripted.seen = []


def test_driver_with_the_transformers_engine_is_deterministic(hf_engine):
    def run(seed):
        torch.manual_seed(seed)
        return run_episodes(hf_engine, TOK, examples(2), SamplingParams(n=3, max_new_tokens=4),
                            factory("toy_envs:TwoTurns"), LIMITS)

    a, b = run(5), run(5)
    assert _nan_equal(a, b)
    assert all(c.env.turns == 2 and c.env.reward is not None and c.env.env_tokens == len(ids(" +1= ")) for c in a)
    assert [c.token_ids for c in run(6)] != [c.token_ids for c in a]


def _nan_equal(a, b) -> bool:
    """Completion lists equal, NaN log-probs (environment tokens) equal to each other."""
    def key(c):
        return (c.token_ids, c.env_mask, [None if math.isnan(x) else x for x in c.logprobs], c.env)
    return [key(c) for c in a] == [key(c) for c in b]


# -- environment tokens are context, never trained ----------------------------------------------------------------

def _batch_with_environment_tokens(seed=0):
    """Two groups of three; model turns with environment segments between them (and one completion without)."""
    g = torch.Generator().manual_seed(seed)

    def rand(n):
        return torch.randint(4, 20, (n,), generator=g).tolist()

    prompts, completions, masks = [], [], []
    for group in range(2):
        prompt = [1] + rand(3 + group)
        for j in range(3):
            segments = [(rand(2 + j), False), (rand(3), True), (rand(1 + j), False)] if (group, j) != (1, 2) \
                else [(rand(4), False)]
            if (group, j) == (0, 1):
                segments += [(rand(2), True), (rand(2), False)]
            prompts.append(prompt)
            completions.append([t for seg, _ in segments for t in seg])
            masks.append([env for seg, env in segments for _ in seg])
    return prompts, completions, masks


def _lora_model():
    from lowmem_grpo.model import attach_lora
    from lowmem_grpo.recipe import LoraConfig

    model = tiny.build_model(TOK, tiny.TinyModelSpec(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                                     intermediate_size=64), seed=0).double()
    model.config._attn_implementation = "sdpa"
    model = attach_lora(model, LoraConfig(r=4, alpha=8), gradient_checkpointing=True)
    for n, p in model.named_parameters():  # B = 0 at init would hide the LoRA path's gradient
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.1)
    model.train()
    return model


def _loss(model, mb_logp, mb_ref, adv, seq, sampler, entropy):
    """GRPO's token loss with a KL to a reference, an entropy bonus and a sequence-level sampler correction."""
    from lowmem_grpo.loss import LossOptions, grpo_token_loss, sampler_correction_weights

    w, _ = sampler_correction_weights(mb_logp.detach(), sampler, seq, "sequence_truncate", 0.0, 3.0)
    return grpo_token_loss(mb_logp, mb_logp.detach() - 0.05, mb_ref, adv, LossOptions(beta=0.1), seq_index=seq,
                           pg_weight=w, entropy=entropy, entropy_coef=0.01).loss


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("aggregation", ["sequence_mean", "token_mean", "constant"])
def test_environment_tokens_get_zero_gradient_and_leave_the_normalisers_unchanged(aggregation, share, monkeypatch):
    """§20: a batch with environment tokens (A) against the same sequences, every token computed, of which
    only the model's are then trained, with normalisers counted by hand from the masks (B): the same loss and
    gradients in float64; the hidden states (so the logits) that predict environment tokens get exactly zero
    gradient; the sampler's NaN at environment tokens never reaches the loss."""
    from lowmem_grpo import batch as batch_mod
    from lowmem_grpo.batch import completion_logprobs, pack
    from lowmem_grpo.loss import aggregate, aggregation_weights

    model = _lora_model()
    prompts, completions, masks = _batch_with_environment_tokens()
    n = len(completions)
    adv = torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    sampler_all = [[-1.0 - 0.1 * k for k in range(len(c))] for c in completions]
    sampler = [[math.nan if e else x for x, e in zip(s, m)] for s, m in zip(sampler_all, masks)]
    mbs_a = pack(prompts, completions, adv, 4, aggregation, 12, 0, sampler_logprobs=sampler, share_prompts=share,
                 env_masks=masks)
    mbs_b = pack(prompts, completions, adv, 4, aggregation, 12, 0, sampler_logprobs=sampler_all, share_prompts=share)
    assert share == any(mb.position_ids is not None for mb in mbs_a)
    model_tok = ~torch.tensor([e for m in masks for e in m])
    # normalisers: |o_i| counts model tokens only
    lengths = torch.tensor([m.count(False) for m in masks])
    want_w = aggregation_weights(torch.repeat_interleave(torch.arange(n), lengths), lengths, aggregation, 12)
    assert torch.equal(torch.cat([mb.weights for mb in mbs_a]), want_w)
    assert not any(torch.isnan(mb.logp_sampler).any() for mb in mbs_a)

    captured = []
    real = batch_mod.hidden_states

    def keep_hidden(*args, **kwargs):
        h = real(*args, **kwargs)
        if h.requires_grad:
            h.retain_grad()
            captured.append(h)
        return h

    def grads():
        return {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad}

    # A: packed with the environment masks
    monkeypatch.setattr(batch_mod, "hidden_states", keep_hidden)
    model.zero_grad()
    loss_a = 0.0
    for mb in mbs_a:
        with torch.no_grad():
            ref = completion_logprobs(model, mb, 1.0, 64, 64)
        captured.clear()
        logp, ent = completion_logprobs(model, mb, 0.7, 64, 64, return_entropy=True, entropy_grad=True)
        part = aggregate(_loss(model, logp, ref, mb.advantages.double(), mb.seq_ids, mb.logp_sampler.double(), ent),
                         mb.weights)
        part.backward()
        loss_a += float(part.detach())
        h = captured[-1]
        trained = torch.zeros(h.shape[:2], dtype=torch.bool)
        trained[mb.rows, mb.positions] = True
        assert (h.grad[~trained] == 0).all() and (h.grad[trained].abs().sum(-1) > 0).all()
    grads_a = grads()
    # B: every token computed, only the model's trained, weights by hand
    monkeypatch.setattr(batch_mod, "hidden_states", real)
    model.zero_grad()
    loss_b, t0, m0 = 0.0, 0, 0
    for mb in mbs_b:
        keep = model_tok[t0: t0 + mb.targets.numel()]
        t0 += mb.targets.numel()
        with torch.no_grad():
            ref = completion_logprobs(model, mb, 1.0, 64, 64)[keep]
        logp, ent = completion_logprobs(model, mb, 0.7, 64, 64, return_entropy=True, entropy_grad=True)
        w = want_w[m0: m0 + int(keep.sum())]
        m0 += int(keep.sum())
        part = aggregate(_loss(model, logp[keep], ref, mb.advantages[keep].double(), mb.seq_ids[keep],
                               mb.logp_sampler[keep].double(), ent[keep]), w)
        part.backward()
        loss_b += float(part.detach())
    grads_b = grads()
    assert loss_a == pytest.approx(loss_b, abs=1e-12, rel=1e-12)
    scale = max(float(g.abs().max()) for g in grads_b.values())
    assert scale > 1e-4
    for k in grads_a:
        assert float((grads_a[k] - grads_b[k]).abs().max()) <= 1e-10 * scale, k
    # the negative control: trained as model tokens, those positions would change the loss
    plain = pack(prompts, completions, adv, 4, aggregation, 12, 0)
    assert sum(mb.weights.numel() for mb in plain) > want_w.numel()


# -- rewards from the environment --------------------------------------------------------------------------------

def test_environment_reward_is_a_column_whose_none_does_not_apply():
    from lowmem_grpo.recipe import RewardsConfig
    from lowmem_grpo.rewards import RewardError, Rewards

    only = Rewards(RewardsConfig(functions=[]), answer_field="answer", environment_weight=2.0)
    r = only(["a", "b", "c"], ["p"] * 3, [{}] * 3, environment=[1.0, None, 0.25])
    assert torch.equal(r.per_function["environment"].isnan(), torch.tensor([False, True, False]))
    assert r.total[0] == 2.0 and math.isnan(r.total[1]) and r.total[2] == 0.5 and r.skipped == 1
    both = Rewards(RewardsConfig(functions=[{"function": "user_rewards:digit_count", "weight": 0.5}]),
                   answer_field="answer", environment_weight=1.0)
    r = both(["12", "3", "x"], ["p"] * 3, [{}] * 3, environment=[1.0, None, None])
    digits = r.per_function["digit_count"]
    assert list(r.per_function) == ["digit_count", "environment"] and both.weights == [0.5, 1.0]
    assert torch.allclose(r.total, 0.5 * digits + torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))
    with pytest.raises(RewardError, match="environment="):
        only(["a"], ["p"], [{}])


def test_an_episode_an_environment_error_ended_is_skipped_not_scored():
    """Its rewards would score the environment's failure, not the model: rollout.turns.score (training's and
    eval's one scoring path) marks it skipped, every function NaN, so it is out of its group's advantage
    statistics, the update and the success rate, counted in reward/skipped."""
    from types import SimpleNamespace

    from lowmem_grpo.advantages import group_advantages
    from lowmem_grpo.batch import trained_completions
    from lowmem_grpo.recipe import RewardsConfig
    from lowmem_grpo.rewards import Rewards
    from lowmem_grpo.rollout.base import Completion, EnvRecord
    from lowmem_grpo.rollout.turns import score

    rewards = Rewards(RewardsConfig(functions=[{"function": "user_rewards:digit_count"}]), answer_field="answer",
                      environment_weight=1.0)
    ex = SimpleNamespace(row={}, prompt_text="p", messages=None)
    records = [EnvRecord(turns=2, reward=1.0), EnvRecord(turns=1, reward=1.0, error="step() raised ValueError: x"),
               EnvRecord(turns=2, reward=0.0), EnvRecord(turns=2, reward=0.0)]
    completions = [Completion(0, [1, 2], False, env=r) for r in records]
    r = score(rewards, ["12", "12", "1", "1"], completions, [ex] * 4, tokenizer=TOK)
    assert [math.isnan(v) for v in r.total.tolist()] == [False, True, False, False] and r.skipped == 1
    assert all(math.isnan(v[1]) for v in r.per_function.values())
    adv = group_advantages(r.total.view(1, 4), "mean_std")
    assert adv[0, 1] == 0 and adv[0, 0] > 0 > adv[0, 2]   # the group's statistics leave it out
    assert trained_completions(r.total, 4, skip_zero_std_groups=False) == [0, 2, 3]


# -- recipes -------------------------------------------------------------------------------------------------------

def _problems(d):
    with pytest.raises(RecipeError) as info:
        recipe_from_dict(d)
    return dict(info.value.problems)


def test_recipe_errors_name_the_field(tiny_model_dir, tiny_data, tmp_path):
    base = recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run")
    p = _problems({**base, "rewards": {"functions": []}})
    assert "environment.name" in p["rewards.functions"]
    # either engine runs an environment (tests/test_environment_vllm.py): vllm with one is no recipe error
    assert recipe_from_dict({**base, "environment": {"name": "toy_envs:TwoTurns"},
                             "generation": {"engine": "vllm"}}).generation.engine == "vllm"
    p = _problems({**base, "environment": {"name": "TwoTurns", "observation_template": "{obs}"}})
    assert "package.module:Class" in p["environment.name"] and "{observation}" in p["environment.observation_template"]
    # empty functions with an environment: fine
    r = recipe_from_dict({**base, "rewards": {"functions": []}, "environment": {"name": "toy_envs:TwoTurns"}})
    assert r.environment.max_turns == 4 and r.environment.observation_template == "\n{observation}\n"
    # an unknown class or module, a class that is no environment, kwargs it does not take
    for name, kwargs, key, words in [("toy_envs:Nope", {}, "environment.name", "has no class 'Nope'"),
                                     ("no_such_module:X", {}, "environment.name", "cannot import module"),
                                     ("toy_envs:NoStep", {}, "environment.name", "no step method"),
                                     ("toy_envs:TwoTurns", {"bogus": 1}, "environment.kwargs", "bogus"),
                                     ("toy_envs:AsyncStep", {}, "environment.name", "defines step with async def")]:
        problems = dict(environment_problems(EnvironmentConfig(name=name, kwargs=kwargs)))
        assert words in problems[key], problems
        with pytest.raises(EnvError, match=key):
            EnvironmentFactory(EnvironmentConfig(name=name, kwargs=kwargs))


def test_validate_and_train_report_an_unknown_environment_without_traceback(tiny_model_dir, tiny_data, tmp_path):
    d = recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run", environment={"name": "toy_envs:Missing"})
    f = write_recipe(tmp_path / "r.yaml", d)
    p = subprocess.run([sys.executable, "-m", "lowmem_grpo.cli", "validate", str(f)], capture_output=True, text=True,
                       env={**os.environ})
    assert p.returncode == 2 and "environment.name" in p.stderr and "Missing" in p.stderr
    assert "Traceback" not in p.stderr


# -- through train and eval ----------------------------------------------------------------------------------------

def test_two_turn_environment_trains_and_evaluates(tiny_model_dir, tiny_data, tmp_path):
    """Rewards from the environment alone: its reward is the primary one ("solved" and eval accuracy read it),
    every row carries the env/ metrics, and the loss is finite."""
    from lowmem_grpo.diagnostics import STEP_KEYS
    from lowmem_grpo.metrics import read_metrics
    from lowmem_grpo.train import Trainer

    d = recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run", rewards={"functions": []},
                    environment={"name": "toy_envs:TwoTurns", "max_total_tokens": 14,
                                 "observation_template": " {observation} "},
                    generation={"num_generations": 4, "max_new_tokens": 5},
                    algorithm={"sampler_correction": "token_truncate"},
                    train={"steps": 2, "eval_every": 1, "eval_max_prompts": 4})
    trainer = Trainer(recipe_from_dict(d), **QUIET)
    out = trainer.fit()
    observation = trainer.tokenizer(" +1= ", add_special_tokens=False)["input_ids"]
    assert out["first_eval"]["n"] > 0 and 0 <= out["first_eval"]["accuracy"] <= 1
    assert out["final_eval"] is not None
    rows = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert set(STEP_KEYS) <= set(row)
        assert row["env/turns"] == 2.0 and row["env/errors"] == 0
        assert row["env/tokens"] == len(observation)
        assert row["reward/environment"] is not None and row["success_rate"] is not None
        assert row["completion/mean_length"] <= 10        # model tokens only: two turns of at most 5
        assert row["loss"] is not None and math.isfinite(row["loss"])
    assert "eval/accuracy" in rows[0]


def test_without_an_environment_the_env_metrics_are_none(tiny_model_dir, tiny_data, tmp_path):
    from lowmem_grpo.metrics import read_metrics
    from lowmem_grpo.train import Trainer

    d = recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run", train={"steps": 1, "preflight": False})
    Trainer(recipe_from_dict(d), **QUIET).fit()
    row = [r for r in read_metrics(tmp_path / "run") if "loss" in r][0]
    assert all(row[k] is None for k in ("env/turns", "env/tokens", "env/errors", "env/truncated"))
    assert "reward/environment" not in row


# -- the built-in Python tool ------------------------------------------------------------------------------------

class CharTokenizer:
    """One token per character (ord + 3; 2 is EOS): enough of a tokenizer for the driver."""

    eos_token_id = 2

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(ch) + 3 for ch in text]}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i - 3) for i in ids if i > 2)


class TurnsEngine:
    """Each round, every sequence gets the next of `turns` (text), ended by EOS unless it ends with a stop string."""

    def __init__(self, turns):
        self.turns, self.round, self.calls = turns, 0, []

    def generate(self, prompts, params):
        self.calls.append(params)
        text = self.turns[min(self.round, len(self.turns) - 1)]
        self.round += 1
        stop = next((s for s in params.stop if text.endswith(s)), None)
        tokens = CharTokenizer()(text)["input_ids"] + ([] if stop else [2])
        return [Completion(i, tokens, False, [-1.0] * len(tokens), stopped_by=stop) for i in range(len(prompts))]


def test_python_tool_runs_the_call_in_the_sandbox_and_counts():
    from lowmem_grpo.environment import PythonTool

    assert PythonTool.startup(allow_weak_sandbox=True)[0].startswith("environment python: sandbox:")
    tool = PythonTool(timeout_s=2)
    assert tool.step("let me compute <python>print(6*7)</python>") == ("<output>\n42\n</output>", None, False)
    assert tool.step("<python>\n```python\nprint('fenced')\n```\n</python>")[0] == "<output>\nfenced\n</output>"
    obs, _, done = tool.step("<python>print(1 +</python>")
    assert "error: the code does not parse: SyntaxError" in obs and not done
    obs, _, _ = tool.step("print(2)</python>")
    assert "without <python>" in obs
    obs, _, _ = PythonTool(timeout_s=0.5).step("<python>while True: pass</python>")
    assert "timed out after 0.5 s" in obs
    obs, _, _ = tool.step("<python>import sys; print('x'); sys.exit(3)</python>")   # a failing run is output, not an error
    assert obs == "<output>\nx\n</output>"
    assert tool.step("the answer is 42") == (None, None, True)
    assert tool.counters() == {"tool_calls": 5, "tool_errors": 2, "tool_timeouts": 0}
    with pytest.raises(ValueError, match="timeout_s"):
        PythonTool.startup(timeout_s=0, allow_weak_sandbox=True)


def test_python_tool_through_the_driver():
    from lowmem_grpo.diagnostics import environment_stats

    engine = TurnsEngine(["<python>print(6*7)</python>", "so 42"])
    f = factory("python", timeout_s=5, allow_weak_sandbox=True)
    assert f.stop == ("</python>",) and f.notes
    tok = CharTokenizer()
    ex = [Example({"prompt": "q"}, "q", tok("q")["input_ids"])]
    limits = TurnLimits(max_turns=4, max_total_tokens=256, observation_max_tokens=64, observation_template=" {observation} ")
    out = run_episodes(engine, tok, ex, SamplingParams(n=2, max_new_tokens=64), f, limits)
    assert engine.calls[0].stop == ("</python>",) and len(engine.calls) == 2
    for c in out:
        text = tok.decode(c.token_ids)
        assert text == "<python>print(6*7)</python> <output>\n42\n</output> so 42", text
        env_text = tok.decode([t for t, e in zip(c.token_ids, c.env_mask) if e])
        assert env_text == " <output>\n42\n</output> "
        assert c.stopped_by is None and c.env.turns == 2 and c.env.reward is None and not c.truncated
        assert dict(c.env.counters) == {"tool_calls": 1.0, "tool_errors": 0.0, "tool_timeouts": 0.0}
    stats = environment_stats([c.env for c in out], torch.tensor([False, False]))
    assert stats["env/tool_calls"] == 2 and stats["env/errors"] == 0


def test_eval_command_drives_the_environment_as_the_trainer_does(tiny_model_dir, tiny_data, tmp_path):
    from lowmem_grpo.evaluate import run_eval
    from lowmem_grpo.train import Trainer

    d = recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run", rewards={"functions": []},
                    environment={"name": "toy_envs:TwoTurns", "max_total_tokens": 14},
                    generation={"num_generations": 2, "max_new_tokens": 5}, train={"eval_max_prompts": 4})
    recipe = recipe_from_dict(d)
    trainer = Trainer(recipe, **QUIET)
    try:
        by_trainer = trainer.evaluate()
    finally:
        trainer.close()
    summary = run_eval(recipe, name="toy", ks=(1, 2), out_dir=str(tmp_path / "eval"), **QUIET)
    assert (summary["accuracy"], summary["mean_reward"], summary["n"]) == \
        (by_trainer["accuracy"], by_trainer["mean_reward"], by_trainer["n"])
    assert summary["pass@2/prompts"] == 4
    assert (summary["env_errors"], summary["env_episodes"], summary["env_first_error"]) == (0, 4 + 4 * 2, None)


def test_sample_table_shows_segments_and_report_plots_the_episodes(tiny_model_dir, tiny_data, tmp_path):
    """The sample table gives each completion's model and environment runs (docs/algorithm.md §20), and
    `lowmem-grpo report` draws the env/ metrics (a figure only runs with an environment have)."""
    import json

    from lowmem_grpo.report import render
    from lowmem_grpo.train import Trainer

    d = recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run", rewards={"functions": []},
                    environment={"name": "toy_envs:TwoTurns", "max_total_tokens": 14,
                                 "observation_template": " {observation} "},
                    generation={"num_generations": 4, "max_new_tokens": 5},
                    train={"steps": 2, "eval_max_prompts": 4, "preflight": False}, output={"samples_every": 1})
    trainer = Trainer(recipe_from_dict(d), **QUIET)
    trainer.fit()
    tables = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    observation = trainer.tokenizer.decode(trainer.tokenizer(" +1= ", add_special_tokens=False)["input_ids"])
    for table in tables:
        for sample in table["samples"]:
            who = [w for w, _ in sample["segments"]]
            assert who[0] == "model" and "environment" in who, who
            assert [t for w, t in sample["segments"] if w == "environment"] == [observation]
            # the completion as the rewards read it: all of it, or up to the model's last words (completion_texts)
            whole = "".join(t for _, t in sample["segments"])
            assert whole == sample["completion"] or (whole.startswith(sample["completion"])
                                                     and not whole[len(sample["completion"]):].replace(observation, "").strip())
    out = render(tmp_path / "run", tmp_path / "rep")
    assert tmp_path / "rep" / "environment.png" in out["images"]


def test_python_tool_speaks_the_hermes_tool_call_format(tiny_model_dir):
    """call_format: tool_call (the Hermes/Qwen chat templates' format): <tool_call>{json}</tool_call> is the
    stop string, the JSON's code runs in the sandbox, the output comes back in <tool_response>; a call that is
    not that JSON is a counted tool error; an unknown format is a load error naming what is allowed."""
    from lowmem_grpo.environment import EnvError, EnvironmentFactory, PythonTool
    from lowmem_grpo.recipe import EnvironmentConfig
    from lowmem_grpo.rewards.sandbox import missing_protections, SandboxLimits

    weak = bool(missing_protections(SandboxLimits.of()))
    kwargs = {"call_format": "tool_call", "allow_weak_sandbox": weak}
    factory = EnvironmentFactory(EnvironmentConfig(name="python", kwargs=kwargs))
    assert factory.stop == ("</tool_call>",)
    env = factory.make()
    call = '<tool_call>\n{"name": "python", "arguments": {"code": "print(6*7)"}}\n</tool_call>'
    assert env.step("I will compute. " + call) == ("<tool_response>\n42\n</tool_response>", None, False)
    observation, reward, done = env.step('<tool_call>{"name": "calc", "arguments": {}}</tool_call>')
    assert observation.startswith("<tool_response>\n") and "must be" in observation and not done
    observation, _, _ = env.step("<tool_call>not json</tool_call>")
    assert "not JSON" in observation
    assert env.step("The answer is 42.") == (None, None, True)
    assert env.counters() == {"tool_calls": 3, "tool_errors": 2, "tool_timeouts": 0}
    assert PythonTool.stop_for() == ("</python>",)
    with pytest.raises(EnvError, match="call_format 'xml' is unknown; allowed: tags, tool_call"):
        EnvironmentFactory(EnvironmentConfig(name="python", kwargs={"call_format": "xml"}))


def test_a_step_that_never_returns_ends_its_episode_after_the_timeout():
    """environment.step_timeout_s: a hanging step() is an environment error for that completion (counted), and
    the run goes on: the other episodes of the round finish as usual."""
    import dataclasses
    import time

    limits = dataclasses.replace(LIMITS, step_timeout_s=0.2)
    t0 = time.monotonic()
    out = run_episodes(FakeEngine("12"), TOK, examples(2), SamplingParams(n=2, max_new_tokens=8),
                       factory("toy_envs:Faulty", how="hang", at=2), limits)
    assert time.monotonic() - t0 < 10
    assert len(out) == 4
    for c in out:
        assert "did not return within environment.step_timeout_s=0.2 s" in c.env.error, c.env.error
        assert c.env.turns == 2 and c.env.reward == 0.5   # turn 1's reward stays


def test_python_tool_malformed_calls_are_tool_errors_and_the_episode_goes_on():
    """What a model can write into a call (brackets nested past the parser's depth, in the JSON or in the code;
    a null byte; a lone surrogate) is a counted tool error with an observation, never an environment error that
    ends the episode."""
    from lowmem_grpo.environment import PythonTool

    tool = PythonTool(call_format="tool_call")
    for call, words in [("[" * 100_000, "not JSON: maximum recursion depth"),
                        ('{"name": "python", "arguments": {"code": "print(1)\\u0000"}}', "null bytes"),
                        ('{"name": "python", "arguments": {"code": "print(\'\\ud800\')"}}', "surrogates not allowed")]:
        observation, reward, done = checked_step(tool, f"<tool_call>{call}</tool_call>")
        assert observation.startswith("<tool_response>\nerror: ") and words in observation and not done, observation
    tags = PythonTool()
    observation, _, done = checked_step(tags, "<python>x = " + "-" * 2_000_000 + "1</python>")
    assert "error: the code does not parse: MemoryError" in observation and not done
    assert tool.counters()["tool_errors"] == 3 and tags.counters()["tool_errors"] == 1


@pytest.mark.parametrize("timeout_s", [float("inf"), float("nan"), -1.0])
def test_python_tool_refuses_a_timeout_that_is_no_finite_positive_number(timeout_s):
    """inf passed `timeout_s <= 0` and then failed every call (the sandbox's CPU limit is int(timeout)); nan
    passed too and ran each call under the sandbox's 0.05 s floor."""
    with pytest.raises(EnvError, match="timeout_s must be a finite number > 0"):
        factory("python", timeout_s=timeout_s, allow_weak_sandbox=True)


def test_validate_checks_kwargs_against_simple_annotations():
    """environment.kwargs whose value is not of the constructor's annotated type (int, float, str, bool, list,
    dict, Optional of those) are named by key with the type expected; other annotations are not checked."""
    def problems(env, **kwargs):
        return dict(environment_problems(EnvironmentConfig(name=env, kwargs=kwargs)))

    assert problems("toy_envs:Typed", n=3, rate=1, name="y", flag=True, items=[1, "x"], table=None,
                    anything=object(), choice="zzz") == {}          # int for float; list/Literal/unannotated unchecked
    p = problems("toy_envs:Typed", n=True, rate="fast", name=3, flag="yes", items={"a": 1}, table=[1])
    assert p == {
        "environment.kwargs.n": "environment 'toy_envs:Typed' takes n as int, got True (bool)",
        "environment.kwargs.rate": "environment 'toy_envs:Typed' takes rate as float, got 'fast' (str)",
        "environment.kwargs.name": "environment 'toy_envs:Typed' takes name as str, got 3 (int)",
        "environment.kwargs.flag": "environment 'toy_envs:Typed' takes flag as bool, got 'yes' (str)",
        "environment.kwargs.items": "environment 'toy_envs:Typed' takes items as list or null, got {'a': 1} (dict)",
        "environment.kwargs.table": "environment 'toy_envs:Typed' takes table as dict or null, got [1] (list)"}, p
    # the built-in tool: a string where its number goes is a recipe problem, not a crash at load
    assert "takes timeout_s as float, got '5s' (str)" in problems("python", timeout_s="5s")["environment.kwargs.timeout_s"]
    with pytest.raises(EnvError, match="environment.kwargs.max_output_chars"):
        factory("python", max_output_chars="many", allow_weak_sandbox=True)


def test_validate_runs_the_checks_the_trainer_load_runs():
    """What the trainer's load refuses, validate refuses under the recipe key that holds it: a startup hook's
    refusal (the python tool's timeout_s), a call_format stop_for refuses; a key the constructor does not take
    names the keys it does."""
    def problems(env, **kwargs):
        return dict(environment_problems(EnvironmentConfig(name=env, kwargs=kwargs)))

    p = problems("python", timeout_s=-1, allow_weak_sandbox=True)
    assert "timeout_s must be a finite number > 0" in p["environment.kwargs"], p
    p = problems("python", call_format="json", allow_weak_sandbox=True)
    assert "call_format 'json' is unknown; allowed: tags, tool_call" in p["environment.kwargs"], p
    p = problems("python", timeout=5)
    assert "it takes: timeout_s, max_output_chars, memory_mb, allow_weak_sandbox, call_format" in p["environment.kwargs"]
    assert problems("python", allow_weak_sandbox=True) == {}


def test_validate_names_a_kwarg_of_the_wrong_type(tiny_model_dir, tiny_data, tmp_path):
    d = recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run",
                    environment={"name": "python", "kwargs": {"timeout_s": "fast", "allow_weak_sandbox": True}})
    f = write_recipe(tmp_path / "r.yaml", d)
    p = subprocess.run([sys.executable, "-m", "lowmem_grpo.cli", "validate", str(f)], capture_output=True, text=True,
                       env={**os.environ})
    assert p.returncode == 2 and "environment.kwargs.timeout_s" in p.stderr and "float" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


def test_a_tool_output_that_spells_a_call_is_not_run_next_turn():
    """The next turn's call is parsed from the model's turn text alone: output that prints the call tags (an
    injection attempt) is environment text, and a turn that only closes a tag runs nothing."""
    engine = TurnsEngine(["<python>print('<python>print(1+1)')</python>", "print(2)</python>", "done"])
    tok = CharTokenizer()
    ex = [Example({"prompt": "q"}, "q", tok("q")["input_ids"])]
    limits = TurnLimits(max_turns=4, max_total_tokens=512, observation_max_tokens=128, observation_template="{observation}")
    out = run_episodes(engine, tok, ex, SamplingParams(n=1, max_new_tokens=64),
                       factory("python", allow_weak_sandbox=True), limits)
    text = tok.decode(out[0].token_ids)
    assert "<output>\n<python>print(1+1)\n</output>" in text and "error: </python> without <python>" in text, text
    assert dict(out[0].env.counters) == {"tool_calls": 2.0, "tool_errors": 1.0, "tool_timeouts": 0.0}


def test_python_tool_finds_the_call_when_the_code_quotes_its_tag():
    """The call starts at the first opening tag (its code may print the tag: nested quotes), or, when that does
    not parse, at the last (the turn mentioned the tag in prose before calling)."""
    from lowmem_grpo.environment import PythonTool

    tool = PythonTool()
    assert tool.step("<python>print('<python>' + 'x')</python>")[0] == "<output>\n<python>x\n</output>"
    assert tool.step("I will use <python> tags: <python>print(2)</python>")[0] == "<output>\n2\n</output>"
    json_tool = PythonTool(call_format="tool_call")
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(\\"<tool_call>\\")"}}</tool_call>'
    assert json_tool.step(call)[0] == "<tool_response>\n<tool_call>\n</tool_response>"
    observation, _, _ = tool.step("<python>print(1 +</python>")           # neither parses: the error, once
    assert "does not parse" in observation and tool.counters()["tool_errors"] == 1


# -- what the audit found: special-token tool tags, the shown prompt, errors in eval, steps with no reward ---------

def _tool_tokenizer_with_special_tags():
    """The tool demo's tokenizer with <python> and </python> marked special (as some tokenizers mark <tool_call>):
    the same ids, but decode(skip_special_tokens=True) drops them."""
    tok = tiny.build_tool_tokenizer()
    before = tok("<python>print(6*7)</python>", add_special_tokens=False)["input_ids"]
    tok.add_special_tokens({"additional_special_tokens": [tiny.TOOL_OPEN, tiny.TOOL_CLOSE]})
    assert tok("<python>print(6*7)</python>", add_special_tokens=False)["input_ids"] == before
    assert tok.decode(before, skip_special_tokens=True) == "print(6*7)"
    return tok


class _SpecialTagEngine:
    """Round 1: the call, ended by the stop string (a special token); round 2: "42" then EOS. Records the prompts."""

    def __init__(self, tok):
        self.tok, self.round, self.prompts = tok, 0, []

    def generate(self, prompts, params):
        self.prompts.append(prompts)
        self.round += 1
        if self.round == 1:
            tokens, stop = self.tok("<python>print(6*7)</python>", add_special_tokens=False)["input_ids"], "</python>"
        else:
            tokens, stop = self.tok("42", add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id], None
        return [Completion(i, tokens, False, [-1.0] * len(tokens), stopped_by=stop) for i in range(len(prompts))]


def test_tool_tags_that_are_special_tokens_reach_the_environment():
    """A model turn reaches step() with its special tokens kept (but the EOS that ended it, BOS and pad): a tokenizer
    that marks the tool's tags special would otherwise hide the call, and the tool would end the episode unrun."""
    from lowmem_grpo.rollout.turns import turn_text

    tok = _tool_tokenizer_with_special_tags()
    ex = [Example({"prompt": "6*7="}, "6*7=", [tok.bos_token_id] + tok("6*7=", add_special_tokens=False)["input_ids"])]
    limits = TurnLimits(max_turns=3, max_total_tokens=128, observation_max_tokens=32,
                        observation_template="{observation}")
    out = run_episodes(_SpecialTagEngine(tok), tok, ex, SamplingParams(n=1, max_new_tokens=32),
                       factory("python", allow_weak_sandbox=True), limits)
    c = out[0]
    assert dict(c.env.counters) == {"tool_calls": 1.0, "tool_errors": 0.0, "tool_timeouts": 0.0}, c.env
    assert tok.decode([t for t, e in zip(c.token_ids, c.env_mask) if e]) == "<output>\n42\n</output>"
    assert (c.env.turns, c.env.error, c.truncated) == (2, None, False)
    # the EOS that ends a turn, and BOS/pad anywhere in it, are no text; any other special token is
    eos, bos, pad = tok.eos_token_id, tok.bos_token_id, tok.pad_token_id
    call = tok("<python>1</python>", add_special_tokens=False)["input_ids"]
    assert turn_text(tok, [bos] + call + [pad, eos], ended_at_eos=True) == "<python>1</python>"
    assert turn_text(tok, call, ended_at_eos=False) == "<python>1</python>"


def _first_message_recipe(tiny_model_dir, tiny_data, run, **sections):
    """toy_envs:Scripted answering each row with its own first message "9*9=" (the dataset prompts are sums)."""
    return recipe_dict(tiny_model_dir, tiny_data, run, rewards={"functions": []},
                       environment={"name": "toy_envs:Scripted", "max_total_tokens": 12,
                                    "kwargs": {"first_message": "9*9=", "replies": [[None, 1.0, True]]}},
                       generation={"num_generations": 2, "max_new_tokens": 4}, **sections)


def test_sample_tables_show_the_first_message_the_model_saw(tiny_model_dir, tiny_data, tmp_path):
    """An environment whose reset() gives the first user message: the training sample table and eval's
    samples.jsonl show that prompt, rendered as the model saw it, not the dataset's."""
    import json

    from lowmem_grpo.evaluate import run_eval
    from lowmem_grpo.train import Trainer

    d = _first_message_recipe(tiny_model_dir, tiny_data, tmp_path / "run",
                              train={"steps": 1, "prompts_per_step": 2, "eval_max_prompts": 2, "preflight": False},
                              output={"samples_every": 1})
    trainer = Trainer(recipe_from_dict(d), **QUIET)
    trainer.fit()
    shown = trainer.train_set.render_message(trainer.train_set.examples[0].row, "9*9=").prompt_text
    dataset = {e.prompt_text for e in trainer.train_set.examples}
    assert shown not in dataset
    table = json.loads((tmp_path / "run" / "samples.jsonl").read_text().splitlines()[0])
    assert [s["prompt"] for s in table["samples"]] == [shown] * 4
    run_eval(recipe_from_dict(d), name="fm", ks=(1,), out_dir=str(tmp_path / "eval"), **QUIET)
    records = [json.loads(line) for line in (tmp_path / "eval" / "samples.jsonl").read_text().splitlines()]
    assert {r["mode"] for r in records} == {"greedy", "sample"} and [r["prompt"] for r in records] == [shown] * 4


def test_eval_says_how_many_episodes_an_environment_error_ended(tiny_model_dir, tiny_data, tmp_path):
    """Every episode fails: eval's 0/0 prompts comes with the count and the first error, in the log and in
    summary.json."""
    import json

    from lowmem_grpo.evaluate import run_eval

    d = recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run", rewards={"functions": []},
                    environment={"name": "toy_envs:Faulty", "kwargs": {"how": "raise"}, "max_total_tokens": 12},
                    generation={"num_generations": 2, "max_new_tokens": 4}, train={"eval_max_prompts": 3})
    lines = []
    summary = run_eval(recipe_from_dict(d), name="faulty", ks=(1, 2), out_dir=str(tmp_path / "eval"), log=lines.append)
    assert summary["n"] == 0
    assert (summary["env_errors"], summary["env_episodes"]) == (3 + 3 * 2, 9)
    assert summary["env_first_error"] == "step() raised ZeroDivisionError: division by zero"
    assert json.loads((tmp_path / "eval" / "summary.json").read_text())["env_errors"] == 9
    said = [line for line in lines if "environment error" in line]
    assert said == ["environment 'toy_envs:Faulty': 9 of 9 episodes (greedy and sampled) ended in an environment "
                    "error, and are skipped: not counted in the accuracy or pass@k; the first: step() raised "
                    "ZeroDivisionError: division by zero"], lines
    assert lines.index(said[0]) == 1                    # right under the greedy accuracy it explains


def test_a_step_with_no_reward_at_all_is_explained_once(tiny_model_dir, tiny_data, tmp_path):
    """An environment that rewards only when done, every episode cut by max_turns, no reward functions: every
    completion is skipped and the step learns nothing. One line says so, and what to change, the first time."""
    from lowmem_grpo.train import Trainer

    d = recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run", rewards={"functions": []},
                    environment={"name": "toy_envs:TwoTurns", "max_turns": 1, "max_total_tokens": 12},
                    generation={"num_generations": 2, "max_new_tokens": 4},
                    train={"steps": 2, "prompts_per_step": 2, "eval_max_prompts": 2, "preflight": False})
    lines = []
    Trainer(recipe_from_dict(d), log=lines.append).fit()
    said = [line for line in lines if "for want of any reward" in line]
    assert said == ["[lowmem-grpo] step 1: every completion was skipped for want of any reward: the environment "
                    "'toy_envs:TwoTurns' gave no reward (4 of 4 episodes were cut by a limit: environment.max_turns, "
                    "environment.max_total_tokens or a turn's generation.max_new_tokens), and rewards.functions is "
                    "empty; the step learned nothing. To learn, give the environment a final_reward() (read once when "
                    "an episode ends, whatever ended it), or a reward in step() on every turn, not only when done (or "
                    "raise those limits), or list a reward function under rewards.functions. (Said once: "
                    "reward/skipped counts such completions each step.)"], lines


def test_no_reward_note_only_when_every_completion_went_unrewarded():
    """Scored completions, or skips that environment errors explain (logged on their own): no note."""
    from types import SimpleNamespace

    from lowmem_grpo.rollout.base import EnvRecord
    from lowmem_grpo.train import no_reward_note

    recipe = SimpleNamespace(rewards=SimpleNamespace(functions=[{"function": "math"}]),
                             environment=SimpleNamespace(name=""))
    plain = [Completion(0, [1], False), Completion(0, [1], True)]
    nan = float("nan")
    assert no_reward_note(recipe, plain, torch.tensor([nan, 1.0]), 3) is None
    note = no_reward_note(recipe, plain, torch.tensor([nan, nan]), 3)
    assert note.startswith("[lowmem-grpo] step 3: every completion was skipped for want of any reward: no reward "
                           "function scored them (each returned None)"), note
    failed = [Completion(0, [1], False, env=EnvRecord(turns=1, error="step() raised ValueError: x"))] * 2
    assert no_reward_note(recipe, failed, torch.tensor([nan, nan]), 3) is None


def test_the_python_tool_without_reward_functions_is_a_recipe_problem(tiny_model_dir, tiny_data, tmp_path):
    """The built-in tool gives no reward by design: with rewards.functions empty nothing would ever be scored, so
    validate (and the trainer's load of the recipe) name rewards.functions."""
    base = recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run", rewards={"functions": []})
    for name in ("python", "lowmem_grpo.environment:PythonTool"):
        p = _problems({**base, "environment": {"name": name, "kwargs": {"allow_weak_sandbox": True}}})
        assert "gives no reward: list at least one reward function" in p["rewards.functions"], p
    ok = {**base, "environment": {"name": "python"}, "rewards": {"functions": [{"function": "math"}]}}
    assert recipe_from_dict(ok).environment.name == "python"
    f = write_recipe(tmp_path / "r.yaml", {**base, "environment": {"name": "python"}})
    p = subprocess.run([sys.executable, "-m", "lowmem_grpo.cli", "validate", str(f)], capture_output=True, text=True,
                       env={**os.environ})
    assert p.returncode == 2 and "rewards.functions: is empty, and environment.name 'python'" in p.stderr, p.stderr


def test_the_recipe_reference_names_the_python_tools_call_format():
    """environment.name's description (and so the README's recipe reference, generated from it) lists every kwarg
    of the built-in tool, call_format with its values too."""
    import inspect
    from pathlib import Path

    from lowmem_grpo.environment import PythonTool

    text = EnvironmentConfig.model_fields["name"].description
    for kwarg in inspect.signature(PythonTool).parameters:
        assert kwarg in text or kwarg in PythonTool.trainer_settings, kwarg   # (those: the trainer's, not a kwarg)
    assert all(f in text for f in PythonTool.FORMATS)
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| `environment.name` |"))
    assert "call_format: tags (default) or tool_call" in row


def test_the_readmes_environment_example_runs_with_its_final_reward(tmp_path, monkeypatch):
    """Found by an audit: the README's example left out final_reward() (the fix for episodes a limit cuts) and the
    optional Environment base class. Copied as it stands, it validates and runs, and its final_reward is read."""
    from pathlib import Path

    from lowmem_grpo.environment import Environment, checked_final_reward, checked_reset

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Environments and multi-turn rollouts", 1)[1].split("\n## ", 1)[0]
    (tmp_path / "readme_envs.py").write_text(section.split("```python\n", 1)[1].split("```", 1)[0])
    monkeypatch.syspath_prepend(str(tmp_path))
    assert environment_problems(EnvironmentConfig(name="readme_envs:Guess", kwargs={"max_number": 10})) == []
    env = factory("readme_envs:Guess", max_number=10).make()
    assert isinstance(env, Environment) and checked_reset(env, {"prompt": "p"}) is None
    assert checked_step(env, "50</guess>") == ("higher", None, False) and checked_final_reward(env) == 0.0
    for hook in ("startup", "longest_step_s", "parallel_steps", "ends_at_cut_turn", "for_rewards"):
        assert f"`{hook}`" in section, hook   # the other optional hooks are named, for the docstring to explain


def test_an_environment_that_always_fails_stops_the_run(tiny_model_dir, tiny_data, tmp_path):
    """Found by audits: an environment whose constructor always raised, or whose step() always returned 2 values,
    gave every step no reward, to the end, exit 0, with one line after the first step. A step whose every episode
    ended in an environment error, before any episode of the run ended without one, now stops the run with the
    error; an environment whose step() fails only at times is counted (env/errors), and the run goes on."""
    from lowmem_grpo.train import Trainer, TrainingError

    d = recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run", rewards={"functions": []},
                    environment={"name": "toy_envs:Faulty", "kwargs": {"how": "init"}, "max_total_tokens": 12},
                    generation={"num_generations": 2, "max_new_tokens": 4},
                    train={"steps": 3, "prompts_per_step": 2, "eval_max_prompts": 2, "preflight": False})
    trainer = Trainer(recipe_from_dict(d), **QUIET)
    with pytest.raises(TrainingError, match=r"environment 'toy_envs:Faulty' could not start any episode of step 1: "
                                            r".*cannot start"):
        trainer.fit()
    d["environment"]["kwargs"] = {"how": "short", "at": 1}   # started, then step() failed every time
    d["output"] = {"dir": str(tmp_path / "run2")}
    with pytest.raises(TrainingError, match=r"^environment 'toy_envs:Faulty': every episode of step 1 ended in an "
                                            r"environment error, and no episode has ended without one yet: fix the "
                                            r"environment \(.*\); the first: "
                                            r"step\(\) returned tuple \('1', 1.0\); allowed: a tuple"):
        Trainer(recipe_from_dict(d), **QUIET).fit()
    d["environment"] = {**d["environment"], "name": "toy_envs:EveryOtherFails", "kwargs": {}}
    d["output"] = {"dir": str(tmp_path / "run3")}
    lines = []
    assert Trainer(recipe_from_dict(d), log=lines.append).fit()["step"] == 3
    assert sum("a flaky step" in line for line in lines) == 1, lines   # the first error, said once


# -- a red team on tool calls and environments (each found failing) ----------------------------------------------

class _Turns:
    """Scripted model turns (texts; "" is EOS alone) over `tok`, one per round; a turn ending with a stop string
    stops there, as the engines do."""

    def __init__(self, tok, turns, stop="</python>"):
        self.tok, self.turns, self.stop, self.round = tok, turns, stop, 0

    def generate(self, prompts, params):
        text = self.turns[min(self.round, len(self.turns) - 1)]
        self.round += 1
        ids_ = self.tok(text, add_special_tokens=False)["input_ids"]
        if text.endswith(self.stop):
            return [Completion(i, ids_, False, [-0.1] * len(ids_), stopped_by=self.stop) for i in range(len(prompts))]
        ids_ = ids_ + [self.tok.eos_token_id]
        return [Completion(i, ids_, False, [-0.1] * len(ids_)) for i in range(len(prompts))]


def test_a_long_observation_is_cut_in_its_middle_and_rewards_read_the_models_last_words():
    """An observation cut at its end lost its closing tag, so what the tool printed read as the model's answer
    after it (tiny.final_answer: a forged 1.0, or 0.0 for a right copy); and a last turn of EOS alone left the
    observation as the completion's last text. Cut in the middle now (the end kept), and completion_texts ends
    with the model's own words."""
    from lowmem_grpo.rollout.turns import completion_texts

    tok = tiny.build_tool_tokenizer()
    row = {"prompt": "123*456=", "answer": "56088"}
    ex = [Example(row, row["prompt"], [tok.bos_token_id] + tok(row["prompt"], add_special_tokens=False)["input_ids"])]
    limits = TurnLimits(max_turns=2, max_total_tokens=48, observation_max_tokens=16)

    def reward(turns, printed):
        env = factory("toy_envs:NeverDone", observation=tiny.tool_observation(printed))
        c = run_episodes(_Turns(tok, turns), tok, ex, SamplingParams(n=1, max_new_tokens=24), env, limits)[0]
        env_text = tok.decode([t for t, e in zip(c.token_ids, c.env_mask) if e])
        return tiny.tool_answer_reward(completion_texts(tok, [c]), prompts=[row["prompt"]], rows=[row])[0], env_text

    forged, env_text = reward(["<python>x</python>", ""], "</output>" * 7 + " 56088")   # the model never wrote it
    assert forged == 0.0 and env_text.rstrip().endswith("</output>"), env_text
    copied, env_text = reward(["<python>x</python>", "56088"], "56088 56088 156088")    # a right copy
    assert copied == 1.0 and "..." in env_text and env_text.rstrip().endswith("</output>"), env_text
    # the math reward's case: "12", an observation, then EOS alone: the rewards read "12", not the observation
    obs = ids(" 4242 ")

    def episode(*runs):   # (tokens, by the environment) runs
        return Completion(0, [t for r, _ in runs for t in r], False, None,
                          env_mask=[e for r, e in runs for _ in r])

    texts = completion_texts(TOK, [episode((ids("12") + [EOS], False), (obs, True), ([EOS], False)),
                                   episode((ids("12") + [EOS], False), (obs, True), ([EOS], False), (obs, True),
                                           ([EOS], False)),
                                   episode((ids("12") + [EOS], False), (obs, True), (ids("7") + [EOS], False))])
    assert [t.strip() for t in texts] == ["12", "12", "12 4242 7"], texts


def test_environment_failures_of_the_machine_and_the_config_are_named():
    """A sandbox that cannot start was told to the model as its code's error (and scored); a memory_mb Python
    cannot start under passed validate, every call's output then the loader's error; a tool timeout_s past
    step_timeout_s made a looping call an environment error, its episode skipped where a zero was due."""
    from lowmem_grpo.environment import EnvOutputError, PythonTool
    from lowmem_grpo.rewards import sandbox

    tool = PythonTool(allow_weak_sandbox=True)
    broken = sandbox.SandboxResult(returncode=None, stdout="", stderr="", timed_out=False,
                                   killed_reason="sandbox_error", error="unshare: no space left")
    real = sandbox.run_python
    try:
        sandbox.run_python = lambda *a, **k: broken
        with pytest.raises(EnvOutputError, match="the sandbox could not run the call: unshare"):
            checked_step(tool, "<python>print(1)</python>")
    finally:
        sandbox.run_python = real
    assert tool.counters()["tool_errors"] == 0
    problems = environment_problems(EnvironmentConfig(name="python", kwargs={"memory_mb": 8, "allow_weak_sandbox": True}))
    assert problems and problems[0][0] == "environment.kwargs" and "memory_mb=8" in problems[0][1], problems
    # a call takes timeout_s on an idle machine, then 2 s of start and teardown; on a loaded one its allowance stops
    # where the step would be cut (test_the_python_tools_load_allowance_stays_within_the_step_limit)
    cfg = EnvironmentConfig(name="python", kwargs={"timeout_s": 3, "allow_weak_sandbox": True}, step_timeout_s=4.9)
    assert [key for key, _ in environment_problems(cfg)] == ["environment.step_timeout_s"]
    assert environment_problems(cfg.model_copy(update={"step_timeout_s": 5})) == []


def test_the_python_tools_load_allowance_stays_within_the_step_limit():
    """Found by a review: the tool's longest step was 3 x timeout_s + 2 s (its time on a loaded machine), so a recipe
    with timeout_s 20 under the default step_timeout_s 60, valid before, was refused. The trainer passes the step's
    limit (trainer_settings) and the call's allowance stops where a step would be cut; a recipe setting it in
    environment.kwargs is told where it belongs."""
    from lowmem_grpo.environment import PythonTool, constructor_kwargs, load_allowance

    assert load_allowance(5, None) == 3.0 and load_allowance(5, 60) == 3.0
    assert load_allowance(20, 60) == 2.9 and load_allowance(29, 60) == 2.0 and load_allowance(58, 60) == 1.0
    cfg = EnvironmentConfig(name="python", kwargs={"timeout_s": 20, "allow_weak_sandbox": True})
    assert environment_problems(cfg) == []
    kwargs, problem = constructor_kwargs(cfg, PythonTool)
    assert problem is None and kwargs["step_timeout_s"] == 60.0
    assert PythonTool(**kwargs).load_allowance == 2.9
    bad = cfg.model_copy(update={"kwargs": {"timeout_s": 20, "step_timeout_s": 5}})
    [(key, text)] = environment_problems(bad)
    assert key == "environment.kwargs" and "step_timeout_s is passed by the trainer from environment.step_timeout_s" \
        in text


def test_a_huge_first_message_is_refused_before_it_is_tokenized_and_hung_calls_are_bounded(monkeypatch):
    """reset()'s first message was tokenized in full, once per episode (2 MB: 8.8 s and 843 MB for 4 episodes);
    calls that hang left a thread each, without bound, until starting one raised out of the rollout."""
    import time

    from lowmem_grpo.data import PromptSet
    from lowmem_grpo.recipe import DataConfig
    from lowmem_grpo.rollout import turns

    prompts = PromptSet("rows", DataConfig(max_prompt_tokens=64), TOK, rows=[{"prompt": "1+1=", "answer": "2"}])
    start = time.monotonic()
    out = run_episodes(FakeEngine("1"), TOK, examples(1), SamplingParams(n=4, max_new_tokens=4),
                       factory("toy_envs:Scripted", first_message="1+" * (1 << 20)), LIMITS,
                       render=prompts.render_message)
    assert all("the message is 2097152 characters" in c.env.error for c in out) and time.monotonic() - start < 2
    monkeypatch.setattr(turns, "MAX_HUNG_CALLS", 3)
    monkeypatch.setattr(turns, "_HUNG", HungCalls())
    release = __import__("threading").Event()
    try:
        for _ in range(3):
            assert isinstance(turns._bounded(release.wait, 0.01, "step()"), turns.EnvOutputError)
        with pytest.raises(EnvError, match="3 environment calls did not return within"):
            turns._bounded(lambda: 1, 0.01, "step()")
    finally:
        release.set()
    for t in turns._HUNG.threads():
        t.join(1)
    assert turns._bounded(lambda: 1, 1, "step()") == 1   # once they end, calls run again


class MarkupReply:
    """Answers the first turn with a Rendered observation of the given parts (markup, content, markup, ...), then
    says done."""

    def __init__(self, parts: list):
        self.parts, self.answered = parts, False

    def reset(self, row):
        return None

    def step(self, model_text):
        from lowmem_grpo.environment import Rendered

        if self.answered:
            return None, None, True
        self.answered = True
        return Rendered(self.parts), None, False


def test_a_rendered_observation_is_cut_in_its_contents_and_never_through_its_markup():
    """observation_max_tokens cut a Rendered observation (a chat template's tool answer) as one, through its
    markup: the next assistant header was cut, and the model's next turn sampled after it. Now only the contents
    are cut, the markup kept whole; an observation whose markup alone is past the limit is not appended, and a
    limit ends the episode (truncated), as for one that would fill the room left."""
    def episode(parts, most):
        limits = TurnLimits(max_turns=3, max_total_tokens=64, observation_max_tokens=most)
        [c] = run_episodes(FakeEngine("12"), TOK, examples(1), SamplingParams(n=1, max_new_tokens=8),
                           factory("test_environment:MarkupReply", parts=parts), limits)
        return c, TOK.decode([t for t, by_env in zip(c.token_ids, c.env_mask) if by_env])

    c, observed = episode(["(", "7" * 40, ")="], 6)
    assert observed == "(777)=" and c.env.turns == 2 and not c.truncated
    c, observed = episode(["(", "7" * 40, ")(", "8" * 3, ")="], 13)   # the short content kept, the long one cut
    assert observed == "(77777)(888)=", observed
    c, observed = episode(["((((", "7", "))))"], 6)
    assert observed == "" and c.env.turns == 1 and c.truncated and c.env.error is None


# -- a third red team's findings -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name, kwargs, words", [
    ("toy_envs:Careless", {"how": "float"}, "step() returned reward <toy_envs._FloatRaises object"),
    ("toy_envs:Careless", {"how": "repr"},
     "step() returned observation <a _ReprRaises whose repr raised RuntimeError>"),
    ("toy_envs:Careless", {"how": "reset_repr"}, "reset() returned _ReprRaises <a _ReprRaises whose repr raised"),
    ("toy_envs:Careless", {"how": "tuple"}, "step() returned _BrokenTuple"),
    ("toy_envs:Careless", {"how": "interrupt"}, "step() raised KeyboardInterrupt"),
    ("toy_envs:DictAttributes", {}, "reading its parallel_steps raised KeyError: 'parallel_steps' (an optional "
                                    "attribute it lacks must raise AttributeError)"),
    ("toy_envs:ExitingFlag", {}, "reading its ends_at_cut_turn raised SystemExit: 2"),
])
def test_values_and_attributes_that_are_user_code_end_that_episode_with_what_went_wrong(name, kwargs, words):
    """Found by a red team: a reward whose __float__ raised, an observation whose __repr__ raised, a tuple subclass
    that cannot be read, or a step raising KeyboardInterrupt ended the step's thread with a traceback and read as
    "did not return within environment.step_timeout_s"; an environment whose attribute lookup raised other than
    AttributeError (a proxy's KeyError, a property calling sys.exit()) crashed the run from the driver's reading of
    parallel_steps or ends_at_cut_turn. Each is that episode's error now, saying what happened."""
    out = run_episodes(FakeEngine("12"), TOK, examples(2), SamplingParams(n=2, max_new_tokens=8),
                       factory(name, **kwargs), LIMITS)
    for c in out:
        assert c.env.error is not None and words in c.env.error, c.env.error
        assert "did not return" not in c.env.error and len(c.token_ids) == len(c.env_mask)


def test_an_observation_of_a_str_subclass_is_read_as_plain_text():
    """Found by a red team: an observation that is a str subclass whose attribute lookups raise (KeyError) crashed
    the run in the driver, which read its `messages` on its own thread; the checks hand on a plain str."""
    out = run_episodes(FakeEngine("12"), TOK, examples(1), SamplingParams(n=2, max_new_tokens=8),
                       factory("toy_envs:Careless", how="sly"), dataclasses_replace(LIMITS, max_turns=2))
    for c in out:
        assert c.env.error is None and c.env.turns == 2 and c.env.reward == 2.0
        assert c.token_ids == ids("12") + [EOS] + ids(" 1 ") + ids("12") + [EOS]
        assert c.env_mask == [False] * 3 + [True] * 3 + [False] * 3


def test_an_environment_instance_shared_by_episodes_is_each_ones_error():
    """Found by a red team: a class handing out one instance (a singleton __new__) had every episode of a step reset
    and stepped on the same object, and every reward scored the last reset's row (the answer of example 1 for the
    episodes of example 0), silently. Each episode needs its own instance: those that share one end in an error."""
    import toy_envs

    toy_envs._THE_ONE = None
    out = run_episodes(FakeEngine("12"), TOK, examples(2), SamplingParams(n=2, max_new_tokens=8),
                       factory("toy_envs:Singleton"), LIMITS)
    for c in out:
        assert c.env.error is not None and "is also another episode's: each episode needs its own" in c.env.error
        assert c.env.turns == 0 and c.env.reward is None and c.token_ids == []
    toy_envs._THE_ONE = None


def test_unhashable_or_shared_value_environments_are_not_taken_for_one_shared_instance():
    """Found by a review of the check above: it hashed the environments, so a @dataclass one (unhashable) stopped the
    run with a TypeError; and it took a for_rewards value that every instance has (a class constant, a bool) for a
    shared instance, ending every episode. And for_rewards was read only after reset(): the reward functions got the
    episode's state before its turns. Now: identities, the for_rewards instance only for ToolCalls', read again at
    the episode's end."""
    out = run_episodes(FakeEngine("12"), TOK, examples(2), SamplingParams(n=2, max_new_tokens=8),
                       factory("toy_envs:DataclassCounter"), LIMITS)
    assert [(c.env.error, c.env.reward, c.env.turns, c.env.instance) for c in out] == [(None, 1.0, 2, {"turns": 2})] * 4
    out = run_episodes(FakeEngine("12"), TOK, examples(2), SamplingParams(n=2, max_new_tokens=8),
                       factory("toy_envs:ConstantForRewards"), LIMITS)
    assert [(c.env.error, c.env.reward, c.env.instance) for c in out] == [(None, 1.0, "calc")] * 4


def positional_only(a: int, /) -> int:
    """Positional only.

    Args:
        a: A number.
    """
    return a


def star_args(*numbers: int) -> int:
    """Sums.

    Args:
        numbers: The numbers.
    """
    return sum(numbers)


def keyword_only(*, a: int, b: int = 3) -> int:
    """Keyword only.

    Args:
        a: A number.
        b: Another.
    """
    return a + b


def test_a_tool_whose_parameters_cannot_be_given_by_name_is_refused():
    """Found by a red team: a tool taking a positional-only parameter or *args got a schema that lists it, and every
    call, made as TRL makes it (fn(**arguments)), failed with a TypeError the model could do nothing about. Refused
    when the tools are described; a keyword-only parameter is fine."""
    from lowmem_grpo.tool_calls import ToolCallError, schema

    for fn, words in ((positional_only, "'positional_only' takes a by position only"),
                      (star_args, "'star_args' takes *numbers by position only")):
        with pytest.raises(ToolCallError, match=re.escape(words) + ".*passed by name"):
            schema(fn, "tools")
    assert schema(keyword_only, "tools")["function"]["parameters"]["required"] == ["a"]


def test_an_optional_property_that_hangs_is_bounded_as_a_step_is():
    """Found by a red team: the driver read an environment's for_rewards (and template_kwargs) on its own thread,
    unbounded, so a property that hangs hung the run. Read once now, after reset(), within
    environment.step_timeout_s."""
    out = run_episodes(FakeEngine("12"), TOK, examples(1), SamplingParams(n=2, max_new_tokens=8),
                       factory("toy_envs:SlowForRewards", seconds=3.0), dataclasses_replace(LIMITS, step_timeout_s=0.3))
    for c in out:
        assert "the constructor or reset() did not return within environment.step_timeout_s=0.3 s" in c.env.error
        assert c.env.turns == 0
