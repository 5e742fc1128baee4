"""The GRPO objective and its family as pure functions on flat per-token tensors (docs/algorithm.md §1, §4-§6,
§13-§16).

Every tensor here is [n_tokens]: the log-prob of the sampled token under the policy (`logp`, with grad),
under the policy that sampled it (`logp_old`) and under the reference (`logp_ref`), and the advantage of
the token's completion. No logits, no models, no I/O. Each variant is one small function; `grpo_token_loss`
composes the surrogate (ratio, target or CISPO clip, SAPO's gate, VESPO's weight or GMPO's geometric mean; token
or sequence ratio; optional two-sided cap), the KL term (ref, mirror, both, none; k1, k2 or k3), a detached per-token
policy-gradient weight and an entropy bonus. The run's choices among these are one `LossOptions`, built from the
recipe by `LossOptions.from_algorithm`; the batch's tensors are its arguments.
`seq_index` [n_tokens] says which completion each token belongs to (any non-negative ids).

Aggregation (docs/algorithm.md §5) is expressed as a per-token weight computed once for the whole batch
(`aggregation_weights`); the loss is sum(weight * token_loss). Because the weights are known before the
first micro-batch, summing micro-batch losses gives exactly the one-batch loss in every mode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch

from .recipe import AlgorithmConfig, algorithm_values

Bound = Union[float, torch.Tensor]


KL_TARGETS = algorithm_values("kl_target")
CLIPS = algorithm_values("clip")
LEVELS = algorithm_values("importance_sampling_level")
SAMPLER_CORRECTIONS = algorithm_values("sampler_correction")
AGGREGATIONS = algorithm_values("aggregation")

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


def kl_terms(logp, logp_ref, logp_old, *, target: str, beta: float, beta_mirror: float, estimator: str = "k3",
             ref_weight: Optional[torch.Tensor] = None):
    """(penalty, kl_ref, kl_mirror) per token, docs/algorithm.md §4: beta * KL to the reference and/or
    beta_mirror * KL to the policy that sampled the batch. A term that is off (its target not chosen, or its
    beta 0) is None; penalty is None when both are. ref_weight (with its gradient) multiplies the reference
    term in the penalty (§4.4: the importance ratio); kl_ref stays the plain estimate."""
    if target not in KL_TARGETS:
        raise ValueError(f"unknown kl target {target!r}")
    est = KL_ESTIMATORS[estimator]
    kl_ref = est(logp, logp_ref) if target in ("ref", "both") and beta > 0 else None
    kl_mirror = est(logp, logp_old) if target in ("mirror", "both") and beta_mirror > 0 else None
    weighted_ref = kl_ref * ref_weight if kl_ref is not None and ref_weight is not None else kl_ref
    parts = [b * kl for b, kl in ((beta, weighted_ref), (beta_mirror, kl_mirror)) if kl is not None]
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


VESPO_SHAPE = (2.0, 3.0, 3.0, 2.0)   # (k_pos, lambda_pos, k_neg, lambda_neg): the paper's and TRL's defaults
# Bounds in log space: a token's log-ratio within +-20, the sequence's log w within [log 1e-8, 20], as the VESPO
# paper's code (and TRL) bound them, so that exp never overflows and a vanishing w stays a number.
VESPO_TOKEN_LOG_RATIO_MAX = 20.0
VESPO_LOG_W_MIN, VESPO_LOG_W_MAX = math.log(1e-8), 20.0
GMPO_EPSILONS = (0.4, 0.4)   # (low, high) in log space: the GMPO paper's and TRL's GMPOConfig default, e^+-0.4


def check_static_options(clip: str, level: str, delta: Optional[float]) -> None:
    """The combinations of clip, level and delta docs/algorithm.md §13-§14 define; anything else is an error, not a
    silent fallback. LossOptions runs this once, at construction."""
    if clip not in CLIPS:
        raise ValueError(f"unknown clip {clip!r}; allowed: {', '.join(CLIPS)}")
    if level not in LEVELS:
        raise ValueError(f"unknown importance sampling level {level!r}; allowed: {', '.join(LEVELS)}")
    if level == "sequence" and clip == "target":
        raise ValueError("clip 'target' is not defined at level 'sequence'")
    if clip == "vespo" and level != "token":   # its weight is a sequence ratio already (§14.2)
        raise ValueError("clip 'vespo' builds its own sequence ratio: level must be 'token'")
    if clip == "gmpo" and level != "token":    # its weight is a geometric mean over the sequence already (§14.3)
        raise ValueError("clip 'gmpo' builds its own sequence ratio: level must be 'token'")
    if delta is not None and clip != "ratio":
        raise ValueError(f"delta only applies to clip 'ratio', not {clip!r}")


def check_surrogate_options(clip: str, level: str, seq_index, delta) -> None:
    """check_static_options, plus what a batch must bring: the completion ids a sequence ratio is built from."""
    check_static_options(clip, level, delta)
    if level == "sequence" and seq_index is None:
        raise ValueError("level 'sequence' needs seq_index")
    if clip in ("vespo", "gmpo") and seq_index is None:
        raise ValueError(f"clip {clip!r} needs seq_index")


def surrogate(clip: str, logp, logp_old, advantages, eps_low: float, eps_high: float, *, level: str = "token",
              seq_index: Optional[torch.Tensor] = None, delta: Optional[float] = None,
              cispo_max_weight: float = 5.0, sapo_temperatures: tuple[float, float] = (1.0, 1.05),
              vespo_phi: Optional[torch.Tensor] = None,
              gmpo_epsilons: tuple[float, float] = GMPO_EPSILONS) -> torch.Tensor:
    """The per-token policy-gradient objective (to maximise) of docs/algorithm.md §6, §13, §14.
    vespo_phi: clip 'vespo''s weight (vespo_weight), computed by the caller, which also reports it.
    gmpo_epsilons: clip 'gmpo''s (low, high) bounds of the log-ratio (§14.3)."""
    check_surrogate_options(clip, level, seq_index, delta)
    if clip == "gmpo":
        return gmpo_surrogate(logp, logp_old, advantages, seq_index, *gmpo_epsilons)
    if clip == "vespo":
        if vespo_phi is None:
            raise ValueError("clip 'vespo' needs its weight vespo_phi (vespo_weight)")
        return vespo_surrogate(logp, advantages, vespo_phi)
    if clip == "cispo":
        return cispo_surrogate(logp, policy_log_ratio(logp, logp_old, level, seq_index), advantages, cispo_max_weight)
    if clip == "sapo":
        return sapo_surrogate(torch.exp(policy_log_ratio(logp, logp_old, level, seq_index)), advantages,
                              *sapo_temperatures)
    if clip == "target":
        return target_clip_surrogate(logp, logp_old, advantages)
    if clip != "ratio":   # a value the schema allows and this function does not know yet
        raise ValueError(f"clip {clip!r} has no surrogate in loss.surrogate")
    if level == "token" and delta is None:  # today's path, op for op
        return ratio_clip_surrogate(logp, logp_old, advantages, eps_low, eps_high)
    ratio = torch.exp(policy_log_ratio(logp, logp_old, level, seq_index))
    low, high = ratio_clip_bounds(eps_low, eps_high)
    if delta is None:
        return pessimistic_clip(ratio, advantages, low, high)
    return two_sided_clip(ratio, advantages, low, high, delta)


# -- Sequence-level ratios (GSPO, docs/algorithm.md §13) ----------------------------------------------------


def _per_sequence_sum(x: torch.Tensor, seq_index: torch.Tensor) -> torch.Tensor:
    """[n_seq_ids] sums of x over each id's tokens (ids absent from seq_index get 0); differentiable."""
    n_ids = int(seq_index.max().item()) + 1 if seq_index.numel() else 0
    return torch.zeros(n_ids, dtype=x.dtype, device=x.device).index_add(0, seq_index, x)


def sequence_sum(x: torch.Tensor, seq_index: torch.Tensor) -> torch.Tensor:
    """Per token: the sum of x over the tokens of its sequence (docs/algorithm.md §15's sequence ratio)."""
    return _per_sequence_sum(x, seq_index)[seq_index]


def sequence_mean(x: torch.Tensor, seq_index: torch.Tensor) -> torch.Tensor:
    """Per token: the mean of x over the tokens of its sequence; each token gets gradient 1/|o_i| of it."""
    counts = torch.bincount(seq_index, minlength=0).to(x.dtype) if seq_index.numel() else x.new_zeros(0)
    return (_per_sequence_sum(x, seq_index) / counts.clamp(min=1))[seq_index]


def sequence_log_ratio(logp: torch.Tensor, logp_old: torch.Tensor, seq_index: torch.Tensor) -> torch.Tensor:
    """GSPO's length-normalised log-ratio, per token: (1/|o_i|) sum_t (lp_it - lp_old_it) over the token's
    sequence, so exp of it is the geometric mean of the sequence's token ratios. docs/algorithm.md §13."""
    return sequence_mean(logp - logp_old, seq_index)


def policy_log_ratio(logp, logp_old, level: str = "token", seq_index: Optional[torch.Tensor] = None) -> torch.Tensor:
    """log r per token: the token's own log-ratio, or its sequence's (docs/algorithm.md §13)."""
    if level == "token":
        return logp - logp_old
    if level == "sequence":
        if seq_index is None:
            raise ValueError("level 'sequence' needs seq_index")
        return sequence_log_ratio(logp, logp_old, seq_index)
    raise ValueError(f"unknown importance sampling level {level!r}")


# -- Two-sided clip and CISPO (docs/algorithm.md §14) -------------------------------------------------------


def two_sided_clip(ratio: torch.Tensor, advantages: torch.Tensor, low: Bound, high: Bound,
                   delta: float) -> torch.Tensor:
    """min(min(r, delta) A, clip(r, low, high) A): PPO's clip, plus a cap on the unclipped term so that a
    token with A < 0 and a huge ratio contributes at most delta A, with no gradient (docs/algorithm.md §14)."""
    return torch.minimum(torch.clamp(ratio, max=delta) * advantages, torch.clamp(ratio, low, high) * advantages)


def cispo_weight(log_ratio: torch.Tensor, max_weight: float) -> torch.Tensor:
    """stopgrad(min(r, max_weight)): the detached importance weight CISPO puts on a token's log-prob."""
    return torch.clamp(torch.exp(log_ratio.detach()), max=max_weight)


def cispo_surrogate(logp, log_ratio, advantages, max_weight: float) -> torch.Tensor:
    """CISPO (MiniMax-M1): sg(min(r, max_weight)) A lp per token. The weight is capped, not the token: every
    token keeps the gradient sg(w) A through its lp (docs/algorithm.md §14)."""
    return cispo_weight(log_ratio, max_weight) * advantages * logp


def sapo_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, tau_pos: float, tau_neg: float) -> torch.Tensor:
    """SAPO (Qwen 2025): a soft gate in place of the clip, (4 / tau) sigmoid(tau (r - 1)) A per token, tau = tau_pos
    for A > 0, tau_neg otherwise. Its gradient, 4 sigma (1 - sigma) r A d lp, is the plain one at r = 1 and fades
    smoothly as r leaves 1 rather than stopping at a bound (docs/algorithm.md §14.1)."""
    tau = torch.where(advantages > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    return torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau * advantages


# -- VESPO (docs/algorithm.md §14.2) --------------------------------------------------------------------------

def vespo_log_ratio(logp, logp_old, seq_index: torch.Tensor,
                    sampler_weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """log w per token, detached, float64: the sum over the token's sequence of its clamped token log-ratios
    (the log of the product of the token ratios, not GSPO's mean), plus the sum of the log of §15's token
    correction where one is given, so that w is the ratio to the distribution the engine sampled from. A masked
    token (weight 0) takes the bound's log 1e-8, and with it its whole sequence's w (§14.2)."""
    with torch.no_grad():
        x = (logp.detach() - logp_old.detach()).to(torch.float64)
        log_w = sequence_sum(x.clamp(-VESPO_TOKEN_LOG_RATIO_MAX, VESPO_TOKEN_LOG_RATIO_MAX), seq_index)
        if sampler_weight is not None:
            log_c = torch.log(sampler_weight.detach().to(log_w.device, torch.float64))
            log_w = log_w + sequence_sum(log_c.clamp(VESPO_LOG_W_MIN, VESPO_LOG_W_MAX), seq_index)
        return log_w.clamp(VESPO_LOG_W_MIN, VESPO_LOG_W_MAX)


def vespo_weight(logp, logp_old, advantages, seq_index: torch.Tensor,
                 shape: tuple[float, float, float, float] = VESPO_SHAPE,
                 sampler_weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """phi(w) = exp(lambda + k log w - lambda w) per token, detached: a Gamma-shaped weight of the sequence ratio
    w (vespo_log_ratio), 1 at w = 1, vanishing as w -> 0 (k) and as w -> inf (lambda); (k, lambda) are
    (k_pos, lambda_pos) for A >= 0, else (k_neg, lambda_neg). docs/algorithm.md §14.2."""
    k_pos, lam_pos, k_neg, lam_neg = shape
    with torch.no_grad():
        log_w = vespo_log_ratio(logp, logp_old, seq_index, sampler_weight)
        pos = advantages.detach().to(log_w.device) >= 0
        k = torch.where(pos, torch.full_like(log_w, k_pos), torch.full_like(log_w, k_neg))
        lam = torch.where(pos, torch.full_like(log_w, lam_pos), torch.full_like(log_w, lam_neg))
        return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).to(logp.dtype)


def vespo_surrogate(logp, advantages, phi: torch.Tensor) -> torch.Tensor:
    """VESPO: sg(phi) A lp per token, whose gradient is phi A d lp (docs/algorithm.md §14.2)."""
    return phi.detach() * advantages * logp


# -- GMPO (docs/algorithm.md §14.3) ----------------------------------------------------------------------------

def gmpo_clipped_log_ratio(log_ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float,
                           eps_high: float) -> torch.Tensor:
    """PPO's pessimistic clip in log space, per token: min(x, clamp(x, -eps_low, eps_high)) for A > 0 is
    min(x, eps_high), max(x, clamp(x, ..)) otherwise is max(x, -eps_low), so only the advantage's side is bounded
    and a token past it stops moving (docs/algorithm.md §14.3). A one-sided clamp, not torch.minimum of the two:
    its gradient is 1 or 0, with no tie between equal operands to split."""
    return torch.where(advantages > 0, log_ratio.clamp(max=eps_high), log_ratio.clamp(min=-eps_low))


def gmpo_surrogate(logp, logp_old, advantages, seq_index: torch.Tensor, eps_low: float,
                   eps_high: float) -> torch.Tensor:
    """GMPO (Zhao et al. 2025): exp(mean over the completion's tokens of their clipped log-ratios) A per token, the
    geometric mean of the clipped token ratios times the advantage. Every token of a completion carries the same
    value, so §5's sequence_mean makes it the completion's term, TRL's GMPO loss; a token's gradient is
    w A / |o_i| if it is unclipped, else 0 (docs/algorithm.md §14.3)."""
    clipped = gmpo_clipped_log_ratio(logp - logp_old, advantages, eps_low, eps_high)
    return torch.exp(sequence_mean(clipped, seq_index)) * advantages


def check_constant_per_sequence(weight: torch.Tensor, seq_index: torch.Tensor, what: str) -> None:
    """Refuse a per-token weight that differs within a completion: with GMPO a token carries its completion's term
    and moves through its geometric mean, so a weight can only mean the completion's (§14.3)."""
    with torch.no_grad():
        w = weight.detach().to(torch.float64)
        n_ids = int(seq_index.max().item()) + 1 if seq_index.numel() else 0
        high = w.new_full((n_ids,), -math.inf).scatter_reduce(0, seq_index, w, "amax")
        low = w.new_full((n_ids,), math.inf).scatter_reduce(0, seq_index, w, "amin")
        if bool((high[seq_index] != low[seq_index]).any()):
            raise ValueError(f"{what} differs between the tokens of a completion; with clip 'gmpo' it must be one "
                             "value per completion (a sequence_* correction, the off-policy mask)")


@dataclass
class TokenLoss:
    loss: torch.Tensor                # [n] per-token loss (-objective); aggregate with aggregation_weights
    kl_ref: Optional[torch.Tensor]    # [n] KL estimate to the reference, or None when that term is off
    kl_mirror: Optional[torch.Tensor]  # [n] KL estimate to the sampling policy (mirror), or None
    clipped_low: torch.Tensor         # [n] bool: A < 0 and r below the lower bound (the clip binds)
    clipped_high: torch.Tensor        # [n] bool: A > 0 and r above the upper bound; for CISPO, A != 0 and
    #                                   the weight capped. r is the sequence's ratio at level 'sequence'; for
    #                                   GMPO the token's own, against its log-space bounds.
    vespo_weight: Optional[torch.Tensor] = None  # [n] clip 'vespo': phi(w) of the token's sequence (detached)

    @property
    def kl(self) -> Optional[torch.Tensor]:
        """The KL to the reference (the field's name before the mirror variant)."""
        return self.kl_ref


def clip_flags(clip: str, log_ratio: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor,
               eps_low: float, eps_high: float, cispo_max_weight: float = 5.0,
               gmpo_epsilons: tuple[float, float] = GMPO_EPSILONS) -> tuple[torch.Tensor, torch.Tensor]:
    """(clipped_low, clipped_high) per token, without gradient, from the ratio the surrogate used (the token's
    or its sequence's). CISPO caps only from above, and a capped weight matters whatever A's sign (§14). GMPO
    clips each token's log-ratio before its mean: compared in log space, as TRL counts them (§14.3)."""
    with torch.no_grad():
        if clip == "gmpo":
            low, high = gmpo_epsilons
            return (log_ratio < -low) & (advantages < 0), (log_ratio > high) & (advantages > 0)
        ratio = torch.exp(log_ratio)
        if clip == "cispo":
            return torch.zeros_like(ratio, dtype=torch.bool), (ratio > cispo_max_weight) & (advantages != 0)
        if clip in ("sapo", "vespo"):   # a soft gate or weight: nothing is ever clipped outright
            return torch.zeros_like(ratio, dtype=torch.bool), torch.zeros_like(ratio, dtype=torch.bool)
        low, high = clip_bounds(clip, logp_old, eps_low, eps_high)
        return (ratio < low) & (advantages < 0), (ratio > high) & (advantages > 0)


def _number_problem(name: str, value, *, above: float, inclusive: bool) -> Optional[str]:
    """Why `value` is not a number above (or, inclusive, at or above) `above`, or None; NaN is refused too."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (
        value >= above if inclusive else value > above)
    return None if ok else f"{name} must be a number {'>=' if inclusive else '>'} {above:g}, got {value!r}"


@dataclass(frozen=True)
class LossOptions:
    """The loss's options for a whole run (docs/algorithm.md §1, §4, §6, §13, §14): what grpo_token_loss does
    with a batch's tensors. What changes per batch (the tensors, pg_weight, the entropy and its adaptive
    coefficient) stays an argument of grpo_token_loss. Built from the recipe by from_algorithm, and checked once,
    here, rather than on every micro-batch. The defaults are the recipe's: GRPO as DeepSeekMath wrote it
    (LossOptions() == LossOptions.from_algorithm(AlgorithmConfig())).
    eps_low / eps_high bound the ratio the level uses: the token's, or at level 'sequence' its sequence's, where
    from_algorithm takes the recipe's sequence_epsilon_* (§13)."""

    beta: float = 0.04                 # weight of the KL to the reference (kl_target ref, both)
    eps_low: float = 0.2               # ratio clip window [1 - eps_low, 1 + eps_high] (§6)
    eps_high: float = 0.2
    clip: str = "ratio"                # one of CLIPS (§6, §14)
    kl_target: str = "ref"             # one of KL_TARGETS (§4.2)
    beta_mirror: float = 0.04          # weight of the KL to the sampling policy (kl_target mirror, both)
    kl_estimator: str = "k3"           # a key of KL_ESTIMATORS (§4.1)
    level: str = "token"               # one of LEVELS: the token's ratio, or its sequence's (§13)
    delta: Optional[float] = None      # clip 'ratio': cap of the unclipped term (§14); None: off
    cispo_max_weight: float = 5.0      # clip 'cispo': cap of the detached weight (§14)
    kl_ratio_weight: bool = False      # the reference KL times the importance ratio (§4.4)
    sapo_temperatures: tuple[float, float] = (1.0, 1.05)   # clip 'sapo': (tau_pos, tau_neg) (§14.1)
    vespo_shape: tuple[float, float, float, float] = VESPO_SHAPE   # clip 'vespo': (k_pos, lam_pos, k_neg, lam_neg)
    gmpo_epsilons: tuple[float, float] = GMPO_EPSILONS   # clip 'gmpo': (low, high) bounds of the log-ratio (§14.3)

    def __post_init__(self):
        # tuples, so that options built from lists (a YAML file, a TRL config) still compare equal and freeze
        object.__setattr__(self, "sapo_temperatures", tuple(self.sapo_temperatures))
        object.__setattr__(self, "vespo_shape", tuple(self.vespo_shape))
        object.__setattr__(self, "gmpo_epsilons", tuple(self.gmpo_epsilons))
        check_static_options(self.clip, self.level, self.delta)
        problems = self._problems()
        if problems:
            raise ValueError(f"LossOptions: {'; '.join(problems)}")

    def _problems(self) -> list[str]:
        """What the loss would compute as garbage (NaN, a negative KL weight) or fail on deep inside a batch."""
        problems = []
        if self.kl_target not in KL_TARGETS:
            problems.append(f"kl_target must be one of {', '.join(KL_TARGETS)}, got {self.kl_target!r}")
        if self.kl_estimator not in KL_ESTIMATORS:
            problems.append(f"kl_estimator must be one of {', '.join(KL_ESTIMATORS)}, got {self.kl_estimator!r}")
        numbers = [("beta", self.beta, 0.0, True), ("beta_mirror", self.beta_mirror, 0.0, True),
                   ("eps_low", self.eps_low, 0.0, True), ("eps_high", self.eps_high, 0.0, True),
                   ("cispo_max_weight", self.cispo_max_weight, 0.0, False)]
        if len(self.sapo_temperatures) != 2:
            problems.append(f"sapo_temperatures must be (tau_pos, tau_neg), got {self.sapo_temperatures!r}")
        else:
            numbers += [(f"sapo_temperatures[{i}]", t, 0.0, False) for i, t in enumerate(self.sapo_temperatures)]
        if len(self.vespo_shape) != 4:
            problems.append(f"vespo_shape must be (k_pos, lambda_pos, k_neg, lambda_neg), got {self.vespo_shape!r}")
        else:
            numbers += [(f"vespo_shape[{i}]", v, 0.0, False) for i, v in enumerate(self.vespo_shape)]
        if len(self.gmpo_epsilons) != 2:
            problems.append(f"gmpo_epsilons must be (low, high), got {self.gmpo_epsilons!r}")
        else:
            numbers += [(f"gmpo_epsilons[{i}]", e, 0.0, False) for i, e in enumerate(self.gmpo_epsilons)]
        if self.delta is not None:   # the recipe's rule (§14): a cap inside the window would clip every token
            numbers.append(("delta", self.delta, 1.0 + self.eps_high, False))
        problems += [p for name, value, above, inclusive in numbers
                     if (p := _number_problem(name, value, above=above, inclusive=inclusive))]
        return problems

    @classmethod
    def from_algorithm(cls, a: AlgorithmConfig) -> "LossOptions":
        """The options recipe.algorithm sets. Every field of the schema the loss reads is read here, and only here
        (tests/test_loss_options.py::test_every_algorithm_field_reaches_the_loss_or_is_named_elsewhere)."""
        sequence = a.importance_sampling_level == "sequence"
        # §13: a sequence ratio is a mean of log-ratios, far closer to 1 than a token's: it has its own window
        eps_low, eps_high = ((a.sequence_epsilon_low, a.sequence_epsilon_high) if sequence
                             else (a.epsilon_low, a.epsilon_high))
        return cls(beta=a.beta, eps_low=eps_low, eps_high=eps_high, clip=a.clip, kl_target=a.kl_target,
                   beta_mirror=a.beta_mirror, kl_estimator=a.kl_estimator, level=a.importance_sampling_level,
                   delta=a.delta, cispo_max_weight=a.cispo_max_weight, kl_ratio_weight=a.kl_ratio_weight,
                   sapo_temperatures=(a.sapo_temperature_pos, a.sapo_temperature_neg),
                   vespo_shape=(a.vespo_k_pos, a.vespo_lambda_pos, a.vespo_k_neg, a.vespo_lambda_neg),
                   gmpo_epsilons=(a.gmpo_epsilon_low, a.gmpo_epsilon_high))


def grpo_token_loss(logp, logp_old, logp_ref, advantages, options: LossOptions, *,
                    seq_index: Optional[torch.Tensor] = None, pg_weight: Optional[torch.Tensor] = None,
                    entropy: Optional[torch.Tensor] = None, entropy_coef: float = 0.0,
                    sampler_weight: Optional[torch.Tensor] = None) -> TokenLoss:
    """-(pg * pg_weight) + KL penalty - entropy_coef * entropy per token (docs/algorithm.md §1, with the
    variants of §4, §6, §13, §14 and §16 that `options` selects). pg_weight (detached) scales the policy term only:
    the sampler correction of §15 times the token mask of §16. options.kl_ratio_weight: the reference KL times the
    importance ratio r (the token's, or its sequence's), with r's gradient (§4.4). clip 'vespo' takes §15's
    correction as sampler_weight, into its sequence ratio, instead of in pg_weight (§14.2). With clip 'gmpo'
    pg_weight must be one value per completion (§14.3)."""
    if not isinstance(options, LossOptions):
        raise TypeError(f"options must be a LossOptions (e.g. LossOptions.from_algorithm(recipe.algorithm)), "
                        f"got {type(options).__name__}")
    o = options
    check_surrogate_options(o.clip, o.level, seq_index, o.delta)   # (the static part passed at construction)
    if sampler_weight is not None and o.clip != "vespo":
        raise ValueError(f"sampler_weight enters clip 'vespo' only; with clip {o.clip!r} it is part of pg_weight (§15)")
    if pg_weight is not None and o.clip == "gmpo":
        check_constant_per_sequence(pg_weight, seq_index, "pg_weight")
    # VESPO's weight once, for the loss and for TokenLoss (§14.2)
    phi = (vespo_weight(logp, logp_old, advantages, seq_index, o.vespo_shape, sampler_weight)
           if o.clip == "vespo" else None)
    loss = -surrogate(o.clip, logp, logp_old, advantages, o.eps_low, o.eps_high, level=o.level, seq_index=seq_index,
                      delta=o.delta, cispo_max_weight=o.cispo_max_weight, sapo_temperatures=o.sapo_temperatures,
                      vespo_phi=phi, gmpo_epsilons=o.gmpo_epsilons)
    if pg_weight is not None:
        loss = loss * pg_weight.detach().to(loss.dtype)
    ref_weight = torch.exp(policy_log_ratio(logp, logp_old, o.level, seq_index)) if o.kl_ratio_weight else None
    penalty, kl_ref, kl_mirror = kl_terms(logp, logp_ref, logp_old, target=o.kl_target, beta=o.beta,
                                          beta_mirror=o.beta_mirror, estimator=o.kl_estimator, ref_weight=ref_weight)
    if penalty is not None:
        loss = loss + penalty
    if entropy is not None and entropy_coef != 0:
        loss = loss - entropy_coef * entropy.to(loss.dtype)  # a bonus: higher entropy, lower loss (§16)
    with torch.no_grad():
        log_ratio = policy_log_ratio(logp.detach(), logp_old, o.level, seq_index)
    clipped_low, clipped_high = clip_flags(o.clip, log_ratio, logp_old, advantages, o.eps_low, o.eps_high,
                                           o.cispo_max_weight, o.gmpo_epsilons)
    return TokenLoss(loss, kl_ref, kl_mirror, clipped_low, clipped_high, phi)


# -- Sampler-mismatch correction (docs/algorithm.md §15) ----------------------------------------------------

def sampler_correction_weights(logp_at_rollout: torch.Tensor, logp_sampler: torch.Tensor,
                               seq_index: Optional[torch.Tensor], mode: str, low: float,
                               high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, masked) per token, both detached: the importance weight from the engine's sampling
    distribution to the trainer's at the same weights (docs/algorithm.md §15).

    ratio = exp(lp_rollout - lp_sampler) per token, or for sequence_* modes exp(sum over the sequence of
    that log-ratio), the product of its token ratios, on each of its tokens. *_truncate: min(ratio, high);
    *_mask: ratio inside [low, high], else 0 (and masked). 'none': all ones."""
    if mode not in SAMPLER_CORRECTIONS:
        raise ValueError(f"unknown sampler correction {mode!r}")
    with torch.no_grad():
        log_ratio = (logp_at_rollout.detach() - logp_sampler.detach()).to(logp_at_rollout.dtype)
        if mode == "none":
            return torch.ones_like(log_ratio), torch.zeros_like(log_ratio, dtype=torch.bool)
        if mode.startswith("sequence_"):
            if seq_index is None:
                raise ValueError(f"sampler correction {mode!r} needs seq_index")
            log_ratio = sequence_sum(log_ratio, seq_index)
        ratio = torch.exp(log_ratio)
        if mode.endswith("_truncate"):
            return torch.clamp(ratio, max=high), torch.zeros_like(ratio, dtype=torch.bool)
        if not mode.endswith("_mask"):   # a value the schema allows and this function does not know yet
            raise ValueError(f"sampler correction {mode!r} has no weights in loss.sampler_correction_weights")
        masked = (ratio < low) | (ratio > high)
        return torch.where(masked, torch.zeros_like(ratio), ratio), masked


def off_policy_sequence_mask(logp: torch.Tensor, logp_sampler: torch.Tensor, advantages: torch.Tensor,
                             seq_index: torch.Tensor, threshold: float) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (docs/algorithm.md §15.1), per token, detached: 0 on every token of
    a completion with A < 0 whose mean of lp_sampler - lp over its tokens (a forward-KL estimate from the
    sampler to the policy now) is above `threshold`, else 1. A wrong answer the policy has moved far from is
    not pushed down further."""
    with torch.no_grad():
        kl = sequence_mean((logp_sampler - logp).detach().to(torch.float64), seq_index)
        return ((advantages >= 0) | (kl <= threshold)).to(logp.dtype)


# -- Token selection and the entropy bonus (docs/algorithm.md §16) -----------------------------------------


def entropy_threshold(entropy: torch.Tensor, quantile: float) -> float:
    """The (1 - quantile)-quantile of the tokens' entropies, interpolated linearly between order statistics as
    torch.quantile does, so that the top `quantile` share of tokens lies at or above it. quantile 1 keeps every
    token (-inf). Sorted here rather than torch.quantile, which refuses inputs above 2^24 elements."""
    if not 0.0 < quantile <= 1.0:
        raise ValueError(f"quantile must be in (0, 1], got {quantile}")
    values = entropy.detach().flatten().to(torch.float64)
    if quantile == 1.0 or values.numel() == 0:
        return float("-inf")
    ordered = torch.sort(values).values
    pos = (1.0 - quantile) * (ordered.numel() - 1)
    lo = int(pos)  # floor: pos >= 0
    hi = min(lo + 1, ordered.numel() - 1)
    return (ordered[lo] + (pos - lo) * (ordered[hi] - ordered[lo])).item()


def top_entropy_mask(entropy: torch.Tensor, threshold: float) -> torch.Tensor:
    """bool per token: entropy >= threshold, the "forking" tokens that keep their policy gradient (§16)."""
    return entropy.detach() >= threshold


def adapt_entropy_coef(coef: float, entropy, target: float, lr: float) -> float:
    """max(0, coef + lr (target - H)), H the mean token entropy (a float or a tensor of entropies): a dual
    step that raises the bonus while entropy is below target and lowers it above, never below 0 (§16)."""
    mean = entropy.detach().to(torch.float64).mean().item() if torch.is_tensor(entropy) else float(entropy)
    return max(0.0, coef + lr * (target - mean))


def aggregation_weights(seq_index: torch.Tensor, seq_lengths: torch.Tensor, mode: str,
                        max_completion_length: int, totals: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """Per-token weights so that sum(w * l) is the aggregate of docs/algorithm.md §5 over the whole batch.

    seq_index [n_tokens]: which completion each token belongs to; seq_lengths [n_seqs]: |o_i| (tokens
    that count; a skipped completion has length 0 and no tokens). totals: (completions, tokens) of the
    whole batch when these are one process's share of it (docs/algorithm.md §21); None: these are all."""
    lengths = seq_lengths.to(torch.float64)
    n_seqs, n_tokens = totals if totals is not None else (seq_lengths.numel(), lengths.sum().item())
    if mode == "sequence_mean":      # 1/G sum_i 1/|o_i| sum_t
        w = 1.0 / (n_seqs * lengths.clamp(min=1))[seq_index]
    elif mode == "token_mean":       # sum_i sum_t / sum_i |o_i|   (DAPO)
        w = torch.full(seq_index.shape, 1.0 / max(1.0, n_tokens), dtype=torch.float64)
    elif mode == "constant":         # sum_i sum_t / (G * L_max)   (Dr. GRPO)
        w = torch.full(seq_index.shape, 1.0 / (n_seqs * max_completion_length), dtype=torch.float64)
    elif mode == "sequence_sum":     # 1/G sum_i sum_t   (LUSPO: a sequence's loss times its length)
        w = torch.full(seq_index.shape, 1.0 / max(1, n_seqs), dtype=torch.float64)
    elif mode == "sum":
        w = torch.ones(seq_index.shape, dtype=torch.float64)
    else:
        raise ValueError(f"unknown aggregation {mode!r}")
    return w


def aggregate(token_loss: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (token_loss * weights.to(token_loss.dtype)).sum()
