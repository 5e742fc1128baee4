"""Rollouts through transformers `generate` on the trainer's own model (adapters on, eval mode).

Sampling also reports the sampler's log-prob of every token it drew (Completion.logprobs), as the vLLM engine
does: the distribution it was drawn from after the repetition penalty, temperature, min-p, top-k and top-p
(vLLM's order), which the trainer compares
with its own log-probs (docs/algorithm.md §15). transformers applies a caller's logits processors before
its own warpers, so the warpers are passed here, in vLLM's order, followed by the recorder, and
generate's own are switched off (temperature 1, top_k 0, top_p 1, min_p None, whatever the model's generation
config says): the same draws, one more log_softmax a token. So is every other logits processor a model's
generation_config.json may ask for (_NEUTRAL: Qwen2.5-Instruct's repetition_penalty 1.05-1.1, for one),
greedy or sampled: the rollout distribution is the recipe's alone (generation.repetition_penalty is passed as
a processor of ours).

SamplingParams.stop (an environment's turn markers, docs/algorithm.md §20) adds one stopping criterion that
decodes each row's last few tokens per step; a row ends with the token that completes a stop string. Without
stop strings nothing is added: the same tokens, log-probs and RNG draws as before.

With `max_batch_sequences` (the memory model's wave, memory.decode_waves) a request larger than that is
decoded over several generate calls, each holding a wave's KV cache; without it, or when the request fits,
it is the one call it always was (same calls, same RNG draws).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch
from transformers import (LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList,
                          MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from ..model import context_tokens as model_context, eval_mode, loaded_by_unsloth, stop_token_ids
from .base import Completion, SamplingParams, wave_plan


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


class _RepetitionPenalty(LogitsProcessor):
    """transformers' (and vLLM's) repetition penalty over each row's own tokens: a token already in the row's
    prompt or completion has its logit divided by `penalty` when positive, multiplied when negative. Unlike
    transformers' RepetitionPenaltyLogitsProcessor it skips the row's left padding (`pad_counts`), which would
    penalise the pad token: Qwen's pad is one of its EOS tokens."""

    def __init__(self, penalty: float, pad_counts: list[int]):
        self.penalty, self.pad_counts, self._pads = penalty, pad_counts, None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self._pads is None:
            self._pads = torch.tensor(self.pad_counts, device=input_ids.device)[:, None]
        real = torch.arange(input_ids.shape[1], device=input_ids.device)[None, :] >= self._pads
        # [rows, tokens], never [rows, vocab]: a pad position stands for the row's last token (real, and seen)
        ids = torch.where(real, input_ids, input_ids[:, -1:])
        seen = scores.gather(1, ids)
        return scores.scatter(1, ids, torch.where(seen > 0, seen / self.penalty, seen * self.penalty))


def first_stop(text: str, stop: tuple) -> Optional[str]:
    """The stop string that occurs first in `text` (the first listed on a tie), or None."""
    found = [(text.find(s), i, s) for i, s in enumerate(stop) if s and s in text]
    return min(found)[2] if found else None


class _StopStrings(StoppingCriteria):
    """Ends a row once its new tokens' text holds a stop string. Each step decodes only the row's last
    `window` new tokens: every token decodes to at least one byte, so a stop string that the latest token
    completes lies inside them, and one completed earlier would have ended the row then."""

    def __init__(self, tokenizer, stop: tuple, prompt_width: int):
        self.tokenizer, self.stop, self.width = tokenizer, stop, prompt_width
        # In tokens: a byte-level BPE token may be one byte of a character (an emoji is up to 4 tokens; a
        # window of characters missed it: found by a red team), and the model may split a string otherwise than
        # the tokenizer would, so its UTF-8 bytes bound it, with the tokenizer's own count and a margin.
        longest = max(max(len(s.encode("utf-8", "surrogatepass")),
                          len(tokenizer(s, add_special_tokens=False)["input_ids"])) for s in stop)
        self.window = 2 * longest + 4
        self.ended: dict[int, tuple[int, str]] = {}   # row -> (its new tokens up to the stop's end, the stop string)

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        n_new = input_ids.shape[1] - self.width
        tails = input_ids[:, max(self.width, input_ids.shape[1] - self.window):].tolist()
        for row, ids in enumerate(tails):
            hit = None if row in self.ended else first_stop(self.tokenizer.decode(ids), self.stop)
            if hit is not None:
                self.ended[row] = (n_new, hit)
        done = [row in self.ended for row in range(len(tails))]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


def _cut(tokens: list, eos: tuple, stopped: Optional[tuple[int, str]]) -> tuple[list, bool, Optional[str]]:
    """(a row's tokens up to its end, truncated, the stop string that ended it): the first of the `eos` ids or
    the stop string (`stopped`: its new-token count and string), whichever came first (EOS on the same token)."""
    end = next((k + 1 for k, t in enumerate(tokens) if t in eos), None)
    if stopped is not None and (end is None or stopped[0] < end):
        return tokens[: stopped[0]], False, stopped[1]
    # Rows that finished are padded after their EOS; a row without EOS ran to max_new_tokens and every token is
    # sampled (a pad id drawn mid-row, as a random model may, stays: it was sampled).
    return (tokens, True, None) if end is None else (tokens[:end], False, None)


# generate's processors that read the model's generation_config (transformers 5.x, _get_logits_processor), set
# to values that switch each off: a keyword argument to generate outranks the model's file.
_NEUTRAL = dict(repetition_penalty=None, encoder_repetition_penalty=None, no_repeat_ngram_size=None,
                encoder_no_repeat_ngram_size=None, bad_words_ids=None, min_length=0, min_new_tokens=None,
                sequence_bias=None, forced_bos_token_id=None, forced_eos_token_id=None, suppress_tokens=None,
                begin_suppress_tokens=None, exponential_decay_length_penalty=None, typical_p=None,
                epsilon_cutoff=None, eta_cutoff=None, top_h=None, guidance_scale=None, watermarking_config=None,
                renormalize_logits=False, remove_invalid_values=False)


def _processors(params: SamplingParams, pad_counts: list[int]) -> list:
    """The logits processors of these params that greedy decoding applies too (before the warpers, as generate);
    pad_counts: each row's left padding."""
    return [_RepetitionPenalty(params.repetition_penalty, pad_counts)] if params.repetition_penalty != 1.0 else []


def _warpers(params: SamplingParams) -> list:
    """transformers' sampling warpers for these params, in vLLM's order: temperature, min-p, top-k, top-p.
    (generate would apply min-p last; with top-p too the two orders keep different tokens, so the engines would
    sample different distributions: found by a red team.)"""
    out = []
    if params.temperature != 1.0:
        out.append(TemperatureLogitsWarper(params.temperature))
    if params.min_p > 0:
        out.append(MinPLogitsWarper(min_p=params.min_p, min_tokens_to_keep=1))
    if params.top_k:
        out.append(TopKLogitsWarper(top_k=params.top_k, min_tokens_to_keep=1))
    if params.top_p < 1.0:
        out.append(TopPLogitsWarper(top_p=params.top_p, min_tokens_to_keep=1))
    return out


class HFEngine:
    def __init__(self, model, tokenizer, max_batch_sequences: Optional[int] = None):
        self.model, self.tokenizer = model, tokenizer
        self.max_batch_sequences = max_batch_sequences  # sequences per generate call (a wave); None: all at once

    def context_tokens(self) -> Optional[int]:
        """The model's positions (max_position_embeddings), or None where its config does not say."""
        return model_context(self.model)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """One generate call when len(prompts) x n fits max_batch_sequences (or there is no cap); else the calls
        of base.wave_plan: whole prompts with their n samples (n <= cap), or one prompt's samples over several
        calls (n > cap), as even as they can be. Completions come back in the order and with the prompt_index
        one call gives; sampling draws differ from one call's."""
        plan = wave_plan(len(prompts), params.n, self.max_batch_sequences)
        if len(plan) == 1:
            return self._generate(prompts, params)
        out = []
        for first, count, each in plan:
            for c in self._generate(prompts[first: first + count], replace(params, n=each)):
                c.prompt_index += first
                out.append(c)
        return out

    @torch.no_grad()
    def _generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        tok = self.tokenizer
        pad, eos = tok.pad_token_id, stop_token_ids(self.model, tok)
        width = max(len(p) for p in prompts)
        device = next(self.model.parameters()).device
        ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        # A row ends at the model's context, as vLLM ends it (truncated): generate would decode past its positions
        # (found by a red team). No row can use more than the shortest prompt leaves.
        context = self.context_tokens()
        room = [params.max_new_tokens if context is None else max(0, min(params.max_new_tokens, context - len(p)))
                for p in prompts]
        kwargs = dict(max_new_tokens=max(1, max(room)), pad_token_id=pad, eos_token_id=list(eos) or None,
                      num_return_sequences=params.n, use_cache=True, **_NEUTRAL)
        if context is not None and loaded_by_unsloth(self.model):
            # Unsloth's generate refuses a padded width + max_new_tokens past the model's positions (2026.7): the
            # batch's rows then end where its longest prompt's room does
            kwargs["max_new_tokens"] = max(1, min(kwargs["max_new_tokens"], context - width))
        recorder, stops = None, None
        pad_counts = [width - len(p) for p in prompts for _ in range(params.n)]   # rows: prompt i at [i*n, (i+1)*n)
        if params.stop:
            stops = _StopStrings(tok, tuple(params.stop), width)
            kwargs.update(stopping_criteria=StoppingCriteriaList([stops]))
        if params.greedy:
            kwargs.update(do_sample=False, logits_processor=LogitsProcessorList(_processors(params, pad_counts)))
        else:
            recorder = _SampledLogprobs()
            processors = [*_processors(params, pad_counts), *_warpers(params), recorder]
            kwargs.update(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, min_p=None,
                          logits_processor=LogitsProcessorList(processors))
        with eval_mode(self.model):
            # generate's output repeats each prompt n times in a row: prompt i -> rows [i*n, (i+1)*n).
            out = self.model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        new = out[:, width:].tolist()
        logprobs = recorder.finish(out) if recorder is not None else None
        completions = []
        for row, tokens in enumerate(new):
            tokens, truncated, stopped_by = _cut(tokens, eos, stops.ended.get(row) if stops else None)
            if len(tokens) > room[row // params.n]:   # past the model's context
                tokens, truncated, stopped_by = tokens[: room[row // params.n]], True, None
            lps = logprobs[row][: len(tokens)] if logprobs is not None else None
            completions.append(Completion(row // params.n, tokens, truncated, lps, stopped_by=stopped_by))
        return completions

    def close(self) -> None:
        """Nothing to release: generate runs on the trainer's model and keeps no cache between calls."""
