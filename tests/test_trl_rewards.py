"""Reward code written for TRL's GRPOTrainer runs unchanged: the calling convention is detected (one rule),
TRL-shaped functions get TRL's keyword arguments (chat-format prompts and completions, dataset columns by
name, completion_ids, trainer_state), None means "does not apply", async functions run concurrently, and
chat-format datasets (the prompt field a list of messages) are rendered with the tokenizer's chat template."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

import trl_style_rewards
from conftest import QUIET, chat_tokenizer, recipe_dict
from lowmem_grpo import tiny
from lowmem_grpo.cli import main
from lowmem_grpo.data import DataError, PromptSet, split_rows
from lowmem_grpo.metrics import read_metrics
from lowmem_grpo.recipe import DataConfig, RecipeError, RewardsConfig, recipe_from_dict
from lowmem_grpo.rewards import RewardError, Rewards, calling_convention, resolve
from lowmem_grpo.rewards.conventions import TRL_NOT_PASSED, TRL_PASSED

# Role markers in characters the tiny tokenizer has: a system message as *text*, any other as (text), then
# '=' opens the assistant's turn.
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}*{{ m['content'] }}*{% else %}"
                 "({{ m['content'] }}){% endif %}{% endfor %}{% if add_generation_prompt %}={% endif %}")


@pytest.fixture(scope="module")
def chat_tok():
    return chat_tokenizer(CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def chat_model_dir(tiny_model_dir, tmp_path_factory):
    """tiny_model_dir's model with a tokenizer that has a chat template (the shared fixture stays without)."""
    path = tmp_path_factory.mktemp("chat_model")
    shutil.copytree(tiny_model_dir, path, dirs_exist_ok=True)
    tok = tiny.build_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    return path


def chat_rows(n: int, seed: int) -> list[dict]:
    """TRL's conversational format: the prompt as messages, the reference in a `solution` column, no answer."""
    return [{"prompt": [{"role": "user", "content": r["prompt"].rstrip("=")}], "solution": r["answer"]}
            for r in tiny.addition_rows(n, seed)]


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def rewards(*functions, on_error: str = "raise", **kw) -> Rewards:
    specs = [f if isinstance(f, dict) else {"function": f} for f in functions]
    return Rewards(RewardsConfig.model_validate({"functions": specs, "on_error": on_error}), answer_field="answer", **kw)


# ----------------------------------------------------------------------------------------------------
# End to end: TRL's documented reward functions on a chat dataset without an answer column

def test_trl_documented_rewards_train_on_chat_data(chat_model_dir, tmp_path, monkeypatch):
    from lowmem_grpo.train import Trainer

    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("TRL_REWARDS_LOG", str(log))
    train, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    tiny.write_jsonl(chat_rows(40, seed=1), train)
    tiny.write_jsonl(chat_rows(4, seed=2), test)
    d = recipe_dict(chat_model_dir, (train, test), tmp_path / "run", train={"steps": 2, "eval_max_prompts": 2},
                    rewards={"functions": [{"function": "trl_style_rewards:accuracy_reward"},
                                           {"function": "trl_style_rewards:format_reward", "weight": 0.5},
                                           {"function": "trl_style_rewards:logs_metric", "weight": 0.0}]})
    Trainer(recipe_from_dict(d), **QUIET).fit()

    steps = [row for row in read_metrics(tmp_path / "run") if "loss" in row]
    assert [row["step"] for row in steps] == [1, 2]
    for row in steps:
        assert row["reward/accuracy_reward"] is not None and row["reward/format_reward"] is not None
        assert row["reward/skipped"] == 0       # every completion scored: the model always has a solution
        assert isinstance(row["reward_metric/mean_length"], float)   # TRL's log_metric, in the step's row
    tok = tiny.build_tokenizer()
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    train_calls = [c for c in calls if len(c["completions"]) == 2 * 4]   # prompts_per_step x num_generations
    assert [c["global_step"] for c in train_calls] == [0, 1]
    for c in train_calls:
        n = len(c["completions"])
        assert all(isinstance(p, list) and p[0]["role"] == "user" for p in c["prompts"])
        assert all(len(comp) == 1 and comp[0]["role"] == "assistant" and isinstance(comp[0]["content"], str)
                   for comp in c["completions"])
        assert c["columns"] == ["solution"] and c["column_lengths"] == {"solution": n}   # not the prompt column
        assert len(c["solution"]) == n and len(c["prompts"]) == n
        # the group's prompts repeat, each with its row's own solution
        for prompt, solution in zip(c["prompts"], c["solution"]):
            assert str(sum(map(int, prompt[0]["content"].split("+")))) == solution
        assert len(c["completion_ids"]) == n and all(isinstance(i, int) for ids in c["completion_ids"] for i in ids)
        assert [tok.decode(ids, skip_special_tokens=True) for ids in c["completion_ids"]] == \
               [comp[0]["content"] for comp in c["completions"]]
    evals = [c for c in calls if c not in train_calls]     # evaluation (greedy, before and after) gets chat prompts too
    assert evals and all(isinstance(p, list) for c in evals for p in c["prompts"])
    assert [c["global_step"] for c in evals] == [0, 2]   # evaluation before step 1 and after step 2, as TRL's


# ----------------------------------------------------------------------------------------------------
# Detection: one rule

@pytest.mark.parametrize("function,convention", [
    ("trl_style_rewards:accuracy_reward", "trl"),     # (completions, solution, **kwargs)
    ("trl_style_rewards:format_reward", "trl"),       # (completions, **kwargs)
    ("trl_style_rewards:strict_keywords", "trl"),     # (completions, prompts, scale): no **kwargs
    ("trl_style_rewards:slow_half", "trl"),           # async def
    ("trl_style_rewards:length_penalty", "trl"),      # a callable instance without __name__: (completion_ids, **kw)
    ("trl_style_rewards:async_judge", "trl"),         # an instance with an async __call__
    ("user_rewards:digit_count", "lowmem"),           # (completions, *, prompts, rows, ...)
    ("user_rewards:has_digit", "trl"),                # (completions, **_): either way for a text dataset
    ("trl_style_rewards:slow_one", "lowmem"),         # async def with rows
    ("math", "lowmem"),                               # built-ins are lowmem-grpo's
])
def test_convention_is_detected(function, convention):
    assert rewards(function).conventions == {function.rsplit(":", 1)[-1]: convention}


@pytest.mark.parametrize("function,why", [
    ("trl_style_rewards:takes_texts", "takes no `completions` by keyword"),
    ("trl_style_rewards:positional_only", "positional-only"),
])
def test_a_function_that_fits_neither_convention_is_named(function, why):
    with pytest.raises(RewardError) as info:
        rewards("math", function)
    msg = str(info.value)
    assert msg.startswith(f"rewards.functions.1.function: reward '{function}'") and "fits neither" in msg
    assert why in msg and "`rows`" in msg and "completions" in msg


def test_ambiguous_lowmem_functions_keep_working_on_text_data():
    r = rewards("user_rewards:has_digit", "user_rewards:digit_count")
    res = r(["a1", "bb"], ["p", "q"], [{"prompt": "p"}, {"prompt": "q"}])
    assert r.conventions == {"has_digit": "trl", "digit_count": "lowmem"}
    assert res.per_function["has_digit"].tolist() == [1.0, 0.0] and res.total.tolist() == [1.25, 0.0]


def test_convention_override():
    # reads kwargs["rows"] without a `rows` parameter: auto calls it TRL's way, and the error says what to set
    with pytest.raises(RewardError, match=r"'reads_rows' raised KeyError.*set convention: lowmem in rewards\.functions\.0"):
        rewards("trl_style_rewards:reads_rows")(["a"], ["p"], [{"prompt": "p", "x": 1}])
    lowmem = rewards({"function": "trl_style_rewards:reads_rows", "convention": "lowmem"})
    assert lowmem(["a"], ["p"], [{"prompt": "p", "x": 1}]).total.tolist() == [2.0]
    # on a chat row, auto calls has_digit TRL's way (completions as messages: it fails, saying what to set);
    # lowmem gives it text
    with pytest.raises(RewardError, match=r"'has_digit' raised AttributeError.*on chat prompts its completions are "
                                          r"\[\{'role': 'assistant'.*set convention: lowmem"):
        rewards("user_rewards:has_digit")(["a1"], ["(1+1)="], [{"prompt": user("1+1")}], prompt_messages=[user("1+1")])
    chat = rewards({"function": "user_rewards:has_digit", "convention": "lowmem"})
    assert chat(["a1"], ["(1+1)="], [{"prompt": user("1+1")}], prompt_messages=[user("1+1")]).total.tolist() == [1.0]
    # an override the function cannot take is named
    with pytest.raises(RewardError, match=r"rewards\.functions\.0\.function: .*'trl_style_rewards:strict_keywords' "
                                          r"must accept the keyword arguments rows"):
        rewards({"function": "trl_style_rewards:strict_keywords", "convention": "lowmem"})
    with pytest.raises(RewardError, match=r"rewards\.functions\.0\.function: .*takes_texts.*cannot be called TRL's way"):
        rewards({"function": "trl_style_rewards:takes_texts", "convention": "trl"})
    with pytest.raises(RecipeError) as info:       # a built-in is lowmem-grpo's
        recipe_from_dict({"model": {"name_or_path": "m"}, "data": {"train_path": "t.jsonl"},
                          "rewards": {"functions": [{"function": "math", "convention": "trl"}]}})
    assert dict(info.value.problems)["rewards.functions.0.convention"].startswith("built-in reward 'math'")


def test_recipe_kwargs_reach_a_trl_function_and_are_checked():
    r = rewards({"function": "trl_style_rewards:with_option", "kwargs": {"scale": 3.0}})
    assert r(["a"], ["p"], [{"prompt": "p"}]).total.tolist() == [3.0]
    with pytest.raises(RewardError, match=r"kwargs\.scael: .*no parameter 'scael'.*scale"):
        rewards({"function": "trl_style_rewards:strict_keywords", "kwargs": {"scael": 3.0}})
    with pytest.raises(RewardError, match=r"kwargs\.completion_ids: .*passed by the trainer"):
        rewards({"function": "trl_style_rewards:format_reward", "kwargs": {"completion_ids": []}})


def test_every_argument_trls_trainer_passes_is_passed_or_documented_as_not():
    """The keyword arguments the installed TRL's GRPOTrainer gives reward functions (read from its source) are
    passed here (TRL_PASSED) or named in TRL_NOT_PASSED, and the README's TRL section names those."""
    spec = importlib.util.find_spec("trl")
    if spec is None:
        pytest.skip("trl is not installed (the test extra)")
    source = (Path(spec.origin).parent / "trainer" / "grpo_trainer.py").read_text(encoding="utf-8")
    assert "prompts=prompts, completions=completions, completion_ids=completion_ids_list, **reward_kwargs" in source
    passed = {"prompts", "completions", "completion_ids"} | set(re.findall(r'^\s*reward_kwargs\["(\w+)"\]\s*=', source, re.M))
    assert "trainer_state" in passed
    assert not passed - set(TRL_PASSED) - set(TRL_NOT_PASSED), sorted(passed - set(TRL_PASSED) - set(TRL_NOT_PASSED))
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    section = readme.split("#### Reward functions written for TRL", 1)[1].split("\n## ", 1)[0]
    assert not [n for n in TRL_NOT_PASSED if f"`{n}`" not in section]


def test_environments_is_required_only_with_an_environment(tmp_path):
    """TRL passes environments= with an environment_factory; here with an environment on (environment.name). A
    function that requires it, in a recipe without one, fails when the run starts (and in validate), naming it,
    not at its first batch as a 'missing dataset column'; with one, it loads and gets each completion's instance."""
    function = "trl_style_rewards:reads_environments"
    why = (rf"reward '{function}' requires `environments` \(.*\), passed only when the recipe names an environment "
           r"\(environment.name; TRL's environment_factory=\): name one, or give the parameter a default \(environments=None\)")
    with pytest.raises(RewardError, match=rf"rewards\.functions\.0\.function: {why}"):
        rewards(function)
    with pytest.raises(RewardError, match=why):
        rewards({"function": function, "convention": "trl"})
    res = _validate(tmp_path, {"function": function})
    assert res.exit_code == 2 and f"rewards.functions.0.function: reward '{function}' requires `environments`" in res.output
    env = type("Env", (), {})
    instances = [env(), env()]
    instances[0].reward, instances[1].reward = 0.25, 1.0
    r = rewards(function, environment_weight=1.0)
    res = r(["a", "b"], ["p", "q"], [{"prompt": "p"}] * 2, environment=[None, None], environments=instances)
    assert res.per_function["reads_environments"].tolist() == [0.25, 1.0]


def test_log_metric_log_extra_and_max_steps_reach_trl_functions():
    r = Rewards(RewardsConfig.model_validate({"functions": [{"function": "trl_style_rewards:logs_metric"},
                                                            {"function": "trl_style_rewards:logs_extra"},
                                                            {"function": "trl_style_rewards:logs_metric_if_given"},
                                                            {"function": "trl_style_rewards:curriculum"}]}),
                answer_field="answer", max_steps=10)
    res = r(["ab", "abcd"], ["p", "q"], [{"prompt": "p"}] * 2, step=4)
    assert res.metrics == {"mean_length": [3.0], "calls": [1.0]} and res.extra == {"length": [2, 4]}
    assert res.per_function["curriculum"].tolist() == [0.4, 0.4]        # global_step / max_steps
    two = Rewards(RewardsConfig.model_validate({"functions": [{"function": "trl_style_rewards:updates_done"}]}),
                  answer_field="answer", max_steps=10, updates_per_step=2)   # algorithm.mu: 2 updates a step
    assert two(["ab"], ["p"], [{"prompt": "p"}], step=4).per_function["updates_done"].tolist() == [8.02]   # TRL's count
    with pytest.raises(RewardError, match=r"log_extra\('length', \.\.\.\) was given 3 values for 2 completions"):
        rewards("trl_style_rewards:logs_extra_wrong")(["ab", "abcd"], ["p", "q"], [{"prompt": "p"}] * 2)


def test_the_chat_hint_is_given_only_for_a_text_vs_messages_error():
    with pytest.raises(RewardError) as info:
        rewards("trl_style_rewards:curriculum")(["a"], ["(1)="], [{"prompt": user("1")}], prompt_messages=[user("1")])
    assert "ZeroDivisionError" in str(info.value) and "on chat prompts" not in str(info.value)


def test_callable_instances_are_named_by_their_attribute_and_awaited():
    r = rewards("trl_style_rewards:length_penalty", "trl_style_rewards:async_judge")
    res = r(["a", "bcd"], ["p", "q"], [{"prompt": "p"}] * 2, completion_ids=[[1], [1, 2, 3]])
    assert list(res.per_function) == ["length_penalty", "async_judge"]
    assert res.per_function["length_penalty"].tolist() == [0.0, -1.0] and res.total.tolist() == [0.5, -0.5]


def test_a_function_without_var_kwargs_gets_only_what_it_names():
    r = rewards({"function": "trl_style_rewards:strict_keywords", "kwargs": {"scale": 2.0}})
    res = r(["a", "b"], ["p", "q"], [{"prompt": "p", "solution": "1"}] * 2, completion_ids=[[1], [2]], step=4)
    assert res.total.tolist() == [2.0, 2.0]


# ----------------------------------------------------------------------------------------------------
# What TRL-shaped functions receive; None = does not apply; async

def test_text_rows_give_strings_and_every_column(tmp_path, monkeypatch):
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("TRL_REWARDS_LOG", str(log))
    rows = [{"prompt": "1+1=", "solution": "2", "level": 1}, {"prompt": "2+2=", "solution": "4"}]
    res = rewards("trl_style_rewards:text_accuracy")(["2", "5"], ["1+1=", "2+2="], rows, completion_ids=[[5], [8]],
                                                    step=7)
    assert res.total.tolist() == [1.0, 0.0]
    (call,) = [json.loads(line) for line in log.read_text().splitlines()]
    assert call["prompts"] == ["1+1=", "2+2="] and call["completions"] == ["2", "5"]
    assert call["completion_ids"] == [[5], [8]] and call["global_step"] == 7
    assert call["columns"] == ["level", "solution"] and call["solution"] == ["2", "4"]   # one value per completion


def test_none_does_not_apply_for_trl_functions_and_skips_for_lowmem():
    four = (["a", "b", "c", "d"], ["p"] * 4, [{"prompt": "p"}] * 4)
    res = rewards("trl_style_rewards:half_applies", {"function": "trl_style_rewards:twos", "weight": 0.5})(*four)
    assert res.total.tolist() == [2.0, 1.0, 2.0, 1.0] and res.skipped == 0     # nan-sum: the None is left out
    assert res.per_function["half_applies"].isnan().tolist() == [False, True, False, True]
    only = rewards("trl_style_rewards:half_applies", "trl_style_rewards:never_applies")(*four)
    assert only.total.isnan().tolist() == [False, True, False, True] and only.skipped == 2   # every function: None
    assert rewards("trl_style_rewards:never_applies")(*four).skipped == 4
    verdicts = rewards("trl_style_rewards:verdicts", {"function": "trl_style_rewards:twos", "weight": 0.5})(*four)
    assert verdicts.total.tolist() == [2.0, 1.0, 1.0, 1.0]   # True: 1.0, False: 0.0, NaN: does not apply
    # lowmem-grpo's None still skips the completion, whatever a TRL-shaped function says
    mixed = rewards({"function": "user_rewards:skip_all", "convention": "lowmem"}, "trl_style_rewards:twos")(*four)
    assert mixed.skipped == 4


def test_per_function_metrics_average_what_each_function_scored():
    import torch

    from lowmem_grpo import diagnostics as diag

    res = rewards("trl_style_rewards:half_applies", "trl_style_rewards:twos")(["a", "b", "c", "d"], ["p"] * 4,
                                                                            [{"prompt": "p"}] * 4)
    row = diag.rollout_stats(res, torch.tensor([1, 1, 1, 1]), torch.tensor([False] * 4), 2, torch.zeros(2, 2))
    assert row["reward/half_applies"] == 1.0 and row["reward/twos"] == 2.0 and row["reward/mean"] == 2.5


def test_async_functions_run_concurrently():
    trl_style_rewards.ARRIVED.clear()
    r = rewards("trl_style_rewards:meet", "trl_style_rewards:meet", "trl_style_rewards:slow_one")
    res = r(["a", "b"], ["p", "q"], [{"prompt": "p"}] * 2)
    assert set(res.per_function) == {"meet", "meet_1", "slow_one"}
    assert res.total.tolist() == [3.0, 3.0] and len(trl_style_rewards.ARRIVED) == 2


def test_async_errors_are_named_and_zeroed():
    with pytest.raises(RewardError, match="'async_raises' raised ValueError: async boom"):
        rewards("trl_style_rewards:async_raises")(["a"], ["p"], [{"prompt": "p"}])
    res = rewards("trl_style_rewards:async_raises", "trl_style_rewards:slow_half", on_error="zero")(
        ["a"], ["p"], [{"prompt": "p"}])
    assert res.errors == {"async_raises": 1} and res.total.tolist() == [0.5]


def test_async_functions_run_inside_a_running_event_loop():
    import asyncio

    async def in_a_notebook():
        return rewards("trl_style_rewards:slow_half")(["a"], ["p"], [{"prompt": "p"}])

    assert asyncio.run(in_a_notebook()).total.tolist() == [0.5]


# ----------------------------------------------------------------------------------------------------
# Columns

def test_a_column_named_like_trls_own_arguments_is_an_error():
    r = rewards("trl_style_rewards:format_reward")
    with pytest.raises(RewardError, match=r"dataset column 'completions' has the name of an argument.*rename the column"):
        r(["1"], ["p"], [{"prompt": "p", "completions": "x"}])
    # lowmem-grpo's functions get rows, where any field name is fine
    assert rewards("user_rewards:digit_count")(["1"], ["p"], [{"prompt": "p", "completions": "x"}]).total.tolist() == [0.25]


def test_a_missing_column_and_a_kwarg_column_clash_are_named():
    with pytest.raises(RewardError, match=r"rewards\.functions\.0\.function: reward 'needs_column' requires the "
                                          r"argument 'difficulty'.*columns: solution"):
        rewards("trl_style_rewards:needs_column")(["1"], ["p"], [{"prompt": "p", "solution": "1"}])
    assert rewards("trl_style_rewards:needs_column")(["1"], ["p"], [{"prompt": "p", "difficulty": 3}]).total.tolist() == [3.0]
    r = rewards({"function": "trl_style_rewards:with_option", "kwargs": {"scale": 2.0}})
    with pytest.raises(RewardError, match=r"rewards\.functions\.0\.kwargs\.scale: 'scale' is also a dataset column"):
        r(["1"], ["p"], [{"prompt": "p", "scale": 5}])


def test_reads_answer():
    assert rewards("math").reads_answer and rewards("exact", "format").reads_answer
    assert not rewards("format", "trl_style_rewards:accuracy_reward").reads_answer


# ----------------------------------------------------------------------------------------------------
# Chat datasets

def _set(tmp_path, rows, tok, **data) -> PromptSet:
    path = tmp_path / "d.jsonl"
    tiny.write_jsonl(rows, path)
    return PromptSet(str(path), DataConfig(train_path=str(path), **data), tok, require_answer=False)


def test_chat_rows_are_rendered_with_the_chat_template(tmp_path, chat_tok):
    ps = _set(tmp_path, [{"prompt": user("1+2"), "solution": "3"}], chat_tok)
    ex = ps.examples[0]
    assert ex.prompt_text == "(1+2)=" and ex.messages == user("1+2")
    assert ex.prompt_ids == chat_tok("(1+2)=", add_special_tokens=False)["input_ids"]
    text = _set(tmp_path, [{"prompt": "1+2=", "answer": "3"}], chat_tok).examples[0]
    assert text.messages is None and text.prompt_text == "1+2="       # data.chat_template stays false for text


def test_system_prompt_is_prepended_unless_the_row_has_one(tmp_path, chat_tok):
    ps = _set(tmp_path, [{"prompt": user("1+2")},
                         {"prompt": [{"role": "system", "content": "0"}, *user("2+2")]}], chat_tok, system_prompt="9")
    first, second = ps.examples[0], ps.examples[1]
    assert first.prompt_text == "*9*(1+2)=" and first.messages[0] == {"role": "system", "content": "9"}
    assert second.prompt_text == "*0*(2+2)=" and [m["role"] for m in second.messages] == ["system", "user"]


def test_chat_template_kwargs_reach_the_template(tmp_path):
    """data.chat_template_kwargs are the template's variables (TRL's chat_template_kwargs: Qwen3's enable_thinking)."""
    tok = tiny.build_tokenizer()
    tok.chat_template = ("{% for m in messages %}({{ m['content'] }}){% endfor %}"
                         "{% if add_generation_prompt %}{% if enable_thinking is defined and not enable_thinking %}**"
                         "{% endif %}={% endif %}")
    rows = [{"prompt": user("1+2")}]
    assert _set(tmp_path, rows, tok).examples[0].prompt_text == "(1+2)="
    assert _set(tmp_path, rows, tok, chat_template_kwargs={"enable_thinking": False}).examples[0].prompt_text == "(1+2)**="
    text_rows = [{"prompt": "1+2"}]   # data.chat_template: true wraps text prompts the same way
    assert _set(tmp_path, text_rows, tok, chat_template=True,
                chat_template_kwargs={"enable_thinking": False}).examples[0].prompt_text == "(1+2)**="
    with pytest.raises(RecipeError, match="data.chat_template_kwargs: sets add_generation_prompt"):
        recipe_from_dict({"model": {"name_or_path": "m"}, "data": {"train_path": "t.jsonl",
                                                                   "chat_template_kwargs": {"add_generation_prompt": False}}})


@pytest.mark.parametrize("prompt,why", [
    ([{"role": "bot", "content": "1"}], r"message prompt\[0\] has role 'bot'; allowed: system, user, assistant, tool"),
    ([{"role": "user", "content": 5}], r"message prompt\[0\] \(user\) has content int 5, expected text"),
    ([{"role": "user"}], r"message prompt\[0\] \(user\) has content missing"),
    ([*user("1"), "2+2"], r"message prompt\[1\] is str, expected a mapping with 'role' and 'content'"),
    ([], "is an empty list"),
])
def test_malformed_messages_name_the_row_or_are_skipped(tmp_path, chat_tok, prompt, why):
    rows = [{"prompt": user("1+1")}, {"prompt": prompt}]
    with pytest.raises(DataError, match=rf"row 2: .*{why}"):
        _set(tmp_path, rows, chat_tok)
    ps = _set(tmp_path, rows, chat_tok, on_bad_row="skip")
    assert len(ps) == 1 and len(ps.skipped) == 1 and ps.skipped[0].startswith("row 2:")


def test_a_template_with_message_prompts_is_an_error(tmp_path, chat_tok):
    with pytest.raises(DataError, match=r"row 1: the prompt field 'prompt' holds chat messages.*data\.template must be "
                                        r"its default '\{prompt\}' \(it is 'Q: \{prompt\}'\)"):
        _set(tmp_path, [{"prompt": user("1+1")}], chat_tok, template="Q: {prompt}")


def test_a_tokenizer_without_a_chat_template_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match=r"row 1: the prompt field 'prompt' holds chat messages, which needs the "
                                        r"tokenizer's chat template, and this tokenizer has none"):
        _set(tmp_path, [{"prompt": user("1+1")}], tiny.build_tokenizer())


def test_answer_is_required_only_when_asked(tmp_path, chat_tok):
    path = tmp_path / "d.jsonl"
    tiny.write_jsonl([{"prompt": user("1+1"), "solution": "2"}], path)
    with pytest.raises(DataError, match="row 1: missing field 'answer'"):
        PromptSet(str(path), DataConfig(train_path=str(path)), chat_tok)
    assert len(PromptSet(str(path), DataConfig(train_path=str(path)), chat_tok, require_answer=False)) == 1


def test_eval_fraction_groups_message_prompts():
    rows = [{"prompt": user(f"{i}+1"), "solution": str(i + 1), "copy": c} for i in range(10) for c in range(3)]
    train, held = split_rows(rows, DataConfig(train_path="x", eval_fraction=0.3))
    held_prompts = {json.dumps(r["prompt"]) for r in held}
    assert len(held_prompts) == 3 and len(held) == 9          # every copy of a held-out prompt, and only those
    assert not held_prompts & {json.dumps(r["prompt"]) for r in train}


# ----------------------------------------------------------------------------------------------------
# validate

def _validate(tmp_path, *functions):
    path = tmp_path / "r.yaml"
    (tmp_path / "t.jsonl").write_text('{"prompt": "p", "answer": "1"}\n')   # validate reads the data's first rows
    path.write_text(yaml.safe_dump({"model": {"name_or_path": "m"}, "data": {"train_path": str(tmp_path / "t.jsonl")},
                                    "rewards": {"functions": list(functions)}}))
    return CliRunner().invoke(main, ["validate", str(path)])


def test_validate_reports_a_misfit_and_the_detected_conventions(tmp_path):
    res = _validate(tmp_path, {"function": "math"}, {"function": "trl_style_rewards:takes_texts"})
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert "rewards.functions.1.function: reward 'trl_style_rewards:takes_texts' (texts) fits neither" in res.output
    res = _validate(tmp_path, {"function": "trl_style_rewards:accuracy_reward"}, {"function": "user_rewards:digit_count"})
    assert res.exit_code == 0, res.output
    assert "rewards.functions.0 (trl_style_rewards:accuracy_reward): called as TRL's GRPOTrainer" in res.output
    assert "rewards.functions.1 (user_rewards:digit_count): called with lowmem-grpo's convention" in res.output


def test_resolve():
    assert calling_convention("f", resolve("trl_style_rewards:format_reward")) == ("trl", [])


STATES = []


def keeps_trainer_state(completions, trainer_state, **kwargs):
    """A curriculum reads trainer_state.epoch / num_train_epochs (TRL passes transformers' TrainerState)."""
    STATES.append(trainer_state)
    return [0.0] * len(completions)


def test_trainer_state_is_transformers_with_the_epoch_once_the_train_set_is_known():
    """Was a frozen dataclass with global_step and max_steps only: trainer_state.epoch raised AttributeError."""
    from transformers import TrainerState

    r = Rewards(RewardsConfig.model_validate({"functions": [{"function": "test_trl_rewards:keeps_trainer_state"}]}),
                answer_field="answer", max_steps=10, updates_per_step=2, prompts_per_step=2)
    r(["a"], ["p"], [{"prompt": "p"}], step=3)
    state = STATES[-1]
    assert isinstance(state, TrainerState) and (state.global_step, state.max_steps) == (6, 20)   # optimizer updates
    # the train set's size is not known yet: transformers' defaults
    assert (state.epoch, state.num_train_epochs, state.log_history) == (0, 0, [])
    r.train_rows = 4   # as the trainer sets it once it has loaded the train set
    r(["a"], ["p"], [{"prompt": "p"}], step=3)
    assert (STATES[-1].epoch, STATES[-1].num_train_epochs) == (1.5, 5)   # 3 x 2 of 4 prompts; 10 x 2 / 4


def test_normalize_then_sum_gives_a_completion_a_trl_function_left_out_the_others_credit():
    """With algorithm.reward_aggregation: normalize_then_sum, a TRL-shaped None is 'does not apply' there too:
    the trainer scores the completion with the other functions (TRL's multi_objective_aggregation)."""
    from types import SimpleNamespace

    from lowmem_grpo.train import Trainer

    r = Rewards(RewardsConfig.model_validate({"functions": [{"function": "trl_style_rewards:text_length"},
                                                            {"function": "trl_style_rewards:half_applies"}]}),
                answer_field="answer")
    texts = ["123", "x", "1", "xyz"]      # text_length: 3, 1, 1, 3; half_applies: 1.0, None, 1.0, None
    result = r(texts, ["1+1="] * 4, [{"prompt": "1+1="}] * 4)
    recipe = recipe_from_dict({"model": {"name_or_path": "m"}, "data": {"train_path": "t.jsonl"},
                               "generation": {"num_generations": 4},
                               "algorithm": {"reward_aggregation": "normalize_then_sum"}})
    adv = Trainer.advantages(SimpleNamespace(recipe=recipe, rewards=r), result).view(-1)
    assert result.skipped == 0
    assert adv[0] > 0 and adv[3] > 0 and adv[1] < 0 and adv[2] < 0   # 1 and 3 keep their length's credit


def records_completions(completions, **kwargs):
    """A TRL-shaped function that keeps what it got."""
    RECORDED.append(completions)
    return [1.0] * len(completions)


def lowmem_records(completions, *, prompts, rows):
    RECORDED.append(completions)
    return [1.0] * len(completions)


RECORDED: list = []


def test_trl_shaped_functions_get_an_environments_episode_as_its_messages():
    """An episode's completion on a chat prompt reached TRL-shaped functions as one assistant message holding the
    tools' output too (completion[-1]["content"] scored a tool's text as the model's answer: found by a red team).
    With completion_messages (rollout/turns.score), they get the turns; lowmem-grpo's functions keep the text."""
    rewards = Rewards(RewardsConfig.model_validate({"functions": [
        {"function": "test_trl_rewards:records_completions"}, {"function": "test_trl_rewards:lowmem_records"}]}),
        answer_field="answer")
    turns = [{"role": "assistant", "content": "call"}, {"role": "tool", "content": "42"},
             {"role": "assistant", "content": "41"}]
    chat = [{"role": "user", "content": "q"}]
    RECORDED.clear()
    rewards(["call 42 41", "plain", "text prompt"], ["p"] * 3, [{}] * 3, prompt_messages=[chat, chat, None],
            completion_messages=[turns, None, [{"role": "assistant", "content": "unused"}]])
    trl_shaped, lowmem = RECORDED
    assert trl_shaped == [turns, [{"role": "assistant", "content": "plain"}], "text prompt"]
    assert lowmem == ["call 42 41", "plain", "text prompt"]
