"""Group advantages (docs/algorithm.md §2): one scalar per completion, from the rewards of its group.

Rewards arrive as a [groups, G] tensor; NaN marks a completion a reward function skipped (for example an
unparseable gold answer). Skipped completions get advantage 0 and take no part in their group's
statistics. A group whose valid rewards are all equal gets all-zero advantages (no policy gradient).
`scale` chooses what mean_std divides by (docs/algorithm.md §17); `normalize_then_sum_advantages` gives
each reward function its own group advantage before weighting them (GDPO, docs/algorithm.md §17).
"""

from __future__ import annotations

import torch

# Added to the std so that groups of nearly equal rewards do not explode (TRL uses 1e-4 as well).
STD_EPS = 1e-4


def _masked_mean(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    n = valid.sum(dim=1, keepdim=True).clamp(min=1)
    return torch.where(valid, x, 0.0).sum(dim=1, keepdim=True) / n


def mean_std(rewards: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """GRPO: (R - mean) / (std + eps), std with Bessel's correction as in DeepSeekMath's reference code."""
    mean = _masked_mean(rewards, valid)
    n = valid.sum(dim=1, keepdim=True)
    var = torch.where(valid, (rewards - mean) ** 2, 0.0).sum(dim=1, keepdim=True) / (n - 1).clamp(min=1)
    return (rewards - mean) / (var.sqrt() + STD_EPS)


def mean_only(rewards: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO / mean-only: R - mean."""
    return rewards - _masked_mean(rewards, valid)


def sign(rewards: torch.Tensor, valid: torch.Tensor, dead_band: float = 0.0) -> torch.Tensor:
    """+1 above the group mean, -1 below, 0 within `dead_band` of it."""
    diff = rewards - _masked_mean(rewards, valid)
    return torch.where(diff > dead_band, 1.0, torch.where(diff < -dead_band, -1.0, 0.0)).to(rewards.dtype)


def rloo(rewards: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Leave-one-out: R_i - mean of the other valid rewards of the group."""
    n = valid.sum(dim=1, keepdim=True)
    total = torch.where(valid, rewards, 0.0).sum(dim=1, keepdim=True)
    return rewards - (total - rewards) / (n - 1).clamp(min=1)


# algorithm.advantage's values (the recipe's Literal) -> their function; tests/test_advantages.py checks that each
# value has one here and a KL weight in diagnostics.omega_sum (§4.3), which a new value needs too
ADVANTAGES = {"mean_std": mean_std, "mean": mean_only, "sign": sign, "rloo": rloo}

def mode_options(algorithm) -> dict:
    """The keyword arguments recipe.algorithm gives its advantage's function (sign's dead band; the others take
    none): the one place that reads a mode's own fields, so that the trainer passes them without knowing the mode."""
    return {"dead_band": algorithm.sign_dead_band} if algorithm.advantage == "sign" else {}


# algorithm.scale_rewards's values (not read from the schema: the recipe imports this module, through diagnostics;
# tests/test_advantages.py checks the two agree)
SCALES = ("group", "batch", "none")


def batch_std(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Bessel-corrected std of all valid entries of the batch, a 0-d tensor (0 with fewer than two)."""
    x = values[valid]
    n = x.numel()
    if n < 2:
        return values.new_zeros(())
    return (((x - x.mean()) ** 2).sum() / (n - 1)).sqrt()


def group_advantages(rewards: torch.Tensor, mode: str = "mean_std", scale: str = "group", **kwargs) -> torch.Tensor:
    """[groups, G] rewards (NaN = skipped) -> [groups, G] advantages (0 where skipped or no contrast).

    scale (mean_std only, docs/algorithm.md §17): 'group' divides by the group's std (GRPO), 'batch' by the
    std of every valid reward of the batch (the mean stays per group), 'none' by nothing (= mode 'mean')."""
    if scale not in SCALES:
        raise ValueError(f"unknown reward scale {scale!r}")
    if scale != "group" and mode != "mean_std":
        raise ValueError(f"scale {scale!r} only applies to advantage 'mean_std', not {mode!r}")
    valid = ~torch.isnan(rewards)
    r = torch.where(valid, rewards, 0.0)
    if scale == "group":
        adv = ADVANTAGES[mode](r, valid, **kwargs)
    elif scale == "none":
        adv = mean_only(r, valid)
    else:
        adv = mean_only(r, valid) / (batch_std(r, valid) + STD_EPS)
    no_contrast = zero_std_groups(rewards)[:, None]
    return torch.where(valid & ~no_contrast, adv, 0.0)


def normalize_then_sum_advantages(per_function: list[torch.Tensor], weights: list[float], mode: str = "mean_std",
                                  scale: str = "group", scored: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    """GDPO (docs/algorithm.md §17): each reward function's [groups, G] scores get their own group advantage,
    the advantages are summed with the functions' weights, and (unless scale is 'none') the sum is divided
    by its std over the batch's scored completions + STD_EPS. Normalising each function first keeps a function
    with a wide reward range from drowning out the others, which summing the rewards first would let it do.

    scored: [groups, G] bool, the completions that have a reward (default: those every function scored). A
    scored completion one function left out (NaN: a TRL-shaped function's None, "does not apply") is out of
    that function's statistics and adds 0 to the sum, as in TRL; one that is not scored gets advantage 0."""
    if not per_function or len(per_function) != len(weights):
        raise ValueError(f"need one weight per reward function: {len(per_function)} functions, {len(weights)} weights")
    if scored is None:
        scored = torch.stack([~torch.isnan(f) for f in per_function]).all(dim=0)
    total = torch.zeros_like(per_function[0])
    for scores, w in zip(per_function, weights):
        total = total + w * group_advantages(torch.where(scored, scores, float("nan")), mode, scale, **kwargs)
    if scale != "none":
        total = total / (batch_std(total, scored) + STD_EPS)
    return torch.where(scored, total, 0.0)


def zero_std_groups(rewards: torch.Tensor) -> torch.Tensor:
    """[groups] bool: groups with fewer than two valid rewards, or all valid rewards equal."""
    valid = ~torch.isnan(rewards)
    hi = torch.where(valid, rewards, float("-inf")).max(dim=1).values
    lo = torch.where(valid, rewards, float("inf")).min(dim=1).values
    return (valid.sum(dim=1) < 2) | (hi == lo)
