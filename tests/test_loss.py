"""The loss against a plain, loop-by-loop float64 evaluation of docs/algorithm.md §1, §2 and §5."""

import math

import pytest
import torch

from conftest import central_differences
from lowmem_grpo.advantages import group_advantages
from lowmem_grpo.loss import AGGREGATIONS, LossOptions, aggregate, aggregation_weights, grpo_token_loss


def hand_objective(lp, lp_old, lp_ref, adv, lengths, beta, eps_low, eps_high, mode, max_len):
    """-J(theta), written as docs/algorithm.md §1 writes it: sums over completions i and tokens t, in Python floats."""
    k, token_terms = 0, []
    for i, L in enumerate(lengths):
        seq = []
        for _ in range(L):
            r = math.exp(lp[k] - lp_old[k])
            a = adv[i]
            surrogate = min(r * a, min(max(r, 1 - eps_low), 1 + eps_high) * a)
            kl = math.exp(lp_ref[k] - lp[k]) - (lp_ref[k] - lp[k]) - 1 if beta > 0 else 0.0
            seq.append(-(surrogate - beta * kl))
            k += 1
        token_terms.append(seq)
    return hand_aggregate(token_terms, mode, max_len)


def hand_aggregate(token_terms: list, mode: str, max_len: int) -> float:
    """docs/algorithm.md §5's aggregations of per-token terms [[...] per completion], as written there. An unknown
    mode raises: a value added to algorithm.aggregation needs its formula here (found by an audit: it was read as
    sum)."""
    n_seq, n_tok = len(token_terms), sum(len(s) for s in token_terms)
    if mode == "sequence_mean":
        return sum(sum(s) / len(s) for s in token_terms) / n_seq
    if mode == "token_mean":
        return sum(sum(s) for s in token_terms) / n_tok
    if mode == "constant":
        return sum(sum(s) for s in token_terms) / (n_seq * max_len)
    if mode == "sequence_sum":
        return sum(sum(s) for s in token_terms) / n_seq
    if mode == "sum":
        return sum(sum(s) for s in token_terms)
    raise ValueError(f"no hand formula for aggregation {mode!r}")


def hand_advantages(rewards):
    out = []
    for group in rewards:
        m = sum(group) / len(group)
        sd = math.sqrt(sum((x - m) ** 2 for x in group) / (len(group) - 1))
        out.append([0.0 if sd == 0 else (x - m) / (sd + 1e-4) for x in group])
    return out


def _inputs(seed, mu, spread):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 7, (8,), generator=g)
    n = int(lengths.sum())
    lp = (torch.randn(n, generator=g, dtype=torch.float64) - 2).requires_grad_()
    # mu = 1: pi_old == pi_theta at the update (ratio 1); mu = 2: a previous update moved the policy.
    lp_old = lp.detach().clone() if mu == 1 else lp.detach() + spread * torch.randn(n, generator=g, dtype=torch.float64)
    lp_ref = lp.detach() + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)
    rewards = torch.randint(0, 2, (2, 4), generator=g).to(torch.float64)
    rewards[1] = torch.tensor([0.0, 1.0, 0.5, 1.0])
    return lengths, lp, lp_old, lp_ref, rewards


@pytest.mark.parametrize("mu", [1, 2])
@pytest.mark.parametrize("beta", [0.0, 0.1])
@pytest.mark.parametrize("mode", AGGREGATIONS)   # every value the recipe allows
def test_loss_equals_hand_formula(mu, beta, mode):
    lengths, lp, lp_old, lp_ref, rewards = _inputs(seed=11 * mu + int(10 * beta), mu=mu, spread=0.4)
    adv_seq = group_advantages(rewards, "mean_std").view(-1)
    assert torch.allclose(adv_seq.view(2, 4), torch.tensor(hand_advantages(rewards.tolist()), dtype=torch.float64), atol=1e-12)
    seq_of_tok = torch.repeat_interleave(torch.arange(8), lengths)
    eps_low, eps_high = 0.2, 0.28
    tl = grpo_token_loss(lp, lp_old, lp_ref, adv_seq[seq_of_tok],
                         LossOptions(beta=beta, eps_low=eps_low, eps_high=eps_high))
    ours = aggregate(tl.loss, aggregation_weights(seq_of_tok, lengths, mode, max_completion_length=6))
    args = (lp_old.tolist(), lp_ref.tolist(), adv_seq.tolist(), lengths.tolist(), beta, eps_low, eps_high, mode, 6)
    assert abs(ours.item() - hand_objective(lp.tolist(), *args)) < 1e-9
    if mu == 2:  # the clip must really be exercised, on both sides
        assert tl.clipped_low.any() and tl.clipped_high.any() and not (tl.clipped_low | tl.clipped_high).all()
    # gradients: autograd of our loss vs central differences of the hand formula
    (grad,) = torch.autograd.grad(ours, lp)
    base = lp.detach().tolist()
    for k in range(0, len(base), 5):
        h = 1e-6
        up, dn = list(base), list(base)
        up[k] += h
        dn[k] -= h
        fd = (hand_objective(up, *args) - hand_objective(dn, *args)) / (2 * h)
        assert abs(grad[k].item() - fd) < 1e-7


def test_mu1_gradient_is_advantage_plus_kl_term():
    """DeepSeekMath eq. 21 at r = 1: d(-J)/d lp_t = -(A + beta * (pi_ref/pi - 1)) * weight."""
    lengths, lp, _, lp_ref, rewards = _inputs(seed=5, mu=1, spread=0)
    adv = group_advantages(rewards).view(-1)
    seq_of_tok = torch.repeat_interleave(torch.arange(8), lengths)
    beta = 0.05
    tl = grpo_token_loss(lp, lp.detach(), lp_ref, adv[seq_of_tok], LossOptions(beta=beta, eps_low=0.2, eps_high=0.2))
    w = aggregation_weights(seq_of_tok, lengths, "sequence_mean", 6)
    (grad,) = torch.autograd.grad(aggregate(tl.loss, w), lp)
    expected = -(adv[seq_of_tok] + beta * (torch.exp(lp_ref - lp.detach()) - 1)) * w
    assert torch.allclose(grad, expected, atol=1e-12)


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_micro_batches_sum_to_the_one_batch_loss(mode):
    lengths, lp, lp_old, lp_ref, rewards = _inputs(seed=21, mu=2, spread=0.3)
    adv = group_advantages(rewards).view(-1)
    seq_of_tok = torch.repeat_interleave(torch.arange(8), lengths)
    w = aggregation_weights(seq_of_tok, lengths, mode, 6)

    def loss_of(sel):
        tl = grpo_token_loss(lp[sel], lp_old[sel], lp_ref[sel], adv[seq_of_tok][sel],
                             LossOptions(beta=0.1, eps_low=0.2, eps_high=0.2))
        return aggregate(tl.loss, w[sel])

    full = loss_of(torch.ones_like(seq_of_tok, dtype=torch.bool))
    (g_full,) = torch.autograd.grad(full, lp)
    total, g_acc = 0.0, torch.zeros_like(lp)
    for chunk in [(0, 3), (3, 5), (5, 8)]:  # micro-batches of whole completions
        sel = (seq_of_tok >= chunk[0]) & (seq_of_tok < chunk[1])
        part = loss_of(sel)
        (g,) = torch.autograd.grad(part, lp)
        total, g_acc = total + part.item(), g_acc + g
    assert abs(total - full.item()) < 1e-12
    assert torch.allclose(g_acc, g_full, atol=1e-12)


# -- The GRPO family (docs/algorithm.md §4, §6): clips ratio and target x every KL target x estimator against a hand
# evaluation (cispo, sapo, vespo, gmpo: each its own hand test, tests/test_loss_options.py) -------------------------

def hand_kl(est, lp, other):
    d = other - lp
    return {"k1": -d, "k2": 0.5 * d * d, "k3": math.exp(d) - d - 1}[est]


def hand_family_objective(lp, lp_old, lp_ref, adv, lengths, clip, kl_target, est, beta, beta_mirror, mode, max_len,
                          hits=None):
    """-J with the clips of docs/algorithm.md §6 written as stated there, in Python floats. `hits` gets each token's
    (branch, sign of A). A clip, KL target or mode it has no formula for raises (found by an audit: an unknown clip
    was read as target)."""
    if clip not in ("ratio", "target") or kl_target not in ("ref", "mirror", "both", "none"):
        raise ValueError(f"no hand formula for clip {clip!r} with kl_target {kl_target!r}")
    terms, k = [], 0
    for i, L in enumerate(lengths):
        seq = []
        for _ in range(L):
            a, pi, pi_old = adv[i], math.exp(lp[k]), math.exp(lp_old[k])
            r = pi / pi_old
            if clip == "ratio":  # min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)
                s = min(r * a, min(max(r, 1 - 0.2), 1 + 0.28) * a)
                branch = "high" if a > 0 and r > 1.28 else "low" if a < 0 and r < 0.8 else "inside"
            else:  # target: the gain stops once pi reaches its target: sqrt(pi_old) for A > 0, pi_old^2 for A < 0
                if a > 0:
                    s = a * min(pi, math.sqrt(pi_old)) / pi_old
                    branch = "high" if pi > math.sqrt(pi_old) else "inside"
                elif a < 0:
                    s = a * max(pi, pi_old ** 2) / pi_old
                    branch = "low" if pi < pi_old ** 2 else "inside"
                else:
                    s, branch = 0.0, "inside"
            penalty = 0.0
            if kl_target in ("ref", "both"):
                penalty += beta * hand_kl(est, lp[k], lp_ref[k])
            if kl_target in ("mirror", "both"):
                penalty += beta_mirror * hand_kl(est, lp[k], lp_old[k])
            if hits is not None:
                hits.append((branch, (a > 0) - (a < 0)))
            seq.append(-(s - penalty))
            k += 1
        terms.append(seq)
    return hand_aggregate(terms, mode, max_len)


def _family_inputs(seed, spread):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 8, (12,), generator=g)
    n = int(lengths.sum())
    lp = (torch.randn(n, generator=g, dtype=torch.float64) - 2).clamp(max=-0.05).requires_grad_()
    lp_old = (lp.detach() + spread * torch.randn(n, generator=g, dtype=torch.float64)).clamp(max=-0.05)
    lp_ref = lp.detach() + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)
    # a mixed binary group, a graded one, and one with no contrast (A = 0)
    rewards = torch.tensor([[1.0, 0, 0, 1], [0.0, 1, 0.5, 1], [1.0, 1, 1, 1]], dtype=torch.float64)
    return lengths, lp, lp_old, lp_ref, rewards


@pytest.mark.parametrize("clip", ["ratio", "target"])
@pytest.mark.parametrize("kl_target", ["ref", "mirror", "both", "none"])
@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
def test_family_loss_equals_hand_formula(clip, kl_target, est):
    mode = AGGREGATIONS[(len(kl_target) + len(est) + len(clip)) % len(AGGREGATIONS)]
    lengths, lp, lp_old, lp_ref, rewards = _family_inputs(seed=len(kl_target) * 7 + len(clip), spread=0.5 if clip == "ratio" else 1.6)
    adv_seq = group_advantages(rewards, "mean_std").view(-1)
    seq_of_tok = torch.repeat_interleave(torch.arange(12), lengths)
    beta, beta_mirror = 0.07, 0.13
    options = LossOptions(beta=beta, eps_low=0.2, eps_high=0.28, clip=clip, kl_target=kl_target,
                          beta_mirror=beta_mirror, kl_estimator=est)
    tl = grpo_token_loss(lp, lp_old, lp_ref, adv_seq[seq_of_tok], options)
    ours = aggregate(tl.loss, aggregation_weights(seq_of_tok, lengths, mode, max_completion_length=7))
    args = (lp_old.tolist(), lp_ref.tolist(), adv_seq.tolist(), lengths.tolist(), clip, kl_target, est, beta,
            beta_mirror, mode, 7)
    hits = []
    assert abs(ours.item() - hand_family_objective(lp.tolist(), *args, hits=hits)) < 1e-9
    # every branch was exercised: clipped low (A < 0), clipped high (A > 0), inside with A < 0, = 0, > 0
    assert {("low", -1), ("high", 1), ("inside", -1), ("inside", 0), ("inside", 1)} <= set(hits), set(hits)
    assert tl.clipped_low.tolist() == [b == "low" for b, _ in hits]
    assert tl.clipped_high.tolist() == [b == "high" for b, _ in hits]
    assert (tl.kl_ref is not None) == (kl_target in ("ref", "both"))
    assert (tl.kl_mirror is not None) == (kl_target in ("mirror", "both"))
    (grad,) = torch.autograd.grad(ours, lp)
    base = lp.detach().tolist()
    for k in range(len(base)):
        h = 1e-6
        up, dn = list(base), list(base)
        up[k] += h
        dn[k] -= h
        fd = (hand_family_objective(up, *args) - hand_family_objective(dn, *args)) / (2 * h)
        assert abs(grad[k].item() - fd) < 1e-7, (k, grad[k].item(), fd)


@pytest.mark.parametrize("clip, kl_target, mode", [("cispo", "ref", "sum"), ("ratio", "forward", "sum"),
                                                   ("ratio", "ref", "median")])
def test_the_hand_formulas_refuse_what_they_do_not_write(clip, kl_target, mode):
    """Found by an audit: an unknown clip was read as target and an unknown aggregation as sum, so a new value
    parametrized in would be checked against the wrong formula."""
    lengths, lp, lp_old, lp_ref, rewards = _family_inputs(seed=1, spread=0.5)
    adv = group_advantages(rewards, "mean_std").view(-1).tolist()
    with pytest.raises(ValueError, match="no hand formula"):
        hand_family_objective(lp.tolist(), lp_old.tolist(), lp_ref.tolist(), adv, lengths.tolist(), clip, kl_target,
                              "k3", 0.1, 0.1, mode, 7)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_ratio_weighted_reference_kl_equals_hand_formula(level):
    """algorithm.kl_ratio_weight (docs/algorithm.md §4.4): the penalty is beta * r * k3(lp, lp_ref), r with its
    gradient. At the token level the gradient is beta * r * (lp - lp_ref) (DeepSeek-V3.2's unbiased reverse-KL
    gradient); at the sequence level r is exp of the sequence's mean log-ratio, so a token's penalty also moves
    with the other tokens of its sequence. Advantages 0: only the KL term is left."""
    g = torch.Generator().manual_seed(3)
    seq = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    n = seq.numel()
    lp = (torch.randn(n, generator=g, dtype=torch.float64) - 1.5).requires_grad_()
    lp_old = lp.detach() + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)
    lp_ref = lp.detach() + 0.4 * torch.randn(n, generator=g, dtype=torch.float64)
    beta = 0.07
    tl = grpo_token_loss(lp, lp_old, lp_ref, torch.zeros(n, dtype=torch.float64),
                         LossOptions(beta=beta, level=level, kl_ratio_weight=True), seq_index=seq)

    def hand(x: list) -> list:
        out = []
        for i in range(n):
            if level == "token":
                log_r = x[i] - lp_old[i].item()
            else:
                mine = [j for j in range(n) if seq[j] == seq[i]]
                log_r = sum(x[j] - lp_old[j].item() for j in mine) / len(mine)
            d = lp_ref[i].item() - x[i]
            out.append(beta * math.exp(log_r) * (math.exp(d) - d - 1))
        return out

    base = lp.detach().tolist()
    assert max(abs(a - b) for a, b in zip(tl.loss.tolist(), hand(base))) < 1e-12
    (grad,) = torch.autograd.grad(tl.loss.sum(), lp)
    if level == "token":   # the closed form
        want = [beta * math.exp(base[i] - lp_old[i].item()) * (base[i] - lp_ref[i].item()) for i in range(n)]
    else:                  # central differences of the hand formula
        want = central_differences(hand, base)
    assert max(abs(a - b) for a, b in zip(grad.tolist(), want)) < 1e-8
    # the logged estimate stays the plain k3; off, the penalty is beta * k3 as before
    d = lp_ref - lp.detach()
    assert torch.allclose(tl.kl_ref.detach(), torch.exp(d) - d - 1)
    off = grpo_token_loss(lp, lp_old, lp_ref, torch.zeros(n, dtype=torch.float64), LossOptions(beta=beta, level=level),
                          seq_index=seq)
    assert torch.allclose(off.loss.detach(), beta * (torch.exp(d) - d - 1))


# -- One list of allowed values: the recipe schema's Literals (loss.py reads them) ------------------------------

def test_every_value_the_recipe_allows_has_its_own_branch_in_loss():
    """Each clip, importance-sampling level, KL target and sampler correction the schema allows runs code of its
    own in loss.py: a value with no branch would fail, or run as another value, at the first update."""
    from typing import get_args

    from lowmem_grpo import loss
    from lowmem_grpo.recipe import AlgorithmConfig

    assert set(loss.KL_ESTIMATORS) == set(get_args(AlgorithmConfig.model_fields["kl_estimator"].annotation))
    lengths, lp, lp_old, lp_ref, rewards = _family_inputs(seed=3, spread=0.5)
    seq = torch.repeat_interleave(torch.arange(12), lengths)
    adv = group_advantages(rewards, "mean_std").view(-1)[seq]
    losses = {}
    for clip in loss.CLIPS:
        for level in loss.LEVELS:
            try:
                loss.check_surrogate_options(clip, level, seq, None)
            except ValueError:   # a combination §13-§14 do not define
                continue
            options = LossOptions(beta=0.0, clip=clip, level=level)
            losses[clip, level] = grpo_token_loss(lp, lp_old, lp_ref, adv, options, seq_index=seq).loss.tolist()
    assert {c for c, _ in losses} == set(loss.CLIPS) and {v for _, v in losses} == set(loss.LEVELS)
    assert len({tuple(x) for x in losses.values()}) == len(losses)   # no two the same
    penalties = [loss.kl_terms(lp, lp_ref, lp_old, target=t, beta=0.1, beta_mirror=0.2)[0] for t in loss.KL_TARGETS]
    assert len({None if p is None else tuple(p.tolist()) for p in penalties}) == len(loss.KL_TARGETS)
    weights = [loss.sampler_correction_weights(lp.detach(), lp_old, seq, m, 0.7, 1.3)[0] for m in loss.SAMPLER_CORRECTIONS]
    assert len({tuple(w.tolist()) for w in weights}) == len(loss.SAMPLER_CORRECTIONS)


def test_a_value_added_to_the_schema_reaches_loss_and_is_refused_there_until_written():
    """Found by an audit: loss.py held its own copies of the schema's Literals, so a clip added to the recipe passed
    validate and failed at the first update with a bare "unknown clip". loss.py reads the schema now, and a value
    with no branch yet is named as such, not run as the ratio clip or a mask."""
    import subprocess
    import sys

    code = """
from typing import Literal, get_args
from lowmem_grpo.recipe import AlgorithmConfig
for name, new in (("clip", "newclip"), ("sampler_correction", "token_new")):
    field = AlgorithmConfig.model_fields[name]
    field.annotation = Literal[get_args(field.annotation) + (new,)]
import torch
from lowmem_grpo import loss
assert "newclip" in loss.CLIPS and "token_new" in loss.SAMPLER_CORRECTIONS
x = torch.zeros(3, dtype=torch.float64)
for call in (lambda: loss.surrogate("newclip", x, x, x + 1, 0.2, 0.2),
             lambda: loss.sampler_correction_weights(x, x, None, "token_new", 0.5, 2.0)):
    try:
        call()
    except ValueError as exc:
        print(exc)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["clip 'newclip' has no surrogate in loss.surrogate",
                                       "sampler correction 'token_new' has no weights in loss.sampler_correction_weights"]
