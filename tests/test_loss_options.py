"""The options of docs/algorithm.md §13-§17 against plain float64 hand evaluations.

Each hand evaluation is written from the formula in the document with Python floats and the math module, one
token (or completion) at a time; gradients are the hand-derived derivatives, not finite differences.
"""

import math
import random

import pytest
import torch

from conftest import central_differences
from lowmem_grpo.advantages import STD_EPS, group_advantages, normalize_then_sum_advantages
from lowmem_grpo.loss import (LossOptions, adapt_entropy_coef, aggregate, cispo_surrogate, entropy_threshold,
                              grpo_token_loss, k3_kl, kl_terms, ratio_clip_surrogate, sampler_correction_weights,
                              sequence_log_ratio, target_clip_surrogate, top_entropy_mask)

TOL = 1e-9
NAN = float("nan")


# -- inputs -------------------------------------------------------------------------------------------------

def _sequences(spec, seed):
    """Tokens of completions given as (id, n_tokens, advantage, mean log-ratio), shuffled so that a
    completion's tokens are not contiguous. Returns per-token Python lists."""
    rng = random.Random(seed)
    toks = []
    for sid, n, adv, mean_lr in spec:
        diffs = [rng.uniform(-0.3, 0.3) for _ in range(n)]
        shift = mean_lr - sum(diffs) / n
        for d in diffs:
            lp_old = rng.uniform(-3.0, -0.6)
            lp = lp_old + d + shift
            toks.append((sid, lp, lp_old, lp + rng.gauss(0.0, 0.3), adv))
    rng.shuffle(toks)
    return {k: [t[i] for t in toks] for i, k in enumerate(("ids", "lp", "lp_old", "lp_ref", "adv"))}


def _tokens(cases, seed):
    """Single tokens given as (advantage, ratio), each its own completion (ids 3, 4, ...)."""
    rng = random.Random(seed)
    lp_old = [rng.uniform(-3.0, -1.7) for _ in cases]
    lp = [lo + math.log(r) for lo, (_, r) in zip(lp_old, cases)]
    return {"ids": [3 + i for i in range(len(cases))], "lp": lp, "lp_old": lp_old,
            "lp_ref": [x + rng.gauss(0.0, 0.3) for x in lp], "adv": [a for a, _ in cases]}


def _tensors(d):
    lp = torch.tensor(d["lp"], dtype=torch.float64, requires_grad=True)
    f64 = {k: torch.tensor(d[k], dtype=torch.float64) for k in ("lp_old", "lp_ref", "adv")}
    return lp, f64["lp_old"], f64["lp_ref"], f64["adv"], torch.tensor(d["ids"])


def _hand_weights(ids):
    """sequence_mean aggregation by hand: 1 / (N |o_i|) for each token."""
    n = {i: ids.count(i) for i in set(ids)}
    return [1.0 / (len(n) * n[i]) for i in ids]


def _hand_seq_ratio(d):
    """s_i = exp((1/|o_i|) sum_t (lp - lp_old)) for each completion id."""
    sums, counts = {}, {}
    for sid, lp, lo in zip(d["ids"], d["lp"], d["lp_old"]):
        sums[sid] = sums.get(sid, 0.0) + (lp - lo)
        counts[sid] = counts.get(sid, 0) + 1
    return {sid: math.exp(sums[sid] / counts[sid]) for sid in sums}, counts


def _close(got, want, tol=TOL):
    got = got.tolist() if torch.is_tensor(got) else got
    assert len(got) == len(want)
    for k, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) < tol, (k, a, b)


def _hand_k3(lp, lp_ref):
    return math.exp(lp_ref - lp) - (lp_ref - lp) - 1.0


def _hand_k3_grad(lp, lp_ref):
    return 1.0 - math.exp(lp_ref - lp)


# -- §13 sequence-level ratios ---------------------------------------------------------------------------------

def test_sequence_log_ratio_is_the_mean_over_the_sequence():
    d = _sequences([(9, 3, 0.0, 0.2), (2, 1, 0.0, -0.4), (5, 4, 0.0, 0.05)], seed=1)
    lp, lp_old, _, _, ids = _tensors(d)
    slr = sequence_log_ratio(lp, lp_old, ids)
    ratios, counts = _hand_seq_ratio(d)
    _close(slr, [math.log(ratios[i]) for i in d["ids"]])
    # gradient of sum_t c_t slr_t: token u of completion i gets sum_{t in i} c_t / |o_i|
    c = [0.5 + 0.25 * k for k in range(len(d["ids"]))]
    (grad,) = torch.autograd.grad((slr * torch.tensor(c, dtype=torch.float64)).sum(), lp)
    per_seq = {i: sum(ck for ck, j in zip(c, d["ids"]) if j == i) for i in counts}
    _close(grad, [per_seq[i] / counts[i] for i in d["ids"]])


GSPO_SPEC = [  # (id, tokens, A, mean log-ratio); eps 3e-4 / 4e-4
    (7, 4, 1.2, 0.01),     # A > 0, s above 1 + eps_high: clipped high
    (2, 3, -0.8, -0.01),   # A < 0, s below 1 - eps_low: clipped low
    (0, 5, 0.5, 1e-4),     # inside the window
    (11, 2, -1.1, 0.02),   # A < 0, s above the window: the unclipped term, gradient kept
    (4, 3, 0.9, -0.02),    # A > 0, s below the window: the unclipped term, gradient kept
    (5, 2, 0.0, 0.03),     # no advantage
]


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_gspo_sequence_clip_equals_hand_formula(beta):
    eps_low, eps_high = 3e-4, 4e-4
    d = _sequences(GSPO_SPEC, seed=3)
    lp, lp_old, lp_ref, adv, ids = _tensors(d)
    tl = grpo_token_loss(lp, lp_old, lp_ref, adv,
                         LossOptions(beta=beta, eps_low=eps_low, eps_high=eps_high, level="sequence"), seq_index=ids)
    w = _hand_weights(d["ids"])
    loss = aggregate(tl.loss, torch.tensor(w, dtype=torch.float64))
    s, counts = _hand_seq_ratio(d)
    lo, hi = 1 - eps_low, 1 + eps_high
    hand, clipped = 0.0, {}
    for sid, lpt, lrf, a, wt in zip(d["ids"], d["lp"], d["lp_ref"], d["adv"], w):
        r = s[sid]
        surr = min(r * a, min(max(r, lo), hi) * a)
        hand += wt * (-surr + beta * _hand_k3(lpt, lrf))
        clipped[sid] = "high" if a > 0 and r > hi else "low" if a < 0 and r < lo else "no"
    assert abs(loss.item() - hand) < TOL
    assert tl.clipped_high.tolist() == [clipped[i] == "high" for i in d["ids"]]
    assert tl.clipped_low.tolist() == [clipped[i] == "low" for i in d["ids"]]
    assert set(clipped.values()) == {"high", "low", "no"}
    # d loss / d lp_u = -(sum_{t in i} w_t) A_i s_i / |o_i| on an unclipped sequence, 0 on a clipped one
    W = {i: sum(wt for wt, j in zip(w, d["ids"]) if j == i) for i in counts}
    (grad,) = torch.autograd.grad(loss, lp)
    want = []
    for sid, lpt, lrf, a, wt in zip(d["ids"], d["lp"], d["lp_ref"], d["adv"], w):
        pg = 0.0 if clipped[sid] != "no" else -W[sid] * a * s[sid] / counts[sid]
        want.append(pg + wt * beta * _hand_k3_grad(lpt, lrf))
    _close(grad, want)
    assert any(abs(g) > 1e-3 for g, i in zip(want, d["ids"]) if i in (11, 4))


@pytest.mark.parametrize("clip", ["ratio", "cispo"])
def test_sequence_level_equals_token_level_at_mu1(clip):
    """With lp_old = lp (mu = 1) every ratio is 1 in value and, because aggregation weights are constant within
    a completion, the sequence level's gradient (1/|o_i|) sum_t w_it A_i equals the token level's w_it A_i."""
    d = _sequences([(4, 3, 0.7, 0.0), (1, 5, -1.3, 0.0), (8, 2, 0.2, 0.0)], seed=19)
    lp = torch.tensor(d["lp"], dtype=torch.float64, requires_grad=True)
    ids, adv = torch.tensor(d["ids"]), torch.tensor(d["adv"], dtype=torch.float64)
    w = torch.tensor(_hand_weights(d["ids"]), dtype=torch.float64)
    grads = []
    for level in ("token", "sequence"):
        tl = grpo_token_loss(lp, lp.detach(), lp.detach(), adv, LossOptions(beta=0.0, clip=clip, level=level),
                             seq_index=ids)
        grads.append(torch.autograd.grad(aggregate(tl.loss, w), lp)[0])
    _close(grads[1], grads[0].tolist(), tol=1e-12)
    _close(grads[0], [-wt * a for wt, a in zip(w.tolist(), d["adv"])], tol=1e-12)


# -- §14 the two-sided clip and CISPO -----------------------------------------------------------------------

DELTA_CASES = [  # (A, r) with eps 0.2 / 0.28, delta 2
    (-1.0, 5.0),   # A < 0, r beyond delta: capped at delta A, no gradient
    (-1.0, 1.6),   # A < 0, 1 + eps_high < r < delta: the unclipped term, as without delta
    (1.0, 5.0),    # A > 0 above the window: clipped high (delta changes nothing)
    (-0.5, 0.5),   # A < 0 below the window: clipped low
    (0.7, 0.5),    # A > 0 below the window: unclipped
    (0.7, 1.1),    # inside
    (0.0, 3.0),
]


def _hand_delta_token(a, r, lo, hi, delta):
    """(-objective, d(-objective)/d lp) of min(min(r, delta) A, clip(r, lo, hi) A), d r / d lp = r."""
    first, second = min(r, delta) * a, min(max(r, lo), hi) * a
    if first < second:
        slope = a * r if r < delta else 0.0
    elif second < first:
        slope = a * r if lo < r < hi else 0.0
    else:
        slope = a * r
    return -min(first, second), -slope


@pytest.mark.parametrize("delta", [2.0, None])
def test_two_sided_clip_equals_hand_formula(delta):
    d = _tokens(DELTA_CASES, seed=5)
    lp, lp_old, lp_ref, adv, ids = _tensors(d)
    tl = grpo_token_loss(lp, lp_old, lp_ref, adv, LossOptions(beta=0.0, eps_low=0.2, eps_high=0.28, delta=delta))
    w = [1.0 / len(DELTA_CASES)] * len(DELTA_CASES)
    loss = aggregate(tl.loss, torch.tensor(w, dtype=torch.float64))
    hand = [_hand_delta_token(a, r, 0.8, 1.28, math.inf if delta is None else delta) for a, r in DELTA_CASES]
    assert abs(loss.item() - sum(wt * v for wt, (v, _) in zip(w, hand))) < TOL
    (grad,) = torch.autograd.grad(loss, lp)
    _close(grad, [wt * g for wt, (_, g) in zip(w, hand)])
    # the cap matters exactly for A < 0 beyond delta: value -delta A (= 2) and no gradient
    if delta is not None:
        assert abs(tl.loss[0].item() - 2.0) < TOL and grad[0].item() == 0.0
    else:
        assert abs(tl.loss[0].item() - 5.0) < TOL and abs(grad[0].item() - w[0] * 5.0) < TOL
    assert tl.clipped_high.tolist() == [False, False, True, False, False, False, False]
    assert tl.clipped_low.tolist() == [False, False, False, True, False, False, False]


CISPO_CASES = [  # (A, r), max weight 2.5
    (1.0, 4.0),    # A > 0, weight capped; PPO's ratio clip would have dropped this token's gradient
    (1.0, 1.3),    # A > 0, uncapped
    (-0.6, 3.0),   # A < 0, weight capped
    (-0.6, 0.4),   # A < 0, uncapped; PPO's ratio clip would have dropped this one too
    (0.0, 9.0),    # no advantage: not counted as capped
]


@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_cispo_equals_hand_formula(beta):
    M = 2.5
    d = _tokens(CISPO_CASES, seed=7)
    lp, lp_old, lp_ref, adv, ids = _tensors(d)
    tl = grpo_token_loss(lp, lp_old, lp_ref, adv, LossOptions(beta=beta, clip="cispo", cispo_max_weight=M))
    w = [0.1, 0.2, 0.3, 0.25, 0.15]
    loss = aggregate(tl.loss, torch.tensor(w, dtype=torch.float64))
    hand, want = 0.0, []
    for (a, r), lpt, lrf, wt in zip(CISPO_CASES, d["lp"], d["lp_ref"], w):
        weight = min(r, M)  # detached: the derivative of -weight A lp is -weight A
        hand += wt * (-weight * a * lpt + beta * _hand_k3(lpt, lrf))
        want.append(wt * (-weight * a + beta * _hand_k3_grad(lpt, lrf)))
    assert abs(loss.item() - hand) < TOL
    (grad,) = torch.autograd.grad(loss, lp)
    _close(grad, want)
    assert all(abs(g) > 1e-3 for g, (a, _) in zip(want, CISPO_CASES) if a != 0)  # no token loses its gradient
    assert tl.clipped_high.tolist() == [True, False, True, False, False]
    assert not tl.clipped_low.any()
    # the bare function: sg(min(r, M)) A lp
    direct = cispo_surrogate(lp, lp - lp_old, adv, M)
    _close(direct, [min(r, M) * a * lpt for (a, r), lpt in zip(CISPO_CASES, d["lp"])])


def test_cispo_at_sequence_level_uses_the_sequence_ratio():
    M = 1.01
    d = _sequences([(3, 3, 1.0, 0.02), (8, 2, -0.5, 0.0), (1, 4, -2.0, 0.05)], seed=9)
    lp, lp_old, lp_ref, adv, ids = _tensors(d)
    tl = grpo_token_loss(lp, lp_old, lp_ref, adv,
                         LossOptions(beta=0.0, clip="cispo", cispo_max_weight=M, level="sequence"), seq_index=ids)
    s, _ = _hand_seq_ratio(d)
    _close(tl.loss, [-min(s[i], M) * a * lpt for i, a, lpt in zip(d["ids"], d["adv"], d["lp"])])
    (grad,) = torch.autograd.grad(tl.loss.sum(), lp)
    _close(grad, [-min(s[i], M) * a for i, a in zip(d["ids"], d["adv"])])
    assert tl.clipped_high.tolist() == [i in (3, 1) for i in d["ids"]]


# -- the policy-gradient weight and the entropy bonus (§15, §16) -------------------------------------------------

def test_pg_weight_scales_only_the_policy_term_and_entropy_bonus_gradient():
    cases = [(1.0, 1.1), (-0.6, 0.9), (0.8, 1.5), (-1.2, 0.7), (0.4, 1.0)]
    d = _tokens(cases, seed=11)
    lp, lp_old, lp_ref, adv, ids = _tensors(d)
    pgw_list = [0.0, 1.3, 0.0, 0.6, 2.0]  # zeros: a masked token (top-entropy mask or sampler mask)
    pgw = torch.tensor(pgw_list, dtype=torch.float64, requires_grad=True)  # must be treated as detached
    H_list = [0.3, 1.7, 0.05, 2.2, 0.9]
    H = torch.tensor(H_list, dtype=torch.float64, requires_grad=True)
    beta, coef = 0.04, 0.02
    tl = grpo_token_loss(lp, lp_old, lp_ref, adv, LossOptions(beta=beta, eps_low=0.2, eps_high=0.28), pg_weight=pgw,
                         entropy=H, entropy_coef=coef)
    w = [0.3, 0.1, 0.2, 0.15, 0.25]
    loss = aggregate(tl.loss, torch.tensor(w, dtype=torch.float64))
    hand, g_lp, g_h = 0.0, [], []
    for (a, r), lpt, lrf, pw, h, wt in zip(cases, d["lp"], d["lp_ref"], pgw_list, H_list, w):
        surr = min(r * a, min(max(r, 0.8), 1.28) * a)
        clipped = (a > 0 and r > 1.28) or (a < 0 and r < 0.8)
        hand += wt * (-surr * pw + beta * _hand_k3(lpt, lrf) - coef * h)
        g_lp.append(wt * (-(0.0 if clipped else a * r) * pw + beta * _hand_k3_grad(lpt, lrf)))
        g_h.append(-coef * wt)  # the bonus is not scaled by pg_weight
    assert abs(loss.item() - hand) < TOL
    grad_lp, grad_h = torch.autograd.grad(loss, (lp, H), retain_graph=True)
    _close(grad_lp, g_lp)
    _close(grad_h, g_h)
    assert g_lp[0] != 0.0  # a masked token still feels the KL penalty
    loss.backward()
    assert pgw.grad is None


# -- §15 the sampler-mismatch correction ------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_sampler_correction_weights_equal_hand_formula(mode):
    ids = [6, 2, 6, 9, 2, 6, 9, 0]
    log_ratio = [0.1, -0.9, 1.2, 0.05, 0.3, -0.2, -0.1, 0.02]  # lp at rollout - lp of the engine
    rng = random.Random(13)
    lp_sampler = [rng.uniform(-4.0, -0.5) for _ in ids]
    lp_rollout = [s + x for s, x in zip(lp_sampler, log_ratio)]
    low, high = 0.5, 2.0
    if mode.startswith("token"):
        ratio = [math.exp(x) for x in log_ratio]
    else:  # the product of the sequence's token ratios
        prod = {}
        for i, x in zip(ids, log_ratio):
            prod[i] = prod.get(i, 1.0) * math.exp(x)
        ratio = [prod[i] for i in ids]
    if mode.endswith("truncate"):
        want_w, want_m = [min(r, high) for r in ratio], [False] * len(ids)
    else:
        want_m = [not (low <= r <= high) for r in ratio]
        want_w = [0.0 if m else r for r, m in zip(ratio, want_m)]
    lp_r = torch.tensor(lp_rollout, dtype=torch.float64, requires_grad=True)
    weights, masked = sampler_correction_weights(lp_r, torch.tensor(lp_sampler, dtype=torch.float64),
                                                 torch.tensor(ids), mode, low, high)
    _close(weights, want_w)
    assert masked.tolist() == want_m and masked.dtype == torch.bool
    assert weights.dtype == torch.float64 and not weights.requires_grad
    # every branch: kept and masked (or truncated and not)
    if mode.endswith("mask"):
        assert any(want_m) and not all(want_m)
    else:
        assert any(r > high for r in ratio) and any(r < high for r in ratio)


def test_sampler_correction_none_and_unknown():
    w, m = sampler_correction_weights(torch.zeros(3), torch.ones(3), None, "none", 0.0, 3.0)
    assert w.tolist() == [1.0, 1.0, 1.0] and not m.any()
    with pytest.raises(ValueError, match="sampler correction"):
        sampler_correction_weights(torch.zeros(3), torch.ones(3), None, "tokens", 0.0, 3.0)


# -- §16 token selection by entropy, the entropy coefficient --------------------------------------------------

def _hand_quantile(values, q):
    """The q-quantile with linear interpolation between order statistics."""
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (pos - lo) * (v[hi] - v[lo])


@pytest.mark.parametrize("quantile", [0.2, 0.35, 0.5, 0.9])
def test_entropy_threshold_and_mask(quantile):
    rng = random.Random(17)
    ent = [rng.uniform(0.0, 3.0) for _ in range(23)]
    t = torch.tensor(ent, dtype=torch.float64)
    thr = entropy_threshold(t, quantile)
    assert abs(thr - _hand_quantile(ent, 1 - quantile)) < TOL
    assert abs(thr - torch.quantile(t, 1 - quantile).item()) < TOL  # torch.quantile's semantics
    mask = top_entropy_mask(t, thr)
    assert mask.tolist() == [e >= thr for e in ent]
    # the top `quantile` share of tokens, up to the one straddling the threshold
    assert abs(mask.sum().item() - quantile * len(ent)) <= 1
    assert entropy_threshold(t.float(), quantile) == pytest.approx(thr, abs=1e-6)


def test_entropy_quantile_one_keeps_every_token():
    t = torch.tensor([0.0, 0.5, 2.0])
    thr = entropy_threshold(t, 1.0)
    assert thr == float("-inf") and top_entropy_mask(t, thr).all()
    with pytest.raises(ValueError, match="quantile"):
        entropy_threshold(t, 0.0)


def test_adapt_entropy_coef_both_directions_and_clamp():
    coef, target, lr = 0.01, 0.5, 0.1
    assert abs(adapt_entropy_coef(coef, 0.3, target, lr) - (0.01 + 0.1 * 0.2)) < TOL  # below target: raise
    assert abs(adapt_entropy_coef(coef, 0.55, target, lr) - (0.01 - 0.1 * 0.05)) < TOL  # above: lower
    assert adapt_entropy_coef(coef, 2.0, target, lr) == 0.0  # would go negative: clamped at 0
    ent = torch.tensor([0.1, 0.2, 0.6])  # mean 0.3
    assert abs(adapt_entropy_coef(coef, ent, target, lr) - 0.03) < 1e-7


# -- §17 reward scaling and several rewards -----------------------------------------------------------------

REWARDS = [[1.0, 2.0, NAN, 6.0], [0.0, 0.0, 0.0, 0.0], [3.0, 0.5, 0.5, 1.0]]


def _hand_means(rows):
    out = []
    for row in rows:
        v = [x for x in row if not math.isnan(x)]
        out.append(sum(v) / len(v))
    return out


def _hand_std(values):
    m = sum(values) / len(values)
    return math.sqrt(sum((x - m) ** 2 for x in values) / (len(values) - 1))


@pytest.mark.parametrize("scale", ["batch", "none"])
def test_scale_rewards_equal_hand_formula(scale):
    r = torch.tensor(REWARDS, dtype=torch.float64)
    adv = group_advantages(r, "mean_std", scale=scale)
    means = _hand_means(REWARDS)
    all_valid = [x for row in REWARDS for x in row if not math.isnan(x)]
    div = _hand_std(all_valid) + 1e-4 if scale == "batch" else 1.0
    want = []
    for g, row in enumerate(REWARDS):
        flat = len(set(x for x in row if not math.isnan(x))) < 2
        want += [0.0 if math.isnan(x) or flat else (x - means[g]) / div for x in row]
    _close(adv.view(-1), want)
    if scale == "none":
        assert torch.equal(adv, group_advantages(r, "mean"))


def test_scale_rewards_only_with_mean_std():
    r = torch.tensor(REWARDS)
    assert torch.equal(group_advantages(r, scale="group"), group_advantages(r))
    with pytest.raises(ValueError, match="'batch'.*'rloo'"):
        group_advantages(r, "rloo", scale="batch")
    with pytest.raises(ValueError, match="'none'.*'sign'"):
        group_advantages(r, "sign", scale="none")


def _hand_group_adv(row, valid, divide):
    """(R - mean) / (std + 1e-4) over the row's valid entries (without the division when not `divide`);
    0 where invalid or when those are all equal."""
    v = [x for x, ok in zip(row, valid) if ok]
    if len(v) < 2 or len(set(v)) < 2:
        return [0.0] * len(row)
    m, s = sum(v) / len(v), (_hand_std(v) + 1e-4 if divide else 1.0)
    return [(x - m) / s if ok else 0.0 for x, ok in zip(row, valid)]


@pytest.mark.parametrize("scale", ["group", "none"])
def test_normalize_then_sum_equals_hand_formula(scale):
    correct = [[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 0.0]]
    length = [[0.2, 0.9, 0.5, NAN], [0.4, 0.4, 0.4, 0.4], [0.0, 0.0, 0.0, 0.0]]  # skips one; group 2 is flat
    weights = [1.0, 0.5]
    adv = normalize_then_sum_advantages([torch.tensor(correct, dtype=torch.float64),
                                         torch.tensor(length, dtype=torch.float64)], weights, scale=scale)
    total, valid_all = [], []
    for g in range(3):
        valid = [not (math.isnan(a) or math.isnan(b)) for a, b in zip(correct[g], length[g])]
        a1, a2 = (_hand_group_adv(f[g], valid, divide=scale != "none") for f in (correct, length))
        total += [weights[0] * x + weights[1] * y for x, y in zip(a1, a2)]
        valid_all += valid
    if scale != "none":
        sd = _hand_std([t for t, ok in zip(total, valid_all) if ok])
        total = [t / (sd + STD_EPS) for t in total]
    want = [t if ok else 0.0 for t, ok in zip(total, valid_all)]
    _close(adv.view(-1), want)
    assert adv[0, 3] == 0 and (adv[1] == 0).all()  # the skipped completion, the group without contrast
    assert (adv[2] != 0).all()  # one function without contrast, the other with: that one decides


def test_normalize_then_sum_leaves_a_not_applicable_score_out_of_that_function_alone():
    """A scored completion one function returned NaN for (a TRL-shaped None: "does not apply") is out of that
    function's group statistics and adds 0 to the sum; the other functions still score it (TRL's
    multi_objective_aggregation="normalize_then_sum"). An unscored completion gets 0 and is in no statistic."""
    a = [[1.0, 0.0, 1.0, 0.0, 1.0]]
    b = [[NAN, 1.0, 0.0, 0.0, NAN]]
    scored = torch.tensor([[True, True, True, True, False]])   # the last: every function skipped it, say
    adv = normalize_then_sum_advantages([torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)],
                                        [1.0, 1.0], scored=scored)
    # by hand, over the scored completions 0-3: a's group advantage on all four, b's on 1-3 (0 on completion 0)
    a1 = _hand_group_adv(a[0][:4], [True] * 4, divide=True)
    b1 = _hand_group_adv(b[0][:4], [False, True, True, True], divide=True)
    s = [x + y for x, y in zip(a1, b1)]
    sd = _hand_std(s)
    _close(adv.view(-1), [x / (sd + STD_EPS) for x in s] + [0.0])
    assert adv[0, 0] > 0 and adv[0, 4] == 0   # completion 0 keeps a's credit; the unscored one has none
    # without `scored`, a completion any function left out is skipped for all (the lowmem-convention meaning)
    skipped = normalize_then_sum_advantages([torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)],
                                            [1.0, 1.0])
    assert skipped[0, 0] == 0 and skipped[0, 4] == 0


def test_normalize_then_sum_needs_one_weight_per_function():
    with pytest.raises(ValueError, match="one weight per reward function"):
        normalize_then_sum_advantages([torch.zeros(1, 2)], [1.0, 2.0])


# -- defaults and invalid combinations ------------------------------------------------------------------------

@pytest.mark.parametrize("clip", ["ratio", "target"])
@pytest.mark.parametrize("kl_target", ["ref", "mirror", "both", "none"])
def test_defaults_give_todays_loss_exactly(clip, kl_target):
    g = torch.Generator().manual_seed(1)
    n = 40
    lp = (torch.randn(n, generator=g, dtype=torch.float64) - 2).requires_grad_()
    spread = 0.5 if clip == "ratio" else 1.6  # so that both bounds bind somewhere
    lp_old = (lp.detach() + spread * torch.randn(n, generator=g, dtype=torch.float64)).clamp(max=-0.05)
    lp_ref = lp.detach() + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    kw = dict(beta=0.04, eps_low=0.2, eps_high=0.28, clip=clip, kl_target=kl_target, beta_mirror=0.1)
    plain = grpo_token_loss(lp, lp_old, lp_ref, adv, LossOptions(**kw))
    explicit = grpo_token_loss(lp, lp_old, lp_ref, adv, LossOptions(**kw, level="token", delta=None),
                               seq_index=torch.arange(n), pg_weight=None, entropy=torch.ones(n), entropy_coef=0.0)
    # today's composition, from the unchanged building blocks
    surr = (ratio_clip_surrogate(lp, lp_old, adv, 0.2, 0.28) if clip == "ratio"
            else target_clip_surrogate(lp, lp_old, adv))
    penalty, _, _ = kl_terms(lp, lp_ref, lp_old, target=kl_target, beta=0.04, beta_mirror=0.1, estimator="k3")
    today = -surr if penalty is None else -surr + penalty
    for tl in (plain, explicit):
        assert torch.equal(tl.loss, today)
        grads = [torch.autograd.grad(x.sum(), lp, retain_graph=True)[0] for x in (tl.loss, today)]
        assert torch.equal(*grads)
    assert torch.equal(plain.clipped_low, explicit.clipped_low)
    assert torch.equal(plain.clipped_high, explicit.clipped_high)
    assert plain.clipped_low.any() and plain.clipped_high.any()
    if kl_target == "ref":
        assert torch.equal(plain.kl_ref, k3_kl(lp, lp_ref))


@pytest.mark.parametrize("options, words", [
    (dict(clip="target", level="sequence"), "not defined at level"),
    (dict(clip="cispo", delta=2.0), "delta only applies"),
    (dict(clip="target", delta=2.0), "delta only applies"),
    (dict(level="tokens"), "importance sampling level"),
    (dict(clip="clipped"), "unknown clip"),
])
def test_invalid_option_combinations(options, words):
    """Refused when the options are built, once, not on each micro-batch."""
    with pytest.raises(ValueError, match=words):
        LossOptions(beta=0.0, **options)


def test_sequence_level_needs_the_batchs_seq_index():
    """What only a batch can bring is checked per call."""
    x = torch.zeros(3, dtype=torch.float64)
    with pytest.raises(ValueError, match="needs seq_index"):
        grpo_token_loss(x, x, x, x, LossOptions(beta=0.0, level="sequence"))


def test_off_policy_sequence_mask_equals_hand_formula():
    """DeepSeek-V3.2's mask (TRL's off_policy_mask_threshold): a completion is dropped when A < 0 and the mean of
    lp_sampler - lp over its tokens is above the threshold; kept otherwise, whatever its KL when A >= 0."""
    from lowmem_grpo.loss import off_policy_sequence_mask

    seq = torch.tensor([0, 0, 1, 1, 1, 2, 2, 3])
    lp = torch.tensor([-1.0, -2.0, -0.5, -0.5, -3.0, -1.0, -1.0, -2.0], dtype=torch.float64, requires_grad=True)
    lp_sampler = torch.tensor([-0.8, -1.6, -0.5, -0.4, -2.9, -0.2, -0.2, -1.0], dtype=torch.float64)
    adv = torch.tensor([-1.0, -1.0, -0.5, -0.5, -0.5, 2.0, 2.0, -0.1], dtype=torch.float64)
    threshold = 0.25
    got = off_policy_sequence_mask(lp, lp_sampler, adv, seq, threshold)
    want = []
    for i in range(len(seq)):
        mine = [j for j in range(len(seq)) if seq[j] == seq[i]]
        kl = sum(lp_sampler[j].item() - lp[j].item() for j in mine) / len(mine)
        want.append(1.0 if adv[i].item() >= 0 or kl <= threshold else 0.0)
    # seq 0: A < 0, KL 0.3 -> dropped; seq 1: KL 0.067 -> kept; seq 2: KL 0.8 but A > 0 -> kept; seq 3: KL 1.0 -> dropped
    assert got.tolist() == want == [0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0]
    assert not got.requires_grad


def test_the_trainer_masks_against_the_engines_log_probs_or_the_old_policys():
    """Trainer.policy_weights puts the off-policy mask in the policy term's weight: against the sampler's
    log-probs where the engine reported them, else against the old policy's."""
    from types import SimpleNamespace

    from lowmem_grpo.recipe import recipe_from_dict
    from lowmem_grpo.train import Trainer

    recipe = recipe_from_dict({"model": {"name_or_path": "m"}, "data": {"train_path": "t.jsonl"},
                               "algorithm": {"off_policy_mask_threshold": 0.1, "mu": 2}})
    me = SimpleNamespace(recipe=recipe)
    logp = torch.tensor([-1.0, -1.0, -2.0, -2.0])
    far = torch.tensor([-0.5, -0.5, -2.0, -2.0])       # sequence 0 moved 0.5 nats away, sequence 1 not at all
    mb = SimpleNamespace(pg_mask=None, logp_sampler=far, advantages=torch.tensor([-1.0, -1.0, -1.0, -1.0]),
                         seq_ids=torch.tensor([0, 0, 1, 1]))
    weight, _ = Trainer.policy_weights(me, mb, logp, logp.clone())
    assert weight.tolist() == [0.0, 0.0, 1.0, 1.0]
    mb.logp_sampler = None                               # no engine log-probs: the old policy's (here: no drift)
    weight, _ = Trainer.policy_weights(me, mb, logp, logp.clone())
    assert weight.tolist() == [1.0, 1.0, 1.0, 1.0]
    weight, _ = Trainer.policy_weights(me, mb, logp, far)
    assert weight.tolist() == [0.0, 0.0, 1.0, 1.0]


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_sapo_surrogate_equals_hand_formula(level):
    """clip: sapo (TRL's loss_type sapo): -(4 / tau) sigmoid(tau (r - 1)) A per token, tau by the sign of A; at
    r = 1 its gradient is the plain -A; nothing is flagged clipped."""
    g = torch.Generator().manual_seed(7)
    seq = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
    n = seq.numel()
    lp = (torch.randn(n, generator=g, dtype=torch.float64) - 1.0).requires_grad_()
    lp_old = lp.detach() + 0.6 * torch.randn(n, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, 1.0, -0.5, -0.5, 0.0, 0.0, 0.0], dtype=torch.float64)
    tau_pos, tau_neg = 1.0, 1.05
    options = LossOptions(beta=0.0, kl_target="none", clip="sapo", level=level, sapo_temperatures=(tau_pos, tau_neg))
    tl = grpo_token_loss(lp, lp_old, None, adv, options, seq_index=seq)

    def hand(x: list) -> list:
        out = []
        for i in range(n):
            if level == "token":
                r = math.exp(x[i] - lp_old[i].item())
            else:
                mine = [j for j in range(n) if seq[j] == seq[i]]
                r = math.exp(sum(x[j] - lp_old[j].item() for j in mine) / len(mine))
            tau = tau_pos if adv[i].item() > 0 else tau_neg
            out.append(-(4 / tau) / (1 + math.exp(-tau * (r - 1))) * adv[i].item())
        return out

    base = lp.detach().tolist()
    assert max(abs(a - b) for a, b in zip(tl.loss.tolist(), hand(base))) < 1e-12
    (grad,) = torch.autograd.grad(tl.loss.sum(), lp)
    fd = central_differences(hand, base)
    assert max(abs(a - b) for a, b in zip(grad.tolist(), fd)) < 1e-8
    assert not tl.clipped_low.any() and not tl.clipped_high.any()
    on_policy = lp.detach().clone().requires_grad_()
    tl = grpo_token_loss(on_policy, on_policy.detach(), None, adv,
                         LossOptions(beta=0.0, kl_target="none", clip="sapo", level=level), seq_index=seq)
    (grad,) = torch.autograd.grad(tl.loss.sum(), on_policy)
    want = -adv if level == "token" else -torch.stack([adv[seq == seq[i]].sum() / (seq == seq[i]).sum()
                                                        for i in range(n)])
    assert torch.allclose(grad, want)


# -- §14.2 VESPO ------------------------------------------------------------------------------------------------

# (completion id, A, [(lp_old, lp), ...]): w < 1 and w > 1 for either sign of A, w = 1, A = 0, a token log-ratio
# beyond the +-20 bound (-25 -> -20: the sum is -0.5, not -5.5) and a sum below log 1e-8 (-22 -> -18.42)
VESPO_CASES = [
    (7, 1.0, [(-1.0, -1.3), (-2.0, -2.1), (-0.7, -0.9)]),
    (2, 0.5, [(-1.5, -1.1), (-2.2, -1.9)]),
    (5, -1.2, [(-0.9, -1.4), (-1.7, -1.6)]),
    (9, -0.4, [(-2.0, -1.8), (-1.1, -0.85), (-3.0, -2.9)]),
    (0, 0.8, [(-1.2, -1.2), (-0.4, -0.4)]),
    (4, -0.7, [(-0.5, -25.5), (-21.0, -1.5)]),
    (3, 1.5, [(-1.0, -13.0), (-0.5, -10.5)]),
    (6, 0.0, [(-1.0, -0.8)]),
]


def _vespo_flat(cases, seed):
    """Per-token lists of VESPO_CASES, shuffled so that a completion's tokens are not contiguous."""
    toks = [(sid, lp, lo, a) for sid, a, pairs in cases for lo, lp in pairs]
    random.Random(seed).shuffle(toks)
    return {k: [t[i] for t in toks] for i, k in enumerate(("ids", "lp", "lp_old", "adv"))}


def _hand_vespo_phi(d, shape, sampler=None):
    """phi per completion id, from the formula of §14.2 with Python floats."""
    k_pos, lam_pos, k_neg, lam_neg = shape
    log_w, adv = {}, {}
    for n, (sid, lp, lo, a) in enumerate(zip(d["ids"], d["lp"], d["lp_old"], d["adv"])):
        x = min(max(lp - lo, -20.0), 20.0)
        if sampler is not None:
            c = sampler[n]
            x += min(max(math.log(c) if c > 0 else -math.inf, math.log(1e-8)), 20.0)
        log_w[sid] = log_w.get(sid, 0.0) + x
        adv[sid] = a
    phi = {}
    for sid, lw in log_w.items():
        lw = min(max(lw, math.log(1e-8)), 20.0)
        k, lam = (k_pos, lam_pos) if adv[sid] >= 0 else (k_neg, lam_neg)
        phi[sid] = math.exp(lam + k * lw - lam * math.exp(lw))
    return phi


@pytest.mark.parametrize("shape", [(2.0, 3.0, 3.0, 2.0), (1.5, 0.8, 0.5, 4.0)])
def test_vespo_equals_hand_formula(shape):
    """clip: vespo (TRL's loss_type vespo): -sg(phi(w_i)) A_i lp per token, w_i the product of the completion's token
    ratios; the gradient is -phi A: phi carries none (at w = 1 its own derivative, k - lambda, is not 0)."""
    from lowmem_grpo.loss import vespo_weight

    d = _vespo_flat(VESPO_CASES, seed=23)
    lp, lp_old, _, adv, ids = _tensors({**d, "lp_ref": d["lp"]})
    tl = grpo_token_loss(lp, lp_old, None, adv,
                         LossOptions(beta=0.0, kl_target="none", clip="vespo", vespo_shape=shape), seq_index=ids)
    phi = _hand_vespo_phi(d, shape)
    want_phi = [phi[i] for i in d["ids"]]
    for got, want in zip(tl.vespo_weight.tolist(), want_phi):   # relative: the clamped ones are ~1e-15
        assert math.isclose(got, want, rel_tol=1e-9, abs_tol=0.0), (got, want)
    assert phi[0] == 1.0 and phi[7] != 1.0 and 0 < phi[3] < 1e-10   # w = 1; w < 1; the log 1e-8 floor
    k_neg, lam_neg = shape[2:]   # completion 4 (A < 0): -25 + 19.5 counts as -20 + 19.5, log w = -0.5
    assert math.isclose(phi[4], math.exp(lam_neg - 0.5 * k_neg - lam_neg * math.exp(-0.5)), rel_tol=1e-12)
    rng = random.Random(5)
    w = [rng.uniform(0.05, 0.3) for _ in d["ids"]]
    loss = aggregate(tl.loss, torch.tensor(w, dtype=torch.float64))
    hand = sum(wt * -p * a * x for wt, p, a, x in zip(w, want_phi, d["adv"], d["lp"]))
    assert abs(loss.item() - hand) < TOL
    (grad,) = torch.autograd.grad(loss, lp)
    _close(grad, [-wt * p * a for wt, p, a in zip(w, want_phi, d["adv"])])
    assert not tl.vespo_weight.requires_grad
    assert not vespo_weight(lp, lp_old, adv, ids, shape).requires_grad
    assert not tl.clipped_low.any() and not tl.clipped_high.any()   # a weight, not a clip
    # on-policy (mu = 1, no sampler correction): w = 1, phi = 1, the plain policy gradient -A
    tl = grpo_token_loss(lp, lp.detach(), None, adv,
                         LossOptions(beta=0.0, kl_target="none", clip="vespo", vespo_shape=shape), seq_index=ids)
    assert tl.vespo_weight.tolist() == [1.0] * len(d["ids"])
    _close(torch.autograd.grad(tl.loss.sum(), lp)[0], [-a for a in d["adv"]])


def test_vespo_takes_the_sampler_correction_into_its_ratio():
    """§14.2/§15: the token correction c enters log w (log c clamped to [log 1e-8, 20]) and does not multiply the
    loss; a masked token (c = 0) drives its completion's phi to ~0; pg_weight (the §16 masks) still multiplies."""
    d = _vespo_flat(VESPO_CASES[:5], seed=29)
    lp, lp_old, _, adv, ids = _tensors({**d, "lp_ref": d["lp"]})
    rng = random.Random(31)
    c = [rng.choice([0.6, 0.95, 1.3, 3.0]) for _ in d["ids"]]
    c[d["ids"].index(2)] = 0.0   # one token of completion 2 masked
    pgw = [rng.choice([0.0, 1.0]) for _ in d["ids"]]
    shape = (2.0, 3.0, 3.0, 2.0)
    tl = grpo_token_loss(lp, lp_old, None, adv,
                         LossOptions(beta=0.0, kl_target="none", clip="vespo", vespo_shape=shape), seq_index=ids,
                         sampler_weight=torch.tensor(c, dtype=torch.float64),
                         pg_weight=torch.tensor(pgw, dtype=torch.float64))
    phi = _hand_vespo_phi(d, shape, sampler=c)
    assert phi[2] < 1e-12 and all(phi[i] > 1e-3 for i in (7, 5, 9, 0))
    want = [-m * phi[i] * a * x for m, i, a, x in zip(pgw, d["ids"], d["adv"], d["lp"])]   # no factor c
    _close(tl.loss, want, tol=1e-12)
    (grad,) = torch.autograd.grad(tl.loss.sum(), lp)
    _close(grad, [-m * phi[i] * a for m, i, a in zip(pgw, d["ids"], d["adv"])], tol=1e-12)
    without = grpo_token_loss(lp, lp_old, None, adv, LossOptions(beta=0.0, kl_target="none", clip="vespo"),
                              seq_index=ids)
    assert not torch.allclose(without.vespo_weight, tl.vespo_weight)


def _padded(seed, lengths, spread=1.0):
    """A padded batch as TRL holds it ([B, T] log-probs and mask, [B] advantages of both signs) and the same tokens
    in this project's flat layout (those under the mask, in row order, with their row as seq_index)."""
    g = torch.Generator().manual_seed(seed)
    B, T = len(lengths), max(lengths)
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    lp_old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.05
    lp = lp_old + spread * torch.randn(B, T, generator=g, dtype=torch.float64) / torch.tensor(lengths)[:, None] ** 0.5
    lp[0, 0] = lp_old[0, 0] - 24.0   # one token beyond the -20 bound
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    adv[1] = 0.0   # A = 0 counts as A >= 0
    seq = torch.arange(B)[:, None].expand(B, T)[mask]
    return lp, lp_old, mask, adv, seq


@pytest.mark.parametrize("correction", [None, "token_truncate", "token_mask"])
# (TRL holds k and lambda in torch's default float32: values exact in float32, so that 1e-12 can hold)
@pytest.mark.parametrize("shape", [(2.0, 3.0, 3.0, 2.0), (1.5, 0.75, 0.5, 4.0)])
def test_vespo_weight_is_trls_gamma_weight(correction, shape):
    """Our phi on the flat layout equals TRL 1.16's GRPOTrainer.get_gamma_weights on the padded batch, with TRL's
    token importance_sampling_ratio (1 on padding, as TRL leaves it) where a sampler correction is on."""
    trainer = pytest.importorskip("trl.trainer.grpo_trainer")
    from lowmem_grpo.loss import vespo_weight

    lengths = [5, 3, 7, 1, 6, 4, 7, 2]
    lp, lp_old, mask, adv, seq = _padded(41, lengths)
    ratio = None
    if correction is not None:
        g = torch.Generator().manual_seed(43)
        lp_sampler = lp_old + 0.4 * torch.randn(lp.shape, generator=g, dtype=torch.float64)
        w, _ = sampler_correction_weights(lp_old[mask], lp_sampler[mask], seq, correction, 0.5, 1.5)
        assert (w == 0).any() if correction == "token_mask" else (w == 1.5).any()
        ratio = torch.ones_like(lp)
        ratio[mask] = w
    k_pos, lam_pos, k_neg, lam_neg = shape
    trl_phi = trainer.GRPOTrainer.get_gamma_weights(adv[:, None], lp - lp_old, mask.to(lp.dtype), ratio,
                                                    k_pos=k_pos, lambda_pos=lam_pos, k_neg=k_neg, lambda_neg=lam_neg)
    ours = vespo_weight(lp[mask], lp_old[mask], adv[seq], seq, shape, None if ratio is None else ratio[mask])
    want = trl_phi.expand_as(lp)[mask]
    assert torch.allclose(ours, want, rtol=1e-12, atol=1e-300), (ours, want)
    assert (want > 0.05).sum() >= 3 and (want != 1).all()   # not all vanished, none trivially 1


class _Accelerator:
    num_processes = 1

    @staticmethod
    def gather(x):
        return x

    @staticmethod
    def reduce(x, reduction="sum"):
        return x


def _trls_loss(loss_type, level, lp_leaf, lp_old, mask, adv, ratio, eps=(0.2, 0.28), shape=(2.0, 3.0, 3.0, 2.0)):
    """TRL 1.16's GRPOTrainer._compute_loss on a stand-in trainer whose model returns lp_leaf: no KL, no entropy
    masks, one accumulation step, one process, so that its normalisers are the whole batch's."""
    from collections import defaultdict
    from types import SimpleNamespace

    trainer = pytest.importorskip("trl.trainer.grpo_trainer")
    B, T = lp_leaf.shape
    k_pos, lam_pos, k_neg, lam_neg = shape
    me = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (lp_leaf, torch.zeros_like(lp_leaf), None),
        get_gamma_weights=trainer.GRPOTrainer.get_gamma_weights, top_entropy_quantile=1.0,
        off_policy_mask_threshold=None, importance_sampling_level=level, beta=0.0, loss_type=loss_type,
        epsilon_low=eps[0], epsilon_high=eps[1], use_vllm=ratio is not None, vllm_importance_sampling_correction=True,
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1, accelerator=_Accelerator(),
        _entropy_bonus_enabled=False, aux_loss_enabled=False, _metrics=defaultdict(lambda: defaultdict(list)),
        args=SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1, vespo_k_pos=k_pos,
                             vespo_lambda_pos=lam_pos, vespo_k_neg=k_neg, vespo_lambda_neg=lam_neg))
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask.long(),
              "advantages": adv, "old_per_token_logps": lp_old, "num_items_in_batch": mask.sum().to(lp_leaf.dtype)}
    if ratio is not None:
        inputs["importance_sampling_ratio"] = ratio
    return trainer.GRPOTrainer._compute_loss(me, None, inputs)


@pytest.mark.parametrize("loss_type, level, correction", [
    ("luspo", "sequence", None), ("luspo", "token", None), ("vespo", "token", None), ("vespo", "token", "token_mask"),
    ("vespo", "token", "token_truncate")])
def test_luspo_and_vespo_losses_and_gradients_are_trls(loss_type, level, correction):
    """TRL's loss_type luspo (its normaliser: each completion's token sum, averaged over completions) and vespo (its
    dapo normaliser; vLLM's token ratio inside the weight, not on the loss) against this project's loss, aggregated
    as lowmem_grpo/trl.py maps them: the same number and the same gradient per token."""
    from lowmem_grpo.loss import aggregation_weights

    lengths = [5, 3, 7, 1, 6, 4, 7, 2]
    lp, lp_old, mask, adv, seq = _padded(47, lengths, spread=0.3 if loss_type == "luspo" else 1.0)
    lp[0, 0] = lp_old[0, 0] - 0.5
    ratio, c = None, None
    if correction is not None:
        g = torch.Generator().manual_seed(53)
        lp_sampler = lp_old + 0.3 * torch.randn(lp.shape, generator=g, dtype=torch.float64)
        c, _ = sampler_correction_weights(lp_old[mask], lp_sampler[mask], seq, correction, 0.5, 1.5)
        ratio = torch.ones_like(lp)
        ratio[mask] = c
    eps = (0.2, 0.28) if level == "token" else (0.05, 0.06)
    leaf = lp.clone().requires_grad_()
    trl_loss = _trls_loss(loss_type, level, leaf, lp_old, mask, adv, ratio, eps)
    (trl_grad,) = torch.autograd.grad(trl_loss, leaf)

    aggregation, clip = {"luspo": ("sequence_sum", "ratio"), "vespo": ("token_mean", "vespo")}[loss_type]
    mine = lp.clone().requires_grad_()
    options = LossOptions(beta=0.0, kl_target="none", clip=clip, eps_low=eps[0], eps_high=eps[1], level=level)
    tl = grpo_token_loss(mine[mask], lp_old[mask], None, adv[seq], options, seq_index=seq, sampler_weight=c)
    ours = aggregate(tl.loss, aggregation_weights(seq, torch.tensor(lengths), aggregation, max(lengths)))
    (our_grad,) = torch.autograd.grad(ours, mine)
    assert abs(ours.item() - trl_loss.item()) < 1e-12, (ours.item(), trl_loss.item())
    assert torch.allclose(our_grad, trl_grad, rtol=1e-10, atol=1e-14)
    assert (our_grad[mask] != 0).sum() >= 10 and (our_grad[~mask] == 0).all()
    if loss_type == "luspo":   # some completions clipped, some not: both branches compared
        assert (tl.clipped_low | tl.clipped_high).any() and not (tl.clipped_low | tl.clipped_high).all()


# -- §14.3 GMPO -------------------------------------------------------------------------------------------------

# (completion id, A, [(lp_old, lp), ...]); the log-ratios, against bounds 0.4 / 0.4: A > 0 with one above 0.4 (clipped)
# and one below -0.4 (kept: not the advantage's side); A < 0 with one below -0.4 (clipped) and one above 0.4 (kept);
# all inside; A = 0; a lone token that is clipped (its completion gets no gradient at all)
GMPO_CASES = [
    (3, 1.0, [(-1.0, -0.3), (-2.0, -2.6), (-0.9, -0.8)]),                    # +0.7, -0.6, +0.1
    (8, -0.7, [(-1.2, -1.9), (-0.8, -0.3), (-1.5, -1.45)]),                  # -0.7, +0.5, +0.05
    (1, 0.6, [(-0.7, -0.5), (-1.3, -1.6)]),                                   # +0.2, -0.3
    (5, -1.3, [(-2.5, -2.2), (-0.6, -0.75), (-1.1, -1.9), (-3.0, -2.2)]),    # +0.3, -0.15, -0.8, +0.8
    (0, 0.0, [(-1.0, -0.2), (-0.4, -1.4)]),                                   # A = 0
    (6, 1.4, [(-1.6, -1.1)]),                                                 # +0.5
]


def _hand_gmpo(d, eps_low, eps_high):
    """§14.3 with Python floats: ({completion id: W_i}, per token (clipped low, clipped high, passes gradient)).
    W_i = exp(mean_t y_t), y = min(x, eps_high) for A > 0, max(x, -eps_low) otherwise (x = lp - lp_old)."""
    sums, counts, flags = {}, {}, []
    for sid, lp, lo, a in zip(d["ids"], d["lp"], d["lp_old"], d["adv"]):
        x = lp - lo
        y = min(x, eps_high) if a > 0 else max(x, -eps_low)
        sums[sid] = sums.get(sid, 0.0) + y
        counts[sid] = counts.get(sid, 0) + 1
        flags.append((a < 0 and x < -eps_low, a > 0 and x > eps_high, y == x))
    return {sid: math.exp(sums[sid] / counts[sid]) for sid in sums}, counts, flags


@pytest.mark.parametrize("eps", [(0.4, 0.4), (0.25, 0.6)])
@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_gmpo_equals_hand_formula(eps, beta):
    """clip: gmpo: every token of completion i carries -W_i A_i, W_i the geometric mean of its clipped token ratios;
    d loss / d lp_iu = -A_i W_i (sum_t w_it) / |o_i| where u's log-ratio is not clipped, else 0 (plus the KL's own).
    Any per-token aggregation weights; the clip flags are the tokens past the bound on the advantage's side."""
    d = _vespo_flat(GMPO_CASES, seed=59)
    rng = random.Random(61)
    d["lp_ref"] = [x + rng.gauss(0.0, 0.3) for x in d["lp"]]
    lp, lp_old, lp_ref, adv, ids = _tensors(d)
    kl = dict(beta=beta, kl_target="ref") if beta else dict(beta=0.0, kl_target="none")
    tl = grpo_token_loss(lp, lp_old, lp_ref, adv, LossOptions(clip="gmpo", gmpo_epsilons=eps, **kl), seq_index=ids)
    W, counts, flags = _hand_gmpo(d, *eps)
    w = [rng.uniform(0.05, 0.3) for _ in d["ids"]]
    weight_sum = {}
    for i, wt in zip(d["ids"], w):
        weight_sum[i] = weight_sum.get(i, 0.0) + wt
    penalty = [beta * _hand_k3(x, r) for x, r in zip(d["lp"], d["lp_ref"])]
    _close(tl.loss, [-W[i] * a + p for i, a, p in zip(d["ids"], d["adv"], penalty)])
    loss = aggregate(tl.loss, torch.tensor(w, dtype=torch.float64))
    hand = sum(wt * (-W[i] * a + p) for wt, i, a, p in zip(w, d["ids"], d["adv"], penalty))
    assert abs(loss.item() - hand) < TOL
    (grad,) = torch.autograd.grad(loss, lp)
    want = [-a * W[i] * weight_sum[i] / counts[i] * passes + wt * beta * _hand_k3_grad(x, r)
            for i, a, (_, _, passes), wt, x, r in zip(d["ids"], d["adv"], flags, w, d["lp"], d["lp_ref"])]
    _close(grad, want)
    assert tl.clipped_low.tolist() == [f[0] for f in flags] and tl.clipped_high.tolist() == [f[1] for f in flags]
    if eps == (0.4, 0.4):   # every branch: clipped and kept on either side of the window, for both signs of A
        assert sum(f[0] for f in flags) == 2 and sum(f[1] for f in flags) == 2
        assert W[6] == math.exp(0.4) and all(g == 0.0 for g, i in zip(want, d["ids"]) if i == 6 and not beta)
    assert all(g != 0.0 for g, i, f in zip(want, d["ids"], flags) if i in (1, 3, 5, 8) and f[2])


@pytest.mark.parametrize("mode", ["sequence_mean", "token_mean", "constant", "sequence_sum", "sum"])
def test_gmpo_on_policy_is_grpo(mode):
    """mu: 1 (lp_old = lp detached): W = 1 and no bound binds, and since §5's weights are the same on every token of
    a completion, the gradient -A (sum_t w_it) / |o_i| is the ratio clip's -w_it A: GMPO differs only off-policy."""
    from lowmem_grpo.loss import aggregation_weights

    d = _vespo_flat(GMPO_CASES, seed=67)
    lp, _, _, adv, ids = _tensors({**d, "lp_ref": d["lp"]})
    lengths = torch.bincount(ids)
    weights = aggregation_weights(ids, lengths, mode, 6)
    grads = []
    for clip in ("gmpo", "ratio"):
        tl = grpo_token_loss(lp, lp.detach(), None, adv, LossOptions(beta=0.0, kl_target="none", clip=clip),
                             seq_index=ids)
        grads.append(torch.autograd.grad(aggregate(tl.loss, weights), lp)[0])
        assert not tl.clipped_low.any() and not tl.clipped_high.any()
    assert torch.allclose(grads[0], grads[1], rtol=1e-12, atol=1e-15) and (grads[0] != 0).sum() >= 10


def _trls_gmpo_loss(lp_leaf, lp_old, lp_ref, mask, adv, eps, beta):
    """TRL 1.16's experimental GMPOTrainer._compute_loss on a stand-in trainer whose model returns lp_leaf: no
    entropy mask, one accumulation step, one process. Returns the loss and the metrics it logged."""
    from collections import defaultdict
    from types import SimpleNamespace

    gmpo = pytest.importorskip("trl.experimental.gmpo.gmpo_trainer")
    B, T = lp_leaf.shape
    me = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (lp_leaf, torch.zeros_like(lp_leaf), None),
        top_entropy_quantile=1.0, epsilon_low=eps[0], epsilon_high=eps[1], beta=beta,
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1, accelerator=_Accelerator(),
        _metrics=defaultdict(lambda: defaultdict(list)))
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask.long(),
              "advantages": adv, "old_per_token_logps": lp_old, "ref_per_token_logps": lp_ref}
    loss = gmpo.GMPOTrainer._compute_loss(me, None, inputs)
    return loss, {k: v[-1] for k, v in me._metrics["train"].items()}


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("eps", [(0.4, 0.4), (0.2, 0.3)])
def test_gmpo_with_sequence_mean_is_trls_loss_and_clip_counts(beta, eps):
    """TRL's GMPO averages -W_i A_i (+ beta x each completion's mean k3) over the completions: §5's sequence_mean
    gives its number and its gradient per token; token_mean does not (the lengths differ). The clip fractions are
    TRL's clip_ratio/low_mean, high_mean and region_mean (tokens past the log-space bound on the advantage's side)."""
    from lowmem_grpo.loss import aggregation_weights

    lengths = [5, 3, 7, 1, 6, 4, 7, 2]
    lp, lp_old, mask, adv, seq = _padded(71, lengths, spread=0.8)
    lp[0, 0] = lp_old[0, 0] - 0.5
    lp_ref = lp + 0.3 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(73), dtype=torch.float64)
    leaf = lp.clone().requires_grad_()
    trl_loss, metrics = _trls_gmpo_loss(leaf, lp_old, lp_ref, mask, adv, eps, beta)
    (trl_grad,) = torch.autograd.grad(trl_loss, leaf)

    kl = dict(beta=beta, kl_target="ref") if beta else dict(beta=0.0, kl_target="none")
    mine = lp.clone().requires_grad_()
    tl = grpo_token_loss(mine[mask], lp_old[mask], lp_ref[mask], adv[seq], LossOptions(clip="gmpo", gmpo_epsilons=eps,
                                                                                        **kl), seq_index=seq)
    ours = aggregate(tl.loss, aggregation_weights(seq, torch.tensor(lengths), "sequence_mean", max(lengths)))
    (our_grad,) = torch.autograd.grad(ours, mine)
    assert abs(ours.item() - trl_loss.item()) < 1e-12, (ours.item(), trl_loss.item())
    assert torch.allclose(our_grad, trl_grad, rtol=1e-10, atol=1e-14)
    assert (our_grad[mask] != 0).sum() >= 10 and (our_grad[~mask] == 0).all()
    other = aggregate(tl.loss, aggregation_weights(seq, torch.tensor(lengths), "token_mean", max(lengths)))
    assert abs(other.item() - trl_loss.item()) > 1e-3
    low, high = tl.clipped_low.double().mean().item(), tl.clipped_high.double().mean().item()
    assert low > 0 and high > 0 and not (tl.clipped_low | tl.clipped_high).all()
    assert abs(low - metrics["clip_ratio/low_mean"]) < 1e-7 and abs(high - metrics["clip_ratio/high_mean"]) < 1e-7
    assert abs(low + high - metrics["clip_ratio/region_mean"]) < 1e-7


@pytest.mark.parametrize("options, call, words", [
    (dict(clip="vespo"), dict(), "needs seq_index"),
    (dict(clip="vespo", level="sequence"), None, "level must be 'token'"),
    (dict(clip="vespo", delta=2.0), None, "delta only applies"),
    (dict(clip="ratio"), dict(sampler_weight=torch.ones(3)), "sampler_weight enters clip 'vespo' only"),
    (dict(clip="gmpo"), dict(), "clip 'gmpo' needs seq_index"),
    (dict(clip="gmpo", level="sequence"), None, "clip 'gmpo' builds its own sequence ratio"),
    (dict(clip="gmpo", delta=2.0), None, "delta only applies"),
    (dict(clip="gmpo", gmpo_epsilons=(0.4,)), None, r"gmpo_epsilons must be \(low, high\)"),
    (dict(clip="gmpo", gmpo_epsilons=(0.4, 0.0)), None, r"gmpo_epsilons\[1\] must be a number > 0"),
    (dict(clip="gmpo"), dict(seq_index=torch.tensor([0, 0, 1]), pg_weight=torch.tensor([1.0, 0.0, 1.0])),
     "pg_weight differs between the tokens of a completion"),
])
def test_invalid_vespo_and_gmpo_combinations(options, call, words):
    """call None: refused when the options are built; else when the loss is called with these tensors."""
    if call is None:
        with pytest.raises(ValueError, match=words):
            LossOptions(beta=0.0, kl_target="none", **options)
        return
    built = LossOptions(beta=0.0, kl_target="none", **options)
    x = torch.zeros(3, dtype=torch.float64)
    with pytest.raises(ValueError, match=words):
        grpo_token_loss(x, x, None, x, built, **call)


def test_gmpo_takes_a_completion_weight_on_its_term():
    """The per-completion weights a GMPO recipe allows (§15's sequence_* correction, §15.1's off-policy mask) multiply
    the completion's term, value and gradient: a weight 0 leaves its completion no gradient at all."""
    d = _vespo_flat(GMPO_CASES, seed=79)
    lp, lp_old, _, adv, ids = _tensors({**d, "lp_ref": d["lp"]})
    per_seq = {3: 0.0, 8: 1.7, 1: 1.0, 5: 0.4, 0: 2.0, 6: 1.0}
    pgw = torch.tensor([per_seq[i] for i in d["ids"]], dtype=torch.float64)
    options = LossOptions(beta=0.0, kl_target="none", clip="gmpo")
    weighted = grpo_token_loss(lp, lp_old, None, adv, options, seq_index=ids, pg_weight=pgw)
    plain = grpo_token_loss(lp, lp_old, None, adv, options, seq_index=ids)
    w = torch.full_like(pgw, 0.1)
    g_weighted = torch.autograd.grad(aggregate(weighted.loss, w), lp)[0]
    g_plain = torch.autograd.grad(aggregate(plain.loss, w), lp)[0]
    assert torch.allclose(weighted.loss, plain.loss * pgw, rtol=1e-15, atol=0)
    assert torch.allclose(g_weighted, g_plain * pgw, rtol=1e-15, atol=0)
    assert (g_weighted[ids == 3] == 0).all() and (g_plain[ids == 3] != 0).any()


# -- §5 sequence_sum (LUSPO) -----------------------------------------------------------------------------------

def test_sequence_sum_aggregation_equals_hand_formula_and_splits_across_processes():
    """w_it = 1 / N: the mean over completions of each one's token sum; two processes holding halves of the batch
    (§21, totals = the whole batch's) give the same weights, and their weighted sums add up to the one-process sum."""
    from lowmem_grpo.loss import aggregation_weights

    lengths = [3, 1, 4, 2, 5]
    seq = torch.repeat_interleave(torch.arange(5), torch.tensor(lengths))
    w = aggregation_weights(seq, torch.tensor(lengths), "sequence_sum", 8)
    _close(w, [1.0 / 5] * sum(lengths), tol=1e-15)
    losses = torch.tensor([random.Random(k).uniform(-2, 2) for k in range(sum(lengths))], dtype=torch.float64)
    hand = sum(sum(losses[seq == i].tolist()) for i in range(5)) / 5
    assert abs(aggregate(losses, w).item() - hand) < 1e-12
    # process 0: completions 0-1, process 1: completions 2-4, each with the batch's totals
    totals = (5, sum(lengths))
    cut = lengths[0] + lengths[1]
    w0 = aggregation_weights(seq[:cut], torch.tensor(lengths[:2]), "sequence_sum", 8, totals)
    w1 = aggregation_weights(seq[cut:] - 2, torch.tensor(lengths[2:]), "sequence_sum", 8, totals)
    assert torch.equal(torch.cat([w0, w1]), w)
    assert abs(aggregate(losses[:cut], w0).item() + aggregate(losses[cut:], w1).item() - hand) < 1e-12
    # without totals a process would normalise by its own completions: a different (wrong) weight
    assert not torch.equal(aggregation_weights(seq[:cut], torch.tensor(lengths[:2]), "sequence_sum", 8), w0)


def test_luspo_gives_every_token_of_an_unclipped_completion_the_same_gradient():
    """GSPO's ratio (§13) under sequence_sum: d loss / d lp_it = -A_i s_i / N whatever |o_i| (sequence_mean divides it
    by |o_i|), and 0 on every token of a clipped completion."""
    from lowmem_grpo.loss import aggregation_weights

    d = _sequences([(0, 2, 1.0, 0.0002), (1, 6, -0.8, 0.0001), (2, 3, 1.2, 0.01), (3, 4, -0.5, -0.01)], seed=37)
    lp, lp_old, _, adv, ids = _tensors(d)
    lengths = torch.bincount(ids)
    eps = (3e-4, 4e-4)
    tl = grpo_token_loss(lp, lp_old, None, adv,
                         LossOptions(beta=0.0, kl_target="none", eps_low=eps[0], eps_high=eps[1], level="sequence"),
                         seq_index=ids)
    (grad,) = torch.autograd.grad(aggregate(tl.loss, aggregation_weights(ids, lengths, "sequence_sum", 8)), lp)
    s, _ = _hand_seq_ratio(d)
    want = []
    for i, a in zip(d["ids"], d["adv"]):
        clipped = (a > 0 and s[i] > 1 + eps[1]) or (a < 0 and s[i] < 1 - eps[0])
        want.append(0.0 if clipped else -a * s[i] / 4)
    _close(grad, want, tol=1e-12)
    assert sum(g == 0.0 for g in want) >= 2 and sum(g != 0.0 for g in want) >= 2


def test_the_trainer_puts_the_sampler_correction_into_vespos_ratio_not_its_weight():
    """Trainer.policy_weights: with clip vespo the §15 weight stays out of the policy term's multiplier (update()
    hands it to the loss as sampler_weight); with the other clips it multiplies the term."""
    from types import SimpleNamespace

    from lowmem_grpo.recipe import recipe_from_dict
    from lowmem_grpo.train import Trainer

    lp_old = torch.tensor([-1.0, -1.0, -2.0, -2.0])
    mb = SimpleNamespace(pg_mask=torch.tensor([True, False, True, True]), logp_sampler=lp_old - 0.2,
                         advantages=torch.ones(4), seq_ids=torch.tensor([0, 0, 1, 1]))
    base = {"model": {"name_or_path": "m"}, "data": {"train_path": "t.jsonl"}}
    for clip in ("vespo", "ratio"):
        me = SimpleNamespace(recipe=recipe_from_dict({**base, "algorithm": {"clip": clip,
                                                                            "sampler_correction": "token_truncate"}}))
        weight, (c, masked) = Trainer.policy_weights(me, mb, lp_old.clone(), lp_old)
        assert torch.allclose(c, torch.full((4,), math.exp(0.2))) and not masked.any()
        want = [1.0, 0.0, 1.0, 1.0] if clip == "vespo" else [math.exp(0.2), 0.0, math.exp(0.2), math.exp(0.2)]
        assert torch.allclose(weight, torch.tensor(want)), (clip, weight)


# -- LossOptions: the run's options as one object, built from the recipe ----------------------------------------

# Fields of recipe.algorithm that do not reach LossOptions, and where they go instead. A field added to the schema
# must be read by LossOptions.from_algorithm or named here: a loss option cannot be dropped on the way to the loss.
ALGORITHM_FIELDS_ELSEWHERE = {
    "advantage": "advantages.py", "sign_dead_band": "advantages.py", "scale_rewards": "advantages.py",
    "reward_aggregation": "advantages.py",
    "aggregation": "the per-token weights of aggregation_weights, per batch (§5)",
    "mu": "Trainer.run_updates (§7)", "minibatches": "Trainer.run_updates (§7)",
    "early_stop_unclipped_fraction": "Trainer.update (§7)", "early_stop_min_improvement": "Trainer.update (§7)",
    "skip_zero_std_groups": "trained_completions (§9)", "mask_truncated_completions": "trained_completions (§16)",
    "sampler_correction": "pg_weight / sampler_weight, per batch (§15)",
    "sampler_correction_min": "pg_weight, per batch (§15)", "sampler_correction_max": "pg_weight, per batch (§15)",
    "off_policy_mask_threshold": "pg_weight, per batch (§15.1)",
    "top_entropy_quantile": "pg_weight, per batch (§16)",
    "entropy_coef": "entropy_coef, adapted per step (§16)", "entropy_target": "adapt_entropy_coef (§16)",
    "entropy_coef_lr": "adapt_entropy_coef (§16)",
    "dynamic_sampling": "dynamic_sampling.py (§18)", "dynamic_sampling_max_draws": "dynamic_sampling.py (§18)",
}

# For each field from_algorithm reads: (a valid recipe it matters in, a new value for the field there)
LOSS_FIELD_CHANGES = {
    "beta": ({}, 0.1), "beta_mirror": ({}, 0.1), "kl_target": ({}, "none"), "kl_estimator": ({}, "k2"),
    "kl_ratio_weight": ({}, True), "clip": ({}, "cispo"), "epsilon_low": ({}, 0.1), "epsilon_high": ({}, 0.28),
    "importance_sampling_level": ({}, "sequence"), "delta": ({}, 3.0),
    "sequence_epsilon_low": ({"importance_sampling_level": "sequence"}, 1e-3),
    "sequence_epsilon_high": ({"importance_sampling_level": "sequence"}, 1e-3),
    "cispo_max_weight": ({"clip": "cispo"}, 2.5),
    "sapo_temperature_pos": ({"clip": "sapo"}, 2.0), "sapo_temperature_neg": ({"clip": "sapo"}, 2.0),
    "vespo_k_pos": ({"clip": "vespo"}, 1.5), "vespo_lambda_pos": ({"clip": "vespo"}, 1.5),
    "vespo_k_neg": ({"clip": "vespo"}, 1.5), "vespo_lambda_neg": ({"clip": "vespo"}, 1.5),
    "gmpo_epsilon_low": ({"clip": "gmpo"}, 0.3), "gmpo_epsilon_high": ({"clip": "gmpo"}, 0.3),
}


class _ReadRecorder:
    """An AlgorithmConfig stand-in that notes each field read from it."""

    def __init__(self, config):
        self._config, self.read = config, set()

    def __getattr__(self, name):
        self.read.add(name)
        return getattr(self._config, name)


def test_every_algorithm_field_reaches_the_loss_or_is_named_elsewhere():
    """A newcomer's audit: the loss took ~20 options threaded by hand from the recipe in Trainer.update, so a new
    option could be forgotten on the way. Each algorithm field is read by LossOptions.from_algorithm or named in
    ALGORITHM_FIELDS_ELSEWHERE (not both), and changing each field it reads changes the options, so that every
    LossOptions field comes from the recipe."""
    from dataclasses import fields

    from lowmem_grpo.loss import CLIPS, LEVELS
    from lowmem_grpo.recipe import AlgorithmConfig

    read = set()
    for clip in CLIPS:   # a field may be read only at some clip or level (sequence_epsilon_*: §13)
        for level in LEVELS:
            try:
                config = AlgorithmConfig(clip=clip, importance_sampling_level=level, mu=2)
            except ValueError:   # a combination the recipe refuses (pydantic's errors are ValueErrors)
                continue
            recorder = _ReadRecorder(config)
            LossOptions.from_algorithm(recorder)
            read |= recorder.read & set(AlgorithmConfig.model_fields)
    unclassified = set(AlgorithmConfig.model_fields) - read - set(ALGORITHM_FIELDS_ELSEWHERE)
    assert not unclassified, f"read in LossOptions.from_algorithm, or name in ALGORITHM_FIELDS_ELSEWHERE: {unclassified}"
    assert not read & set(ALGORITHM_FIELDS_ELSEWHERE), read & set(ALGORITHM_FIELDS_ELSEWHERE)
    assert set(LOSS_FIELD_CHANGES) == read, set(LOSS_FIELD_CHANGES) ^ read
    moved = set()
    for name, (context, value) in LOSS_FIELD_CHANGES.items():
        before = LossOptions.from_algorithm(AlgorithmConfig(**context))
        after = LossOptions.from_algorithm(AlgorithmConfig(**context, **{name: value}))
        changed = {f.name for f in fields(LossOptions) if getattr(before, f.name) != getattr(after, f.name)}
        assert changed, f"algorithm.{name} does not reach LossOptions"
        moved |= changed
    assert moved == {f.name for f in fields(LossOptions)}


def test_loss_options_defaults_are_the_recipes_and_sequence_level_takes_its_own_epsilons():
    """LossOptions() is the recipe's default GRPO; at importance_sampling_level sequence the clip window is
    sequence_epsilon_low/high (§13), the rule Trainer.update held before the options were one object."""
    from dataclasses import FrozenInstanceError

    from lowmem_grpo.recipe import AlgorithmConfig

    assert LossOptions() == LossOptions.from_algorithm(AlgorithmConfig())
    token = LossOptions.from_algorithm(AlgorithmConfig(epsilon_low=0.1, epsilon_high=0.3))
    assert (token.level, token.eps_low, token.eps_high) == ("token", 0.1, 0.3)
    seq = LossOptions.from_algorithm(AlgorithmConfig(importance_sampling_level="sequence", sequence_epsilon_low=1e-3,
                                                     sequence_epsilon_high=2e-3, delta=1.5))
    assert (seq.level, seq.eps_low, seq.eps_high, seq.delta) == ("sequence", 1e-3, 2e-3, 1.5)
    with pytest.raises(FrozenInstanceError):   # one run, one set of options
        seq.beta = 1.0
    assert LossOptions(sapo_temperatures=[1.0, 2.0]) == LossOptions(sapo_temperatures=(1.0, 2.0))


@pytest.mark.parametrize("options, words", [
    (dict(beta=-0.1), "beta must be a number >= 0, got -0.1"),
    (dict(beta_mirror=NAN), "beta_mirror must be a number >= 0"),
    (dict(eps_low=-0.2), "eps_low must be a number >= 0"),
    (dict(kl_estimator="k4"), "kl_estimator must be one of k1, k2, k3, got 'k4'"),
    (dict(kl_target="forward"), "kl_target must be one of ref, mirror, both, none"),
    (dict(clip="sapo", sapo_temperatures=(1.0,)), r"sapo_temperatures must be \(tau_pos, tau_neg\)"),
    (dict(clip="sapo", sapo_temperatures=(1.0, 0.0)), r"sapo_temperatures\[1\] must be a number > 0"),
    (dict(clip="vespo", vespo_shape=(2.0, 3.0, 3.0)), "vespo_shape must be"),
    (dict(delta=1.1, eps_high=0.2), "delta must be a number > 1.2, got 1.1"),
    (dict(cispo_max_weight="5"), "cispo_max_weight must be a number > 0"),
])
def test_loss_options_refuse_what_the_loss_would_compute_as_garbage(options, words):
    """Found by the refactor: a bad estimator was a KeyError and a short temperature pair an unpacking error deep in
    the first micro-batch, a zero temperature or a NaN weight a NaN loss; now one line naming the field, at
    construction."""
    with pytest.raises(ValueError, match=words) as exc:
        LossOptions(**options)
    assert "\n" not in str(exc.value) and str(exc.value).startswith("LossOptions: ")


def test_the_loss_names_what_it_takes_in_place_of_options():
    x = torch.zeros(3, dtype=torch.float64)
    from lowmem_grpo.recipe import AlgorithmConfig

    with pytest.raises(TypeError, match=r"options must be a LossOptions .*got AlgorithmConfig"):
        grpo_token_loss(x, x, x, x, AlgorithmConfig())
