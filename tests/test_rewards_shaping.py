"""The shaping rewards (lowmem_grpo/rewards/shaping.py): DAPO's soft overlong punishment, the think/answer
format reward and the n-gram repetition penalty, each checked against hand-computed scores on every branch;
their options are validated like every built-in's and appear in the README's reward options table."""

import inspect
import math
from pathlib import Path

import pytest
import yaml

from lowmem_grpo.recipe import RecipeError, recipe_from_dict
from lowmem_grpo.rewards import Rewards
from lowmem_grpo.rewards.options import BUILTINS, option_names, option_problems, option_reference
from lowmem_grpo.rewards.shaping import (has_think_answer_format, overlong_limits, overlong_reward,
                                         repetition_reward, think_format_reward)

ROOT = Path(__file__).resolve().parent.parent
SHAPING = ("overlong", "think_format", "repetition")


def ids(*lengths: int) -> list[list[int]]:
    return [[7] * n for n in lengths]


def overlong(*lengths: int, **kwargs) -> list[float]:
    return overlong_reward(["text"] * len(lengths), completion_ids=ids(*lengths), **kwargs)


# ---------------------------------------------------------------------------------------------
# overlong: R = 0 for L <= L_max - L_cache, (L_max - L_cache - L) / L_cache inside the buffer, -1 past L_max

def test_overlong_explicit_options_every_branch():
    # L_max 10, L_cache 4: the ramp starts after 6 tokens and falls by 1/4 a token
    assert overlong(0, 1, 6, 7, 8, 9, 10, 11, 50, max_length=10, buffer=4) == \
        [0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0]


def test_overlong_null_options_read_max_new_tokens():
    # L_max = max_new_tokens = 20, L_cache = 20 // 5 = 4: ramp from 16 tokens
    assert overlong(15, 16, 17, 18, 19, 20, max_new_tokens=20) == [0.0, 0.0, -0.25, -0.5, -0.75, -1.0]


def test_overlong_dapo_setting():
    # DAPO §3.4: L_max 20480, L_cache 4096 (the null buffer: a fifth)
    assert overlong_limits(None, None, 20480) == (20480, 4096)
    assert overlong(16384, 16384 + 1024, 16384 + 3072, 20480, max_new_tokens=20480) == [0.0, -0.25, -0.75, -1.0]


def test_overlong_a_cut_completion_scores_minus_one_from_the_ramp():
    # cut at max_new_tokens: L = L_max exactly, the ramp's last token; never the L > L_max branch
    assert overlong(32, max_new_tokens=32) == [-1.0]
    assert overlong(31, max_new_tokens=32) == [pytest.approx(-5 / 6)]   # L_cache = 6: (26 - 31) / 6


def test_overlong_explicit_max_length_ignores_max_new_tokens():
    # L_max 12, null L_cache = 2: ramp from 10; max_new_tokens 100 plays no part
    assert overlong(10, 11, 12, 13, max_length=12, max_new_tokens=100) == [0.0, -0.5, -1.0, -1.0]


def test_overlong_explicit_buffer_with_null_max_length():
    # L_max = max_new_tokens = 20, L_cache 10: ramp from 10
    assert overlong(10, 15, 20, max_new_tokens=20, buffer=10) == [0.0, -0.5, -1.0]


def test_overlong_zero_buffer_is_a_hard_limit():
    # max_length 4: the null buffer is 4 // 5 = 0, so no ramp: 0 up to L_max, -1 past it
    assert overlong(3, 4, 5, max_length=4) == [0.0, 0.0, -1.0]
    assert overlong(9, 10, 11, max_length=10, buffer=0) == [0.0, 0.0, -1.0]


def test_overlong_counts_tokens_not_characters():
    scores = overlong_reward(["a" * 1000, ""], completion_ids=ids(2, 9), max_length=10, buffer=4)
    assert scores == [0.0, -0.75]


def test_overlong_call_errors():
    with pytest.raises(ValueError, match=r"buffer must be less than max_length \(10, null: generation.max_new_tokens = 10\), got 10"):
        overlong(1, max_new_tokens=10, buffer=10)
    with pytest.raises(ValueError, match="max_length is null and no max_new_tokens"):
        overlong(1)
    with pytest.raises(ValueError, match="needs completion_ids"):
        overlong_reward(["a"], max_new_tokens=10)
    with pytest.raises(ValueError, match="2 completion_ids for 1 completions"):
        overlong_reward(["a"], completion_ids=ids(1, 2), max_new_tokens=10)


# ---------------------------------------------------------------------------------------------
# think_format

@pytest.mark.parametrize("text", [
    "<think>a</think><answer>b</answer>",
    "  \n<think>\nreason step by step\n</think>\n\n<answer> 42 </answer>\n",
    "<think></think><answer>5</answer>",                      # an empty think block (a no-think model)
    "<think>x < y and y > z</think> <answer>x</answer>",      # angle brackets that are not the tags
])
def test_think_format_match(text):
    assert think_format_reward([text]) == [1.0]


@pytest.mark.parametrize("text", [
    "<answer>5</answer>",                                            # no think block
    "<think>x</think>",                                              # no answer block
    "<answer>5</answer><think>x</think>",                            # wrong order
    "Sure. <think>x</think><answer>5</answer>",                      # text before
    "<think>x</think> so <answer>5</answer>",                        # text between
    "<think>x</think><answer>5</answer> done",                       # text after
    "<think>x</think><think>y</think><answer>5</answer>",            # think twice
    "<think>x</think><answer>5</answer><answer>6</answer>",          # answer twice
    "<think>maybe <answer>4</answer></think><answer>5</answer>",     # a tag inside the other block
    "<think>x</think><answer>5</think></answer>",                    # a stray closing tag
    "<think>x<answer>5</answer>",                                    # think not closed
    "<think>x</think><answer>5",                                     # answer not closed
    "<Think>x</Think><answer>5</answer>",                            # tags are case-sensitive
    "",
])
def test_think_format_near_misses(text):
    assert think_format_reward([text]) == [0.0]


def test_think_format_custom_tags():
    texts = ["<reasoning>r</reasoning>\n<final>5</final>", "<think>r</think><answer>5</answer>"]
    assert think_format_reward(texts, think_tag="reasoning", answer_tag="final") == [1.0, 0.0]
    assert think_format_reward(texts) == [0.0, 1.0]
    assert has_think_answer_format("<t-1>a</t-1><a_2>b</a_2>", "t-1", "a_2")


@pytest.mark.parametrize("kwargs, match", [
    ({"think_tag": "a>b"}, "think_tag must be a tag name"),
    ({"answer_tag": ".*"}, "answer_tag must be a tag name"),
    ({"think_tag": "x", "answer_tag": "x"}, "answer_tag must differ from think_tag"),
])
def test_think_format_call_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        think_format_reward(["<think>a</think><answer>b</answer>"], **kwargs)


# ---------------------------------------------------------------------------------------------
# repetition: -max_penalty * (1 - distinct / total word n-grams)

def test_repetition_known_counts():
    # trigrams of 'a b c a b c': abc bca cab abc -> 3 distinct of 4
    assert repetition_reward(["a b c a b c"]) == [-0.25]
    # 'x y z' five times: 13 trigrams, 3 distinct
    assert repetition_reward(["x y z " * 5]) == [pytest.approx(-10 / 13)]
    # bigrams of 'a a a a': 3, all one
    assert repetition_reward(["a a a a"], ngram=2) == [pytest.approx(-2 / 3)]
    # no repeated trigram
    assert repetition_reward(["the cat sat on the mat"]) == [0.0]


def test_repetition_ngram_one_counts_words():
    # unigrams: 6 words, 5 distinct ('the' twice); 4 words, 1 distinct
    assert repetition_reward(["the cat sat on the mat", "a a a a"], ngram=1) == [pytest.approx(-1 / 6), -0.75]


def test_repetition_short_completions_score_zero():
    assert repetition_reward(["", "a", "a b"]) == [0.0, 0.0, 0.0]
    assert repetition_reward(["a b c"]) == [0.0]                 # one trigram, distinct
    assert repetition_reward(["a a"], ngram=3) == [0.0]


def test_repetition_max_penalty_and_whitespace():
    assert repetition_reward(["a b c a b c"], max_penalty=2.0) == [-0.5]
    assert repetition_reward(["a\nb  c\ta b\n\nc"]) == [-0.25]      # any whitespace splits words


def test_repetition_no_negative_zero():
    (score,) = repetition_reward(["one two three four"])
    assert score == 0.0 and math.copysign(1.0, score) == 1.0


@pytest.mark.parametrize("kwargs, match", [
    ({"ngram": 0}, "ngram must be an integer >= 1"),
    ({"ngram": 2.0}, "ngram must be an integer >= 1"),
    ({"max_penalty": 0}, "max_penalty must be a finite number > 0"),
    ({"max_penalty": float("inf")}, "max_penalty must be a finite number > 0"),
])
def test_repetition_call_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        repetition_reward(["a b c"], **kwargs)


# ---------------------------------------------------------------------------------------------
# Options: validated like every built-in's; completion_ids and max_new_tokens come from the trainer

@pytest.mark.parametrize("name, kwargs, expected", [
    ("overlong", {"max_len": 10}, {"max_len": "unknown option of reward 'overlong' (allowed: max_length, buffer)"}),
    ("think_format", {"tag": "t"}, {"tag": "unknown option of reward 'think_format' (allowed: think_tag, answer_tag)"}),
    ("repetition", {"n": 2}, {"n": "unknown option of reward 'repetition' (allowed: ngram, max_penalty)"}),
    ("overlong", {"max_length": "100"}, {"max_length": "reward 'overlong': must be int | None, got '100' (str)"}),
    ("overlong", {"buffer": 2.0}, {"buffer": "reward 'overlong': must be int | None, got 2.0 (float)"}),
    ("overlong", {"max_length": True}, {"max_length": "reward 'overlong': must be int | None, got True (bool)"}),
    ("overlong", {"max_length": 0}, {"max_length": "reward 'overlong': input should be greater than or equal to 1 (got 0)"}),
    ("overlong", {"buffer": -1}, {"buffer": "reward 'overlong': input should be greater than or equal to 0 (got -1)"}),
    ("overlong", {"max_length": 100, "buffer": 100},
     {"buffer": "reward 'overlong': buffer must be less than max_length (100), got 100"}),
    ("overlong", {"max_length": 100, "buffer": 150},
     {"buffer": "reward 'overlong': buffer must be less than max_length (100), got 150"}),
    ("think_format", {"think_tag": 5}, {"think_tag": "reward 'think_format': must be str, got 5 (int)"}),
    ("think_format", {"answer_tag": "<answer>"},
     {"answer_tag": "reward 'think_format': answer_tag must be a tag name (a letter, then letters, digits, '_' or '-'), "
                    "got '<answer>'"}),
    ("think_format", {"think_tag": "answer"},      # clashes with the default answer_tag
     {"answer_tag": "reward 'think_format': answer_tag must differ from think_tag, got 'answer' for both"}),
    ("repetition", {"ngram": "3"}, {"ngram": "reward 'repetition': must be int, got '3' (str)"}),
    ("repetition", {"ngram": 0}, {"ngram": "reward 'repetition': input should be greater than or equal to 1 (got 0)"}),
    ("repetition", {"max_penalty": "1"}, {"max_penalty": "reward 'repetition': must be float, got '1' (str)"}),
    ("repetition", {"max_penalty": 0.0}, {"max_penalty": "reward 'repetition': input should be greater than 0 (got 0.0)"}),
    ("repetition", {"max_penalty": float("inf")},
     {"max_penalty": "reward 'repetition': max_penalty must be a finite number, got inf"}),
])
def test_option_problems(name, kwargs, expected):
    assert dict(option_problems(name, kwargs)) == expected


@pytest.mark.parametrize("name, kwargs", [
    ("overlong", {"max_length": 100, "buffer": 99}), ("overlong", {"buffer": 4096}), ("overlong", {}),
    ("think_format", {"think_tag": "reasoning", "answer_tag": "final"}), ("think_format", {}),
    ("repetition", {"ngram": 1, "max_penalty": 2}), ("repetition", {}),
])
def test_valid_options(name, kwargs):
    assert option_problems(name, kwargs) == []


@pytest.mark.parametrize("key", ["completion_ids", "max_new_tokens"])
def test_trainer_passed_arguments_are_not_options(key):
    (option, msg), = option_problems("overlong", {key: 5})
    assert option == key and msg.startswith("reward 'overlong' is passed") and "trainer" in msg
    # a reward that is not passed it: just an unknown option
    assert option_problems("repetition", {key: 5}) == [
        (key, "unknown option of reward 'repetition' (allowed: ngram, max_penalty)")]


def test_recipe_validation_names_the_key_path():
    data = {"model": {"name_or_path": "m"}, "data": {"train_path": "t.jsonl"},
            "rewards": {"functions": [{"function": "math"},
                                      {"function": "overlong", "weight": 0.5,
                                       "kwargs": {"max_length": 64, "buffer": 64, "completion_ids": []}}]}}
    with pytest.raises(RecipeError) as info:
        recipe_from_dict(data)
    problems = dict(info.value.problems)
    assert set(problems) == {"rewards.functions.1.kwargs.buffer", "rewards.functions.1.kwargs.completion_ids"}


def test_builtin_flags_and_signatures():
    flags = {n: (BUILTINS[n].reads_answer, BUILTINS[n].reads_completion_ids, BUILTINS[n].reads_max_new_tokens)
             for n in SHAPING}
    assert flags == {"overlong": (False, True, True), "think_format": (False, False, False),
                     "repetition": (False, False, False)}
    fns = {"overlong": overlong_reward, "think_format": think_format_reward, "repetition": repetition_reward}
    for name, fn in fns.items():
        assert BUILTINS[name].function == f"lowmem_grpo.rewards.shaping:{fn.__name__}"
        params = inspect.signature(fn).parameters
        assert ("completion_ids" in params) == BUILTINS[name].reads_completion_ids
        assert ("max_new_tokens" in params) == BUILTINS[name].reads_max_new_tokens
        for option in option_names(BUILTINS[name].options):   # each option a keyword with the schema's default
            assert params[option].default == BUILTINS[name].options.model_fields[option].default
        assert "solved" in fn.__doc__ and "after a correctness reward" in fn.__doc__


def test_loaded_by_rewards_after_a_correctness_reward():
    cfg = recipe_from_dict({"model": {"name_or_path": "m"}, "data": {"train_path": "t.jsonl"},
                            "rewards": {"functions": [{"function": "exact"},
                                                      {"function": "think_format", "weight": 0.5},
                                                      {"function": "repetition", "kwargs": {"ngram": 1}}]}}).rewards
    rewards = Rewards(cfg, answer_field="answer")
    res = rewards(["<think>a</think><answer>5</answer>", "5"], ["p", "p"], [{"answer": "5"}] * 2)
    assert res.per_function["think_format"].tolist() == [1.0, 0.0]
    assert res.per_function["repetition"].tolist() == [0.0, 0.0]
    assert res.total.tolist() == [0.5, 1.0]


# ---------------------------------------------------------------------------------------------
# The README's reward options table (generated by scripts/gen_recipe_reference.py)

def test_options_in_the_reference_rows_and_readme():
    rows = {(label, option): meaning for label, option, _, _, meaning in option_reference()}
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for name in SHAPING:
        for option in option_names(BUILTINS[name].options):
            assert rows[(f"`{name}`", option)], (name, option)     # every option has a description
            assert f"| `{name}` | `{option}` |" in readme, (name, option)


# ---------------------------------------------------------------------------------------------
# Found by a red team: an environment's episodes against the one turn's limit, shaping rewards listed first,
# overlong options that can never punish, think_format under a chat template that opens the think block

def env_recipe(functions, **environment) -> dict:
    return {"model": {"name_or_path": "m"}, "data": {"train_path": "t.jsonl"},
            "rewards": {"functions": functions}, "generation": {"max_new_tokens": 16},
            "environment": {"name": "python", "max_turns": 2, "max_total_tokens": 48, **environment}}


def test_overlong_with_an_environment_measures_the_episode_against_max_total_tokens():
    """generation.max_new_tokens (16) caps one turn; environment.max_total_tokens (48) the episode, model and
    environment tokens, which is what completion_ids hold: a 22-token two-turn episode no limit cut scored -1
    against 16; it scores 0, and an episode the limit cut (48 tokens exactly) gets its -1 from the ramp's end."""
    rewards = Rewards.from_recipe(recipe_from_dict(env_recipe([{"function": "exact"}, {"function": "overlong"}])))
    episodes = [[1] * 11 + [2] * 6 + [3] * 5, [1] * 48, [1] * 40]   # L_max 48, L_cache 9: ramp from 39
    res = rewards(["7"] * 3, ["p"] * 3, [{"answer": "7"}] * 3, completion_ids=episodes, environment=[None] * 3)
    assert res.per_function["overlong"].tolist() == [0.0, -1.0, pytest.approx(-1 / 9)]
    assert overlong(22, 48, max_new_tokens=16, max_total_tokens=48) == [0.0, -1.0]
    assert overlong(22, max_new_tokens=16) == [-1.0]                        # without an environment: one turn's
    assert overlong(22, max_new_tokens=16, max_total_tokens=48, max_length=20) == [-1.0]   # an explicit L_max wins
    with pytest.raises(ValueError, match=r"\(48, null: environment.max_total_tokens = 48\), got 48"):
        overlong(1, max_new_tokens=16, max_total_tokens=48, buffer=48)


@pytest.mark.parametrize("functions, where", [
    (["overlong", "exact"], "('exact', rewards.functions.1)"),
    (["repetition", "think_format", "countdown"], "('countdown', rewards.functions.2)"),
    (["overlong", "tests.user_rewards:f"], "('tests.user_rewards:f', rewards.functions.1)"),
    (["repetition"], "list the task's reward first, then the shaping ones"),
    (["think_format", "math"], "('math', rewards.functions.1)"),
    (["format", "overlong", "exact"], "('exact', rewards.functions.2)"),
])
def test_a_shaping_reward_first_is_refused(functions, where):
    """The first function is the one "solved" is read from (a score >= 1): overlong and repetition never reach 1,
    think_format and format score the form of a wrong answer 1."""
    with pytest.raises(RecipeError) as info:
        recipe_from_dict({"model": {"name_or_path": "m"}, "data": {"train_path": "t.jsonl"},
                          "rewards": {"functions": [{"function": f} for f in functions]}})
    (key, msg), = info.value.problems
    assert key == "rewards.functions.0.function" and f"'{functions[0]}'" in msg and where in msg, msg
    assert 'the first function is the one "solved"' in msg


@pytest.mark.parametrize("functions", [["format"], ["think_format"], ["format", "overlong", "repetition"],
                                       ["exact", "overlong", "think_format"]])
def test_a_form_only_task_or_a_task_reward_first_is_accepted(functions):
    r = recipe_from_dict({"model": {"name_or_path": "m"}, "data": {"train_path": "t.jsonl"},
                          "rewards": {"functions": [{"function": f} for f in functions]}})
    assert Rewards(r.rewards, answer_field="answer", max_new_tokens=8).notes == []


def test_a_shaping_reward_first_before_a_user_function_or_an_environment_is_a_note(tmp_path, monkeypatch):
    """Where the task's reward may be a user function's or the environment's, the order is noted (validate, and the
    trainer's start-up lines), not refused."""
    from click.testing import CliRunner

    from lowmem_grpo.cli import main

    (tmp_path / "my_rewards.py").write_text("def score(completions, *, prompts, rows):\n"
                                            "    return [1.0] * len(completions)\n")
    (tmp_path / "t.jsonl").write_text('{"prompt": "p", "answer": "1"}\n')
    for functions, env in [(["think_format", "my_rewards:score"], False), (["overlong"], True), (["format"], True)]:
        data = env_recipe([{"function": f} for f in functions]) if env else {
            "model": {"name_or_path": "m"}, "data": {"train_path": "t.jsonl"},
            "rewards": {"functions": [{"function": f} for f in functions]}}
        data["data"]["train_path"] = str(tmp_path / "t.jsonl")
        (tmp_path / "r.yaml").write_text(yaml.safe_dump(data))
        monkeypatch.chdir(tmp_path)
        monkeypatch.syspath_prepend(str(tmp_path))
        res = CliRunner().invoke(main, ["validate", str(tmp_path / "r.yaml")])
        assert res.exit_code == 0, res.output
        note = f"note: rewards.functions.0: '{functions[0]}' "
        assert note in res.output and '"solved"' in res.output, res.output
        rewards = Rewards.from_recipe(recipe_from_dict(data))
        assert [n for n in rewards.notes if n.startswith(note)], rewards.notes


@pytest.mark.parametrize("kwargs, generation, environment, key, words", [
    ({"max_length": 4096, "buffer": 512}, 1024, None, "max_length", "4096 - 512 = 3584 tokens, and none is longer "
                                                                     "than generation.max_new_tokens (1024)"),
    ({"max_length": 2000}, 1024, None, "max_length", "2000 - 400 = 1600 tokens (null buffer: max_length // 5)"),
    ({}, 4, None, "buffer", "4 - 0 = 4 tokens (null buffer"),                 # a null buffer of a tiny limit: 0
    ({"max_length": 600, "buffer": 50}, 16, 512, "max_length", "environment.max_total_tokens (512)"),
    ({"buffer": 512}, 16, 512, "buffer", "must be less than max_length, here environment.max_total_tokens (512)"),
    ({"buffer": 16}, 16, None, "buffer", "must be less than max_length, here generation.max_new_tokens (16)"),
])
def test_overlong_options_that_can_never_punish_are_refused(kwargs, generation, environment, key, words):
    data = {"model": {"name_or_path": "m"}, "data": {"train_path": "t.jsonl"},
            "rewards": {"functions": [{"function": "exact"}, {"function": "overlong", "kwargs": kwargs}]},
            "generation": {"max_new_tokens": generation}}
    if environment:
        data["environment"] = {"name": "python", "max_total_tokens": environment}
    with pytest.raises(RecipeError) as info:
        recipe_from_dict(data)
    (found, msg), = info.value.problems
    assert found == f"rewards.functions.1.kwargs.{key}" and words in msg, msg


@pytest.mark.parametrize("kwargs, generation, environment", [
    ({"max_length": 2000, "buffer": 1000}, 1024, None),   # the ramp starts at 1000: a cut completion gets -0.024
    ({"max_length": 600}, 16, 512), ({}, 1024, None), ({}, 5, None), ({"max_length": 10, "buffer": 0}, 16, None),
])
def test_overlong_options_that_can_punish_are_accepted(kwargs, generation, environment):
    data = {"model": {"name_or_path": "m"}, "data": {"train_path": "t.jsonl"},
            "rewards": {"functions": [{"function": "exact"}, {"function": "overlong", "kwargs": kwargs}]},
            "generation": {"max_new_tokens": generation}}
    if environment:
        data["environment"] = {"name": "python", "max_total_tokens": environment}
    recipe_from_dict(data)


@pytest.mark.parametrize("prompt, completion, expected", [
    ("<|Assistant|><think>\n", "reasoning</think>\n<answer>5</answer>", 1.0),   # R1-distill: the template opens it
    ("<|Assistant|><think>\n", "<think>again</think><answer>5</answer>", 0.0),  # a second opening tag
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "<answer>5</answer>", 1.0),   # Qwen3 without thinking
    ("<|im_start|>assistant\n", "reasoning</think>\n<answer>5</answer>", 0.0),
    ("say <think> here<|im_start|>assistant\n", "<think>r</think><answer>5</answer>", 1.0),   # a tag mid-prompt: none
])
def test_think_format_reads_a_think_block_the_prompt_opened(prompt, completion, expected):
    assert think_format_reward([completion], prompts=[prompt]) == [expected]
