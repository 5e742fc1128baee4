"""Per-token log-probabilities without ever holding [tokens x vocab] logits (docs/algorithm.md §10, §11).

    log p(t | h) = z_t - logsumexp(z),   z = cap(scale (h W^T + b)) / temperature

(`scale` and `cap(x) = c tanh(x / c)` are the final-logit transforms some architectures apply after their
LM head: model.logit_transform; Cohere and Granite scale, Gemma 2-4 soft-cap, most do neither) is computed
over tiles of (rows x vocab columns) with an online logsumexp in fp32 (fp64 when the inputs are fp64, for
parity tests). Forward saves only the hidden states, the targets and one logsumexp per row; backward
recomputes each tile's softmax:

    dL/dh = g / T * (w_t - sum_j p_j w_j)          dL/dW_j = g / T * (1[j = t] - p_j) h

(times `scale`, and with a soft-cap each tile's dL/dz times cap' = 1 - (cap(x) / c)^2, a second tile while
it is used), so the peak extra memory is a tile or two, whatever the sequence length or vocabulary. The LM
head's gradient is only built when its weight requires grad (LoRA leaves it frozen). Memory argument and
numbers: see scripts/bench_memory.py; the full-logits reference this must agree with is `reference_log_probs`.

With entropy_grad the per-row entropy H = logsumexp - sum_j p_j z_j (for the entropy bonus,
docs/algorithm.md §16) is differentiable too: dH/dz_j = -p_j (log p_j + H), so backward adds
ge * (-p_j (log p_j + H)) to each tile's dL/dz for the entropy's incoming gradient ge, and keeps two tiles
alive instead of one. The reference for both is `reference_entropy`.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class Transform(NamedTuple):
    """z = cap(scale * raw) / temperature, cap(x) = softcap * tanh(x / softcap) (no cap when softcap is None)."""
    scale: float = 1.0
    softcap: Optional[float] = None
    inv_temp: float = 1.0

    def apply_(self, raw: torch.Tensor) -> torch.Tensor:
        """In place: raw head outputs -> final tempered logits."""
        if self.softcap is not None:
            return raw.mul_(self.scale / self.softcap).tanh_().mul_(self.softcap * self.inv_temp)
        if self.scale * self.inv_temp != 1.0:
            raw.mul_(self.scale * self.inv_temp)
        return raw

    def cap_slope(self, z: torch.Tensor) -> Optional[torch.Tensor]:
        """d cap / dx at final logits z (a new tile): 1 - tanh^2; None without a cap (the slope is 1)."""
        if self.softcap is None:
            return None
        return torch.mul(z, 1.0 / (self.softcap * self.inv_temp)).square_().neg_().add_(1.0)   # one tile

    @property
    def linear(self) -> float:
        """The constant factor of dz/draw: scale / temperature (times cap_slope, where there is a cap)."""
        return self.scale * self.inv_temp


def _tile_logits(h, weight, bias, v0, v1, tf: Transform):
    z = h @ weight[v0:v1].to(h.dtype).T
    if bias is not None:
        z += bias[v0:v1].to(h.dtype)
    return tf.apply_(z)


def _entropy_tile_grad_(z, lse, entropy, g, ge):
    """In place, tile z of tempered logits -> -p g - ge p (log p + H): dL/dz of g * lp plus ge * H, without the
    1[j = target] g term (docs/algorithm.md §16). Holds one more tile (p) while it works, two in all."""
    z.sub_(lse[:, None])                        # log p
    p = torch.exp(z)
    z.add_(entropy[:, None]).mul_(-ge[:, None]).sub_(g[:, None]).mul_(p)  # p * (-g - ge (log p + H))
    del p


class _SelectiveLogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, tf, chunk_rows, chunk_vocab, want_entropy,
                entropy_grad=False):
        acc = _acc_dtype(hidden.dtype)
        n, vocab = hidden.shape[0], weight.shape[0]
        logp = torch.empty(n, dtype=acc, device=hidden.device)
        lse = torch.empty(n, dtype=acc, device=hidden.device)
        entropy = torch.empty(n if want_entropy else 0, dtype=acc, device=hidden.device)
        for r0 in range(0, n, chunk_rows):
            r1 = min(n, r0 + chunk_rows)
            h = hidden[r0:r1].to(acc)
            m = torch.full((r1 - r0,), float("-inf"), dtype=acc, device=hidden.device)
            s = torch.zeros(r1 - r0, dtype=acc, device=hidden.device)
            sz = torch.zeros_like(s) if want_entropy else None  # sum exp(z - m) * z, for the entropy
            for v0 in range(0, vocab, chunk_vocab):
                # In-place ops keep one tile alive (two with entropy): the tile is the kernel's whole
                # extra memory, so it is not copied.
                z = _tile_logits(h, weight, bias, v0, min(vocab, v0 + chunk_vocab), tf)
                m_new = torch.maximum(m, z.max(dim=1).values)
                scale = torch.exp(m - m_new)
                z -= m_new[:, None]                       # z - m
                if want_entropy:
                    e = torch.exp(z)
                    # sum e * z_orig = sum e * (z - m) + m * sum e; a batched dot avoids a third tile
                    ez = (e.unsqueeze(1) @ z.unsqueeze(2)).view(-1)
                    e_sum = e.sum(dim=1)
                    sz = sz * scale + ez + m_new * e_sum
                    del e
                else:
                    e_sum = z.exp_().sum(dim=1)
                s = s * scale + e_sum
                m = m_new
            lse[r0:r1] = m + torch.log(s)
            t = targets[r0:r1]
            zt = (h * weight[t].to(acc)).sum(dim=1)
            if bias is not None:
                zt = zt + bias[t].to(acc)
            logp[r0:r1] = tf.apply_(zt) - lse[r0:r1]
            if want_entropy:
                entropy[r0:r1] = lse[r0:r1] - sz / s
        ctx.save_for_backward(hidden, weight, bias if bias is not None else torch.empty(0), targets, lse,
                              entropy if entropy_grad else torch.empty(0))
        ctx.has_bias = bias is not None
        ctx.cfg = (tf, chunk_rows, chunk_vocab)
        ctx.entropy_grad = entropy_grad
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logp.to(hidden.dtype) if hidden.dtype == torch.float64 else logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        bias = bias if ctx.has_bias else None
        tf, chunk_rows, chunk_vocab = ctx.cfg
        acc = lse.dtype
        n, vocab = hidden.shape[0], weight.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = ctx.has_bias and ctx.needs_input_grad[2]
        grad_h = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(vocab, dtype=acc, device=weight.device) if need_b else None
        g_all = grad_logp.to(acc)
        ge_all = grad_entropy.to(acc) if ctx.entropy_grad and grad_entropy is not None else None
        for r0 in range(0, n, chunk_rows):
            r1 = min(n, r0 + chunk_rows)
            h, g, t = hidden[r0:r1].to(acc), g_all[r0:r1], targets[r0:r1]
            for v0 in range(0, vocab, chunk_vocab):
                v1 = min(vocab, v0 + chunk_vocab)
                dz = _tile_logits(h, weight, bias, v0, v1, tf)
                slope = tf.cap_slope(dz)   # (a second tile, only for a soft-capped head)
                if ge_all is None:
                    dz.sub_(lse[r0:r1, None]).exp_().mul_(-g[:, None])  # -p * g, in place: one tile
                else:
                    _entropy_tile_grad_(dz, lse[r0:r1], entropy[r0:r1], g, ge_all[r0:r1])
                inside = (t >= v0) & (t < v1)
                rows = inside.nonzero(as_tuple=True)[0]
                dz[rows, t[rows] - v0] += g[rows]  # + 1[j = t] * g
                if slope is not None:
                    dz.mul_(slope)
                    del slope
                if need_h:
                    grad_h[r0:r1] += (dz @ weight[v0:v1].to(acc)) * tf.linear
                if need_w:
                    grad_w[v0:v1] += (dz.T @ h) * tf.linear
                if need_b:
                    grad_b[v0:v1] += dz.sum(dim=0) * tf.linear
        return (
            grad_h.to(hidden.dtype) if need_h else None,
            grad_w.to(weight.dtype) if need_w else None,
            grad_b.to(bias.dtype) if need_b else None,
            None, None, None, None, None, None,
        )


def selective_log_softmax(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    chunk_rows: int = 1024,
    chunk_vocab: int = 8192,
    return_entropy: bool = False,
    entropy_grad: bool = False,
    scale: float = 1.0,
    softcap: Optional[float] = None,
):
    """log p(targets) for each row of `hidden` [n, d] under the head `weight` [vocab, d] (+ `bias`), its
    logits scaled by `scale` and soft-capped at `softcap` (the model's final-logit transform) before the
    temperature.

    Returns a float32 (float64 for float64 inputs) tensor [n]; with return_entropy also the per-row
    entropy of the tempered distribution: without gradient (for logging) unless entropy_grad, which makes
    it differentiable (the entropy bonus, docs/algorithm.md §16) and needs return_entropy.
    """
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"hidden must be [n, d] and targets [n]; got {tuple(hidden.shape)} and {tuple(targets.shape)}")
    if entropy_grad and not return_entropy:
        raise ValueError("entropy_grad needs return_entropy=True")
    logp, entropy = _SelectiveLogSoftmax.apply(
        hidden, weight, bias, targets, Transform(float(scale), None if softcap is None else float(softcap),
                                                 1.0 / float(temperature)),
        int(chunk_rows), int(chunk_vocab), bool(return_entropy), bool(entropy_grad))
    return (logp, entropy) if return_entropy else logp


def _reference_logits(hidden, weight, bias, temperature, scale, softcap):
    """Full logits, in the order a transformers causal LM makes them (head, scale, soft-cap), then tempered."""
    logits = hidden @ weight.T
    if bias is not None:
        logits = logits + bias
    logits = logits * scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return (logits / temperature).to(_acc_dtype(hidden.dtype))


def reference_log_probs(hidden, weight, targets, bias=None, temperature=1.0, scale=1.0, softcap=None):
    """The plain path: full logits, log_softmax, gather. Parity reference and the naive baseline."""
    logits = _reference_logits(hidden, weight, bias, temperature, scale, softcap)
    return torch.log_softmax(logits, dim=-1).gather(1, targets[:, None]).squeeze(1)


def reference_entropy(hidden, weight, bias=None, temperature=1.0, scale=1.0, softcap=None):
    """The plain path for the entropy: full logits, log_softmax, -sum p log p per row (parity reference)."""
    logp = torch.log_softmax(_reference_logits(hidden, weight, bias, temperature, scale, softcap), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)
