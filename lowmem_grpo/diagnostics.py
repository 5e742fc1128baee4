"""What a step did, as pure computations for the metrics row (grpo-spec.md sections 3, 4, 7 and 8).

No models, no I/O: tensors and floats in, numbers out. train.py calls these and writes the results.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

# Inside the square roots of spec 3's weights. STD_EPS (1e-4) is added to the std in advantages.py;
# its square keeps the same scale here.
OMEGA_EPS = 1e-8

# Keys every step row carries (None where a quantity does not apply to the run), besides reward/<fn> and
# reward/<fn>/std per reward function. tests and scripts/run_variants.py check them.
STEP_KEYS = (
    "reward/mean", "reward/std", "success_rate", "success_rate/per_prompt", "success_rate/hist",
    "zero_std_fraction", "omega/plus", "omega/minus",
    "clip/low", "clip/high", "clip/fraction", "kl", "kl/ref", "kl/mirror", "kl/p_ref", "kl/p_star", "entropy",
    "completion/mean_length", "completion/truncated_fraction",
    "update/mu_ran", "update/unclipped_fraction", "update/stop",
    "update/logp_change_pos", "update/logp_change_neg", "update/frac_pos_up", "update/frac_neg_down",
    "rollout/logprob_abs_diff", "rollout/logprob_abs_diff_max",
)


# -- Spec 3: binary rewards make GRPO a weighted contrastive loss ------------------------------------------

def omega_plus(p: float, eps: float = OMEGA_EPS) -> float:
    """Weight of a correct completion under mean_std at success rate p: (1-p) / sqrt(p(1-p) + eps)."""
    return (1.0 - p) / math.sqrt(p * (1.0 - p) + eps)


def omega_minus(p: float, eps: float = OMEGA_EPS) -> float:
    """Weight of a wrong completion under mean_std: p / sqrt(p(1-p) + eps)."""
    return p / math.sqrt(p * (1.0 - p) + eps)


def omega_sum(p: float, mode: str = "mean_std", group_size: Optional[int] = None, eps: float = OMEGA_EPS) -> float:
    """omega_plus + omega_minus for an advantage mode: how far one exact KL-regularised update moves
    logit(p), times beta (spec 4). mean_std: 1/sqrt(p(1-p)+eps); mean: 1 (spec 4); rloo is mean scaled
    by G/(G-1); sign gives +-1."""
    if mode == "mean_std":
        return omega_plus(p, eps) + omega_minus(p, eps)
    if mode == "mean":
        return 1.0
    if mode == "rloo":
        if not group_size or group_size < 2:
            raise ValueError("rloo weights need the group size G >= 2")
        return group_size / (group_size - 1)
    if mode == "sign":
        return 2.0
    raise ValueError(f"unknown advantage mode {mode!r}")


def contrastive_weights(advantages: torch.Tensor, correct: torch.Tensor, valid: torch.Tensor):
    """(mean omega_plus, mean omega_minus) as the advantages actually gave them: per group with both
    correct and wrong completions, the mean advantage of its correct ones and minus that of its wrong ones,
    averaged over those groups. (None, None) when no group has both. [groups, G] inputs."""
    pos = correct & valid
    neg = ~correct & valid
    mixed = pos.any(dim=1) & neg.any(dim=1)
    if not mixed.any():
        return None, None
    adv = advantages.to(torch.float64)
    w_plus = torch.where(pos, adv, 0.0).sum(1) / pos.sum(1).clamp(min=1)
    w_minus = -torch.where(neg, adv, 0.0).sum(1) / neg.sum(1).clamp(min=1)
    return float(w_plus[mixed].mean()), float(w_minus[mixed].mean())


# -- Success rates ------------------------------------------------------------------------------------------

def success_rates(correct: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[groups] fraction of each group's valid completions that are correct (NaN: no valid completion)."""
    n = valid.sum(dim=1)
    hits = (correct & valid).sum(dim=1).to(torch.float64)
    return torch.where(n > 0, hits / n.clamp(min=1), float("nan"))


def success_histogram(rates: torch.Tensor, group_size: int) -> list[int]:
    """Counts of prompts at success rate 0, 1/G, ..., 1 (a rate between bins, from skipped completions,
    goes to the nearest bin); prompts with no valid completion are not counted."""
    ok = ~torch.isnan(rates)
    bins = torch.round(rates[ok] * group_size).long().clamp(0, group_size)
    return torch.bincount(bins, minlength=group_size + 1).tolist()


def is_binary(rewards: torch.Tensor) -> bool:
    """Every valid (non-NaN) reward is 0 or 1, and there is at least one."""
    r = rewards[~torch.isnan(rewards)]
    return r.numel() > 0 and bool(((r == 0) | (r == 1)).all())


def rollout_diagnostics(correct: torch.Tensor, valid: torch.Tensor, advantages: torch.Tensor) -> dict:
    """Per-prompt success rates, their histogram and the contrastive weights ([groups, G] inputs)."""
    rates = success_rates(correct, valid)
    plus, minus = contrastive_weights(advantages, correct, valid)
    return {"success_rate/per_prompt": [None if math.isnan(x) else round(x, 6) for x in rates.tolist()],
            "success_rate/hist": success_histogram(rates, correct.shape[1]),
            "omega/plus": plus, "omega/minus": minus}


# -- Spec 4: the success-amplification recurrence under a reference KL --------------------------------------

def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def kl_recurrence_step(p_prev: float, p_ref: float, beta: float, mode: str = "mean_std",
                       group_size: Optional[int] = None) -> float:
    """p_n = 1 / (1 + (1 - p_ref)/p_ref * exp(-(omega_plus + omega_minus)(p_{n-1}) / beta)), in logit form."""
    if p_ref <= 0.0 or p_ref >= 1.0:
        return p_ref  # no success (or no failure) under the reference: nothing to amplify
    logit_ref = math.log(p_ref) - math.log1p(-p_ref)
    return _sigmoid(logit_ref + omega_sum(p_prev, mode, group_size) / beta)


def kl_recurrence(p_ref: float, beta: float, n: int, mode: str = "mean_std", group_size: Optional[int] = None) -> list[float]:
    """[p_1, ..., p_n] from p_0 = p_ref (spec 4)."""
    out, p = [], p_ref
    for _ in range(n):
        p = kl_recurrence_step(p, p_ref, beta, mode, group_size)
        out.append(p)
    return out


def kl_fixed_point(p_ref: float, beta: float, mode: str = "mean_std", group_size: Optional[int] = None,
                   tol: float = 1e-12, max_iter: int = 10_000) -> float:
    """p* of the recurrence: iterate from p_ref until it moves less than tol (the last iterate otherwise)."""
    p = p_ref
    for _ in range(max_iter):
        nxt = kl_recurrence_step(p, p_ref, beta, mode, group_size)
        if abs(nxt - p) < tol:
            return nxt
        p = nxt
    return p


# -- Spec 7: stopping the mu updates of one batch early -----------------------------------------------------

def early_stop_reason(unclipped_fraction: Optional[float], objective: float, prev_objective: Optional[float],
                      min_unclipped: float, min_improvement: Optional[float]) -> Optional[str]:
    """Why the remaining updates of a batch should not run, or None. `objective` is measured before the
    update about to be applied, `prev_objective` before the previous one (so their difference is what the
    previous update gained)."""
    if min_unclipped > 0 and unclipped_fraction is not None and unclipped_fraction < min_unclipped:
        return "unclipped_fraction"
    if min_improvement is not None and prev_objective is not None and objective - prev_objective < min_improvement:
        return "no_improvement"
    return None


# -- Spec 8: did preferred completions become more likely, dispreferred ones less? --------------------------

def sequence_sums(token_values: torch.Tensor, seq_ids: torch.Tensor, n_seqs: int) -> torch.Tensor:
    """[n_seqs] per-completion sums of a per-token quantity (float64)."""
    out = torch.zeros(n_seqs, dtype=torch.float64)
    return out.index_add_(0, seq_ids.cpu(), token_values.detach().cpu().to(torch.float64))


def logp_change(before: torch.Tensor, after: torch.Tensor, advantages: torch.Tensor) -> dict:
    """Mean change of sequence log-prob for completions with A > 0 and with A < 0, and the fraction of each
    that moved the intended way (up for A > 0, down for A < 0). None where a side has no completion."""
    delta = after.to(torch.float64) - before.to(torch.float64)
    pos, neg = advantages > 0, advantages < 0

    def mean(x, m):
        return float(x[m].mean()) if m.any() else None

    return {"update/logp_change_pos": mean(delta, pos), "update/logp_change_neg": mean(delta, neg),
            "update/frac_pos_up": mean((delta > 0).to(torch.float64), pos),
            "update/frac_neg_down": mean((delta < 0).to(torch.float64), neg)}
