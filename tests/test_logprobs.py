"""Parity of the chunked selective log-softmax against log_softmax + gather (the plain reference)."""

import pytest
import torch

from lowmem_grpo.logprobs import reference_entropy, reference_log_probs, selective_log_softmax

CASES = [  # (n rows, hidden, vocab, chunk rows, chunk vocab, temperature, bias)
    (1, 8, 5, 1, 2, 1.0, False),
    (37, 16, 1003, 8, 100, 0.7, False),   # vocab not a multiple of the tile
    (64, 32, 517, 64, 517, 1.3, True),    # one tile
    (50, 24, 257, 7, 64, 0.5, True),
]


def _grads(fn, h, w, b, t, g):
    out = fn(h, w, t, b)
    params = [x for x in (h, w, b) if x is not None and x.requires_grad]
    return out, torch.autograd.grad((out * g).sum(), params)


@pytest.mark.parametrize("n,d,v,cr,cv,temp,bias", CASES)
@pytest.mark.parametrize("trainable_head", [False, True])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-9), (torch.float32, 1e-5)])
def test_chunked_equals_full_logits(n, d, v, cr, cv, temp, bias, trainable_head, dtype, tol):
    g0 = torch.Generator().manual_seed(n * v)
    h = torch.randn(n, d, generator=g0, dtype=dtype).requires_grad_()
    w = (torch.randn(v, d, generator=g0, dtype=dtype) * 0.5).requires_grad_(trainable_head)
    b = (torch.randn(v, generator=g0, dtype=dtype)).requires_grad_(trainable_head) if bias else None
    t = torch.randint(0, v, (n,), generator=g0)
    g = torch.randn(n, generator=g0, dtype=dtype)

    def chunked(h, w, t, b):
        return selective_log_softmax(h, w, t, bias=b, temperature=temp, chunk_rows=cr, chunk_vocab=cv)

    def full(h, w, t, b):
        return reference_log_probs(h, w, t, bias=b, temperature=temp)

    out, grads = _grads(chunked, h, w, b, t, g)
    ref, ref_grads = _grads(full, h, w, b, t, g)
    assert len(grads) == (3 if trainable_head and bias else 2 if trainable_head else 1)

    def rel(a, r):
        return ((a.double() - r.double()).abs().max() / r.double().abs().max().clamp(min=1e-30)).item()

    assert rel(out, ref) < tol
    for a, r in zip(grads, ref_grads):
        assert rel(a, r) < tol


def test_frozen_head_builds_no_head_gradient():
    h = torch.randn(5, 4, requires_grad=True)
    w = torch.randn(11, 4)  # requires_grad False: LoRA leaves the head frozen
    out = selective_log_softmax(h, w, torch.randint(0, 11, (5,)), chunk_vocab=3)
    out.sum().backward()
    assert w.grad is None and h.grad is not None


def test_entropy_matches_definition():
    g = torch.Generator().manual_seed(1)
    h, w = torch.randn(9, 6, generator=g, dtype=torch.float64), torch.randn(23, 6, generator=g, dtype=torch.float64)
    _, ent = selective_log_softmax(h, w, torch.zeros(9, dtype=torch.long), temperature=0.8, chunk_rows=4,
                                   chunk_vocab=5, return_entropy=True)
    logp = torch.log_softmax(h @ w.T / 0.8, dim=-1)
    assert torch.allclose(ent, -(logp.exp() * logp).sum(-1), atol=1e-12)


def test_shape_errors_are_clear():
    with pytest.raises(ValueError, match="hidden must be"):
        selective_log_softmax(torch.randn(2, 3, 4), torch.randn(5, 4), torch.zeros(2, dtype=torch.long))


ENTROPY_CASES = [  # (n rows, hidden, vocab, chunk rows, chunk vocab, temperature, bias): several tiles each way
    (13, 6, 41, 4, 9, 0.7, True),
    (20, 8, 100, 7, 33, 1.3, False),
    (5, 4, 17, 2, 17, 0.5, True),
]


@pytest.mark.parametrize("n,d,v,cr,cv,temp,bias", ENTROPY_CASES)
def test_entropy_gradient_equals_full_logits(n, d, v, cr, cv, temp, bias):
    """docs/algorithm.md §16: with entropy_grad, sum(a * logp) + sum(b * entropy) and its gradients w.r.t.
    hidden, head weight and bias agree with full logits to 1e-9 in float64."""
    g0 = torch.Generator().manual_seed(n + v)
    h = torch.randn(n, d, generator=g0, dtype=torch.float64).requires_grad_()
    w = (torch.randn(v, d, generator=g0, dtype=torch.float64) * 0.7).requires_grad_()
    b = torch.randn(v, generator=g0, dtype=torch.float64).requires_grad_() if bias else None
    t = torch.randint(0, v, (n,), generator=g0)
    a, c = torch.randn(n, generator=g0, dtype=torch.float64), torch.randn(n, generator=g0, dtype=torch.float64)
    params = [x for x in (h, w, b) if x is not None]

    logp, ent = selective_log_softmax(h, w, t, bias=b, temperature=temp, chunk_rows=cr, chunk_vocab=cv,
                                      return_entropy=True, entropy_grad=True)
    ours = (a * logp).sum() + (c * ent).sum()
    ref_logp, ref_ent = reference_log_probs(h, w, t, bias=b, temperature=temp), reference_entropy(h, w, b, temp)
    ref = (a * ref_logp).sum() + (c * ref_ent).sum()
    assert (ent - ref_ent).abs().max().item() < 1e-9 and abs(ours.item() - ref.item()) < 1e-9
    for x, y in zip(torch.autograd.grad(ours, params), torch.autograd.grad(ref, params)):
        assert (x - y).abs().max().item() < 1e-9
    # the entropy term alone (no gradient reaches logp)
    _, ent2 = selective_log_softmax(h, w, t, bias=b, temperature=temp, chunk_rows=cr, chunk_vocab=cv,
                                    return_entropy=True, entropy_grad=True)
    ref_ent2 = reference_entropy(h, w, b, temp)
    for x, y in zip(torch.autograd.grad((c * ent2).sum(), params), torch.autograd.grad((c * ref_ent2).sum(), params)):
        assert (x - y).abs().max().item() < 1e-9


def test_entropy_gradient_float32_and_frozen_head():
    g0 = torch.Generator().manual_seed(4)
    h = torch.randn(11, 8, generator=g0).requires_grad_()
    w = torch.randn(50, 8, generator=g0)  # frozen head (LoRA)
    t = torch.randint(0, 50, (11,), generator=g0)
    logp, ent = selective_log_softmax(h, w, t, temperature=0.9, chunk_rows=3, chunk_vocab=16, return_entropy=True,
                                      entropy_grad=True)
    (gh,) = torch.autograd.grad(logp.sum() - 0.3 * ent.sum(), h)
    ref = reference_log_probs(h, w, t, temperature=0.9).sum() - 0.3 * reference_entropy(h, w, temperature=0.9).sum()
    (rh,) = torch.autograd.grad(ref, h)
    assert torch.allclose(gh, rh, atol=1e-5)
    # without entropy_grad the entropy stays a logging figure without gradient
    _, ent_log = selective_log_softmax(h, w, t, return_entropy=True)
    assert not ent_log.requires_grad
    with pytest.raises(ValueError, match="entropy_grad needs return_entropy"):
        selective_log_softmax(h, w, t, entropy_grad=True)


def test_bf16_inputs_get_fp32_logits_not_bf16_ones():
    """A bf16 model's hidden states and head: the kernel's tiles are fp32 (TRL's cast_lm_head_to_fp32, always on
    here). Its log-probs equal an fp64 evaluation of the same bf16 values to fp32 precision, where rounding the
    logits to bf16 first, as a plain bf16 matmul does, is off by orders of magnitude more."""
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(64, 128, generator=g) * 2).to(torch.bfloat16)
    w = (torch.randn(3000, 128, generator=g) * 0.5).to(torch.bfloat16)
    t = torch.randint(0, 3000, (64,), generator=g)
    exact = reference_log_probs(h.double(), w.double(), t)
    ours = selective_log_softmax(h, w, t, chunk_rows=16, chunk_vocab=1000)
    assert ours.dtype == torch.float32
    bf16_logits = torch.log_softmax((h @ w.T).float(), -1).gather(1, t[:, None]).squeeze(1).double()
    err_ours, err_bf16 = (ours.double() - exact).abs().max().item(), (bf16_logits - exact).abs().max().item()
    assert err_ours < 1e-4 and err_bf16 > 50 * err_ours, (err_ours, err_bf16)


TRANSFORMS = [  # (scale, softcap): Cohere's scale, Granite's 1/logits_scaling, Gemma's soft-cap, both
    (0.0625, None), (4.0, None), (1.0, 2.0), (3.0, 1.5),
]


@pytest.mark.parametrize("scale,softcap", TRANSFORMS)
@pytest.mark.parametrize("temp", [1.0, 0.7])
def test_a_scaled_or_soft_capped_head_equals_full_logits(scale, softcap, temp):
    """The final-logit transforms (model.logit_transform): log-probs, entropy and the gradients w.r.t. hidden,
    head and bias, of sum(a * logp) + sum(c * entropy), agree with full logits transformed as a transformers
    model does (head, scale, soft-cap, then temperature), to 1e-9 in float64. Logits large enough that the
    cap bends them (|scale * z| up to ~8 against caps of 1.5 and 2)."""
    g0 = torch.Generator().manual_seed(int(scale * 100 + (softcap or 0) * 10))
    n, d, v = 13, 8, 97
    h = torch.randn(n, d, generator=g0, dtype=torch.float64).requires_grad_()
    w = torch.randn(v, d, generator=g0, dtype=torch.float64).requires_grad_()
    b = torch.randn(v, generator=g0, dtype=torch.float64).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g0)
    a, c = torch.randn(n, generator=g0, dtype=torch.float64), torch.randn(n, generator=g0, dtype=torch.float64)
    kw = dict(bias=b, temperature=temp, scale=scale, softcap=softcap)
    logp, ent = selective_log_softmax(h, w, t, chunk_rows=5, chunk_vocab=20, return_entropy=True, entropy_grad=True,
                                      **kw)
    ref_logp, ref_ent = reference_log_probs(h, w, t, **kw), reference_entropy(h, w, **kw)
    assert (logp - ref_logp).abs().max().item() < 1e-9 and (ent - ref_ent).abs().max().item() < 1e-9
    ours, ref = (a * logp).sum() + (c * ent).sum(), (a * ref_logp).sum() + (c * ref_ent).sum()
    for x, y in zip(torch.autograd.grad(ours, (h, w, b)), torch.autograd.grad(ref, (h, w, b))):
        assert (x - y).abs().max().item() < 1e-9
    # and without the entropy's gradient (the usual policy-loss path)
    logp = selective_log_softmax(h, w, t, chunk_rows=4, chunk_vocab=33, **kw)
    for x, y in zip(torch.autograd.grad((a * logp).sum(), (h, w, b)),
                    torch.autograd.grad((a * reference_log_probs(h, w, t, **kw)).sum(), (h, w, b))):
        assert (x - y).abs().max().item() < 1e-9
    # the transform matters here: the untransformed log-probs are far off
    assert (reference_log_probs(h, w, t, bias=b, temperature=temp) - ref_logp).abs().max().item() > 0.1
