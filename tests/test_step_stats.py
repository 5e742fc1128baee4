"""The step's statistics (diagnostics.py) against hand computations, and one rule for "solved"."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from lowmem_grpo import diagnostics as diag
from lowmem_grpo.evaluate import greedy, sampled
from lowmem_grpo.rewards import RewardResult
from lowmem_grpo.rollout.base import Completion, SamplingParams

NAN = float("nan")


def result_of(primary, other=None, weight_other=0.5):
    primary = torch.tensor(primary, dtype=torch.float64)
    per = {"math": primary}
    total = primary.clone()
    if other is not None:
        per["fmt"] = torch.tensor(other, dtype=torch.float64)
        total = total + weight_other * per["fmt"]
    return RewardResult(total, per, {}, int(torch.isnan(total).sum()))


def test_solved_excludes_skipped_completions_and_counts_them():
    s = diag.solved(result_of([1.0, 0.0, NAN, 1.0, 0.5, NAN]))
    assert s.counted == 4 and s.skipped == 2
    assert s.rate == pytest.approx(2 / 4)
    assert [s.at(i) for i in range(6)] == [True, False, None, True, False, None]
    assert diag.solved(result_of([NAN, NAN])).rate is None


def test_solved_reads_the_first_function_only():
    # the second function's score never makes a completion solved, and its skips do not exclude one
    s = diag.solved(result_of([0.0, 1.0, 1.0], other=[1.0, NAN, 0.0]))
    assert [s.at(i) for i in range(3)] == [False, True, True]


class _Engine:
    """Returns one fixed completion per prompt (token = the prompt's first id)."""

    def generate(self, prompts, params):
        return [Completion(i, [p[0]], False) for i, p in enumerate(prompts) for _ in range(params.n)]

    def close(self):
        pass


class _Tok:
    def batch_decode(self, ids, skip_special_tokens=True):
        return [str(x[0]) for x in ids]


def test_training_success_rate_equals_eval_accuracy_with_skips():
    """The same scores give the same figure in training metrics and in held-out accuracy (skips excluded
    from both), where they used to disagree (skips counted as failures in training)."""
    scores = [1.0, 0.0, NAN, 1.0, NAN, 0.0, 1.0, 1.0]
    by_prompt = {str(i): s for i, s in enumerate(scores)}

    def rewards(texts, prompts, rows, **_):   # eval also passes completion_ids and prompt_messages
        return result_of([by_prompt[t] for t in texts])

    examples = [SimpleNamespace(prompt_ids=[i], prompt_text=f"p{i}", row={}, messages=None) for i in range(len(scores))]
    accuracy = greedy(_Engine(), _Tok(), rewards, examples, max_new_tokens=1, batch_size=3)
    result = result_of(scores)
    row = diag.rollout_stats(result, torch.ones(8, dtype=torch.long), torch.zeros(8, dtype=torch.bool), 4,
                             torch.zeros(2, 4))
    assert row["success_rate"] == accuracy["accuracy"] == pytest.approx(4 / 6)
    assert row["success_rate/skipped"] == 2 and accuracy["n"] == 6
    # pass@1 from samples, the same rule again: prompts whose samples are all skipped are left out
    out = sampled(_Engine(), _Tok(), rewards, examples, SamplingParams(n=2, max_new_tokens=1), [1])
    assert out["pass@1"] == pytest.approx(4 / 6) and out["pass@1/prompts"] == 6


def test_rollout_stats_by_hand():
    primary = [1.0, 0.0, 1.0, NAN, 0.0, 0.0, 0.0, 0.0]
    fmt = [1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    result = result_of(primary, fmt)
    lengths = torch.tensor([3, 5, 2, 4, 1, 1, 1, 1])
    truncated = torch.tensor([False, True, False, False, False, False, False, True])
    adv = torch.arange(8, dtype=torch.float64).view(2, 4)
    row = diag.rollout_stats(result, lengths, truncated, 4, adv)
    totals = [p + 0.5 * f for p, f in zip(primary, fmt) if not math.isnan(p)]
    mean = sum(totals) / len(totals)
    assert row["reward/mean"] == pytest.approx(mean)
    assert row["reward/std"] == pytest.approx(math.sqrt(sum((t - mean) ** 2 for t in totals) / (len(totals) - 1)))
    assert row["success_rate"] == pytest.approx(2 / 7) and row["success_rate/skipped"] == 1
    assert row["reward/skipped"] == 1
    assert row["completion/mean_length"] == pytest.approx(18 / 8)
    assert row["completion/truncated_fraction"] == pytest.approx(2 / 8)
    assert row["zero_std_fraction"] == pytest.approx(1 / 2)  # group 2's totals are all 0.5
    assert row["reward/fmt"] == pytest.approx(7 / 8)
    assert row["success_rate/per_prompt"] == [pytest.approx(2 / 3), 0.0]
    assert row["success_rate/hist"] == [1, 0, 0, 1, 0]  # 2/3 of G=4 rounds to bin 3


def test_update_stats_by_hand():
    parts = [diag.TokenStats(loss=0.25, entropy=torch.tensor([1.0, 2.0, 3.0]),
                             clipped_low=torch.tensor([True, False, False]), clipped_high=torch.tensor([False, False, True]),
                             advantages=torch.tensor([-1.0, 0.0, 2.0]), kl_ref=torch.tensor([0.1, 0.2, 0.3])),
             diag.TokenStats(loss=-0.5, entropy=torch.tensor([4.0]), clipped_low=torch.tensor([False]),
                             clipped_high=torch.tensor([False]), advantages=torch.tensor([3.0]),
                             kl_ref=torch.tensor([0.4]))]
    s = diag.update_stats(parts, kl_ref_on=True, kl_mirror_on=False)
    assert s.loss == pytest.approx(-0.25) and s.n_tokens == 4
    assert s.entropy == pytest.approx(10 / 4)
    assert (s.clip_low, s.clip_high, s.clip_fraction) == (pytest.approx(0.25), pytest.approx(0.25), pytest.approx(0.5))
    assert s.kl_ref == pytest.approx(1.0 / 4) and s.kl_mirror is None
    assert s.unclipped_fraction == pytest.approx(1 / 3)  # of the 3 tokens with A != 0, only the last one
    row = s.row()
    assert row["kl"] == row["kl/ref"] and row["clip/fraction"] == pytest.approx(0.5)


def test_sampler_agreement_and_sample_table():
    pairs = [(torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -2.0])), (torch.tensor([-3.0]), torch.tensor([-2.0]))]
    out = diag.sampler_agreement(pairs)
    assert out["rollout/logprob_abs_diff"] == pytest.approx(1.5 / 3) and out["rollout/logprob_abs_diff_max"] == 1.0
    assert diag.sampler_agreement([]) == {}
    table = diag.sample_table(["a", "b", "c"], ["x", "y", "z"], result_of([1.0, NAN, 0.0]), limit=2)
    assert table == [{"prompt": "a", "completion": "x", "reward": 1.0, "reward/math": 1.0},
                     {"prompt": "b", "completion": "y", "reward": None, "reward/math": None}]


def test_p_star_only_under_a_reference_kl_and_binary_rewards():
    binary, graded = torch.tensor([0.0, 1.0, 1.0]), torch.tensor([0.0, 0.5, 1.0])
    on = diag.p_star(0.3, binary, "ref", 0.1, "mean_std", 8)
    assert on["kl/p_ref"] == 0.3 and on["kl/p_star"] == pytest.approx(diag.kl_fixed_point(0.3, 0.1, "mean_std", 8))
    assert diag.p_star(0.3, graded, "ref", 0.1, "mean_std", 8)["kl/p_star"] is None
    assert diag.p_star(0.3, binary, "none", 0.1, "mean_std", 8)["kl/p_star"] is None
    assert diag.p_star(None, binary, "ref", 0.1, "mean_std", 8)["kl/p_star"] is None


def test_the_totals_reward_keys_are_reserved_from_reward_function_names():
    """Found by a newcomer audit: a reward/<x> figure of the total (STEP_KEYS) must be a name no reward function takes
    (rewards.ROW_REWARD_KEYS), else a function named x overwrote it in the row and the report drew it as a function."""
    from lowmem_grpo.diagnostics import STEP_KEYS
    from lowmem_grpo.rewards import ROW_REWARD_KEYS

    totals = {k.split("/", 1)[1] for k in STEP_KEYS if k.startswith("reward/")}
    assert totals and totals == set(ROW_REWARD_KEYS)
