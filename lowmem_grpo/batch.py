"""Completions -> micro-batches of flat per-token tensors, and their log-probs from hidden states.

Everything between the model's forward and the loss works on flat [n_tok] tensors over the completion
tokens of a micro-batch (docs/algorithm.md §5): the hidden state at position t predicts token t + 1, so
completion token k of a sequence with prompt length p is predicted at position p - 1 + k. Only those
positions are projected onto the vocabulary (the chunked kernel in logprobs.py), never [tokens x vocab].

Tokens an environment wrote into a completion (docs/algorithm.md §20) are in the input ids, as context, and
nowhere else: not in the flat tensors, not in |o_i|, not among the sampler's log-probs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from itertools import chain
from typing import Optional

import torch

from .advantages import zero_std_groups
from .logprobs import selective_log_softmax
from .loss import aggregation_weights
from .model import hidden_states, lm_head_params
from .offload import ActivationOffload


@dataclass
class MicroBatch:
    input_ids: torch.Tensor       # [rows, width] prompt + completion (shared: prompt + its completions), right-padded
    attention_mask: torch.Tensor  # [rows, width] 0/1; shared layout: [rows, width, width] bool, query x key
    rows: torch.Tensor            # [n_tok] which row of the micro-batch each completion token is in
    positions: torch.Tensor       # [n_tok] position whose hidden state predicts the token
    targets: torch.Tensor         # [n_tok] the completion tokens
    advantages: torch.Tensor      # [n_tok] the token's completion's advantage
    weights: torch.Tensor         # [n_tok] aggregation weight (loss.aggregation_weights), float64
    seq_ids: torch.Tensor         # [n_tok] index of the completion in the whole batch
    logp_old: Optional[torch.Tensor] = None
    logp_ref: Optional[torch.Tensor] = None
    logp_start: Optional[torch.Tensor] = None    # before the batch's first update (docs/algorithm.md §8)
    logp_sampler: Optional[torch.Tensor] = None  # [n_tok] the rollout engine's own log-probs, when it reports them
    position_ids: Optional[torch.Tensor] = None  # [rows, width] shared layout only (else 0, 1, 2, ... per row)
    pg_mask: Optional[torch.Tensor] = None       # [n_tok] bool: tokens given policy gradient (top entropy, §16)

    @property
    def logp_at_rollout(self) -> Optional[torch.Tensor]:
        """The trainer's log-probs at the weights that sampled the batch: the old log-probs with mu > 1,
        else those the first update computed (mu = 1 samples and updates at the same weights)."""
        return self.logp_old if self.logp_old is not None else self.logp_start


@dataclass(frozen=True)
class BatchShare:
    """One process's completions within the whole batch (docs/algorithm.md §21): the batch index of its first
    completion, and the batch's completions and trained tokens, the aggregation normalisers (§5)."""

    first: int
    n_seqs: int
    n_tokens: int


def trained_completions(total: torch.Tensor, group_size: int, skip_zero_std_groups: bool,
                        exclude: Optional[torch.Tensor] = None) -> list[int]:
    """Indices of the completions that go into the update: scored (a skipped one has no reward, §2), with
    skip_zero_std_groups from a group whose rewards are not all equal (§9), and not in `exclude` (bool per
    completion: the truncated ones with mask_truncated_completions, §16). The rest are not packed, so they
    count in no aggregation normaliser either."""
    keep = ~torch.isnan(total)
    if skip_zero_std_groups:
        keep &= ~zero_std_groups(total.view(-1, group_size)).repeat_interleave(group_size)
    if exclude is not None:
        keep &= ~exclude
    return keep.nonzero().flatten().tolist()


def minibatches(keep: list[int], n: int) -> list[list[int]]:
    """`keep` cut in order into min(n, len(keep)) mini-batches of near-equal size, an optimizer update each
    (docs/algorithm.md §7). The prompts were drawn at random, so no shuffle is needed, and a group's
    completions stay together (its prompt computed once, §12) wherever the sizes allow."""
    n = max(1, min(n, len(keep)))
    size, extra = divmod(len(keep), n)
    bounds = [i * size + min(i, extra) for i in range(n + 1)]
    return [keep[bounds[i]:bounds[i + 1]] for i in range(n)]


def _ragged(lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(owner, offset) of every element of sequences laid end to end: which sequence each is in, and its
    index inside it. lengths [b] -> two [sum(lengths)] long tensors."""
    owner = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    return owner, torch.arange(int(lengths.sum())) - starts[owner]


# A micro-batch's completions of one prompt share one copy of it (docs/algorithm.md §12) when its rows stay
# at most this wide (the attention over a row is dense) and the layout saves at least a fifth of the tokens.
SHARED_MAX_WIDTH = 512
SHARED_MIN_SAVING = 0.2


def _layout(prompts: list[list[int]], completions: list[list[int]], share: bool):
    """One micro-batch's rows. Unshared: one row per completion, prompt + completion. Shared: one row per run
    of consecutive completions with the same prompt, prompt + each completion in turn. Returns (row
    tokens, row of each completion, its first token's index in the row, prompt length of its row)."""
    rows, row_of, start, p_len = [], [], [], []
    for prompt, completion in zip(prompts, completions):
        if not (share and rows and prompt == prompts[len(row_of) - 1]):
            rows.append(list(prompt))
        row_of.append(len(rows) - 1)
        start.append(len(rows[-1]))
        p_len.append(len(prompt))
        rows[-1] += completion
    return rows, torch.tensor(row_of), torch.tensor(start), torch.tensor(p_len)


def model_token_mask(completions: list[list[int]], env_masks: Optional[list[Optional[list]]]) -> Optional[torch.Tensor]:
    """[all completion tokens] bool, True where the model sampled the token (§20); None when no completion
    holds an environment token (every token is trained). A mask whose length is not its completion's is a
    ValueError naming the completion."""
    if env_masks is None or all(m is None or not any(m) for m in env_masks):
        return None
    if len(env_masks) != len(completions):
        raise ValueError(f"{len(env_masks)} environment masks for {len(completions)} completions")
    for i, (c, m) in enumerate(zip(completions, env_masks)):
        if m is not None and len(m) != len(c):
            raise ValueError(f"completion {i}: its environment mask has {len(m)} entries for {len(c)} tokens")
    env = chain.from_iterable(m if m is not None else [False] * len(c) for c, m in zip(completions, env_masks))
    return ~torch.tensor(list(env), dtype=torch.bool)


def _kept(t: torch.Tensor, keep: Optional[torch.Tensor]) -> torch.Tensor:
    return t if keep is None else t[keep]


def pack(prompts: list[list[int]], completions: list[list[int]], advantages: torch.Tensor, micro_batch_size: int,
         aggregation: str, max_completion_length: int, pad_id: int,
         sampler_logprobs: Optional[list[list[float]]] = None, share_prompts: bool = False,
         env_masks: Optional[list[Optional[list]]] = None,
         part: Optional[BatchShare] = None) -> list[MicroBatch]:
    """Micro-batches of `micro_batch_size` completions, with the flat per-token tensors of their completion
    tokens in completion order. The aggregation weights are computed over the whole batch, so the
    micro-batches' weighted sums add up to the batch's aggregate. With share_prompts, a micro-batch whose
    completions of one prompt can share one copy of it (SHARED_MAX_WIDTH, SHARED_MIN_SAVING) is laid out
    so (§12): same log-probs, fewer tokens. `env_masks[i]` (per token of completions[i], True where an
    environment wrote it; None: the model's alone) leaves those tokens in the input ids only (§20).
    part: where these completions sit in the whole batch when they are one process's share of it (§21);
    None: they are all of it. No Python loop per token."""
    lengths = torch.tensor([len(c) for c in completions], dtype=torch.long)
    trained = model_token_mask(completions, env_masks)   # None: every completion token is trained
    seq_of_token = torch.repeat_interleave(torch.arange(len(completions)), lengths)
    if trained is not None:   # |o_i| counts the model's tokens only (§20)
        lengths_trained = torch.zeros_like(lengths).index_add_(0, seq_of_token, trained.long())
        seq_of_token = seq_of_token[trained]
    else:
        lengths_trained = lengths
    all_weights = aggregation_weights(seq_of_token, lengths_trained, aggregation, max_completion_length,
                                      None if part is None else (part.n_seqs, part.n_tokens))
    first = 0 if part is None else part.first
    adv = advantages.to(torch.float32)
    batches, tok0, all0 = [], 0, 0
    for s0 in range(0, len(completions), micro_batch_size):
        s1 = min(len(completions), s0 + micro_batch_size)
        layout = _layout(prompts[s0:s1], completions[s0:s1], share=False)
        if share_prompts:
            shared = _layout(prompts[s0:s1], completions[s0:s1], share=True)
            width = max(len(r) for r in shared[0])
            if (width <= SHARED_MAX_WIDTH and len(shared[0]) < len(layout[0])
                    and len(shared[0]) * width <= (1 - SHARED_MIN_SAVING) * len(layout[0]) * max(len(r) for r in layout[0])):
                layout = shared
        rows, row_of, start, p_len = layout
        c_len = lengths[s0:s1]
        row_len = torch.tensor([len(r) for r in rows])
        owner, col = _ragged(row_len)
        width = int(row_len.max())
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        ids[owner, col] = torch.tensor(list(chain.from_iterable(rows)), dtype=torch.long)
        seq, k = _ragged(c_len)  # completion (within the micro-batch) and index in it, per completion token
        # the hidden state at t predicts token t + 1: a completion's first token is predicted at its prompt's
        # last position, token k at its own token k - 1
        positions = torch.where(k == 0, p_len[seq] - 1, start[seq] + k - 1)
        keep = None if trained is None else trained[all0: all0 + seq.numel()]
        all0 += seq.numel()
        n_tok = seq.numel() if keep is None else int(keep.sum())
        if len(rows) == s1 - s0:
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            mask[owner, col] = 1
            position_ids = None
        else:
            mask, position_ids = _shared_attention(row_len, row_of, start, c_len, p_len, width)
        mb = MicroBatch(ids, mask, _kept(row_of[seq], keep), _kept(positions, keep),
                        _kept(torch.tensor(list(chain.from_iterable(completions[s0:s1])), dtype=torch.long), keep),
                        _kept(adv[s0:s1][seq], keep), all_weights[tok0: tok0 + n_tok], _kept(seq + s0 + first, keep),
                        position_ids=position_ids)
        if sampler_logprobs is not None:   # (NaN at environment tokens: never kept)
            mb.logp_sampler = _kept(torch.tensor(list(chain.from_iterable(sampler_logprobs[s0:s1])),
                                                 dtype=torch.float32), keep)
        batches.append(mb)
        tok0 += n_tok
    return batches


def _shared_attention(row_len, row_of, start, c_len, p_len, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows of prompt + completions: which key each query may attend to ([rows, width, width] bool) and
    the position ids ([rows, width]) that make every completion see exactly prompt + itself, as if it were
    alone in its row. Padding attends to the prompt and earlier padding (no empty softmax row)."""
    n_rows = row_len.numel()
    segment = torch.full((n_rows, width), -2, dtype=torch.long)  # -2 padding, -1 prompt, j completion j
    position_ids = torch.zeros((n_rows, width), dtype=torch.long)
    prompt_of_row = torch.zeros(n_rows, dtype=torch.long).index_copy_(0, row_of, p_len)
    pr_owner, pr_col = _ragged(prompt_of_row)
    segment[pr_owner, pr_col] = -1
    position_ids[pr_owner, pr_col] = pr_col
    seq, k = _ragged(c_len)
    segment[row_of[seq], start[seq] + k] = seq
    position_ids[row_of[seq], start[seq] + k] = p_len[seq] + k
    q = torch.arange(width)
    causal = q[None, :] <= q[:, None]
    same = (segment[:, None, :] == segment[:, :, None]) | (segment[:, None, :] == -1)
    return causal[None] & same, position_ids


def completion_logprobs(model, mb: MicroBatch, temperature: float, chunk_rows: int, chunk_vocab: int,
                        return_entropy: bool = False, entropy_grad: bool = False, offload: bool = False,
                        autocast: Optional[torch.dtype] = None):
    """log pi(target) at every completion token of the micro-batch (and the entropy: with gradient when
    entropy_grad, for an entropy bonus, §16). offload: with gradient, the decoder's checkpointed layer inputs
    wait in host memory until backward (§22). autocast: the decoder (not the log-prob kernel, whose tiles stay
    fp32) runs under torch.autocast in this dtype (§24)."""
    device = next(model.parameters()).device
    keep_out = ActivationOffload(model) if offload and torch.is_grad_enabled() else contextlib.nullcontext()
    mixed = torch.autocast(device.type, dtype=autocast) if autocast is not None else contextlib.nullcontext()
    with keep_out, mixed:
        h = hidden_states(model, mb.input_ids.to(device), mb.attention_mask.to(device),
                          None if mb.position_ids is None else mb.position_ids.to(device))
    h = h[mb.rows.to(device), mb.positions.to(device)]  # only completion positions are projected
    head = lm_head_params(model)
    return selective_log_softmax(h, head.weight, mb.targets.to(device), bias=head.bias, temperature=temperature,
                                 chunk_rows=chunk_rows, chunk_vocab=chunk_vocab, return_entropy=return_entropy,
                                 entropy_grad=entropy_grad, scale=head.scale, softcap=head.softcap)
