"""Group advantages (docs/algorithm.md §2): one scalar per completion, from the rewards of its group.

Rewards arrive as a [groups, G] tensor; NaN marks a completion a reward function skipped (for example an
unparseable gold answer). Skipped completions get advantage 0 and take no part in their group's
statistics. A group whose valid rewards are all equal gets all-zero advantages (no policy gradient).
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


ADVANTAGES = {"mean_std": mean_std, "mean": mean_only, "sign": sign, "rloo": rloo}


def group_advantages(rewards: torch.Tensor, mode: str = "mean_std", **kwargs) -> torch.Tensor:
    """[groups, G] rewards (NaN = skipped) -> [groups, G] advantages (0 where skipped or no contrast)."""
    valid = ~torch.isnan(rewards)
    r = torch.where(valid, rewards, 0.0)
    adv = ADVANTAGES[mode](r, valid, **kwargs)
    no_contrast = zero_std_groups(rewards)[:, None]
    return torch.where(valid & ~no_contrast, adv, 0.0)


def zero_std_groups(rewards: torch.Tensor) -> torch.Tensor:
    """[groups] bool: groups with fewer than two valid rewards, or all valid rewards equal."""
    valid = ~torch.isnan(rewards)
    hi = torch.where(valid, rewards, float("-inf")).max(dim=1).values
    lo = torch.where(valid, rewards, float("inf")).min(dim=1).values
    return (valid.sum(dim=1) < 2) | (hi == lo)
