"""The GRPO family (docs/algorithm.md §3, §4, §6-§8): each variant against a hand evaluation, the recipe's
invalid combinations, the p* recurrence (§4) on a tabular policy, and the diagnostics in a real run."""

import math

import pytest
import torch
import yaml

from conftest import QUIET, recipe_dict
from lowmem_grpo import diagnostics as diag
from lowmem_grpo.advantages import STD_EPS, group_advantages
from lowmem_grpo.loss import (LossOptions, aggregate, aggregation_weights, grpo_token_loss, k1_kl, k2_kl, k3_kl,
                              kl_terms, ratio_clip_surrogate, target_clip_surrogate)
from lowmem_grpo.metrics import read_metrics
from lowmem_grpo.recipe import RecipeError, recipe_from_dict, recipe_to_yaml
from lowmem_grpo.train import Trainer

MIN = {"model": {"name_or_path": "m"}, "data": {"train_path": "t.jsonl"}}


def _rand(seed, n, shift=-2.0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (shift + scale * torch.randn(n, generator=g, dtype=torch.float64)).clamp(max=-0.05)


# -- KL estimators and their composer (docs/algorithm.md §4; Schulman 2020) -------------------------------------

@pytest.mark.parametrize("name", ["k1", "k2", "k3"])
def test_kl_estimators_values_and_gradients(name):
    fn = {"k1": k1_kl, "k2": k2_kl, "k3": k3_kl}[name]
    lp = _rand(1, 40).requires_grad_()
    other = _rand(2, 40)
    value = fn(lp, other)
    (grad,) = torch.autograd.grad(value.sum(), lp)
    for x, o, v, gr in zip(lp.tolist(), other.tolist(), value.tolist(), grad.tolist()):
        d = o - x  # log(pi_other / pi)
        hand = {"k1": -d, "k2": d * d / 2, "k3": math.exp(d) - d - 1}[name]
        hand_grad = {"k1": 1.0, "k2": -d, "k3": 1 - math.exp(d)}[name]  # d/d lp by hand
        assert abs(v - hand) < 1e-12 and abs(gr - hand_grad) < 1e-12
    if name == "k1":
        assert (value < 0).any()  # unbiased, but either sign per token
    else:
        assert (value >= 0).all()


@pytest.mark.parametrize("target", ["ref", "mirror", "both", "none"])
def test_kl_terms_composer(target):
    lp, ref, old = _rand(3, 30), _rand(4, 30), _rand(5, 30)
    penalty, kl_ref, kl_mirror = kl_terms(lp, ref, old, target=target, beta=0.1, beta_mirror=0.3, estimator="k2")
    want_ref = [0.5 * (r - x) ** 2 for x, r in zip(lp.tolist(), ref.tolist())]
    want_mir = [0.5 * (o - x) ** 2 for x, o in zip(lp.tolist(), old.tolist())]
    on_ref, on_mir = target in ("ref", "both"), target in ("mirror", "both")
    assert (kl_ref is not None) == on_ref and (kl_mirror is not None) == on_mir
    if target == "none":
        assert penalty is None
        return
    want = [0.1 * a * on_ref + 0.3 * b * on_mir for a, b in zip(want_ref, want_mir)]
    assert max(abs(p - w) for p, w in zip(penalty.tolist(), want)) < 1e-12
    # a zero weight switches its term off (no reference pass is needed then)
    assert kl_terms(lp, ref, old, target=target, beta=0.0, beta_mirror=0.0, estimator="k3")[0] is None


# -- Clipped surrogates (docs/algorithm.md §1, §6): values, hand-derived gradients, every branch hit --------------

def _branch_inputs(kind):
    """Tokens built so that each branch of the clip is taken: [lp_old, log r, A]."""
    lp_old = torch.tensor([-0.5, -1.0, -2.0, -0.7, -1.5, -3.0, -1.2, -0.9, -2.5, -1.1], dtype=torch.float64)
    if kind == "ratio":  # window [0.8, 1.28]
        log_r = torch.tensor([0.5, 0.1, -0.5, -0.4, 0.1, 0.5, 0.0, 0.3, -0.1, 0.2], dtype=torch.float64)
    else:  # A > 0 binds above -lp_old/2, A < 0 below lp_old
        log_r = torch.tensor([0.4, 0.2, -2.5, -0.5, 0.1, 1.7, 0.0, -1.5, 0.9, -0.2], dtype=torch.float64)
    adv = torch.tensor([1.5, 1.5, -1.0, -1.0, -1.0, 0.7, 0.0, 0.8, -0.6, 2.0], dtype=torch.float64)
    return lp_old, log_r, adv


def _hand_clip(kind, lp_old, log_r, a):
    """(surrogate, d surrogate / d lp, branch) for one token, from the words of docs/algorithm.md §6."""
    r, pi_old = math.exp(log_r), math.exp(lp_old)
    if kind == "ratio":
        lo, hi = 0.8, 1.28
    else:
        lo, hi = pi_old, 1 / math.sqrt(pi_old)  # pi = pi_old^2 and pi = sqrt(pi_old), as ratios
    if a > 0 and r > hi:
        return hi * a, 0.0, "high"
    if a < 0 and r < lo:
        return lo * a, 0.0, "low"
    return r * a, r * a, "inside"  # d(r A)/d lp = r A


@pytest.mark.parametrize("kind", ["ratio", "target"])
def test_clip_surrogates_every_branch(kind):
    lp_old, log_r, adv = _branch_inputs(kind)
    lp = (lp_old + log_r).requires_grad_()
    if kind == "ratio":
        s = ratio_clip_surrogate(lp, lp_old, adv, 0.2, 0.28)
    else:
        s = target_clip_surrogate(lp, lp_old, adv)
    (grad,) = torch.autograd.grad(s.sum(), lp)
    branches = set()
    for k in range(len(adv)):
        value, dvalue, branch = _hand_clip(kind, lp_old[k].item(), log_r[k].item(), adv[k].item())
        assert abs(s[k].item() - value) < 1e-12 and abs(grad[k].item() - dvalue) < 1e-12, k
        branches.add((branch, int(torch.sign(adv[k]))))
    assert {("high", 1), ("low", -1), ("inside", 1), ("inside", 0), ("inside", -1)} <= branches
    # the pessimistic side is not clipped: A > 0 below the window, A < 0 above it keep their gradient
    tl = grpo_token_loss(lp, lp_old, None, adv,
                         LossOptions(beta=0.0, eps_low=0.2, eps_high=0.28, clip=kind, kl_target="none"))
    binding = tl.clipped_low | tl.clipped_high
    assert torch.equal(binding, (grad == 0) & (adv != 0))


def test_target_is_a_probability_ratio_clip_is_not():
    """docs/algorithm.md §6: a ratio bound above 1/pi_old is unreachable; the target (sqrt(pi_old) <= 1) never is."""
    lp_old = torch.log(torch.tensor([0.9, 0.5, 0.01], dtype=torch.float64))
    lp = torch.zeros(3, dtype=torch.float64, requires_grad=True)  # pi = 1: the largest reachable
    adv = torch.ones(3, dtype=torch.float64)
    tl_ratio = grpo_token_loss(lp, lp_old, None, adv,
                               LossOptions(beta=0.0, eps_low=0.2, eps_high=0.2, kl_target="none"))
    tl_target = grpo_token_loss(lp, lp_old, None, adv, LossOptions(beta=0.0, clip="target", kl_target="none"))
    assert tl_ratio.clipped_high.tolist() == [False, True, True]  # 1/0.9 < 1.2: never clipped
    assert tl_target.clipped_high.all()


# -- docs/algorithm.md §3: with binary rewards the surrogate gradient is the contrastive weight -------------------

@pytest.mark.parametrize("mode", ["sequence_mean", "token_mean", "constant", "sum"])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_surrogate_gradient_is_contrastive_weight(mode, k):
    G = 8
    p = k / G
    rewards = torch.tensor([[1.0] * k + [0.0] * (G - k)], dtype=torch.float64)
    lengths = torch.randint(1, 9, (G,), generator=torch.Generator().manual_seed(k))
    seq = torch.repeat_interleave(torch.arange(G), lengths)
    lp = _rand(k, int(lengths.sum())).requires_grad_()
    w = aggregation_weights(seq, lengths, mode, max_completion_length=8)
    for adv_mode in ("mean_std", "mean"):
        adv = group_advantages(rewards, adv_mode).view(-1)
        tl = grpo_token_loss(lp, lp.detach(), None, adv[seq], LossOptions(beta=0.0, kl_target="none"))  # r = 1
        (grad,) = torch.autograd.grad(-aggregate(tl.loss, w), lp)  # gradient of J
        per_completion = torch.zeros(G, dtype=torch.float64).index_add_(0, seq, grad)
        factor = torch.zeros(G, dtype=torch.float64).index_add_(0, seq, w)  # the aggregation factor sum_t w_it
        weight = per_completion / factor
        if adv_mode == "mean":
            plus, minus = 1 - p, p
        else:  # the weights of docs/algorithm.md §3; our std has Bessel's correction and STD_EPS added (advantages.py)
            s = math.sqrt(p * (1 - p) * G / (G - 1))
            c = math.sqrt((G - 1) / G) * s / (s + STD_EPS)
            plus, minus = diag.omega_plus(p, eps=0.0) * c, diag.omega_minus(p, eps=0.0) * c
            assert abs(plus / diag.omega_plus(p) - math.sqrt((G - 1) / G)) < 1e-3
        assert torch.allclose(weight[:k], torch.full((k,), plus, dtype=torch.float64), atol=1e-9, rtol=0)
        assert torch.allclose(weight[k:], torch.full((G - k,), -minus, dtype=torch.float64), atol=1e-9, rtol=0)
        # and the diagnostic reads the same weights back from the advantages
        got_plus, got_minus = diag.contrastive_weights(adv.view(1, G), rewards >= 1, torch.ones(1, G, dtype=torch.bool))
        assert abs(got_plus - plus) < 1e-9 and abs(got_minus - minus) < 1e-9


# -- Recipe: invalid combinations name the field --------------------------------------------------------------

@pytest.mark.parametrize("algorithm, field, words", [
    ({"kl_target": "mirror"}, "kl_target", "mu > 1"),
    ({"kl_target": "both", "beta": 0.1}, "kl_target", "nothing to compare"),
    ({"beta": 0.0}, "beta", "kl_target: none"),
    ({"kl_target": "both", "mu": 2, "beta": 0.0}, "beta", "must be > 0"),
    ({"kl_target": "mirror", "mu": 2, "beta_mirror": 0.0}, "beta_mirror", "must be > 0"),
    ({"clip": "target"}, "clip", "never binds"),
    ({"clip": "target", "mu": 2, "epsilon_high": 0.3}, "epsilon_high", "ratio clip"),
    ({"early_stop_unclipped_fraction": 0.5}, "early_stop_unclipped_fraction", "mu > 1"),
    ({"early_stop_min_improvement": 0.0}, "early_stop_min_improvement", "mu > 1"),
    ({"kl_estimator": "k4"}, "kl_estimator", "'k3'"),
    ({"early_stop_unclipped_fraction": 1.5, "mu": 2}, "early_stop_unclipped_fraction", "<= 1"),
    # VESPO (§14.2): its shape only with clip vespo, and positive; what it does not use is refused
    ({"vespo_k_pos": 2.5}, "vespo_k_pos", "only with clip: vespo"),
    ({"clip": "sapo", "vespo_lambda_neg": 1.0}, "vespo_lambda_neg", "only with clip: vespo"),
    ({"clip": "vespo", "vespo_lambda_pos": 0.0}, "vespo_lambda_pos", "greater than 0"),
    ({"clip": "vespo", "vespo_k_neg": -1.0}, "vespo_k_neg", "greater than 0"),
    ({"clip": "vespo", "importance_sampling_level": "sequence"}, "importance_sampling_level", "leave it token"),
    ({"clip": "vespo", "sampler_correction": "sequence_truncate"}, "sampler_correction", "token_truncate or token_mask"),
    ({"clip": "vespo", "epsilon_low": 0.1}, "epsilon_low", "clip: vespo does not use"),
    ({"clip": "vespo", "delta": 2.0}, "delta", "clip is 'vespo'"),
    # GMPO (§14.3): its log-space bounds only with clip gmpo, and positive; no ratio bound, level, cap or token weight
    ({"gmpo_epsilon_low": 0.3}, "gmpo_epsilon_low", "only with clip: gmpo"),
    ({"clip": "vespo", "gmpo_epsilon_high": 0.3}, "gmpo_epsilon_high", "only with clip: gmpo"),
    ({"clip": "gmpo", "gmpo_epsilon_high": 0.0}, "gmpo_epsilon_high", "greater than 0"),
    ({"clip": "gmpo", "epsilon_high": 0.28}, "epsilon_high", "its log-space bounds are gmpo_epsilon_low/high"),
    ({"clip": "gmpo", "importance_sampling_level": "sequence"}, "importance_sampling_level", "leave it token"),
    ({"clip": "gmpo", "delta": 2.0}, "delta", "clip is 'gmpo'"),
    ({"clip": "gmpo", "sampler_correction": "token_truncate"}, "sampler_correction", "or sequence_mask"),
    ({"clip": "gmpo", "top_entropy_quantile": 0.2}, "top_entropy_quantile", "leave it 1"),
    ({"aggregation": "sequence_sums"}, "aggregation", "'sequence_sum'"),
])
def test_invalid_combinations_name_the_field(algorithm, field, words):
    with pytest.raises(RecipeError) as info:
        recipe_from_dict({**MIN, "algorithm": algorithm})
    problems = dict(info.value.problems)
    assert f"algorithm.{field}" in problems, problems
    assert words in problems[f"algorithm.{field}"]


def test_valid_combinations_and_saved_recipes_reload():
    for algorithm in ({"kl_target": "none", "beta": 0.0}, {"kl_target": "both", "mu": 2},
                      {"kl_target": "mirror", "mu": 3, "kl_estimator": "k1", "clip": "target",
                       "early_stop_unclipped_fraction": 0.3, "early_stop_min_improvement": 0.0},
                      {"clip": "vespo", "vespo_k_pos": 1.5, "vespo_lambda_neg": 2.5, "sampler_correction": "token_mask"},
                      {"aggregation": "sequence_sum", "importance_sampling_level": "sequence", "mu": 2},
                      {"clip": "gmpo", "mu": 2, "gmpo_epsilon_low": 0.3, "sampler_correction": "sequence_mask",
                       "off_policy_mask_threshold": 0.5, "kl_ratio_weight": True}):
        r = recipe_from_dict({**MIN, "algorithm": algorithm})
        again = recipe_from_dict(yaml.safe_load(recipe_to_yaml(r)))  # resume reloads the dump of every field
        assert again.algorithm == r.algorithm
    d = recipe_from_dict(MIN).algorithm  # the defaults are GRPO as written (docs/algorithm.md §1)
    assert (d.kl_target, d.beta, d.kl_estimator, d.clip, d.epsilon_low, d.epsilon_high, d.mu, d.advantage,
            d.aggregation) == ("ref", 0.04, "k3", "ratio", 0.2, 0.2, 1, "mean_std", "sequence_mean")


def test_all_cross_field_problems_at_once():
    with pytest.raises(RecipeError) as info:
        recipe_from_dict({**MIN, "algorithm": {"kl_target": "both", "beta": 0, "beta_mirror": 0, "clip": "target"}})
    assert {"algorithm.kl_target", "algorithm.beta", "algorithm.beta_mirror", "algorithm.clip"} <= set(dict(info.value.problems))


# -- docs/algorithm.md §4: the recurrence, and a tabular policy optimised exactly each iteration reproduces it ----

def _exact_iterates(p_ref_logits, correct, beta, adv_mode, n):
    """A softmax policy over a few fixed completions; each iteration maximises the unclipped surrogate
    E_old[r A] - beta KL(pi || pi_ref) exactly (LBFGS), A = +omega_plus(p) / -omega_minus(p) at the old p."""
    lp_ref = torch.log_softmax(p_ref_logits, 0)
    theta = p_ref_logits.clone()
    out = []
    for _ in range(n):
        lp_old = torch.log_softmax(theta, 0).detach()
        p = float(lp_old.exp()[correct].sum())
        if adv_mode == "mean_std":
            plus, minus = diag.omega_plus(p), diag.omega_minus(p)
        else:
            plus, minus = 1 - p, p
        adv = torch.where(correct, plus, -minus).to(torch.float64)
        theta = theta.clone().requires_grad_()
        opt = torch.optim.LBFGS([theta], lr=1, max_iter=500, tolerance_grad=1e-12, tolerance_change=1e-14,
                                line_search_fn="strong_wolfe")

        def closure():
            opt.zero_grad()
            lp = torch.log_softmax(theta, 0)
            # E_old[r A] with the old probabilities as weights (eps wide open: unclipped)
            surrogate = aggregate(-ratio_clip_surrogate(lp, lp_old, adv, 1.0, 1e9), lp_old.exp())
            kl = (lp.exp() * k3_kl(lp, lp_ref)).sum()  # E_pi[k3] = KL(pi || pi_ref), exactly
            loss = surrogate + beta * kl
            loss.backward()
            return loss

        for _ in range(3):
            opt.step(closure)
        theta = theta.detach()
        out.append(float(torch.softmax(theta, 0)[correct].sum()))
    return out


@pytest.mark.parametrize("adv_mode, beta", [("mean_std", 2.5), ("mean_std", 0.5), ("mean", 0.5)])
def test_tabular_policy_follows_the_kl_recurrence(adv_mode, beta):
    logits = torch.tensor([0.3, -1.2, 0.8, 0.1, -0.4, 0.5], dtype=torch.float64)
    correct = torch.tensor([True, True, False, False, False, False])
    p_ref = float(torch.softmax(logits, 0)[correct].sum())
    measured = _exact_iterates(logits, correct, beta, adv_mode, 5)
    predicted = diag.kl_recurrence(p_ref, beta, 5, adv_mode)
    # the issue asks for 0.02; exact optimisation agrees to ~1e-8, so hold it to much less
    assert max(abs(a - b) for a, b in zip(measured, predicted)) < 1e-5, (measured, predicted)
    assert all(p > p_ref for p in measured)  # success amplification
    if adv_mode == "mean":  # docs/algorithm.md §4: p_n = sigmoid(logit(p_ref) + 1/beta) for every n
        closed = 1 / (1 + (1 - p_ref) / p_ref * math.exp(-1 / beta))
        assert all(abs(p - closed) < 1e-9 for p in predicted)
    else:
        assert abs(predicted[0] - predicted[1]) > 0.01  # the mean_std iterates really move


def test_fixed_point():
    p_ref, beta = 0.2, 1.0
    p_star = diag.kl_fixed_point(p_ref, beta)
    assert p_ref < p_star < 1
    assert abs(diag.kl_recurrence_step(p_star, p_ref, beta) - p_star) < 1e-10
    assert diag.kl_fixed_point(0.0, 0.04) == 0.0 and diag.kl_fixed_point(1.0, 0.04) == 1.0
    assert abs(diag.kl_fixed_point(0.3, 2.0, "mean") - 1 / (1 + 7 / 3 * math.exp(-0.5))) < 1e-12
    assert diag.kl_fixed_point(0.3, 2.0, "rloo", group_size=4) > diag.kl_fixed_point(0.3, 2.0, "mean")


# -- Diagnostics: small pure functions ----------------------------------------------------------------------

def test_success_rates_and_histogram():
    correct = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    valid = torch.ones_like(correct)
    valid[3, 1] = False  # one skipped completion: 1 of 3 valid
    rates = diag.success_rates(correct, valid)
    assert torch.allclose(rates, torch.tensor([0.5, 1.0, 0.0, 1 / 3], dtype=torch.float64))
    assert diag.success_histogram(rates, 4) == [1, 1, 1, 0, 1]
    assert diag.is_binary(torch.tensor([0.0, 1.0, float("nan")])) and not diag.is_binary(torch.tensor([0.0, 0.5]))


def test_logp_change_and_early_stop():
    before = torch.tensor([-3.0, -2.0, -4.0, -1.0, -5.0])
    after = torch.tensor([-2.5, -2.2, -4.5, -0.5, -5.0])
    adv = torch.tensor([1.0, 0.5, -1.0, -2.0, 0.0])
    out = diag.logp_change(before, after, adv)
    assert out["update/logp_change_pos"] == pytest.approx((0.5 - 0.2) / 2)
    assert out["update/logp_change_neg"] == pytest.approx((-0.5 + 0.5) / 2)
    assert out["update/frac_pos_up"] == 0.5 and out["update/frac_neg_down"] == 0.5
    assert diag.logp_change(before, after, torch.zeros(5))["update/frac_pos_up"] is None
    ids = torch.tensor([0, 0, 1, 2, 2])
    assert diag.sequence_sums(torch.tensor([1.0, 2, 3, 4, 5]), ids, 4).tolist() == [3.0, 3.0, 9.0, 0.0]
    assert diag.early_stop_reason(0.2, 1.0, None, 0.3, None) == "unclipped_fraction"
    assert diag.early_stop_reason(0.9, 1.0, None, 0.3, 0.0) is None  # the first update has nothing to compare
    assert diag.early_stop_reason(0.9, 1.0, 1.2, 0.3, 0.0) == "no_improvement"
    assert diag.early_stop_reason(0.9, 1.3, 1.2, 0.3, 0.05) is None
    assert diag.early_stop_reason(0.1, 1.0, 1.2, 0.0, None) is None  # both off


# -- End to end: every diagnostic in every step row ---------------------------------------------------------

BINARY = {"functions": [{"function": "user_rewards:has_digit"}]}


def _steps(run_dir):
    return [row for row in read_metrics(run_dir) if "loss" in row or "update/stop" in row]


def test_every_diagnostic_in_every_row(tiny_model_dir, tiny_data, tmp_path):
    d = recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run", rewards=BINARY, train={"steps": 3, "update_diagnostics_every": 1},
                    generation={"num_generations": 8, "max_new_tokens": 4}, optimizer={"lr": 3e-3})
    Trainer(recipe_from_dict(d), **QUIET).fit()
    rows = _steps(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        for key in diag.STEP_KEYS + ("reward/has_digit", "reward/has_digit/std"):
            assert key in row, key
        assert len(row["success_rate/per_prompt"]) == 2 and sum(row["success_rate/hist"]) == 2
        assert len(row["success_rate/hist"]) == 9
        assert row["kl/mirror"] is None and row["kl/ref"] == row["kl"] >= 0 and row["update/mu_ran"] == 1
        assert row["kl/p_ref"] == rows[0]["success_rate"] and row["kl/p_star"] > row["kl/p_ref"]
    mixed = [r for r in rows if r["omega/plus"] is not None]
    assert mixed, "no group with both correct and wrong completions: pick another seed"
    for key in ("update/logp_change_pos", "update/logp_change_neg", "update/frac_pos_up", "update/frac_neg_down"):
        assert all(r[key] is not None for r in mixed), key
    # what an update is for (docs/algorithm.md §8): preferred completions up, dispreferred down
    assert sum(r["update/frac_pos_up"] + r["update/frac_neg_down"] for r in mixed) / (2 * len(mixed)) > 0.5
    assert sum(r["update/logp_change_pos"] for r in mixed) > 0 > sum(r["update/logp_change_neg"] for r in mixed)


def test_mirror_target_clip_and_early_stop(tiny_model_dir, tiny_data, tmp_path):
    common = dict(rewards=BINARY, train={"steps": 2}, generation={"num_generations": 8, "max_new_tokens": 4})
    d = recipe_dict(tiny_model_dir, tiny_data, tmp_path / "a", **common,
                    algorithm={"kl_target": "both", "mu": 3, "clip": "target", "kl_estimator": "k2"})
    Trainer(recipe_from_dict(d), **QUIET).fit()
    rows = _steps(tmp_path / "a")
    assert all(r["update/mu_ran"] == 3 and r["update/stop"] is None for r in rows)
    assert all(r["kl/mirror"] is not None and r["kl/ref"] is not None for r in rows)
    assert any(r["kl/mirror"] > 0 for r in rows)  # the last of 3 updates has moved away from pi_old
    # an improvement no update can reach: only the first of mu updates runs; the schedule still counts mu
    d = recipe_dict(tiny_model_dir, tiny_data, tmp_path / "b", **common,
                    algorithm={"kl_target": "mirror", "mu": 3, "early_stop_min_improvement": 1e9},
                    optimizer={"lr": 1e-2, "schedule": "linear"})
    t = Trainer(recipe_from_dict(d), **QUIET)
    t.fit()
    rows = _steps(tmp_path / "b")
    assert all(r["update/mu_ran"] == 1 and r["update/stop"] == "no_improvement" for r in rows)
    assert t.scheduler.last_epoch == 2 * 3
    # update diagnostics every 2 steps: figures of docs/algorithm.md §8 at step 2 only; 0: never
    for every, with_figures in ((2, [False, True, False]), (0, [False, False, False])):
        d = recipe_dict(tiny_model_dir, tiny_data, tmp_path / f"c{every}",
                        **{**common, "train": {"steps": 3, "update_diagnostics_every": every}})
        Trainer(recipe_from_dict(d), **QUIET).fit()
        rows = _steps(tmp_path / f"c{every}")
        assert [r["time/diagnostics_s"] is not None for r in rows] == with_figures  # the forward ran
        assert all(r[k] is None for r, w in zip(rows, with_figures) if not w
                   for k in ("update/logp_change_pos", "update/logp_change_neg", "update/frac_pos_up"))


# (option set, the extra keys that hold a number in every row): LUSPO with GSPO's ratio, VESPO with the sampler
# correction folded into its ratio, GMPO with a completion weight (§15's sequence correction) and narrow log-space
# bounds, so that mu = 2's second update clips some tokens (§5, §14.2, §14.3)
NEW_LOSSES = {
    "luspo": {"aggregation": "sequence_sum", "importance_sampling_level": "sequence", "mu": 2},
    "vespo": {"clip": "vespo", "mu": 2, "vespo_k_pos": 1.5, "sampler_correction": "token_mask",
              "sampler_correction_min": 0.5},
    "gmpo": {"clip": "gmpo", "mu": 2, "gmpo_epsilon_low": 0.02, "gmpo_epsilon_high": 0.03,
             "sampler_correction": "sequence_truncate"},
}


@pytest.mark.parametrize("name", sorted(NEW_LOSSES))
def test_newest_losses_train_with_every_row_key(tiny_model_dir, tiny_data, tmp_path, monkeypatch, name):
    """A short run with each of the newest losses: every step row holds every key, and the loss sees what the
    recipe says (LUSPO: weight 1/N on every token; VESPO: its shape, the sampler's weight in its ratio, not in
    pg_weight; GMPO: its log-space bounds, the sequence correction in pg_weight, one value per completion)."""
    from lowmem_grpo import train as train_mod

    calls, weights = [], []
    real_loss, real_aggregate = train_mod.grpo_token_loss, train_mod.aggregate

    def spy_loss(*args, **kwargs):
        calls.append({**vars(args[4]), **kwargs})   # the run's LossOptions and the batch's arguments
        return real_loss(*args, **kwargs)

    def spy_aggregate(token_loss, w):
        weights.append(w.detach().cpu())
        return real_aggregate(token_loss, w)

    monkeypatch.setattr(train_mod, "grpo_token_loss", spy_loss)
    monkeypatch.setattr(train_mod, "aggregate", spy_aggregate)
    d = recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run", train={"steps": 2, "preflight": False},
                    algorithm={"kl_target": "none", **NEW_LOSSES[name]})
    d["data"]["eval_path"] = ""
    Trainer(recipe_from_dict(d), **QUIET).fit()
    rows = _steps(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        missing = [k for k in diag.STEP_KEYS if k not in row]
        assert not missing, missing
        assert math.isfinite(row["loss"]) and row["update/mu_ran"] == 2
    n = 2 * 4   # prompts_per_step x num_generations
    if name == "luspo":
        assert all(c["level"] == "sequence" for c in calls) and all(r["vespo/weight_mean"] is None for r in rows)
        assert weights and all(torch.allclose(w, torch.full_like(w, 1 / n)) for w in weights)
    elif name == "gmpo":
        assert calls and all(c["clip"] == "gmpo" and c["gmpo_epsilons"] == (0.02, 0.03) and c["level"] == "token"
                             and c["pg_weight"] is not None and c["sampler_weight"] is None for c in calls)
        for c in calls:   # the sequence_truncate weight: one per completion (the loss refuses anything else)
            ids, w = c["seq_index"].cpu(), c["pg_weight"].cpu()
            assert all(torch.unique(w[ids == i]).numel() == 1 for i in torch.unique(ids))
        # the second of mu = 2 updates has moved tokens past the narrow bounds; the first (r = 1) clips none
        assert any(r["clip/fraction"] > 0 for r in rows) and all(r["vespo/weight_mean"] is None for r in rows)
        assert all(isinstance(r["sampler/weight_mean"], float) for r in rows)
    else:
        assert all(r["clip/fraction"] == 0 and isinstance(r["sampler/weight_mean"], float) for r in rows)
        # mu = 2: the second update's weights moved off 1 (phi(1) = 1, and phi <= its maximum, 1.26 here)
        assert all(0 < r["vespo/weight_mean"] < 1.3 and r["vespo/weight_mean"] != 1.0 for r in rows)
        assert calls and all(c["clip"] == "vespo" and c["vespo_shape"] == (1.5, 3.0, 3.0, 2.0)
                             and c["sampler_weight"] is not None and c["pg_weight"] is None for c in calls)
