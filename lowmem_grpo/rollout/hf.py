"""Rollouts through transformers `generate` on the trainer's own model (adapters on, eval mode).

Sampling also reports the sampler's log-prob of every token it drew (Completion.logprobs), as the vLLM engine
does: the distribution it was drawn from after temperature, top-k and top-p, which the trainer compares
with its own log-probs (docs/algorithm.md §15). transformers applies a caller's logits processors before
its own warpers, so the warpers are passed here, in transformers' order, followed by the recorder, and
generate's own are switched off (temperature 1, top_k 0, top_p 1): the same draws, one more log_softmax a
token.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor, LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from ..model import eval_mode
from .base import Completion, SamplingParams


class _SampledLogprobs(LogitsProcessor):
    """Keeps the log-softmax of the final scores of the latest step; at the next step, whose input_ids end
    with the token drawn from them, gathers that token's log-prob. One [rows, vocab] tensor alive."""

    def __init__(self):
        self.steps: list[torch.Tensor] = []   # [rows] log-prob of the token drawn at each step
        self._last = None

    def _gather(self, drawn: torch.Tensor) -> None:
        self.steps.append(self._last.gather(1, drawn[:, None]).squeeze(1).float().cpu())

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self._last is not None:
            self._gather(input_ids[:, -1])
        self._last = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def finish(self, sequences: torch.Tensor) -> list[list[float]]:
        """[rows][step] after generate returned `sequences` (the last step's token is its last column)."""
        if self._last is not None:
            self._gather(sequences[:, -1])
            self._last = None
        return torch.stack(self.steps, dim=1).tolist() if self.steps else [[] for _ in range(sequences.shape[0])]


def _warpers(params: SamplingParams) -> list:
    """transformers' sampling warpers for these params, in the order generate builds them."""
    out = []
    if params.temperature != 1.0:
        out.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k:
        out.append(TopKLogitsWarper(top_k=params.top_k, min_tokens_to_keep=1))
    if params.top_p < 1.0:
        out.append(TopPLogitsWarper(top_p=params.top_p, min_tokens_to_keep=1))
    return out


class HFEngine:
    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        tok = self.tokenizer
        pad, eos = tok.pad_token_id, tok.eos_token_id
        width = max(len(p) for p in prompts)
        device = next(self.model.parameters()).device
        ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        kwargs = dict(max_new_tokens=params.max_new_tokens, pad_token_id=pad, eos_token_id=eos,
                      num_return_sequences=params.n, use_cache=True)
        recorder = None
        if params.greedy:
            kwargs.update(do_sample=False)
        else:
            recorder = _SampledLogprobs()
            kwargs.update(do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                          logits_processor=LogitsProcessorList([*_warpers(params), recorder]))
        with eval_mode(self.model):
            # generate's output repeats each prompt n times in a row: prompt i -> rows [i*n, (i+1)*n).
            out = self.model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        new = out[:, width:].tolist()
        logprobs = recorder.finish(out) if recorder is not None else None
        completions = []
        for row, tokens in enumerate(new):
            # Rows that finished are padded after their EOS; a row without EOS ran to max_new_tokens and
            # every token is sampled (a pad id drawn mid-row, as a random model may, stays: it was sampled).
            truncated = eos not in tokens
            if not truncated:
                tokens = tokens[: tokens.index(eos) + 1]
            lps = logprobs[row][: len(tokens)] if logprobs is not None else None
            completions.append(Completion(row // params.n, tokens, truncated, lps))
        return completions

    def close(self) -> None:
        """Nothing to release: generate runs on the trainer's model and keeps no cache between calls."""
