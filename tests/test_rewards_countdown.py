"""Countdown reward: one test per rule, the safe evaluator, the generator and the shipped instances."""

from __future__ import annotations

import importlib.util
import json
from fractions import Fraction
from pathlib import Path

import pytest

from lowmem_grpo.rewards.countdown import (countdown_reward, evaluate, extract_expression, generate_countdown,
                                           score_expression)

ROOT = Path(__file__).resolve().parent.parent
ROW = {"numbers": [25, 5, 4, 3], "target": 80}


def score(completion, row=ROW, **kw):
    return countdown_reward([completion], prompts=[""], rows=[row], **kw)[0]


def test_correct_expression_scores_one():
    assert score("<answer>(25 - 5) * 4</answer>") == 1.0
    assert score("<answer>25 * 4 - 5 * 3 - 5</answer>") == 0.0     # 5 used twice, listed once


def test_wrong_value_scores_zero():
    assert score("<answer>(25 - 5) * 3</answer>") == 0.0


def test_only_given_numbers():
    assert score("<answer>(25 - 5) * 4 + 0</answer>") == 0.0        # 0 is not in the list
    assert score("<answer>20 * 4</answer>") == 0.0                  # 20 is not in the list


def test_each_number_at_most_as_often_as_listed():
    assert score("<answer>25 + 25 + 25 + 5</answer>") == 0.0
    assert score("<answer>25 + 25 + 25 + 5</answer>", {"numbers": [25, 25, 25, 5], "target": 80}) == 1.0


def test_not_every_number_must_be_used_unless_use_all():
    assert score("<answer>(25 - 5) * 4</answer>") == 1.0
    assert score("<answer>(25 - 5) * 4</answer>", use_all=True) == 0.0
    assert score("<answer>(25 - 5) * (4 + 3) - 60</answer>", use_all=True) == 0.0           # 60 not given
    assert score("<answer>(25 * 3 + 5) * 4 / 4</answer>", {"numbers": [25, 3, 5, 4, 4], "target": 80},
                 use_all=True) == 1.0


@pytest.mark.parametrize("expression", ["2 ** 3 * 10", "25 // 5 * 16", "25 % 5 + 80", "abs(-80)",
                                        "__import__('os').getpid()", "80.0", "8e1", "[80][0]", "(lambda: 80)()",
                                        "25 if 5 else 4", "True * 80", "5 << 4"])
def test_only_arithmetic_is_allowed(expression):
    row = {"numbers": [2, 3, 10, 25, 5, 16, 80, 0, 4, 1], "target": 80}
    assert score(f"<answer>{expression}</answer>", row) == 0.0


def test_division_is_exact_rational_arithmetic():
    assert score("<answer>7 / 2 * 2</answer>", {"numbers": [7, 2, 2], "target": 7}) == 1.0
    assert score("<answer>(3 + 3 / 7) * 7</answer>", {"numbers": [3, 3, 7, 7], "target": 24}) == 1.0
    assert score("<answer>7 / 2</answer>", {"numbers": [7, 2], "target": 3}) == 0.0         # 3.5, not 3
    assert score("<answer>4 / (5 - 5)</answer>", {"numbers": [4, 5, 5], "target": 0}) == 0.0


def test_unary_minus_and_parentheses():
    assert score("<answer>-(4 - 25) * 5 - 25</answer>", {"numbers": [4, 25, 5, 25], "target": 80}) == 1.0
    assert evaluate("-(3 - 10)") == (Fraction(7), [3, 10])


def test_answer_tag_wins_and_the_last_one_counts():
    text = "Try <answer>25 * 3</answer>... no. Final: <answer>(25 - 5) * 4</answer>\n25 * 3"
    assert extract_expression(text) == "(25 - 5) * 4"
    assert score(text) == 1.0


def test_last_expression_line_without_tags():
    text = "We need 80.\n25 - 5 = 20, and 20 * 4 = 80.\n(25 - 5) * 4 = 80\nThat's it!"
    assert extract_expression(text) == "(25 - 5) * 4"
    assert score(text) == 1.0
    assert score("The answer is eighty.") == 0.0
    assert score("80") == 0.0       # a lone number is no expression


def test_unicode_operators_and_an_equation_form():
    assert score("<answer>(25 \u2212 5) \u00d7 4</answer>") == 1.0
    assert score("<answer>80 = (25 - 5) * 4</answer>") == 1.0


def test_long_or_deep_expressions_are_rejected_not_crashing():
    deep = "(" * 500 + "25" + ")" * 500
    assert score(f"<answer>{deep}</answer>") == 0.0
    assert score_expression("+".join(["25"] * 200), [25] * 200, 5000) == 0.0   # over the length cap


def test_no_eval(tmp_path):
    marker = tmp_path / "executed"
    attack = f"<answer>__import__('pathlib').Path({str(marker)!r}).touch()</answer>"
    assert score(attack) == 0.0
    assert not marker.exists()


@pytest.mark.parametrize("row", [{"numbers": [], "target": 3}, {"numbers": None, "target": 3},
                                 {"numbers": "1 2", "target": 3}, {"numbers": [1, "2"], "target": 3},
                                 {"numbers": [1, 2], "target": 3.0}, {"numbers": [True, 2], "target": 3},
                                 {"numbers": [1, 2], "target": "3"}, None])
def test_malformed_rows_are_skipped(row):
    assert score("<answer>1 + 2</answer>", row) is None


@pytest.mark.parametrize("row, option, field", [({}, "numbers_field", "numbers"),
                                                ({"target": 3}, "numbers_field", "numbers"),
                                                ({"numbers": [1, 2]}, "target_field", "target")])
def test_a_row_without_the_field_is_an_error_naming_it(row, option, field):
    """A field the row does not have at all is a recipe's field name the data does not use: an error naming it, the
    option and the row's fields, not a skip of every completion (found by a red team)."""
    with pytest.raises(ValueError) as info:
        score("<answer>1 + 2</answer>", row)
    have = ", ".join(sorted(row)) or "nothing"
    assert str(info.value) == (f"countdown reward: the row has no field {field!r} ({option}; the row has: {have}): set "
                               f"rewards.functions[].kwargs.{option} to the row's field")


def test_rows_required():
    with pytest.raises(ValueError):
        countdown_reward(["1 + 2"])


# ---------------------------------------------------------------------------------------------
# Generator and shipped data

def test_generator_is_deterministic_and_solvable():
    a, b = generate_countdown(50, seed=7), generate_countdown(50, seed=7)
    assert a == b and a != generate_countdown(50, seed=8)
    for inst in a:
        assert 3 <= len(inst["numbers"]) <= 4 and inst["target"] not in inst["numbers"]
        assert 10 <= inst["target"] <= 999
        assert countdown_reward([f"<answer>{inst['solution']}</answer>"], rows=[inst]) == [1.0]
        assert str(inst["target"]) in inst["prompt"]


def test_shipped_countdown_file_matches_its_generator():
    spec = importlib.util.spec_from_file_location("make_data", ROOT / "scripts" / "make_data.py")
    make_data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_data)
    text = (ROOT / "data" / "countdown.jsonl").read_text(encoding="utf-8")
    assert text == make_data.render(make_data.countdown())
    rows = [json.loads(line) for line in text.splitlines()]
    assert len(rows) >= 200
    solutions = [f"Reasoning...\n<answer>{r['solution']}</answer>" for r in rows]
    assert countdown_reward(solutions, rows=rows) == [1.0] * len(rows)
    off_by_one = [{**r, "target": r["target"] + 1} for r in rows]
    assert countdown_reward(solutions, rows=off_by_one) == [0.0] * len(rows)


def test_field_names_follow_the_dataset():
    """Jiayi-Pan/Countdown-Tasks-3to4 names its numbers `nums`: the kwargs map the columns."""
    row = {"nums": [4, 6, 1], "target": 24}
    assert countdown_reward(["<answer>4 * 6 * 1</answer>"], rows=[row], numbers_field="nums") == [1.0]
    with pytest.raises(ValueError, match=r"no field 'numbers' \(numbers_field; the row has: nums, target\)"):
        countdown_reward(["<answer>4 * 6 * 1</answer>"], rows=[row])   # no `numbers`: an error, not a skip
    assert countdown_reward(["<answer>4 * 6</answer>"], rows=[{"n": [4, 6, 1], "t": 24}], numbers_field="n",
                            target_field="t", use_all=True) == [0.0]


@pytest.mark.parametrize("answer", ["(25 - 5) * 4.", "\\left(25 - 5\\right) * 4", "(25 - 5) \u00b7 4", "(25 - 5) \u22c5 4",
                                    "(25 - 5) \u00d7 4", "(25 - 5) \\times 4", "(25 - 5) \\cdot 4", "`(25 - 5) * 4`",
                                    "`(25 - 5) * 4`.", "$(25 - 5) * 4$.", "\\((25 - 5) * 4\\)", "```\n(25 - 5) * 4\n```",
                                    "(25 - 5) * 4 = 80.", "\\left(25 - 5\\right) \\times 4 = 80."])
def test_harmless_formatting_is_accepted(answer):
    """F8 (red team): a final period, \\left( \\right), the middle dot, backticks: each scored 0 for a right
    expression. Tagged or on the last line, they are read as the plain expression."""
    assert score(f"<answer>{answer}</answer>") == 1.0
    assert score(f"We need 80.\n{answer}\n") == 1.0


@pytest.mark.parametrize("answer", ["(25 - 5) ** 4.", "25 // 5 * 16.", "`(25 - 5) * 4.0`", "(25 - 5) * 4 * 4.",
                                    "`20 * 4`", "4 / (5 - 5).", "(25 - 5) \\cdot\\cdot 4", "(25 - 5) \u00d7\u00d7 4",
                                    "25 \\div\\div 5", "\\left[25 - 5\\right] * 4", "`(25 - 5) * 3`."])
def test_formatting_never_changes_the_arithmetic(answer):
    row = {"numbers": [25, 5, 4, 16, 3], "target": 80}
    assert score(f"<answer>{answer}</answer>", row) == 0.0


def test_the_expression_after_the_reasoning_wins():
    """As for the math reward: after a closing </think>, a draft inside the reasoning is no answer."""
    assert score("<think><answer>(25 - 5) * 4</answer></think><answer>25 * 3</answer>") == 0.0
    assert score("<think><answer>25 * 3</answer></think>\n<answer>(25 - 5) * 4</answer>") == 1.0
    assert score("<think>\n(25 - 5) * 4\n</think>\nI give up.") == 0.0
    assert score("<think><answer>(25 - 5) * 4</answer></think> no idea") == 0.0
    assert score("<think>\n25 * 3\n</think>\n(25 - 5) * 4\n") == 1.0


@pytest.mark.parametrize("kwargs, key, says", [
    ({}, "rewards.functions.0.kwargs.numbers_field",
     "names the row field 'numbers', which none of its 3 rows has, in {path} (they have: nums, prompt, target)"),
    ({"numbers_field": "nums", "target_field": "goal"}, "rewards.functions.0.kwargs.target_field",
     "names the row field 'goal', which none of its 3 rows has"),
    ({"numbers_field": "prompt"}, "rewards.functions.0.function",
     "countdown: none of its 3 rows in {path} has numbers (field 'prompt') as a non-empty list of integers and a "
     "target (field 'target') as an integer, so every completion would be skipped (row 1: prompt='Use 1, 2' (str), "
     "target=3 (int))"),
])
def test_validate_refuses_countdown_fields_the_data_does_not_have(tmp_path, kwargs, key, says):
    """Found by a red team: the hub's `nums` with the default numbers_field 'numbers' validated ok, and then every
    completion was skipped without a word."""
    from click.testing import CliRunner

    from lowmem_grpo.cli import main

    data = tmp_path / "cd.jsonl"
    data.write_text("".join(json.dumps({"prompt": "Use 1, 2", "nums": [1, 2], "target": 3}) + "\n" for _ in range(3)))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(json.dumps({"model": {"name_or_path": "m"}, "data": {"train_path": str(data)},
                                  "rewards": {"functions": [{"function": "countdown", "kwargs": kwargs}]}}))
    res = CliRunner().invoke(main, ["validate", str(recipe)])
    assert res.exit_code == 2 and f"{key}: {says.format(path=data)}" in res.output, res.output
    assert "Traceback" not in res.output
    ok = dict(kwargs, numbers_field="nums", target_field="target")
    res = CliRunner().invoke(main, ["validate", str(recipe), "--set", f"rewards.functions.0.kwargs={json.dumps(ok)}"])
    assert res.exit_code == 0, res.output
