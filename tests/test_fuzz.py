"""Fuzzing the three doors user input comes through: recipes, dataset rows, reward-function outputs.

Each random input must be accepted, or rejected with the project's own error naming what is wrong
(RecipeError with key paths, DataError naming the row, RewardError naming the function); never any
other exception.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st
from pydantic import ValidationError

from lowmem_grpo import tiny
from lowmem_grpo.data import DataError, DataSettingsError, PromptSet
from lowmem_grpo.recipe import DataConfig, Recipe, RecipeError, RewardsConfig, load_recipe, recipe_from_dict
from lowmem_grpo.rewards import RewardError, Rewards

FUZZ = settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck))

SECTIONS = {name: sorted(f.annotation.model_fields) for name, f in Recipe.model_fields.items()
            if isinstance(f.annotation, type) and hasattr(f.annotation, "model_fields")}
ALL_KEYS = sorted({k for keys in SECTIONS.values() for k in keys} | set(Recipe.model_fields))

leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=True, allow_infinity=True),
                 st.text(max_size=12), st.sampled_from(["auto", "ref", "hf", "sign", "math", "1e-3", "-1", "true"]))
key = st.one_of(st.sampled_from(ALL_KEYS), st.text(max_size=8))
value = st.recursive(leaf, lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(key, inner, max_size=3)),
                     max_leaves=8)


def _section(name: str):
    keys = st.one_of(st.sampled_from(SECTIONS[name]), st.text(max_size=6))
    return st.dictionaries(keys, value, max_size=5)


reward_fn = st.fixed_dictionaries({"function": st.one_of(st.sampled_from(["math", "format", "x:y", ""]), value)},
                                  optional={"weight": value, "kwargs": value, "extra": value})
recipes = st.one_of(
    value,
    st.fixed_dictionaries({}, optional={**{name: st.one_of(_section(name), value) for name in SECTIONS},
                                        "seed": value, "bogus": value,
                                        "rewards": st.one_of(st.fixed_dictionaries({"functions": st.lists(reward_fn, max_size=3)}),
                                                             value)}),
)
SPECIAL = ("<top level>", "<yaml>", "<file>")


def _names_a_field(exc: RecipeError, data) -> None:
    assert exc.problems, exc
    for path, msg in exc.problems:
        assert isinstance(path, str) and path and isinstance(msg, str) and msg, exc.problems
        head = path.split(".")[0]
        given = {str(k) for k in data} | {repr(k) for k in data} if isinstance(data, dict) else set()
        named = any(path == k or path.startswith(k + ".") for k in given)  # keys may hold dots themselves
        assert path in SPECIAL or head in ("model", "data") or named, (path, data)


@FUZZ
@given(recipes)
def test_fuzz_recipe_dicts(data):
    try:
        r = recipe_from_dict(data)
    except RecipeError as exc:
        _names_a_field(exc, data)
    else:
        assert isinstance(r, Recipe) and r.model.name_or_path and r.data.train_path


@FUZZ
@given(recipes, st.lists(st.tuples(st.sampled_from(["train.steps", "output.tensorboard", "lora", "seed", "a.b.c", "x"]),
                                   st.text(max_size=8)), max_size=2),
       st.booleans())
def test_fuzz_recipe_yaml_text(tmp_path_factory, data, overrides, garble):
    path = tmp_path_factory.getbasetemp() / "fuzz.yaml"
    try:
        text = yaml.safe_dump(data)
    except yaml.YAMLError:
        return
    if garble:  # a hand-edited file: cut mid-way and a stray indent
        text = text[: len(text) // 2] + "\n  : [\n" + text[len(text) // 2:]
    path.write_text(text)
    try:
        load_recipe(path, [f"{k}={v}" for k, v in overrides])
    except RecipeError as exc:
        assert exc.problems and all(isinstance(p, str) and p for p, _ in exc.problems)


TOK = tiny.build_tokenizer()
row_value = st.one_of(leaf, st.lists(leaf, max_size=3), st.dictionaries(st.text(max_size=4), leaf, max_size=2),
                      st.text(alphabet=st.characters(codec="utf-8"), max_size=30))
rows = st.dictionaries(st.one_of(st.sampled_from(["prompt", "answer", "question", "x"]), st.text(max_size=5), st.integers()),
                       row_value, max_size=5)
templates = st.one_of(st.just("{prompt}"), st.sampled_from(["Q: {question}\nA:", "{prompt} {x[0]}", "{prompt.real}", "{0}",
                                                            "{prompt!r:>5}", "{", "}{", "{prompt:d}", "{x[a][b]}"]),
                      st.text(max_size=12))


@FUZZ
@given(rows, templates, st.booleans(), st.integers(1, 40))
def test_fuzz_dataset_rows(row, template, chat, max_tokens):
    try:
        cfg = DataConfig(train_path="fuzz.jsonl", template=template, chat_template=chat, max_prompt_tokens=max_tokens)
    except ValidationError as exc:  # a template no row could fill: a recipe error naming data.template
        assert "template" in str(exc), str(exc)
        return
    try:
        ps = PromptSet("fuzz.jsonl", cfg, TOK, rows=[row])
    except DataSettingsError as exc:   # a setting no row can meet: the file and the setting, no row
        assert "fuzz.jsonl" in str(exc) and "data.chat_template" in str(exc), str(exc)
    except DataError as exc:
        assert "fuzz.jsonl" in str(exc) and "row 1" in str(exc), str(exc)
    else:
        (ex,) = ps.examples
        assert ex.row is row and 0 < len(ex.prompt_ids) <= max_tokens and isinstance(ex.prompt_text, str)


class _Weird:
    def __float__(self):
        raise ValueError("no float for you")


number = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True), st.integers(-2**70, 2**70), st.booleans(),
                   st.text(max_size=3), st.just(_Weird()), st.complex_numbers(max_magnitude=10), st.just(np.float32("nan")),
                   st.just(np.int64(3)), st.just(torch.tensor(1.0)), st.just(np.array([1.0, 2.0])))
outputs = st.one_of(
    st.lists(number, min_size=0, max_size=6),
    st.lists(st.one_of(number, st.lists(number, max_size=2)), max_size=6),
    number, st.text(max_size=6), st.dictionaries(st.text(max_size=3), number, max_size=4),
    st.lists(st.floats(), min_size=0, max_size=6).map(lambda xs: torch.tensor(xs, dtype=torch.float64)),
    st.lists(st.floats(), min_size=0, max_size=6).map(lambda xs: np.array(xs, dtype=np.float64)),
    st.lists(st.floats(), min_size=4, max_size=4).map(lambda xs: torch.tensor(xs).view(2, 2)),
    st.lists(st.floats(), min_size=4, max_size=4).map(lambda xs: np.array(xs).reshape(2, 2)),
    st.lists(number, min_size=4, max_size=4).map(lambda xs: np.array(xs, dtype=object)),
)


@FUZZ
@given(outputs, st.sampled_from(["raise", "zero"]))
def test_fuzz_reward_outputs(out, on_error):
    rewards = Rewards(RewardsConfig(functions=[{"function": "math"}], on_error=on_error), answer_field="answer")
    rewards.functions = [("fuzz", lambda completions, **kw: out, 1.0, {})]  # the wrapper around a user function
    try:
        res = rewards(["a", "b", "c", "d"], ["p"] * 4, [{"answer": "1"}] * 4)
    except RewardError as exc:
        assert on_error == "raise" and "reward 'fuzz'" in str(exc), str(exc)
    else:
        t = res.per_function["fuzz"]
        assert t.shape == (4,) and t.dtype == torch.float64
        assert all(math.isnan(v) or math.isfinite(v) for v in t.tolist())
        if on_error == "zero" and res.errors:
            assert res.errors == {"fuzz": 4} and t.tolist() == [0.0] * 4
