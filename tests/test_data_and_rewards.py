"""Bad dataset rows and bad reward functions give clear errors naming what is wrong (or counted skips)."""

import json

import numpy as np
import pytest
import torch

from lowmem_grpo import tiny
from lowmem_grpo.data import DataError, PromptSet, batch_indices, read_rows
from lowmem_grpo.recipe import DataConfig, RewardsConfig, RewardSpec
from lowmem_grpo.rewards import RewardError, Rewards


@pytest.fixture(scope="module")
def tok():
    return tiny.build_tokenizer()


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_missing_field_names_the_row(tmp_path, tok):
    f = _jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2="}])
    with pytest.raises(DataError, match=r"row 2: missing field 'answer'"):
        PromptSet(str(f), DataConfig(train_path=str(f)), tok)
    ps = PromptSet(str(f), DataConfig(train_path=str(f), on_bad_row="skip"), tok)
    assert len(ps) == 1 and len(ps.skipped) == 1


def test_bad_json_and_unknown_format(tmp_path):
    bad = tmp_path / "d.jsonl"
    bad.write_text('{"prompt": "x"}\n{not json\n')
    with pytest.raises(DataError, match=r"d.jsonl:2: not valid JSON"):
        read_rows(str(bad))
    with pytest.raises(DataError, match="allowed: .jsonl, .csv, .parquet"):
        read_rows(str(_jsonl(tmp_path / "d.txt", [])))


def test_csv_and_template(tmp_path, tok):
    f = tmp_path / "d.csv"
    f.write_text("q,a\n1+2,3\n")
    ps = PromptSet(str(f), DataConfig(train_path=str(f), prompt_field="q", answer_field="a", template="{prompt}="), tok)
    assert ps.examples[0].prompt_text == "1+2=" and ps.examples[0].prompt_ids[0] == tok.bos_token_id


def test_batches_are_a_pure_function_of_step():
    a = [batch_indices(10, 4, s, seed=1) for s in range(5)]
    assert a == [batch_indices(10, 4, s, seed=1) for s in range(5)]
    assert sorted(sum(a[:5], [])[:10]) == list(range(10))  # first epoch covers every row once


def _rewards(fn, on_error="raise"):
    return Rewards(RewardsConfig(functions=[RewardSpec(function=fn)], on_error=on_error), answer_field="answer")


@pytest.mark.parametrize("fn,message", [
    ("user_rewards:raises", "'raises' raised ZeroDivisionError"),
    ("user_rewards:wrong_count", "returned 4 scores for 3 completions"),
    ("user_rewards:not_numbers", "score 0 is 'high'"),
    ("user_rewards:nan_scores", "score 0 is nan"),
    # found by an audit: a dict was read as its keys ("returned 1 scores"); sys.exit() ended the trainer, silently
    ("user_rewards:a_dict", r"returned dict, expected a list of 3 numbers \(one per completion\)"),
    ("user_rewards:exits", r"'exits' raised RuntimeError: sys.exit\(3\) was called"),
    # found by an audit: +-1e200 overflowed the group std, and the run learned nothing without a word
    ("user_rewards:huge", r"score 1 is 1e\+200, beyond \+-1e\+100: its square overflows"),
])
def test_bad_reward_functions_are_named(fn, message):
    with pytest.raises(RewardError, match=message):
        _rewards(fn)(["a", "b", "c"], ["p"] * 3, [{}] * 3)
    res = _rewards(fn, on_error="zero")(["a", "b", "c"], ["p"] * 3, [{}] * 3)
    assert res.total.tolist() == [0.0, 0.0, 0.0] and sum(res.errors.values()) == 3


def test_unloadable_reward_is_a_clear_error():
    with pytest.raises(RewardError, match="not a built-in"):
        _rewards("nonexistent")
    with pytest.raises(RewardError, match="cannot import module 'no_such_pkg.mod'"):
        _rewards("no_such_pkg.mod:fn")
    with pytest.raises(RewardError, match="has no callable 'nope'"):
        _rewards("user_rewards:nope")


def test_skips_are_nan_and_counted():
    res = _rewards("user_rewards:skip_all")(["a", "b"], ["p"] * 2, [{}] * 2)
    assert torch.isnan(res.total).all() and res.skipped == 2


def test_math_reward_builtin():
    res = _rewards("math")(["so 47", "48", "no idea"], ["p"] * 3, [{"answer": "47"}] * 3)
    assert res.total.tolist() == [1.0, 0.0, 0.0]


def test_limit_reads_only_the_first_rows(tmp_path, tok):
    f = _jsonl(tmp_path / "d.jsonl", [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(5)] + [{"prompt": "x"}])
    ps = PromptSet(str(f), DataConfig(train_path=str(f)), tok, limit=3)
    assert [e.row["answer"] for e in ps.examples] == ["1", "2", "3"]  # the bad 6th row is never reached


def test_exact_gives_no_reward_for_a_blank_answer_and_compares_a_number_as_one():
    """Found by a red team: a blank gold answer ('' of an empty CSV cell) gave 1.0 to an empty completion: no reward
    now (None), as for a missing one. A gold stored as a number lost its text: JSON reads 1e2 as 100.0, and '100'
    scored 0 against '100.0'; a number is compared by its value, a text answer still as text."""
    from decimal import Decimal

    from lowmem_grpo.rewards.format import exact_reward

    assert exact_reward(["", " ", "x"], rows=[{"answer": ""}, {"answer": "  "}, {}]) == [None, None, None]
    golds = [100.0, 100.0, 0.1, 2, 10**30, Decimal("2.50"), Decimal("2.50"), 100.0, 2, "2.50", "100"]
    said = ["100", "1e2", "0.1", "2.0", str(10**30), "2.5", "2.50", "100 apples", "3", "2.5", "100.0"]
    assert exact_reward(said, rows=[{"answer": g} for g in golds]) == [1.0] * 7 + [0.0] * 4
    assert exact_reward(["1", "true"], rows=[{"answer": True}] * 2) == [0.0, 0.0]   # (a boolean is no number here)


# ---------------------------------------------------------------------------------------------
# Found by a red team: scores that are booleans or complex numbers in numpy's or torch's types; a user function
# that changes what the next function reads

@pytest.mark.parametrize("score, kind", [
    (np.True_, "a boolean"), (np.array(False), "a boolean"), (torch.tensor(True), "a boolean"),
    (np.complex128(1 + 5j), "a complex number"), (np.complex64(1), "a complex number"),
    (np.array(1 + 0j), "a complex number"), (torch.tensor(1 + 2j), "a complex number"),
])
def test_numpy_and_torch_booleans_and_complex_scores_are_refused_as_a_bool_is(score, kind):
    from lowmem_grpo.rewards import check_scores

    with pytest.raises(RewardError, match=rf"reward 'f': score 1 is .* \({type(score).__name__}, {kind}\), expected a "
                                          "real number or None"):
        check_scores("f", [1.0, score], 2)
    with pytest.raises(RewardError, match=r"score 0 is True \(bool\)"):
        check_scores("f", [True], 1)


def test_a_trl_shaped_functions_booleans_and_nan_are_read_as_trl_reads_them():
    """TRL 1.16 makes its rewards a float32 tensor (True: 1.0) and turns None into NaN: a TRL-shaped function's
    booleans and NaN were refused here (found by a red team). Read so for it alone; lowmem-grpo's own refuse them."""
    from lowmem_grpo.rewards import check_scores

    scores = [True, np.False_, torch.tensor(True), float("nan"), np.float32("nan"), 0.5, None]
    assert check_scores("f", scores, 7, trl=True) == [1.0, 0.0, 1.0, None, None, 0.5, None]
    with pytest.raises(RewardError, match=r"score 0 is True \(bool\)"):
        check_scores("f", scores, 7)
    with pytest.raises(RewardError, match=r"score 0 is nan, expected a finite number or None"):
        check_scores("f", [float("nan")], 1)
    with pytest.raises(RewardError, match=r"score 0 is inf"):   # (TRL's NaN is "does not apply"; inf is no score)
        check_scores("f", [float("inf")], 1, trl=True)


def test_numpy_and_torch_real_scores_are_taken():
    from lowmem_grpo.rewards import check_scores

    assert check_scores("f", [np.float32(0.5), np.int64(2), np.array(1.5), torch.tensor(3.0), None], 5) == \
        [0.5, 2.0, 1.5, 3.0, None]
    assert check_scores("f", np.ones(2, dtype=np.float32), 2) == [1.0, 1.0]


MUTATING = '''
def mutate(completions, *, prompts, rows):
    rows[0]["answer"] = "hacked"
    rows[1]["tags"].append("x")
    completions[0], prompts[0] = "x", "y"
    return [0.0] * len(completions)

def trl_mutate(completions, answer, tags, **kwargs):
    answer[0] = "hacked"
    tags[0].append("y")
    completions[0] = "x"
    return [0.0] * len(completions)

def trl_read(completions, answer, tags, **kwargs):
    return [float(c == a and t == ["t"]) for c, a, t in zip(completions, answer, tags)]
'''


def test_a_user_function_cannot_change_what_the_next_function_reads(tmp_path, monkeypatch):
    (tmp_path / "mutating.py").write_text(MUTATING)
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = [{"answer": "42", "tags": ["t"]}, {"answer": "42", "tags": ["t"]}]
    specs = [RewardSpec(function="mutating:mutate"), RewardSpec(function="exact"),
             RewardSpec(function="mutating:trl_mutate"), RewardSpec(function="mutating:trl_read"),
             RewardSpec(function="mutating:mutate")]
    r = Rewards(RewardsConfig(functions=specs), answer_field="answer")
    completions, prompts = ["42", "42"], ["p", "p"]
    res = r(completions, prompts, rows)
    assert res.per_function["exact"].tolist() == [1.0, 1.0]       # the gold, and the completion, as they were
    assert res.per_function["trl_read"].tolist() == [1.0, 1.0]     # TRL's columns and completions too
    assert rows == [{"answer": "42", "tags": ["t"]}, {"answer": "42", "tags": ["t"]}]   # the dataset's rows
    assert completions == ["42", "42"] and prompts == ["p", "p"]
