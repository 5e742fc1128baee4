"""What a step did, as pure computations for the metrics row (docs/algorithm.md §3, §4, §7 and §8).

No models, no I/O: tensors and floats in, numbers out. train.py calls these and writes the results.
The rule "solved" lives here too, and training metrics, eval and the report all use it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .advantages import zero_std_groups

# Inside the square roots of docs/algorithm.md §3's weights. STD_EPS (1e-4) is added to the std in advantages.py;
# its square keeps the same scale here.
OMEGA_EPS = 1e-8

# Keys every step row carries (None where a quantity does not apply to the run), besides reward/<fn> and
# reward/<fn>/std per reward function. tests and scripts/run_variants.py check them.
STEP_KEYS = (
    "reward/mean", "reward/std", "reward/skipped", "success_rate", "success_rate/per_prompt", "success_rate/hist",
    "zero_std_fraction", "omega/plus", "omega/minus",
    "clip/low", "clip/high", "clip/fraction", "kl", "kl/ref", "kl/mirror", "kl/p_ref", "kl/p_star", "entropy",
    "completion/mean_length", "completion/truncated_fraction",
    "update/mu_ran", "update/unclipped_fraction", "update/stop",
    "update/logp_change_pos", "update/logp_change_neg", "update/frac_pos_up", "update/frac_neg_down",
    "rollout/logprob_abs_diff", "rollout/logprob_abs_diff_max", "success_rate/skipped",
    "sampler/weight_mean", "sampler/masked_fraction", "vespo/weight_mean", "entropy/threshold",
    "entropy/kept_fraction", "entropy/coef",
    "dynamic/draws", "dynamic/prompts_drawn", "dynamic/extra_rollouts", "dynamic/groups_discarded",
    "dynamic/groups_surplus", "dynamic/groups_short",
    "env/turns", "env/tokens", "env/errors", "env/truncated",
)


# -- "Solved": one rule for training metrics, eval, the report and the progress line -----------------------

# A built-in verifiable reward scores a right answer 1.
SOLVED_THRESHOLD = 1.0


@dataclass(frozen=True)
class Solved:
    """Per completion: `valid`, the primary reward scored it (None = skipped, excluded from rates and
    counted); `correct`, valid and at least SOLVED_THRESHOLD."""

    correct: torch.Tensor
    valid: torch.Tensor

    @property
    def counted(self) -> int:
        return int(self.valid.sum())

    @property
    def skipped(self) -> int:
        return int((~self.valid).sum())

    @property
    def rate(self) -> Optional[float]:
        """Correct / counted; None when the primary reward skipped every completion."""
        return int(self.correct.sum()) / self.counted if self.counted else None

    def at(self, i: int) -> Optional[bool]:
        return bool(self.correct[i]) if bool(self.valid[i]) else None


def solved(result) -> Solved:
    """Which completions of a RewardResult are solved: the primary reward (the recipe's first function; with
    rewards from an environment alone, its "environment" column, docs/algorithm.md §20) reached
    SOLVED_THRESHOLD. A completion it skipped is neither right nor wrong."""
    primary = next(iter(result.per_function.values()))
    valid = ~torch.isnan(primary)
    return Solved(valid & (primary >= SOLVED_THRESHOLD), valid)


# -- The rollout: rewards, lengths, groups --------------------------------------------------------------------

def rollout_stats(result, lengths: torch.Tensor, truncated: torch.Tensor, group_size: int,
                  advantages: torch.Tensor) -> dict:
    """The metrics of one step's completions: rewards per function, success, lengths, group statistics.
    `result` is the step's RewardResult; lengths/truncated are per completion; advantages [groups, G]."""
    total = result.total
    valid = ~torch.isnan(total)
    done = solved(result)
    rewards = total.view(-1, group_size)
    row = {"reward/mean": float(total[valid].mean()) if valid.any() else None,
           "reward/std": float(total[valid].std()) if valid.sum() > 1 else None,
           "success_rate": done.rate, "success_rate/skipped": done.skipped,
           "zero_std_fraction": float(zero_std_groups(rewards).float().mean()),
           "completion/mean_length": float(lengths.to(torch.float32).mean()),
           "completion/truncated_fraction": int(truncated.sum()) / truncated.numel(),
           "reward/skipped": result.skipped}
    for name, values in result.per_function.items():
        ok = ~torch.isnan(values)
        row[f"reward/{name}"] = float(values[ok].mean()) if ok.any() else None
        row[f"reward/{name}/std"] = float(values[ok].std()) if ok.sum() > 1 else None
    row.update(rollout_diagnostics(done.correct.view_as(rewards), done.valid.view_as(rewards), advantages))
    for name, n in result.errors.items():
        row[f"reward_errors/{name}"] = n
    for name, values in result.metrics.items():   # TRL's log_metric: the step's mean
        row[f"reward_metric/{name}"] = sum(values) / len(values) if values else None
    return row


def environment_stats(records: Sequence, truncated: torch.Tensor) -> dict:
    """docs/algorithm.md §20, per step: mean model turns and environment tokens per completion, environment
    errors (completions whose episode an error ended), the share a limit cut, and env/<name>: each of the
    environment's own counters summed over the completions. `records` are the completions' EnvRecords (None:
    no environment drove it); {} when none did."""
    if not records or all(r is None for r in records):
        return {}
    n = len(records)
    row = {"env/turns": sum(r.turns for r in records if r is not None) / n,
           "env/tokens": sum(r.env_tokens for r in records if r is not None) / n,
           "env/errors": sum(1 for r in records if r is not None and r.error is not None),
           "env/truncated": int(truncated.sum()) / n}
    for r in records:
        for name, value in (r.counters if r is not None else ()):
            if f"env/{name}" not in STEP_KEYS:   # (a counter cannot overwrite the statistics above)
                row[f"env/{name}"] = row.get(f"env/{name}", 0) + value
    return row


SAMPLE_ROWS = 16   # completions in a step's sample table


def sample_table(prompts: Sequence[str], texts: Sequence[str], result, limit: int = SAMPLE_ROWS,
                 segments: Optional[Sequence[Optional[list]]] = None) -> list[dict]:
    """The first `limit` completions with their prompt and rewards, total and per function (None = skipped);
    with an environment, also each completion's segments: [who, text] runs, who "model" or "environment"
    (docs/algorithm.md §20)."""
    def num(x) -> Optional[float]:
        return None if math.isnan(x) else float(x)

    return [{"prompt": prompts[i], "completion": texts[i], "reward": num(result.total[i]),
             **{f"reward/{name}": num(values[i]) for name, values in result.per_function.items()},
             **{f"extra/{column}": values[i] for column, values in result.extra.items()},
             **({"segments": segments[i]} if segments is not None and segments[i] is not None else {})}
            for i in range(min(limit, len(texts)))]


# -- An update pass: what the loss saw -----------------------------------------------------------------------

@dataclass
class TokenStats:
    """One micro-batch's per-token figures from an update pass, detached (inputs of update_stats)."""

    loss: float                        # the micro-batch's aggregated loss (its share of the batch loss)
    entropy: torch.Tensor
    clipped_low: torch.Tensor
    clipped_high: torch.Tensor
    advantages: torch.Tensor
    kl_ref: Optional[torch.Tensor] = None
    kl_mirror: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class UpdateStats:
    loss: float                                 # the batch loss (sum of the micro-batches' shares)
    n_tokens: int
    entropy: float
    clip_low: float                             # fractions of all tokens
    clip_high: float
    clip_fraction: float
    kl_ref: Optional[float]                     # mean per token; None when that term is off
    kl_mirror: Optional[float]
    unclipped_fraction: Optional[float]         # of the tokens with A != 0, those no clip bound (§7)

    def row(self) -> dict:
        return {"loss": self.loss, "kl": self.kl_ref, "kl/ref": self.kl_ref, "kl/mirror": self.kl_mirror,
                "entropy": self.entropy, "clip/low": self.clip_low, "clip/high": self.clip_high,
                "clip/fraction": self.clip_fraction, "update/unclipped_fraction": self.unclipped_fraction}


def update_stats(parts: Sequence[TokenStats], kl_ref_on: bool, kl_mirror_on: bool) -> UpdateStats:
    """Token-weighted means over the micro-batches of one update pass."""
    n = sum(p.entropy.numel() for p in parts)
    per_tok = max(1, n)
    signed = sum(int((p.advantages != 0).sum()) for p in parts)
    unclipped = sum(int(((p.advantages != 0) & ~p.clipped_low & ~p.clipped_high).sum()) for p in parts)
    low = sum(int(p.clipped_low.sum()) for p in parts)
    high = sum(int(p.clipped_high.sum()) for p in parts)

    def kl(get, on: bool) -> Optional[float]:
        return sum(get(p).sum().item() if get(p) is not None else 0.0 for p in parts) / per_tok if on else None

    return UpdateStats(loss=sum(p.loss for p in parts), n_tokens=n,
                       entropy=sum(p.entropy.sum().item() for p in parts) / per_tok,
                       clip_low=low / per_tok, clip_high=high / per_tok, clip_fraction=(low + high) / per_tok,
                       kl_ref=kl(lambda p: p.kl_ref, kl_ref_on), kl_mirror=kl(lambda p: p.kl_mirror, kl_mirror_on),
                       unclipped_fraction=unclipped / signed if signed else None)


def sampler_correction_stats(parts: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """§15 over an update pass: the mean importance weight given to the policy term and the fraction of
    tokens masked out, from (weights, masked) per micro-batch. {} when the correction is off."""
    if not parts:
        return {}
    w = torch.cat([p[0].to(torch.float64) for p in parts])
    masked = torch.cat([p[1] for p in parts])
    return {"sampler/weight_mean": float(w.mean()) if w.numel() else None,
            "sampler/masked_fraction": float(masked.float().mean()) if masked.numel() else None}


def vespo_stats(parts: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """§14.2 over an update pass: the mean VESPO weight phi over completions (each counted once, as TRL's
    vespo/phi_seq_mean), from (per-token phi, seq ids) per micro-batch. {} without clip: vespo."""
    if not parts:
        return {}
    per_completion = []
    for phi, seq_ids in parts:   # phi is its completion's at every token: take one per completion
        ids, inverse = torch.unique(seq_ids, return_inverse=True)
        per_completion.append(torch.zeros(len(ids), dtype=torch.float64).scatter(0, inverse, phi.to(torch.float64)))
    values = torch.cat(per_completion)
    return {"vespo/weight_mean": float(values.mean()) if values.numel() else None}


def sampler_agreement(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """How far the rollout engine's log-probs of the sampled tokens are from the trainer's at the same
    weights: mean and max |difference| over (trainer, sampler) pairs. Empty when there is nothing to compare."""
    diffs = [(ours.detach().float().cpu() - theirs).abs() for ours, theirs in pairs]
    if not diffs or not sum(d.numel() for d in diffs):
        return {}
    d = torch.cat(diffs)
    return {"rollout/logprob_abs_diff": float(d.mean()), "rollout/logprob_abs_diff_max": float(d.max())}


# -- §3: binary rewards make GRPO a weighted contrastive loss ------------------------------------------

def omega_plus(p: float, eps: float = OMEGA_EPS) -> float:
    """Weight of a correct completion under mean_std at success rate p: (1-p) / sqrt(p(1-p) + eps)."""
    return (1.0 - p) / math.sqrt(p * (1.0 - p) + eps)


def omega_minus(p: float, eps: float = OMEGA_EPS) -> float:
    """Weight of a wrong completion under mean_std: p / sqrt(p(1-p) + eps)."""
    return p / math.sqrt(p * (1.0 - p) + eps)


def omega_sum(p: float, mode: str = "mean_std", group_size: Optional[int] = None, eps: float = OMEGA_EPS) -> float:
    """omega_plus + omega_minus for an advantage mode: how far one exact KL-regularised update moves
    logit(p), times beta (docs/algorithm.md §4). mean_std: 1/sqrt(p(1-p)+eps); mean: 1; rloo is mean scaled
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


# -- §4: the success-amplification recurrence under a reference KL --------------------------------------

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
    """[p_1, ..., p_n] from p_0 = p_ref (docs/algorithm.md §4)."""
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


# -- §7: stopping the mu updates of one batch early -----------------------------------------------------

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


# -- §8: did preferred completions become more likely, dispreferred ones less? --------------------------

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


def logp_moved(before: Sequence[torch.Tensor], after: Sequence[torch.Tensor], seq_ids: Sequence[torch.Tensor],
               advantages: Sequence[torch.Tensor]) -> dict:
    """logp_change over a batch given per micro-batch: per-token log-probs before the first update and
    after the last, each token's completion index in the batch, and its advantage."""
    ids = torch.cat(list(seq_ids))
    n = int(ids.max()) + 1 if ids.numel() else 0
    seq_adv = torch.zeros(n, dtype=torch.float64).index_copy_(0, ids, torch.cat(list(advantages)).to(torch.float64))
    return logp_change(sequence_sums(torch.cat(list(before)), ids, n), sequence_sums(torch.cat(list(after)), ids, n),
                       seq_adv)


def p_star(p_ref: Optional[float], total: torch.Tensor, kl_target: str, beta: float, mode: str,
           group_size: int) -> dict:
    """docs/algorithm.md §4: where exact KL-regularised GRPO would take the success rate, from the
    reference's. Only under a reference KL and binary rewards, the recurrence's assumptions."""
    if kl_target not in ("ref", "both") or p_ref is None or not is_binary(total):
        return {"kl/p_ref": None, "kl/p_star": None}
    return {"kl/p_ref": p_ref, "kl/p_star": kl_fixed_point(p_ref, beta, mode, group_size)}


def mean_row(rows: Sequence[dict]) -> dict:
    """One row for the updates of a pass over several mini-batches (§7): each number averaged over the updates
    that report one, a flag true if it was in any, anything else (a stop's reason) the last update's."""
    out = {}
    for key in dict.fromkeys(k for row in rows for k in row):
        values = [row[key] for row in rows if key in row]
        numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if values and all(isinstance(v, bool) for v in values):
            out[key] = any(values)
        elif numbers and all(v is None or isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            out[key] = sum(numbers) / len(numbers)
        else:
            out[key] = values[-1]
    return out
