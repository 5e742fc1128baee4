"""Toy environments for tests/test_environment_vllm.py, importable as 'toy_envs_vllm:<Class>'.

Their `stop` is a class attribute the test sets to a string the tiny random model's greedy output really
contains (so that turns end at a stop string, not only at EOS or the budget). Observations use the tiny
tokenizer's characters "0123456789+-*=() ".
"""

from __future__ import annotations

from lowmem_grpo.environment import PythonTool


class AskAgain:
    """`turns` model turns: after each but the last it answers with `ask` and the turn's length; after the last
    it scores the turn by its share of digits and ends the episode."""

    stop: tuple = ()

    def __init__(self, turns: int = 3, ask: str = "+1="):
        self.turns, self.ask, self.turn = turns, ask, 0

    def reset(self, row):
        self.turn = 0
        return None

    def step(self, model_text: str):
        self.turn += 1
        if self.turn < self.turns:
            return f"{self.ask}{len(model_text)}", None, False
        return None, sum(ch.isdigit() for ch in model_text) / max(1, len(model_text)), True


class ScriptedPython(PythonTool):
    """The built-in Python tool with a scripted call: a random model writes no code, so each turn that ends
    with the (test-chosen) stop string becomes the call `print(<turn length> * 7)`, run in the sandbox; the
    observation is its output without the <output> tags (characters the tiny tokenizer knows). Two calls, then
    the episode ends."""

    stop: tuple = ()

    def step(self, model_text: str):
        if self.calls >= 2 or not any(model_text.rstrip().endswith(s) for s in self.stop):
            return None, None, True
        observation, reward, done = super().step(f"<python>print({len(model_text)} * 7)</python>")
        return observation.replace("<output>", "").replace("</output>", "").strip(), reward, done
