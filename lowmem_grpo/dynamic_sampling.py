"""DAPO's dynamic sampling (Yu et al. 2025, §3.2; docs/algorithm.md §18): a group whose rewards are all
equal gives no policy gradient, so it is replaced by the group of a newly drawn prompt until the step
holds prompts_per_step groups with contrast, or the recipe's bound on extra draws is reached.

The prompts of extra draw d of step s are a seeded sample keyed by (seed, s, d), independent of what any
earlier step drew: the data order stays a pure function of (seed, step), and a resumed run replays it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import torch

from .advantages import zero_std_groups
from .rewards import RewardResult


def extra_indices(n: int, batch_size: int, step: int, draw: int, seed: int) -> list[int]:
    """Row indices of extra draw `draw` (1, 2, ...) of step `step` (0-based): batch_size distinct rows
    (all of them when the set is smaller), drawn without regard to the epoch order of data.batch_indices."""
    if draw < 1:
        raise ValueError(f"extra draws are numbered from 1, got {draw}")
    return random.Random(f"{seed}:{step}:draw{draw}").sample(range(n), min(batch_size, n))


@dataclass
class Rollouts:
    """One or more draws' groups: examples[g] has completions [g*G, (g+1)*G), their texts and rewards."""

    examples: list
    completions: list
    texts: list
    result: RewardResult

    def contrast(self, group_size: int) -> torch.Tensor:
        """[groups] bool: the group's valid rewards are not all equal (docs/algorithm.md §9)."""
        return ~zero_std_groups(self.result.total.view(-1, group_size))

    def take(self, groups: list[int], group_size: int) -> "Rollouts":
        """These groups, in this order."""
        idx = [g * group_size + j for g in groups for j in range(group_size)]
        at = torch.tensor(idx, dtype=torch.long)
        completions = [replace(self.completions[i], prompt_index=k // group_size) for k, i in enumerate(idx)]
        r = self.result
        total = r.total[at]
        return Rollouts([self.examples[g] for g in groups], completions, [self.texts[i] for i in idx],
                        RewardResult(total, {k: v[at] for k, v in r.per_function.items()},
                                     {k: n for k, n in r.errors.items()}, int(torch.isnan(total).sum()),
                                     {k: list(v) for k, v in r.metrics.items()},
                                     {k: [v[i] for i in idx] for k, v in r.extra.items()}))

    @staticmethod
    def cat(parts: list["Rollouts"], group_size: int) -> "Rollouts":
        """The draws' groups one after another (reward errors summed over the draws)."""
        examples, completions, texts = [], [], []
        for p in parts:
            completions += [replace(c, prompt_index=c.prompt_index + len(examples)) for c in p.completions]
            examples += p.examples
            texts += p.texts
        total = torch.cat([p.result.total for p in parts])
        per_fn = {k: torch.cat([p.result.per_function[k] for p in parts]) for k in parts[0].result.per_function}
        errors: dict = {}
        for p in parts:
            for k, n in p.result.errors.items():
                errors[k] = errors.get(k, 0) + n
        metrics: dict = {}
        for p in parts:
            for k, v in p.result.metrics.items():
                metrics.setdefault(k, []).extend(v)
        n = [len(p.texts) for p in parts]
        extra = {k: [x for p, m in zip(parts, n) for x in p.result.extra.get(k, [None] * m)]
                 for k in dict.fromkeys(k for p in parts for k in p.result.extra)}
        return Rollouts(examples, completions, texts,
                        RewardResult(total, per_fn, errors, int(torch.isnan(total).sum()), metrics, extra))


def fill_with_contrast(draws: list[Rollouts], wanted: int, group_size: int) -> tuple[Rollouts, dict]:
    """The first `wanted` groups with contrast over the draws, in draw order (fewer when the draws hold
    fewer), and what was drawn and discarded, for the metrics row."""
    every = Rollouts.cat(draws, group_size)
    good = every.contrast(group_size).nonzero().flatten().tolist()
    kept = good[:wanted]
    n_groups = len(every.examples)
    return every.take(kept, group_size), {
        "dynamic/draws": len(draws) - 1,                      # extra draws after the step's own prompts
        "dynamic/prompts_drawn": n_groups,
        "dynamic/extra_rollouts": (n_groups - len(draws[0].examples)) * group_size,
        "dynamic/groups_discarded": n_groups - len(good),     # without contrast
        "dynamic/groups_surplus": len(good) - len(kept),      # with contrast, beyond the step's need
        "dynamic/groups_short": wanted - len(kept),           # the bound was reached first
    }
