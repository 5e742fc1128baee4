"""Built-in rewards' typed options: `validate` names a misspelt or ill-typed option with its key path, the
reward and the allowed options; valid options take effect; the answer field is data.answer_field alone; a
user function's kwargs must fit its signature; the README's reward options table is generated from the schemas."""

import inspect
import marshal
import os
import subprocess
import sys
from importlib import util
from pathlib import Path
from typing import Optional

import pytest
import yaml
from click.testing import CliRunner

from lowmem_grpo.cli import main
from lowmem_grpo.recipe import RecipeError, recipe_from_dict
from lowmem_grpo.rewards import RewardError, Rewards, calling_convention, resolve
from lowmem_grpo.rewards import code as code_module
from lowmem_grpo.rewards.options import BUILTINS, PASSED_BY_TRAINER, option_names
from lowmem_grpo.rewards.sandbox import SandboxLimits, SandboxResult, run_python

ROOT = Path(__file__).resolve().parent.parent
MIN = {"model": {"name_or_path": "m"}, "data": {"train_path": "t.jsonl"}}


def recipe(*functions, **sections) -> dict:
    return {**MIN, "rewards": {"functions": list(functions)}, **sections}


def problems(data) -> dict:
    with pytest.raises(RecipeError) as info:
        recipe_from_dict(data)
    return dict(info.value.problems)


def allowed(name: str) -> str:
    names = option_names(BUILTINS[name].options)
    return f"allowed: {', '.join(names)}" if names else "it takes no options"


def load(*functions, answer_field: str = "answer") -> Rewards:
    return Rewards(recipe_from_dict(recipe(*functions)).rewards, answer_field=answer_field)


# ---------------------------------------------------------------------------------------------
# Unknown and ill-typed options are validate errors

MISSPELT = {"math": "extrct", "format": "patern", "exact": "patern", "code": "timout",
            "code_binary": "tests_feild", "code_io": "float_tolerence", "code_io_binary": "max_case",
            "countdown": "use_al", "overlong": "max_len",
            "think_format": "think_tga", "repetition": "n_gram"}


def test_every_builtin_has_a_case():
    assert set(MISSPELT) == set(BUILTINS) and set(ILL_TYPED) | {"exact"} == set(BUILTINS)


@pytest.mark.parametrize("name", sorted(MISSPELT))
def test_validate_names_a_misspelt_option(name, tmp_path):
    key = MISSPELT[name]
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe({"function": "math"}, {"function": name, "kwargs": {key: 1}})))
    res = CliRunner().invoke(main, ["validate", str(path)])
    assert res.exit_code == 2, res.output
    assert f"rewards.functions.1.kwargs.{key}: unknown option of reward '{name}' ({allowed(name)})" in res.output
    assert "Traceback" not in res.output


# option, ill-typed value, the allowed type the message names
ILL_TYPED = {"math": ("workers", "two", "int"), "format": ("pattern", 5, "str"),
             "code": ("total_timeout", "long", "float | None"), "code_binary": ("hide_paths", ["/x", 1], "list[str] | None"),
             "code_io": ("max_cases", "all", "int | None"), "code_io_binary": ("float_tolerance", "1e-6", "float"),
             "countdown": ("use_all", "yes", "bool"), "overlong": ("buffer", 0.5, "int | None"),
             "think_format": ("answer_tag", None, "str"), "repetition": ("ngram", 2.0, "int")}


@pytest.mark.parametrize("name", sorted(ILL_TYPED))
def test_validate_names_an_ill_typed_option_and_its_type(name):
    key, value, typ = ILL_TYPED[name]
    p = problems(recipe({"function": name, "kwargs": {key: value}}))
    assert p == {f"rewards.functions.0.kwargs.{key}":
                 f"reward '{name}': must be {typ}, got {value!r} ({type(value).__name__})"}


@pytest.mark.parametrize("name, kwargs, words", [
    ("math", {"workers": -1}, ["greater than or equal to 0", "got -1"]),
    ("math", {"extract": "boxed,guess"}, ["'guess'", "boxed, answer_tag, hashes, last_number"]),
    ("format", {"pattern": "(<answer>"}, ["not a valid regular expression"]),
    ("code", {"memory_mb": 0}, ["greater than or equal to 1", "got 0"]),
    ("code", {"timeout": 0}, ["greater than 0"]),
])
def test_out_of_range_and_invalid_values(name, kwargs, words):
    (key, msg), = problems(recipe({"function": name, "kwargs": kwargs})).items()
    assert key == f"rewards.functions.0.kwargs.{next(iter(kwargs))}" and msg.startswith(f"reward '{name}': ")
    assert all(w in msg for w in words), msg


def test_yaml_values_are_not_coerced():
    # strict: the string 'false' would otherwise become False, and 2.0 workers an int
    assert "must be bool" in problems(recipe({"function": "countdown", "kwargs": {"use_all": "false"}}))[
        "rewards.functions.0.kwargs.use_all"]
    assert "must be int" in problems(recipe({"function": "code", "kwargs": {"workers": 2.5}}))[
        "rewards.functions.0.kwargs.workers"]


def test_all_problems_at_once_with_the_rest_of_the_recipe():
    p = problems(recipe({"function": "math", "kwargs": {"extrct": "boxed", "timeout": "slow"}},
                        {"function": "countdown", "weight": "heavy", "kwargs": {"use_all": 1}},
                        train={"steps": 0}))
    assert set(p) == {"rewards.functions.0.kwargs.extrct", "rewards.functions.0.kwargs.timeout",
                      "rewards.functions.1.weight", "rewards.functions.1.kwargs.use_all", "train.steps"}


@pytest.mark.parametrize("name", [n for n, b in BUILTINS.items() if b.reads_answer])
def test_answer_field_as_a_reward_kwarg_points_to_data(name):
    msg = problems(recipe({"function": name, "kwargs": {"answer_field": "solution"}}))[
        "rewards.functions.0.kwargs.answer_field"]
    assert f"reward '{name}'" in msg and "data.answer_field" in msg


def test_answer_field_on_a_reward_that_does_not_read_it_is_unknown():
    msg = problems(recipe({"function": "countdown", "kwargs": {"answer_field": "target"}}))[
        "rewards.functions.0.kwargs.answer_field"]
    assert "unknown option of reward 'countdown'" in msg and allowed("countdown") in msg


def test_validate_does_not_import_torch(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe({"function": "math", "kwargs": {"extrct": 1}})))
    code = ("import sys\nfrom lowmem_grpo.cli import main\ntry:\n    main(['validate', sys.argv[1]])\n"
            "except SystemExit as exc:\n    print('exit', exc.code, 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "exit 2 False", out.stdout + out.stderr
    assert "kwargs.extrct: unknown option of reward 'math'" in out.stderr


# ---------------------------------------------------------------------------------------------
# Valid options pass and take effect

def test_format_pattern_changes_the_score():
    done = ["<answer>5</answer>", "5"]
    assert load({"function": "format"})(done, ["p"] * 2, [{}] * 2).total.tolist() == [0.0, 1.0]
    tagged = load({"function": "format", "kwargs": {"pattern": "^<answer>.*</answer>$"}})
    assert tagged(done, ["p"] * 2, [{}] * 2).total.tolist() == [1.0, 0.0]


def test_math_extract_and_the_answer_field_from_data():
    rows = [{"solution": "7", "answer": "8"}] * 2
    completions = ["so 7", "\\boxed{8} then 7"]
    # default extractors: a box wins over the last number; the gold answer is data.answer_field's
    assert load({"function": "math"}, answer_field="solution")(completions, ["p"] * 2, rows).total.tolist() == [1.0, 0.0]
    last = load({"function": "math", "kwargs": {"extract": ["last_number"], "workers": 0}}, answer_field="solution")
    assert last(completions, ["p"] * 2, rows).total.tolist() == [1.0, 1.0]
    assert load({"function": "math"}, answer_field="answer")(completions, ["p"] * 2, rows).total.tolist() == [0.0, 1.0]


def test_exact_reads_data_answer_field():
    rows = [{"gold": "7", "answer": "8"}]
    assert load({"function": "exact"}, answer_field="gold")(["7"], ["p"], rows).total.tolist() == [1.0]
    assert load({"function": "exact"}, answer_field="answer")(["7"], ["p"], rows).total.tolist() == [0.0]


def test_countdown_fields_and_use_all():
    rows = [{"nums": [2, 3, 4], "goal": 6}]
    plain = load({"function": "countdown", "kwargs": {"numbers_field": "nums", "target_field": "goal"}})
    assert plain(["<answer>2 * 3</answer>"], ["p"], rows).total.tolist() == [1.0]
    strict = load({"function": "countdown", "kwargs": {"numbers_field": "nums", "target_field": "goal", "use_all": True}})
    assert strict(["<answer>2 * 3</answer>"], ["p"], rows).total.tolist() == [0.0]
    with pytest.raises(RewardError, match="reward 'countdown' raised ValueError: countdown reward: the row has no "
                                          r"field 'numbers' \(numbers_field; the row has: goal, nums\)"):
        load({"function": "countdown"})(["<answer>2 * 3</answer>"], ["p"], rows)   # default fields: not in the row


@pytest.mark.parametrize("name", ["code", "code_binary"])
def test_code_options_reach_the_sandbox(name, monkeypatch):
    """tests_field picks the row's tests; the sandbox options arrive at run_python as one SandboxLimits."""
    seen = []

    def fake_run_python(code, timeout_s, *, stdin, limits):
        job = marshal.loads(stdin)
        seen.append((limits, job["tests"], job["timeout"]))
        lines = f"{job['nonce']} ready 1\n" + "".join(f"{job['nonce']} {i} value [\"I\",\"1\"]\n"
                                                     for i in range(len(job["tests"])))
        return SandboxResult(returncode=0, stdout=lines, stderr="", timed_out=False, killed_reason=None)

    monkeypatch.setattr(code_module, "run_python", fake_run_python)
    rewards = load({"function": name, "kwargs": {"tests_field": "checks", "timeout": 1.5, "memory_mb": 256,
                                                 "hide_paths": [], "namespaces": False, "workers": 1,
                                                 "allow_weak_sandbox": True}})
    res = rewards(["def f():\n    return 1"], ["p"], [{"checks": ["assert f() == 1"], "tests": ["assert False"]}])
    assert res.total.tolist() == [1.0]
    (limits, tests, timeout), = seen
    assert tests == [{"kind": "value", "src": "f()"}] and timeout == 1.5   # the literal stays with the trainer
    assert isinstance(limits, SandboxLimits) and limits.memory_mb == 256 and limits.hide_paths == []
    assert limits.namespaces is False and limits.max_procs == SandboxLimits().max_procs


# ---------------------------------------------------------------------------------------------
# One declaration: signatures agree with the schemas; the sandbox limits are declared once

@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_builtin_signature_matches_its_schema(name):
    spec = BUILTINS[name]
    params = inspect.signature(resolve(name)).parameters
    named = {n: p.default for n, p in params.items()
             if p.kind is p.KEYWORD_ONLY
             and n not in ("prompts", "rows", *PASSED_BY_TRAINER)}
    schema = spec.options.model_fields
    rest = set(schema) - set(named)
    assert set(named) <= set(schema), named
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):   # the code rewards: the rest are the sandbox's
        assert rest == set(SandboxLimits.model_fields)
    else:
        assert not rest, rest
    for n, default in named.items():
        want = schema[n].default
        assert (list(default) if isinstance(default, tuple) else default) == want, (name, n)
    assert ("answer_field" in params) == spec.reads_answer
    assert ("completion_ids" in params) == spec.reads_completion_ids
    assert ("max_new_tokens" in params) == spec.reads_max_new_tokens
    assert ("max_total_tokens" in params) == spec.reads_max_new_tokens   # (with an environment on)


def test_sandbox_limits_are_declared_once():
    assert issubclass(BUILTINS["code"].options, SandboxLimits)
    assert not set(inspect.signature(run_python).parameters) & set(SandboxLimits.model_fields)
    with pytest.raises(TypeError, match="memry_mb.*allowed: memory_mb"):
        run_python("print(1)", 5, memry_mb=256)     # refused before anything runs
    assert SandboxLimits.of(SandboxLimits(memory_mb=256), cpu_s=2) == SandboxLimits(memory_mb=256, cpu_s=2)


# ---------------------------------------------------------------------------------------------
# Rewards re-checks at load; user functions' kwargs fit their signatures

def strict_reward(completions, *, prompts, rows, bonus: float = 1.0):
    return [bonus] * len(completions)


def rowless_reward(completions, *, prompts):
    return [0.0] * len(completions)


def test_rewards_rechecks_builtin_options():
    r = recipe_from_dict(recipe({"function": "format"}))
    r.rewards.functions[0].kwargs["patern"] = "x"      # changed after validation
    with pytest.raises(RewardError, match=r"rewards\.functions\.0\.kwargs\.patern: unknown option of reward 'format'"):
        Rewards(r.rewards, answer_field="answer")


def test_user_function_kwargs_fit_its_signature():
    ok = load({"function": "test_reward_options:strict_reward", "kwargs": {"bonus": 2.0}})
    assert ok(["a"], ["p"], [{}]).total.tolist() == [2.0]
    r = recipe_from_dict(recipe({"function": "test_reward_options:strict_reward", "kwargs": {"bonsu": 2.0}}))
    with pytest.raises(RewardError) as info:       # validate cannot know; loading the function can
        Rewards(r.rewards, answer_field="answer")
    msg = str(info.value)
    assert "rewards.functions.0.kwargs.bonsu" in msg and "'test_reward_options:strict_reward'" in msg and "bonus" in msg


def test_a_parameter_no_call_fills_is_named_before_the_run():
    """Found by an audit: `def f(completions, *, prompts, rows, alpha)` passed validate, then failed the first step
    ("missing 1 required keyword-only argument"). It is a problem of the recipe entry now, and with alpha given
    in its kwargs the function runs."""
    with pytest.raises(RewardError, match=r"rewards\.functions\.0\.kwargs: reward 'user_rewards:needs_alpha' requires "
                                          r"alpha, which no call passes: give it in this function's kwargs, or a default"):
        load({"function": "user_rewards:needs_alpha"})
    assert load({"function": "user_rewards:needs_alpha", "kwargs": {"alpha": 0.5}})(["a"], ["p"], [{}]).total.tolist() \
        == [0.5]


def test_user_function_with_var_kwargs_takes_any_option():
    rewards = load({"function": "user_rewards:digit_count", "kwargs": {"per_digit": 1.0, "anything": 1}})
    assert rewards(["a1b2"], ["p"], [{}]).total.tolist() == [2.0]


def test_user_function_must_take_what_every_call_passes():
    # (without a `rows` parameter the auto rule calls it TRL's way: lowmem-grpo's convention is asked for here)
    with pytest.raises(RewardError, match=r"rewards\.functions\.0\.function: .*rowless_reward.* rows"):
        load({"function": "test_reward_options:rowless_reward", "convention": "lowmem"})
    with pytest.raises(RewardError, match=r"kwargs\.rows: .*passed by the trainer"):
        load({"function": "user_rewards:digit_count", "kwargs": {"rows": []}})


def typed_reward(completions, *, prompts, rows, tolerance: int = 5, scale: Optional[float] = None):
    return [float(tolerance)] * len(completions)


def trl_typed_reward(completions, tolerance: int = 5, **kwargs):
    return [float(tolerance)] * len(completions)


def test_validate_checks_reward_kwargs_against_simple_annotations(tmp_path):
    """Found by an audit: `tolerance: abc` for an int parameter passed validate, while environment kwargs were
    checked. One rule for both (user_code.kwargs_type_problems), in either calling convention; YAML's 3 for a
    float is fine."""
    fn = "test_reward_options:typed_reward"
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe({"function": fn, "kwargs": {"tolerance": "abc", "scale": 3}})))
    res = CliRunner().invoke(main, ["validate", str(path)])
    assert res.exit_code == 2, res.output
    assert f"rewards.functions.0.kwargs.tolerance: reward '{fn}' takes tolerance as int, got 'abc' (str)" in res.output
    assert "kwargs.scale" not in res.output and "Traceback" not in res.output
    assert load({"function": fn, "kwargs": {"tolerance": 2, "scale": 3}})(["a"], ["p"], [{}]).total.tolist() == [2.0]
    assert calling_convention("t", trl_typed_reward, kwargs={"tolerance": 1.5}) == \
        ("trl", [("kwargs.tolerance", "reward 't' takes tolerance as int, got 1.5 (float)")])


def test_an_unfound_module_says_where_python_looked(tmp_path, monkeypatch):
    """Found by an audit: "cannot import module 'my_rewards'" did not say where Python looked or how to fix it. A
    module that imports a missing one gets no such hint: the module itself was found."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RewardError) as info:
        load({"function": "absent_rewards_module:f"})
    assert (f"No module named 'absent_rewards_module' (searched the Python path and the current folder {os.getcwd()}: "
            "run from the folder that holds absent_rewards_module.py, or add that folder to PYTHONPATH)") \
        in str(info.value)
    (tmp_path / "needs_a_missing_one.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardError) as info:
        load({"function": "needs_a_missing_one:f"})
    assert "No module named 'no_such_dependency_xyz'" in str(info.value) and "searched" not in str(info.value)


# ---------------------------------------------------------------------------------------------
# README

def reward_templates() -> dict[str, str]:
    """Where the lowmem convention's template signature is shown -> its code (a def whose body is `...`)."""
    from lowmem_grpo import rewards
    from lowmem_grpo.rewards import conventions

    readme = (ROOT / "README.md").read_text(encoding="utf-8").split("Your own: `rewards.functions:", 1)[1]
    found = {"README.md": readme.split("```python\n", 1)[1].split("```", 1)[0]}
    for where, doc in (("rewards/__init__.py", rewards.__doc__), ("rewards/conventions.py", conventions.__doc__)):
        found[where] = next(line.strip() for line in doc.splitlines() if line.strip().startswith("def ")) + ": ..."
    return found


@pytest.mark.parametrize("where", ["README.md", "rewards/__init__.py", "rewards/conventions.py"])
def test_the_reward_templates_refuse_a_misspelt_kwarg(where):
    """Found by an audit: the templates ended in **kwargs, which took a misspelt `tolerence: 3` silently (the run
    used the default). Copied as they stand, a misspelt kwarg is an error naming it."""
    namespace: dict = {}
    exec(reward_templates()[where], namespace)
    fn = next(v for k, v in namespace.items() if callable(v) and not k.startswith("__"))
    assert calling_convention("mine:f", fn, kwargs={"tolerence": 3}) == \
        ("lowmem", [("kwargs.tolerence", "reward 'mine:f' has no parameter 'tolerence' and no **kwargs (its keyword "
                                         "parameters: completions, prompts, rows, tolerance)")])


def test_readme_reward_options_table_is_current():
    spec = util.spec_from_file_location("gen", ROOT / "scripts" / "gen_recipe_reference.py")
    gen = util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    block = gen.reward_options_block()
    assert block in (ROOT / "README.md").read_text(), \
        "README reward options table is stale: run python scripts/gen_recipe_reference.py --write"
    for name, builtin in BUILTINS.items():
        assert f"`{name}`" in block
        assert all(f"| `{option}` |" in block for option in option_names(builtin.options))


# ---------------------------------------------------------------------------------------------
# Found by a red team: unbounded weights; format's search, and a pattern that backtracks for hours

@pytest.mark.parametrize("weight", [1e200, -1e7, 1000000.5])
def test_a_weight_past_the_bound_is_refused(weight):
    """A weight of 1e200 made totals whose group std overflowed: every advantage 0, nothing learned."""
    assert problems(recipe({"function": "math"}, {"function": "format", "weight": weight})) == {
        "rewards.functions.1.weight": "must be within +-1000000: a total that large overflows the advantages' standard "
                                      f"deviation; rescale the weights (got {weight!r})"}
    env = recipe({"function": "math"}, environment={"name": "python", "reward_weight": weight})
    assert problems(env) == {"environment.reward_weight": "must be within +-1000000, as a reward function's weight "
                                                          f"(got {weight:g})"}


def test_a_weight_within_the_bound_keeps_advantages():
    from lowmem_grpo.advantages import group_advantages

    r = load({"function": "exact", "weight": 1e6}, {"function": "format", "weight": -1e6})
    res = r(["42", "7", "42", "7"], ["p"] * 4, [{"answer": "42"}] * 4)
    adv = group_advantages(res.total.view(1, 4))
    assert res.total.tolist() == [0.0, -1e6, 0.0, -1e6] and adv.abs().min() > 0.5


def test_format_finds_the_pattern_anywhere_unless_anchored():
    from lowmem_grpo.rewards.format import format_reward

    text = ["junk <answer>5</answer> junk"]
    assert format_reward(text, pattern="<answer>.*</answer>") == [1.0]
    assert format_reward(text, pattern="^<answer>.*</answer>$") == [0.0]
    assert "anywhere in the completion" in format_reward.__doc__ and "whole match" in \
        BUILTINS["format"].options.model_fields["pattern"].description


def test_a_pattern_that_backtracks_without_end_skips_the_completion_with_one_warning(monkeypatch):
    """'^(a|aa)+$' on 'a' * 40 + '!' backtracks for hours in re: the match stops at MATCH_TIMEOUT_S, the completion is
    skipped (None), and the warning says why, once per process."""
    import time
    import warnings

    from lowmem_grpo.rewards import format as format_module

    monkeypatch.setattr(format_module, "MATCH_TIMEOUT_S", 0.2)
    monkeypatch.setattr(format_module, "_timeout_warned", False)
    start = time.monotonic()
    with pytest.warns(UserWarning, match=r"format reward: the pattern '\^\(a\|aa\)\+\$' took over 0.2 s"):
        scores = format_module.format_reward(["a" * 40 + "!", "aaaa", "a" * 40 + "!"], pattern=r"^(a|aa)+$")
    assert scores == [None, 1.0, None] and time.monotonic() - start < 10
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # once per process
        assert format_module.format_reward(["a" * 40 + "!"], pattern=r"^(a|aa)+$") == [None]
    assert format_module.format_reward(["a" * 40 + "!"], pattern=r"^(a+)+$") == [0.0]   # the red team's own
    res = load({"function": "format", "kwargs": {"pattern": r"^(a|aa)+$"}})(["a" * 40 + "!", "aa"], ["p"] * 2, [{}] * 2)
    assert res.skipped == 1 and res.total.tolist()[1] == 1.0
