"""The rollout engine interface: G completions per prompt, as token ids.

Engines know nothing of rewards, losses or recipes. They sample with the current weights of the
trainer's model (the transformers engine calls it directly; the vLLM engine runs the same modules), in
eval mode. What an engine needs to size itself comes in an `EngineConfig`; what one request samples
comes in `SamplingParams`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

# Prompts per generate call in greedy eval. The vLLM engine sizes its batch for it and memory.py models
# the same, so it lives here, below all three.
EVAL_BATCH = 64
DEFAULT_KV_CACHE_BYTES = 1 << 30


def wave_plan(num_prompts: int, n: int, cap: Optional[int]) -> list[tuple[int, int, int]]:
    """How a request for n samples of each of num_prompts prompts is decoded in generate calls (waves) of at
    most `cap` sequences: (first prompt, prompts, samples of each) per call, in order. Whole prompts when
    n <= cap, else each prompt's samples over several calls. The fewest calls, made as even as they can be:
    a wave's KV cache sets the phase's peak, and 8 samples in waves of 4 + 4 take as many calls as 7 + 1 at
    less memory (docs/algorithm.md §23). No cap, or one that holds the request: the one call."""
    if cap is None or num_prompts * n <= cap:
        return [(0, num_prompts, n)]
    if n <= cap:
        plan, first = [], 0
        for count in _even(num_prompts, -(-num_prompts // (cap // n))):
            plan.append((first, count, n))
            first += count
        return plan
    return [(i, 1, each) for i in range(num_prompts) for each in _even(n, -(-n // cap))]


def _even(total: int, parts: int) -> list[int]:
    """total split into `parts` sizes that differ by at most 1, the larger first."""
    q, r = divmod(total, parts)
    return [q + 1] * r + [q] * (parts - r)


def largest_wave(num_prompts: int, n: int, cap: Optional[int]) -> int:
    """The most sequences any call of wave_plan holds."""
    return max(count * each for _, count, each in wave_plan(num_prompts, n, cap))


@dataclass(frozen=True)
class SamplingParams:
    n: int
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0   # (applies to greedy decoding too, as in transformers and vLLM)
    greedy: bool = False
    stop: tuple[str, ...] = ()   # strings that end a completion besides EOS (an environment's turn ends, §20)

    @classmethod
    def from_generation(cls, g, n: Optional[int] = None) -> "SamplingParams":
        """The recipe's sampling settings (a GenerationConfig); n defaults to its num_generations."""
        return cls(n=g.num_generations if n is None else n, max_new_tokens=g.max_new_tokens,
                   temperature=g.temperature, top_p=g.top_p, top_k=g.top_k, min_p=g.min_p,
                   repetition_penalty=g.repetition_penalty)


@dataclass(frozen=True)
class EngineConfig:
    """What an engine needs to know before its first request."""

    name: str = "hf"                  # "hf" (transformers generate) or "vllm" (in-process, shared modules)
    seed: int = 0                     # vLLM seeds its own state with it (sampling follows torch's RNG)
    kv_cache_memory_bytes: int = DEFAULT_KV_CACHE_BYTES  # vLLM: KV cache allocated once at start-up
    max_num_seqs: Optional[int] = None  # vLLM: sequences decoded at once (None: vLLM's default)
    max_batch_sequences: Optional[int] = None  # transformers: sequences per generate call (None: all at once)

    @classmethod
    def from_recipe(cls, recipe, max_batch_sequences: Optional[int] = None) -> "EngineConfig":
        """`max_batch_sequences`: the memory model's wave (memory.Waves.max_batch_sequences), when the budget
        holds fewer sequences than a step or an eval call would decode at once."""
        g = recipe.generation
        # One step decodes prompts_per_step x G sequences at once, an eval call EVAL_BATCH: size for the
        # larger, not vLLM's default (its warm-up samples max_num_seqs rows of full logits). In waves, vLLM
        # schedules at most a wave at once (its own scheduler splits larger requests), and the transformers
        # engine splits its generate calls.
        return cls(name=g.engine, seed=recipe.seed, kv_cache_memory_bytes=g.kv_cache_memory_bytes,
                   max_num_seqs=max_batch_sequences or max(recipe.train.prompts_per_step * g.num_generations, EVAL_BATCH),
                   max_batch_sequences=max_batch_sequences)


@dataclass(frozen=True)
class EnvRecord:
    """What an environment did in one completion's episode (rollout/turns.py, docs/algorithm.md §20)."""

    turns: int = 0                     # model turns taken
    env_tokens: int = 0                # tokens the environment wrote (observations) into the completion
    error: Optional[str] = None        # why the environment ended the episode badly (raised, wrong types); None: no error
    reward: Optional[float] = None     # the sum of the rewards it gave over the turns; None: it gave none
    prompt_text: Optional[str] = None  # reset()'s first message as rendered, when it gave one (else the example's)
    prompt_messages: Optional[list] = None  # reset()'s chat messages, when it gave the prompt as messages
    counters: tuple = ()               # (name, value) pairs of its optional counters() at the episode's end
    exchanges: tuple = ()              # per observation in the completion, the messages it came with (Rendered.messages)
    # what TRL-shaped reward functions get as environments[i] (environment.for_rewards: the instance, or what it
    # names), held until the completion is scored; never compared, printed or sent anywhere
    instance: Any = field(default=None, compare=False, repr=False)


@dataclass
class Completion:
    prompt_index: int           # which prompt of the request it answers
    token_ids: list             # sampled tokens, EOS included when the model stopped (with an environment:
                                # model turns and the environment's observations, in order)
    truncated: bool             # hit max_new_tokens without EOS or a stop string (environment: a limit ended it)
    logprobs: Optional[list] = None  # sampler's log-probs of token_ids, when the engine reports them; NaN at
                                     # environment tokens (never read: they are not trained, §20)
    stopped_by: Optional[str] = None  # the SamplingParams.stop string that ended it, else None
    env_mask: Optional[list] = None   # per token of token_ids, True where the environment wrote it; None: all
                                      # tokens are the model's
    prompt_ids: Optional[list] = None  # the prompt it was sampled from when not its example's (an environment's
                                       # first message, §20); None: the example's prompt_ids
    env: Optional[EnvRecord] = None    # the environment's episode, when one drove the rollout


class RolloutEngine(Protocol):
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """len(prompts) * params.n completions, grouped by prompt: prompt i's are at [i*n, (i+1)*n)."""
        ...

    def close(self) -> None:
        """Release what the engine holds (vLLM: its KV cache and process-wide state). Idempotent."""
        ...


class EngineError(Exception):
    """A rollout engine that cannot be used here (not installed, not built, wrong machine)."""
