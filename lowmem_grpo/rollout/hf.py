"""Rollouts through transformers `generate` on the trainer's own model (adapters on, eval mode)."""

from __future__ import annotations

import torch

from ..model import eval_mode
from .base import Completion, SamplingParams


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
        if params.greedy:
            kwargs.update(do_sample=False)
        else:
            kwargs.update(do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
        with eval_mode(self.model):
            # generate's output repeats each prompt n times in a row: prompt i -> rows [i*n, (i+1)*n).
            out = self.model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        new = out[:, width:].tolist()
        completions = []
        for row, tokens in enumerate(new):
            if eos in tokens:
                tokens, truncated = tokens[: tokens.index(eos) + 1], False
            else:
                tokens, truncated = [t for t in tokens if t != pad] if pad != eos else tokens, True
            completions.append(Completion(row // params.n, tokens, truncated))
        return completions

    def close(self) -> None:
        """Nothing to release: generate runs on the trainer's model and keeps no cache between calls."""
