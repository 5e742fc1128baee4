"""Parity of the chunked selective log-softmax against log_softmax + gather (the plain reference)."""

import pytest
import torch

from lowmem_grpo.logprobs import reference_log_probs, selective_log_softmax

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
