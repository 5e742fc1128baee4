"""The GRPO objective as pure functions on flat per-token tensors (grpo-spec.md sections 1 and 5).

Every tensor here is [n_tokens]: the log-prob of the sampled token under the policy (`logp`, with grad),
under the policy that sampled it (`logp_old`) and under the reference (`logp_ref`), and the advantage of
the token's completion. No logits, no models, no I/O.

Aggregation (spec 5) is expressed as a per-token weight computed once for the whole batch
(`aggregation_weights`); the loss is sum(weight * token_loss). Because the weights are known before the
first micro-batch, summing micro-batch losses gives exactly the one-batch loss in every mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


def k3_kl(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """exp(ref - lp) - (ref - lp) - 1: Schulman's k3 estimator of KL(pi_theta || pi_ref), >= 0."""
    d = logp_ref - logp
    return torch.exp(d) - d - 1.0


def clipped_surrogate(logp, logp_old, advantages, eps_low: float, eps_high: float) -> torch.Tensor:
    """min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) per token, r = exp(logp - logp_old)."""
    ratio = torch.exp(logp - logp_old)
    return torch.minimum(ratio * advantages, torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages)


@dataclass
class TokenLoss:
    loss: torch.Tensor        # [n] per-token loss (-objective); aggregate with aggregation_weights
    kl: Optional[torch.Tensor]  # [n] k3 KL to the reference, or None when beta == 0
    clipped_low: torch.Tensor  # [n] bool: ratio below 1 - eps_low with A < 0 (the clip binds)
    clipped_high: torch.Tensor  # [n] bool: ratio above 1 + eps_high with A > 0


def grpo_token_loss(logp, logp_old, logp_ref, advantages, *, beta: float, eps_low: float, eps_high: float) -> TokenLoss:
    """-(min(r A, clip(r) A) - beta * KL_k3) per token (spec section 1)."""
    loss = -clipped_surrogate(logp, logp_old, advantages, eps_low, eps_high)
    kl = None
    if beta > 0:
        kl = k3_kl(logp, logp_ref)
        loss = loss + beta * kl
    with torch.no_grad():
        ratio = torch.exp(logp - logp_old)
        clipped_low = (ratio < 1.0 - eps_low) & (advantages < 0)
        clipped_high = (ratio > 1.0 + eps_high) & (advantages > 0)
    return TokenLoss(loss, kl, clipped_low, clipped_high)


def aggregation_weights(seq_index: torch.Tensor, seq_lengths: torch.Tensor, mode: str,
                        max_completion_length: int) -> torch.Tensor:
    """Per-token weights so that sum(w * l) is the spec-5 aggregate over the whole batch.

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
