"""Shaping rewards: they judge how a completion is written, not whether it is right.

    overlong      DAPO's soft overlong punishment (Yu et al. 2025, "DAPO", §3.4): 0 up to a length, then a
                  linear ramp down to -1 over a buffer of tokens, -1 past the maximum length
    think_format  1.0 for exactly <think>...</think> then <answer>...</answer>, else 0.0 (the `math`
                  reward's answer_tag extractor reads the answer block)
    repetition    the n-gram repetition penalty of Yeo et al. 2025 ("Demystifying Long Chain-of-Thought
                  Reasoning in LLMs"): -max_penalty * the fraction of repeated n-grams

Put them after a correctness reward in rewards.functions. The first function is the primary reward:
"solved" (success_rate, held-out accuracy, pass@k) is read from it alone (lowmem_grpo/diagnostics.py,
`solved`), so a shaping reward listed first would make a well-formatted wrong answer count as solved,
and one that never reaches 1 (overlong, repetition) would make nothing count: a recipe that does so is
refused, or noted where the task's reward may be a user function's (rewards/options.py, first_function_problem).

The reward modules' options and their checks live in rewards/options.py; the functions below check their
arguments again because they can be called directly. This module imports only the standard library.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Optional, Sequence

DEFAULT_THINK_TAG = "think"
DEFAULT_ANSWER_TAG = "answer"
DEFAULT_NGRAM = 3
DEFAULT_MAX_PENALTY = 1.0
# A null buffer is this fraction of the maximum length: DAPO used L_cache = 4096 with L_max = 20480 (§3.4).
BUFFER_DIVISOR = 5
TAG_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")


# --------------------------------------------------------------------------------------------------
# overlong

def overlong_limits(max_length: Optional[int], buffer: Optional[int],
                    max_new_tokens: Optional[int], max_total_tokens: Optional[int] = None) -> tuple[int, int]:
    """(L_max, L_cache) of DAPO's soft overlong punishment from the reward's options: a null max_length is
    the trainer's generation.max_new_tokens, or environment.max_total_tokens (max_total_tokens) with an environment
    on; a null buffer a fifth of L_max (rounded down)."""
    if max_length is None and max_total_tokens is not None:
        # with an environment a completion is its whole episode, model and environment tokens, which
        # environment.max_total_tokens limits (generation.max_new_tokens limits one turn): found by a red team, a
        # short two-turn episode scored -1 against the one turn's limit
        max_length, source = max_total_tokens, f"null: environment.max_total_tokens = {max_total_tokens}"
    elif max_length is None:
        if max_new_tokens is None:
            raise ValueError("overlong reward: max_length is null and no max_new_tokens was passed "
                             "(the trainer passes generation.max_new_tokens)")
        max_length, source = max_new_tokens, f"null: generation.max_new_tokens = {max_new_tokens}"
    else:
        source = "the option"
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise ValueError(f"overlong reward: max_length must be a positive integer, got {max_length!r} ({source})")
    if buffer is None:
        buffer = max_length // BUFFER_DIVISOR
    if isinstance(buffer, bool) or not isinstance(buffer, int) or buffer < 0:
        raise ValueError(f"overlong reward: buffer must be a non-negative integer, got {buffer!r}")
    if buffer >= max_length:
        # DAPO's ramp starts at L_max - L_cache: with no room before it every length would be punished
        raise ValueError(f"overlong reward: buffer must be less than max_length ({max_length}, {source}), got {buffer}")
    return max_length, buffer


def overlong_score(length: int, max_length: int, buffer: int) -> float:
    """DAPO's R_length (§3.4) for a completion of `length` tokens: 0 up to L_max - L_cache, then
    (L_max - L_cache - L) / L_cache inside the buffer (reaching -1 at L = L_max), -1 past L_max."""
    expected = max_length - buffer
    if length <= expected:
        return 0.0
    if length <= max_length:   # buffer > 0 here: length > expected = max_length - buffer
        return (expected - length) / buffer
    return -1.0


def overlong_reward(completions, *, prompts=None, rows=None, completion_ids: Optional[Sequence[Sequence[int]]] = None,
                    max_new_tokens: Optional[int] = None, max_length: Optional[int] = None,
                    buffer: Optional[int] = None, max_total_tokens: Optional[int] = None) -> list[float]:
    """DAPO's soft overlong punishment (Yu et al. 2025, §3.4), in [-1, 0], from each completion's length in
    tokens (len(completion_ids[i]), as the trainer passes them).

    L_max is `max_length` (null: generation.max_new_tokens, which the trainer passes as max_new_tokens) and
    L_cache is `buffer` (null: L_max // 5). A completion the sampler cut at max_new_tokens has exactly
    L_max tokens, so with max_length = max_new_tokens it is never past L_max: it gets its -1 from the
    ramp's last token, and the -1 branch (L > L_max) is reached only with a max_length below
    max_new_tokens. With an environment a completion is the whole episode (its completion_ids: the model's
    turns and the environment's observations) and the trainer passes environment.max_total_tokens, the limit on
    those same tokens, as max_total_tokens: the null max_length is that, so an episode a limit cut mid-turn has
    exactly L_max tokens (docs/algorithm.md §19).

    A shaping reward: list it after a correctness reward, since the first function is the one "solved" is
    read from (lowmem_grpo/diagnostics.py, `solved`)."""
    if completion_ids is None:
        raise ValueError("overlong reward needs completion_ids (each completion's token ids; the trainer passes them)")
    if len(completion_ids) != len(completions):
        raise ValueError(f"overlong reward: {len(completion_ids)} completion_ids for {len(completions)} completions")
    limit, buffer = overlong_limits(max_length, buffer, max_new_tokens, max_total_tokens)
    return [overlong_score(len(ids), limit, buffer) for ids in completion_ids]


# --------------------------------------------------------------------------------------------------
# think_format

def check_tag_name(option: str, value) -> str:
    """The tag name, or a ValueError naming the option: the name is put into a regular expression and
    between < >, so only a plain XML-like name is accepted."""
    if not isinstance(value, str) or not TAG_NAME.fullmatch(value):
        raise ValueError(f"{option} must be a tag name (a letter, then letters, digits, '_' or '-'), got {value!r}")
    return value


@lru_cache(maxsize=16)
def _think_answer_pattern(think_tag: str, answer_tag: str) -> re.Pattern:
    # \s* around and between the two blocks; anything (the non-greedy body) inside them
    return re.compile(rf"\s*<{think_tag}>.*?</{think_tag}>\s*<{answer_tag}>.*?</{answer_tag}>\s*", re.DOTALL)


def has_think_answer_format(text: str, think_tag: str = DEFAULT_THINK_TAG, answer_tag: str = DEFAULT_ANSWER_TAG) -> bool:
    """Whether `text` is one think block then one answer block, with only whitespace outside them. Each of
    the four tags must occur exactly once: a second block, or a tag inside the other block, is a miss.
    Tags are case-sensitive."""
    tags = (f"<{think_tag}>", f"</{think_tag}>", f"<{answer_tag}>", f"</{answer_tag}>")
    if any(text.count(tag) != 1 for tag in tags):
        return False
    return _think_answer_pattern(think_tag, answer_tag).fullmatch(text) is not None


def prompt_think_opening(prompt, think_tag: str = DEFAULT_THINK_TAG) -> str:
    """The think block a prompt ends in, which the completion continues: '<think>\\n' where the chat template opened it
    (DeepSeek-R1-distill's), '<think>\\n\\n</think>\\n\\n' where it wrote an empty one (Qwen3 without thinking); ''
    for any other prompt."""
    if not isinstance(prompt, str):
        return ""
    at = prompt.rfind(f"<{think_tag}>")
    if at < 0 or not re.fullmatch(rf"<{think_tag}>\s*(?:</{think_tag}>\s*)?", prompt[at:]):
        return ""
    return prompt[at:]


def think_format_reward(completions, *, prompts=None, rows=None, think_tag: str = DEFAULT_THINK_TAG,
                        answer_tag: str = DEFAULT_ANSWER_TAG) -> list[float]:
    """1.0 when the completion is exactly <think>...</think> followed by <answer>...</answer> (whitespace
    allowed around and between the blocks, nothing else outside them, each tag once), else 0.0. The blocks'
    contents are not judged (an empty think block is allowed). Where the prompt ends in a think block the chat
    template opened, or wrote empty (prompt_think_opening), the completion is read after it, as the assistant's
    turn is: else such a template's completions would all score 0 (found by a red team).

    A shaping reward: list it after a correctness reward, since the first function is the one "solved" is
    read from (lowmem_grpo/diagnostics.py, `solved`)."""
    check_tag_name("think_tag", think_tag)
    check_tag_name("answer_tag", answer_tag)
    if think_tag == answer_tag:
        raise ValueError(f"think_format reward: answer_tag must differ from think_tag, got {answer_tag!r} for both")
    openings = [prompt_think_opening(p, think_tag) for p in prompts] if prompts is not None else [""] * len(completions)
    return [1.0 if has_think_answer_format(o + c, think_tag, answer_tag) else 0.0
            for o, c in zip(openings, completions)]


# --------------------------------------------------------------------------------------------------
# repetition

def repeated_fraction(text: str, ngram: int) -> float:
    """1 - distinct / total over the word n-grams of `text` (words split on whitespace); 0.0 when it has
    fewer than `ngram` words, so no n-gram at all."""
    words = text.split()
    total = len(words) - ngram + 1
    if total <= 0:
        return 0.0
    distinct = len(set(zip(*(words[i:] for i in range(ngram)))))
    return 1.0 - distinct / total


def repetition_reward(completions, *, prompts=None, rows=None, ngram: int = DEFAULT_NGRAM,
                      max_penalty: float = DEFAULT_MAX_PENALTY) -> list[float]:
    """Yeo et al. 2025's n-gram repetition penalty: -max_penalty * (1 - distinct n-grams / total n-grams)
    over the completion's whitespace-split words, in [-max_penalty, 0]; 0 for fewer than `ngram` words.
    Why: a correctness reward alone does not punish a completion that loops until the length limit cuts
    it (it is simply wrong, like any other wrong answer); this makes the repeats themselves cost something.

    A shaping reward: list it after a correctness reward, since the first function is the one "solved" is
    read from (lowmem_grpo/diagnostics.py, `solved`)."""
    if isinstance(ngram, bool) or not isinstance(ngram, int) or ngram < 1:
        raise ValueError(f"repetition reward: ngram must be an integer >= 1, got {ngram!r}")
    if isinstance(max_penalty, bool) or not isinstance(max_penalty, (int, float)) or not 0 < max_penalty < float("inf"):
        raise ValueError(f"repetition reward: max_penalty must be a finite number > 0, got {max_penalty!r}")
    # 0.0 - x rather than -x: no -0.0 in the metrics for a completion without repeats
    return [0.0 - max_penalty * repeated_fraction(c, ngram) for c in completions]
