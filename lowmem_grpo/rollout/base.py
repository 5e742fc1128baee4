"""The rollout engine interface: G completions per prompt, as token ids.

Engines know nothing of rewards or losses. They sample with the current weights of the trainer's model
(the transformers engine calls it directly; the vLLM engine runs the same modules), in eval mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol


@dataclass(frozen=True)
class SamplingParams:
    n: int
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False


@dataclass
class Completion:
    prompt_index: int           # which prompt of the request it answers
    token_ids: list             # sampled tokens, EOS included when the model stopped
    truncated: bool             # hit max_new_tokens without EOS
    logprobs: Optional[list] = None  # sampler's log-probs of token_ids, when the engine reports them


class RolloutEngine(Protocol):
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """len(prompts) * params.n completions, grouped by prompt: prompt i's are at [i*n, (i+1)*n)."""
        ...


class EngineError(Exception):
    """A rollout engine that cannot be used here (not installed, not built, wrong machine)."""


def make_engine(name: str, model, tokenizer, recipe=None) -> RolloutEngine:
    if name == "hf":
        from .hf import HFEngine

        return HFEngine(model, tokenizer)
    if name == "vllm":
        try:
            from .vllm import VLLMEngine  # imported here: vllm is an optional, GPU-first dependency
        except ImportError as exc:
            raise EngineError(f"generation.engine=vllm is not available ({exc}); use generation.engine: hf") from None
        return VLLMEngine(model, tokenizer, recipe)
    raise EngineError(f"generation.engine={name!r} is unknown; allowed: hf, vllm")
