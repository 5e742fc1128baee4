"""Packing: the vectorised pack equals a plain per-token reference, tensor for tensor."""

from __future__ import annotations

import random

import pytest
import torch

from lowmem_grpo.batch import MicroBatch, pack, trained_completions
from lowmem_grpo.loss import aggregation_weights


def reference_pack(prompts, completions, advantages, micro_batch_size, aggregation, max_len, pad_id, sampler=None):
    """The obviously-correct version: one Python step per token."""
    lengths = torch.tensor([len(c) for c in completions])
    seq_of_token = torch.repeat_interleave(torch.arange(len(completions)), lengths)
    weights = aggregation_weights(seq_of_token, lengths, aggregation, max_len)
    out, tok0 = [], 0
    for s0 in range(0, len(completions), micro_batch_size):
        idx = range(s0, min(len(completions), s0 + micro_batch_size))
        seqs = [prompts[i] + completions[i] for i in idx]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        rows, pos, tgt, adv, sid, lps = [], [], [], [], [], []
        for b, i in enumerate(idx):
            for t, tok in enumerate(seqs[b]):
                ids[b, t] = tok
                mask[b, t] = 1
            for k, tok in enumerate(completions[i]):
                rows.append(b)
                pos.append(len(prompts[i]) - 1 + k)
                tgt.append(tok)
                adv.append(float(advantages[i]))
                sid.append(i)
                if sampler is not None:
                    lps.append(sampler[i][k])
        n = len(tgt)
        mb = MicroBatch(ids, mask, torch.tensor(rows, dtype=torch.long), torch.tensor(pos, dtype=torch.long),
                        torch.tensor(tgt, dtype=torch.long), torch.tensor(adv, dtype=torch.float32),
                        weights[tok0: tok0 + n], torch.tensor(sid, dtype=torch.long))
        if sampler is not None:
            mb.logp_sampler = torch.tensor(lps, dtype=torch.float32)
        out.append(mb)
        tok0 += n
    return out


FIELDS = ("input_ids", "attention_mask", "rows", "positions", "targets", "advantages", "weights", "seq_ids",
          "logp_sampler")


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("aggregation", ["sequence_mean", "token_mean", "constant", "sum"])
def test_pack_equals_the_per_token_reference(seed, aggregation):
    rng = random.Random(seed)
    n = rng.randint(1, 13)
    prompts = [[rng.randint(3, 50) for _ in range(rng.randint(1, 9))] for _ in range(n)]
    # lengths include 0 (an empty completion) and the cap
    completions = [[rng.randint(3, 50) for _ in range(rng.choice([0, 1, 2, 5, 7]))] for _ in range(n)]
    if all(not c for c in completions):
        completions[0] = [7]
    advantages = torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    sampler = [[rng.uniform(-5, 0) for _ in c] for c in completions] if seed % 2 else None
    mbs = rng.choice([1, 2, 3, 64])
    got = pack(prompts, completions, advantages, mbs, aggregation, 7, 0, sampler_logprobs=sampler)
    want = reference_pack(prompts, completions, advantages, mbs, aggregation, 7, 0, sampler)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        for field in FIELDS:
            a, b = getattr(g, field), getattr(w, field)
            assert (a is None) == (b is None), field
            if a is not None:
                assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), field


def test_logp_at_rollout_prefers_old_logprobs():
    mb = reference_pack([[1, 2]], [[3, 4]], torch.ones(1), 1, "sum", 2, 0)[0]
    assert mb.logp_at_rollout is None
    mb.logp_start = torch.tensor([-1.0, -2.0])
    assert torch.equal(mb.logp_at_rollout, mb.logp_start)  # mu = 1: the first update's own log-probs
    mb.logp_old = torch.tensor([-3.0, -4.0])
    assert torch.equal(mb.logp_at_rollout, mb.logp_old)    # mu > 1: the no-grad pass before any update


def test_trained_completions_leave_out_skipped_and_optionally_flat_groups():
    nan = float("nan")
    total = torch.tensor([1.0, 0.0, nan, 1.0,   1.0, 1.0, nan, 1.0,   nan, nan, nan, 0.0], dtype=torch.float64)
    assert trained_completions(total, 4, skip_zero_std_groups=False) == [0, 1, 3, 4, 5, 7, 11]
    # group 2: all valid rewards equal; group 3: one valid reward (no contrast either)
    assert trained_completions(total, 4, skip_zero_std_groups=True) == [0, 1, 3]
    # and the aggregation normaliser counts only what was kept: sequence_mean weights 1 / (N |o_i|)
    kept = trained_completions(total, 4, skip_zero_std_groups=True)
    mb = pack([[1]] * len(kept), [[5, 6]] * len(kept), torch.ones(len(kept)), 64, "sequence_mean", 2, 0)[0]
    assert torch.allclose(mb.weights, torch.full((6,), 1 / (3 * 2), dtype=torch.float64))


def _group_batch(seed=0, groups=3, g=4):
    """Prompts repeated G times in a row (as a step's batch is), completions of mixed lengths."""
    rng = random.Random(seed)
    prompts, completions = [], []
    for _ in range(groups):
        prompt = [1] + [rng.randint(3, 20) for _ in range(rng.randint(2, 6))]
        for _ in range(g):
            prompts.append(prompt)
            completions.append([rng.randint(3, 20) for _ in range(rng.randint(1, 5))])
    return prompts, completions


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_shared_prompt_layout_gives_the_same_logprobs_and_gradients(attn):
    """§12: a group's completions behind one copy of their prompt, with a per-query mask and position ids,
    against one row per completion, in float64. Qwen2 computes its RMSNorm (and eager attention its
    softmax) in float32 even in a float64 model, so the two layouts, which sum a prompt token's gradient
    before or after that float32 step, agree to float32 rounding: log-probs within 1e-10 under sdpa (1e-6
    eager), LoRA gradients within 1e-6 of their scale. A wrong layout (positions off by one) is far off."""
    from lowmem_grpo import tiny
    from lowmem_grpo.batch import completion_logprobs
    from lowmem_grpo.model import attach_lora
    from lowmem_grpo.recipe import LoraConfig

    tok = tiny.build_tokenizer()
    model = tiny.build_model(tok, tiny.TinyModelSpec(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                                     intermediate_size=64), seed=0).double()
    model.config._attn_implementation = attn
    model = attach_lora(model, LoraConfig(r=4, alpha=8), gradient_checkpointing=True)
    for n, p in model.named_parameters():  # B = 0 at init would hide the LoRA path's gradient
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.1)
    model.train()
    prompts, completions = _group_batch()
    adv = torch.randn(len(completions), dtype=torch.float64)
    results = {}
    for share in (False, True):
        mbs = pack(prompts, completions, adv, 7, "sequence_mean", 5, 0, share_prompts=share)
        if share:
            assert any(mb.position_ids is not None for mb in mbs)
            assert sum(mb.input_ids.numel() for mb in mbs) < 0.8 * sum(m.input_ids.numel() for m in results[False][2])
        model.zero_grad()
        logps = [completion_logprobs(model, mb, 0.7, 1024, 1024) for mb in mbs]
        sum((lp * mb.weights * mb.advantages.double()).sum() for lp, mb in zip(logps, mbs)).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        results[share] = (torch.cat(logps).detach(), grads, mbs)
    (lp0, g0, _), (lp1, g1, mbs) = results[False], results[True]
    assert lp0.shape == lp1.shape and torch.allclose(lp0, lp1, atol=1e-10 if attn == "sdpa" else 1e-6, rtol=0)
    scale = max(float(g.abs().max()) for g in g0.values())
    assert scale > 1e-3  # the gradients compared are not all zero
    for n in g0:
        assert float((g0[n] - g1[n]).abs().max()) < 1e-6 * scale, n
    for mb in mbs:  # the negative control: a layout error shows at once (RoPE sees only position differences,
        if mb.position_ids is not None:  # so shift all but the first token)
            mb.position_ids[:, 1:] += 2
    with torch.no_grad():
        wrong = torch.cat([completion_logprobs(model, mb, 0.7, 1024, 1024) for mb in mbs])
    assert (wrong - lp0).abs().max() > 1e-3


def test_shared_layout_only_where_it_pays():
    prompts, completions = _group_batch(groups=2, g=4)
    # one completion per micro-batch: nothing to share
    assert all(mb.position_ids is None for mb in pack(prompts, completions, torch.ones(8), 1, "sum", 5, 0,
                                                      share_prompts=True))
    # long completions behind short prompts: sharing saves little, the rows get wide
    long = [[5] * 400 for _ in completions]
    assert all(mb.position_ids is None for mb in pack(prompts, long, torch.ones(8), 8, "sum", 400, 0,
                                                      share_prompts=True))
    # the flat per-token tensors do not depend on the layout
    a = pack(prompts, completions, torch.arange(8.0), 8, "token_mean", 5, 0)
    b = pack(prompts, completions, torch.arange(8.0), 8, "token_mean", 5, 0, share_prompts=True)
    assert b[0].position_ids is not None
    for field in ("targets", "advantages", "weights", "seq_ids"):
        assert torch.equal(getattr(a[0], field), getattr(b[0], field)), field
