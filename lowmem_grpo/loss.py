"""The GRPO objective and its family as pure functions on flat per-token tensors (docs/algorithm.md §1, §4-§6).

Every tensor here is [n_tokens]: the log-prob of the sampled token under the policy (`logp`, with grad),
under the policy that sampled it (`logp_old`) and under the reference (`logp_ref`), and the advantage of
the token's completion. No logits, no models, no I/O. Each variant is one small function; `grpo_token_loss`
composes the surrogate (ratio or target clip) and the KL term (ref, mirror, both, none; k1, k2 or k3).

Aggregation (docs/algorithm.md §5) is expressed as a per-token weight computed once for the whole batch
(`aggregation_weights`); the loss is sum(weight * token_loss). Because the weights are known before the
first micro-batch, summing micro-batch losses gives exactly the one-batch loss in every mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

Bound = Union[float, torch.Tensor]

# -- KL estimators (Schulman 2020, "Approximating KL divergence"), samples from the sampling policy ------
# Each estimates KL(pi_theta || pi_other) from the sampled tokens' log-probs; `other` is the reference
# (kl_target ref) or the policy that sampled the batch (kl_target mirror): docs/algorithm.md §4.


def k1_kl(logp: torch.Tensor, logp_other: torch.Tensor) -> torch.Tensor:
    """lp - lp_other: the plain log-ratio; unbiased, any sign per token, gradient 1 per token."""
    return logp - logp_other


def k2_kl(logp: torch.Tensor, logp_other: torch.Tensor) -> torch.Tensor:
    """(lp - lp_other)^2 / 2: >= 0, biased, low variance; gradient (lp - lp_other)."""
    return 0.5 * (logp - logp_other) ** 2


def k3_kl(logp: torch.Tensor, logp_other: torch.Tensor) -> torch.Tensor:
    """exp(other - lp) - (other - lp) - 1: k3, >= 0, unbiased; gradient 1 - pi_other/pi.
    docs/algorithm.md §1, §4."""
    d = logp_other - logp
    return torch.exp(d) - d - 1.0


KL_ESTIMATORS = {"k1": k1_kl, "k2": k2_kl, "k3": k3_kl}


def kl_terms(logp, logp_ref, logp_old, *, target: str, beta: float, beta_mirror: float, estimator: str = "k3"):
    """(penalty, kl_ref, kl_mirror) per token, docs/algorithm.md §4: beta * KL to the reference and/or
    beta_mirror * KL to the policy that sampled the batch. A term that is off (its target not chosen, or its
    beta 0) is None; penalty is None when both are."""
    if target not in ("ref", "mirror", "both", "none"):
        raise ValueError(f"unknown kl target {target!r}")
    est = KL_ESTIMATORS[estimator]
    kl_ref = est(logp, logp_ref) if target in ("ref", "both") and beta > 0 else None
    kl_mirror = est(logp, logp_old) if target in ("mirror", "both") and beta_mirror > 0 else None
    parts = [b * kl for b, kl in ((beta, kl_ref), (beta_mirror, kl_mirror)) if kl is not None]
    return (sum(parts) if parts else None), kl_ref, kl_mirror


# -- Clipped surrogates (docs/algorithm.md §1, §6) --------------------------------------------------------


def pessimistic_clip(ratio: torch.Tensor, advantages: torch.Tensor, low: Bound, high: Bound) -> torch.Tensor:
    """min(r A, clip(r, low, high) A) (PPO): A > 0 stops gaining above `high`, A < 0 below `low`."""
    return torch.minimum(ratio * advantages, torch.clamp(ratio, low, high) * advantages)


def ratio_clip_bounds(eps_low: float, eps_high: float) -> tuple[float, float]:
    return 1.0 - eps_low, 1.0 + eps_high


def target_clip_bounds(logp_old: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target clip (docs/algorithm.md §6) as ratio bounds: a token reaches its target when
    pi = pi_old^2 (A < 0: r = pi_old) or pi = sqrt(pi_old) (A > 0: r = pi_old^-1/2). Both targets are
    probabilities, hence always reachable."""
    return torch.exp(logp_old), torch.exp(-0.5 * logp_old)


def ratio_clip_surrogate(logp, logp_old, advantages, eps_low: float, eps_high: float) -> torch.Tensor:
    """'ratio' clip: min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) per token, r = exp(logp - logp_old).
    docs/algorithm.md §6."""
    return pessimistic_clip(torch.exp(logp - logp_old), advantages, *ratio_clip_bounds(eps_low, eps_high))


def target_clip_surrogate(logp, logp_old, advantages) -> torch.Tensor:
    """'target' clip: the token's gain stops once pi reaches sqrt(pi_old) (A > 0) or pi_old^2 (A < 0).
    docs/algorithm.md §6."""
    return pessimistic_clip(torch.exp(logp - logp_old), advantages, *target_clip_bounds(logp_old))


clipped_surrogate = ratio_clip_surrogate  # the name before the clip variants


def clip_bounds(clip: str, logp_old: torch.Tensor, eps_low: float, eps_high: float) -> tuple[Bound, Bound]:
    if clip == "ratio":
        return ratio_clip_bounds(eps_low, eps_high)
    if clip == "target":
        return target_clip_bounds(logp_old)
    raise ValueError(f"unknown clip {clip!r}")


def surrogate(clip: str, logp, logp_old, advantages, eps_low: float, eps_high: float) -> torch.Tensor:
    if clip == "target":
        return target_clip_surrogate(logp, logp_old, advantages)
    if clip == "ratio":
        return ratio_clip_surrogate(logp, logp_old, advantages, eps_low, eps_high)
    raise ValueError(f"unknown clip {clip!r}")


@dataclass
class TokenLoss:
    loss: torch.Tensor                # [n] per-token loss (-objective); aggregate with aggregation_weights
    kl_ref: Optional[torch.Tensor]    # [n] KL estimate to the reference, or None when that term is off
    kl_mirror: Optional[torch.Tensor]  # [n] KL estimate to the sampling policy (mirror), or None
    clipped_low: torch.Tensor         # [n] bool: A < 0 and r below the lower bound (the clip binds)
    clipped_high: torch.Tensor        # [n] bool: A > 0 and r above the upper bound

    @property
    def kl(self) -> Optional[torch.Tensor]:
        """The KL to the reference (the field's name before the mirror variant)."""
        return self.kl_ref


def grpo_token_loss(logp, logp_old, logp_ref, advantages, *, beta: float, eps_low: float = 0.2,
                    eps_high: float = 0.2, clip: str = "ratio", kl_target: str = "ref", beta_mirror: float = 0.0,
                    kl_estimator: str = "k3") -> TokenLoss:
    """-(surrogate - KL penalty) per token (docs/algorithm.md §1, with the variants of §4 and §6)."""
    loss = -surrogate(clip, logp, logp_old, advantages, eps_low, eps_high)
    penalty, kl_ref, kl_mirror = kl_terms(logp, logp_ref, logp_old, target=kl_target, beta=beta,
                                          beta_mirror=beta_mirror, estimator=kl_estimator)
    if penalty is not None:
        loss = loss + penalty
    with torch.no_grad():
        ratio = torch.exp(logp - logp_old)
        low, high = clip_bounds(clip, logp_old, eps_low, eps_high)
        clipped_low = (ratio < low) & (advantages < 0)
        clipped_high = (ratio > high) & (advantages > 0)
    return TokenLoss(loss, kl_ref, kl_mirror, clipped_low, clipped_high)


def aggregation_weights(seq_index: torch.Tensor, seq_lengths: torch.Tensor, mode: str,
                        max_completion_length: int) -> torch.Tensor:
    """Per-token weights so that sum(w * l) is the aggregate of docs/algorithm.md §5 over the whole batch.

    seq_index [n_tokens]: which completion each token belongs to; seq_lengths [n_seqs]: |o_i| (tokens
    that count; a skipped completion has length 0 and no tokens)."""
    n_seqs = seq_lengths.numel()
    lengths = seq_lengths.to(torch.float64)
    if mode == "sequence_mean":      # 1/G sum_i 1/|o_i| sum_t
        w = 1.0 / (n_seqs * lengths.clamp(min=1))[seq_index]
    elif mode == "token_mean":       # sum_i sum_t / sum_i |o_i|   (DAPO)
        w = torch.full(seq_index.shape, 1.0 / max(1.0, lengths.sum().item()), dtype=torch.float64)
    elif mode == "constant":         # sum_i sum_t / (G * L_max)   (Dr. GRPO)
        w = torch.full(seq_index.shape, 1.0 / (n_seqs * max_completion_length), dtype=torch.float64)
    elif mode == "sum":
        w = torch.ones(seq_index.shape, dtype=torch.float64)
    else:
        raise ValueError(f"unknown aggregation {mode!r}")
    return w


def aggregate(token_loss: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (token_loss * weights.to(token_loss.dtype)).sum()
