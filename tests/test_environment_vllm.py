"""Environments through the in-process vLLM engine (docs/algorithm.md §20), on CPU.

The vLLM engine honours SamplingParams.stop with vLLM's own stop strings and cuts a completion where the
transformers engine does (right after the token that completes the stop string); greedy multi-turn rollouts
(a toy environment, and the Python tool with a scripted call) are token for token the same through either
engine; each round's generate recomputes its prompt (prefix cache reset); a short run trains through vLLM
with a two-turn environment. Needs vllm (tests/test_vllm_engine.py says when these skip and when they must run).
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import QUIET, recipe_dict
from lowmem_grpo import tiny
from lowmem_grpo.data import Example
from lowmem_grpo.environment import EnvironmentFactory
from lowmem_grpo.recipe import EnvironmentConfig, recipe_from_dict
from lowmem_grpo.rollout.base import EngineConfig, SamplingParams
from lowmem_grpo.rollout.turns import TurnLimits, run_episodes
from test_vllm_engine import _import_engine

TOK = tiny.build_tokenizer()
EOS = TOK.eos_token_id


def ids(text: str) -> list:
    return TOK(text, add_special_tokens=False)["input_ids"]


PROMPTS = [[TOK.bos_token_id] + ids(f"{i}+{i + 3}=") for i in range(4)]


@pytest.fixture(autouse=True)
def _leave_torch_rng_alone():
    """These tests seed and sample: torch's global RNG is put back after each, so that tests run after them
    (whose LoRA initialisations draw from it) see what they would see without them."""
    with torch.random.fork_rng():
        yield


@pytest.fixture(scope="module")
def engines(vllm_model_dir):
    """(transformers engine, vLLM engine) on the same float32 model."""
    V = _import_engine()
    from transformers import AutoModelForCausalLM

    from lowmem_grpo.rollout.hf import HFEngine

    with torch.random.fork_rng():
        model = AutoModelForCausalLM.from_pretrained(vllm_model_dir, dtype=torch.float32)
        engine = V.VLLMEngine(model, TOK, EngineConfig(name="vllm", kv_cache_memory_bytes=32 << 20))
    yield HFEngine(model, TOK), engine
    engine.close()


def _stop_in_greedy_output(hf) -> str:
    """A character of the tokenizer's alphabet that the greedy output of PROMPTS[0] holds after its first two
    tokens: a stop string the model really meets (it is random, so this is read, not assumed)."""
    out = hf.generate(PROMPTS[:1], SamplingParams(n=1, max_new_tokens=24, greedy=True))[0]
    text = "".join(TOK.decode([t]) for t in out.token_ids[2:])
    stop = next((ch for ch in text if ch in tiny.CHARS and ch.strip()), None)
    assert stop is not None, f"the greedy output {text!r} holds no plain character"
    return stop


def test_stop_string_through_vllm_cuts_like_the_transformers_engine(engines):
    hf, v = engines
    stop = _stop_in_greedy_output(hf)
    greedy = SamplingParams(n=1, max_new_tokens=24, greedy=True)
    free = v.generate(PROMPTS, greedy)
    assert [c.token_ids for c in free] == [c.token_ids for c in hf.generate(PROMPTS, greedy)]
    for params in (SamplingParams(n=1, max_new_tokens=24, greedy=True, stop=(stop,)),
                   SamplingParams(n=1, max_new_tokens=24, greedy=True, stop=(stop, "(8", "zz"))):
        by_hf, by_vllm = hf.generate(PROMPTS, params), v.generate(PROMPTS, params)
        assert [(c.token_ids, c.stopped_by, c.truncated) for c in by_vllm] == \
            [(c.token_ids, c.stopped_by, c.truncated) for c in by_hf]
        assert any(c.stopped_by for c in by_vllm)
        for a, b in zip(free, by_vllm):
            assert a.token_ids[: len(b.token_ids)] == b.token_ids        # the same tokens, cut earlier
            assert len(b.logprobs) == len(b.token_ids) and a.logprobs[: len(b.logprobs)] == pytest.approx(b.logprobs)
            if b.stopped_by is not None:
                assert TOK.decode(b.token_ids).endswith(b.stopped_by) and not b.truncated
                assert all(s not in TOK.decode(b.token_ids[:-1]) for s in params.stop)   # none met earlier
            else:
                assert (b.token_ids, b.truncated) == (a.token_ids, a.truncated)
    # sampled: every completion either ends at the first stop string it meets, at EOS, or at the budget
    torch.manual_seed(0)
    sampled = v.generate(PROMPTS, SamplingParams(n=4, max_new_tokens=16, stop=(stop,)))
    assert len(sampled) == 16 and any(c.stopped_by == stop for c in sampled)
    for c in sampled:
        text = TOK.decode(c.token_ids)
        assert len(c.logprobs) == len(c.token_ids) and all(math.isfinite(x) and x <= 0 for x in c.logprobs)
        assert stop not in TOK.decode(c.token_ids[:-1])
        if c.stopped_by:
            assert text.endswith(stop) and not c.truncated and c.token_ids[-1] != EOS
        else:
            assert stop not in text and c.truncated == (c.token_ids[-1] != EOS)
            assert c.truncated == (len(c.token_ids) == 16 and c.token_ids[-1] != EOS)
    # a stop string never met changes nothing
    never = v.generate(PROMPTS, SamplingParams(n=1, max_new_tokens=24, greedy=True, stop=("zz",)))
    assert [(c.token_ids, c.truncated, c.stopped_by) for c in never] == [(c.token_ids, c.truncated, None) for c in free]


def test_stop_strings_in_vllm_requests_and_results():
    """What the engine asks vLLM for, and how it reads the result: stop strings only where vLLM has a tokenizer
    (else an EngineError naming the fix), kept in the output and matched with special tokens; no
    detokenizing without them. EOS wins over a stop string the same token completes (as in rollout/hf.py)."""
    from types import SimpleNamespace as NS

    V = _import_engine()
    _, plain = V.to_requests(PROMPTS[:1], SamplingParams(n=2, max_new_tokens=4), EOS, stop_strings=True)
    assert not plain.detokenize and not plain.stop
    with pytest.raises(V.EngineError, match="generation.engine: hf"):
        V.to_requests(PROMPTS[:1], SamplingParams(n=1, max_new_tokens=4, stop=("=",)), EOS)
    _, sp = V.to_requests(PROMPTS[:1], SamplingParams(n=1, max_new_tokens=4, stop=("=", "+1")), EOS, stop_strings=True)
    assert (sp.stop, sp.include_stop_str_in_output, sp.detokenize, sp.skip_special_tokens) == (["=", "+1"], True, True, False)
    assert sp.stop_token_ids == [EOS]

    def out(tokens, reason):
        return NS(outputs=[NS(index=0, token_ids=tokens, logprobs=None, stop_reason=reason)])

    a, b, c, d = V.to_completions([out(ids("1="), "="), out(ids("1=") + [EOS], "="), out(ids("12"), None),
                                   out(ids("1") + [EOS], EOS)], EOS)
    assert (a.stopped_by, a.truncated) == ("=", False)
    assert (b.stopped_by, b.truncated) == (None, False)
    assert (c.stopped_by, c.truncated) == (None, True)
    assert (d.stopped_by, d.truncated) == (None, False)


def _examples(n: int) -> list:
    return [Example({"prompt": f"{i}+{i + 3}=", "answer": str(2 * i + 3)}, f"{i}+{i + 3}=", PROMPTS[i])
            for i in range(n)]


class _Recorder:
    """Wraps an engine: records each generate's completions."""

    def __init__(self, engine):
        self.engine, self.rounds = engine, []

    def generate(self, prompts, params):
        out = self.engine.generate(prompts, params)
        self.rounds.append((params, out))
        return out


def _episodes(engine, env_name: str, stop: str, kwargs=None, n=2, max_new_tokens=8):
    import toy_envs_vllm

    cls = getattr(toy_envs_vllm, env_name.split(":")[1])
    cls.stop = (stop,)
    try:
        factory = EnvironmentFactory(EnvironmentConfig(name=env_name, kwargs=kwargs or {}))
        limits = TurnLimits(max_turns=4, max_total_tokens=60, observation_max_tokens=16,
                            observation_template=" {observation} ")
        rec = _Recorder(engine)
        out = run_episodes(rec, TOK, _examples(3), SamplingParams(n=n, max_new_tokens=max_new_tokens, greedy=True),
                           factory, limits)
    finally:
        cls.stop = ()
    return out, rec.rounds


def _key(c):
    return (c.token_ids, c.env_mask, c.stopped_by, c.truncated, c.env.turns, c.env.env_tokens, c.env.reward,
            c.env.error, c.env.counters)


def test_greedy_multi_turn_rollouts_are_token_equal_between_engines(engines):
    """A toy environment that asks for three turns, its turns ending at a stop string the model's greedy output
    holds: the same completions (tokens, environment mask, turns, stop) through vLLM as through transformers.
    Each round is one generate; vLLM resets its prefix cache before each one, so a round's prompt (prompt +
    earlier turns + observations) is recomputed as the transformers engine recomputes it."""
    hf, v = engines
    stop = _stop_in_greedy_output(hf)
    resets = []
    reset = v.llm.reset_prefix_cache

    def counted(*args, **kwargs):
        resets.append(reset(*args, **kwargs))
        return resets[-1]

    v.llm.reset_prefix_cache = counted
    try:
        by_vllm, rounds_vllm = _episodes(v, "toy_envs_vllm:AskAgain", stop, {"turns": 3})
    finally:
        del v.llm.reset_prefix_cache
    by_hf, rounds_hf = _episodes(hf, "toy_envs_vllm:AskAgain", stop, {"turns": 3})
    assert len(rounds_vllm) == len(rounds_hf) >= 2 and resets == [True] * len(rounds_vllm)
    assert all(p.stop == (stop,) and p.n == 1 for p, _ in rounds_vllm)
    turns_at_stop = [c for _, outs in rounds_vllm for c in outs if c.stopped_by == stop]
    assert turns_at_stop, "no turn ended at the stop string"
    assert [_key(c) for c in by_vllm] == [_key(c) for c in by_hf]
    assert any(c.env.turns >= 2 and any(c.env_mask) for c in by_vllm)
    for c in by_vllm:  # sampler log-probs at the model's tokens, NaN at the environment's (vLLM reports them greedy too)
        assert len(c.token_ids) == len(c.env_mask) <= 60
        if c.logprobs is not None:
            assert all(math.isnan(x) == e for x, e in zip(c.logprobs, c.env_mask))


def test_python_tool_rollouts_are_token_equal_between_engines(engines):
    """The built-in Python tool (its calls scripted: a random model writes no code) through both engines:
    the sandbox's outputs come back as environment tokens, the same completions either way."""
    hf, v = engines
    stop = _stop_in_greedy_output(hf)
    kwargs = {"timeout_s": 10, "allow_weak_sandbox": True}
    by_vllm, _ = _episodes(v, "toy_envs_vllm:ScriptedPython", stop, kwargs, n=1)
    by_hf, _ = _episodes(hf, "toy_envs_vllm:ScriptedPython", stop, kwargs, n=1)
    assert [_key(c) for c in by_vllm] == [_key(c) for c in by_hf]
    calls = [dict(c.env.counters)["tool_calls"] for c in by_vllm]
    assert any(n >= 1 for n in calls) and all(c.env.error is None for c in by_vllm)
    for c in by_vllm:
        env_text = TOK.decode([t for t, e in zip(c.token_ids, c.env_mask) if e])
        assert env_text.replace(" ", "").isdigit() or not env_text


def test_episodes_longer_than_the_models_context_end_there_in_both_engines(engines):
    """environment.max_total_tokens past the model's context (256 here, vLLM's max_model_len): each episode ends,
    truncated, where prompt + completion fill the context; vLLM is never handed a longer prompt (it raised
    VLLMValidationError mid-run), and greedy episodes stay token for token the same through either engine."""
    hf, v = engines
    factory = EnvironmentFactory(EnvironmentConfig(name="toy_envs:NeverDone", kwargs={"observation": "0123456789" * 10}))
    limits = TurnLimits(max_turns=9, max_total_tokens=1000, observation_max_tokens=60, observation_template=" {observation} ")
    params = SamplingParams(n=1, max_new_tokens=24, greedy=True)
    by_vllm = run_episodes(v, TOK, _examples(2), params, factory, limits)
    by_hf = run_episodes(hf, TOK, _examples(2), params, factory, limits)
    assert [_key(c) for c in by_vllm] == [_key(c) for c in by_hf]
    for c, prompt in zip(by_vllm, PROMPTS):
        assert len(prompt) + len(c.token_ids) <= 256 and c.truncated and c.env.error is None
        # it ran into the context: no room left for a turn and an observation (60 tokens) more
        assert len(prompt) + len(c.token_ids) > 256 - 24 - 60 and c.env.turns >= 3


def test_a_stop_string_that_is_a_special_token_reaches_the_environment_in_both_engines(vllm_model_dir):
    """A tokenizer that marks the environment's stop string special (as some mark <tool_call>): both engines end a
    turn at it, step() sees it at the end of the turn's text, and greedy episodes stay token for token the same."""
    V = _import_engine()
    from transformers import AutoModelForCausalLM

    from lowmem_grpo.rollout.hf import HFEngine
    from toy_envs import Scripted

    with torch.random.fork_rng():
        model = AutoModelForCausalLM.from_pretrained(vllm_model_dir, dtype=torch.float32)
    tok = tiny.build_tokenizer()
    stop = _stop_in_greedy_output(HFEngine(model, tok))
    tok.add_special_tokens({"additional_special_tokens": [stop]})   # the same id, now special
    assert tok.decode(ids(stop), skip_special_tokens=True) == ""
    assert tok(stop, add_special_tokens=False)["input_ids"] == ids(stop)
    replies = [["+1", None, False], ["+2", None, False], [None, 1.0, True]]
    limits = TurnLimits(max_turns=3, max_total_tokens=60, observation_max_tokens=16,
                        observation_template=" {observation} ")
    params = SamplingParams(n=1, max_new_tokens=8, greedy=True)
    seen, out = {}, {}
    Scripted.stop = (stop,)
    vllm_engine = None
    try:
        factory = EnvironmentFactory(EnvironmentConfig(name="toy_envs:Scripted", kwargs={"replies": replies}))
        assert factory.stop == (stop,)
        vllm_engine = V.VLLMEngine(model, tok, EngineConfig(name="vllm", kv_cache_memory_bytes=32 << 20))
        for name, engine in (("vllm", vllm_engine), ("hf", HFEngine(model, tok))):
            Scripted.seen = []
            out[name] = run_episodes(engine, tok, _examples(3), params, factory, limits)
            seen[name] = list(Scripted.seen)
    finally:
        Scripted.stop, Scripted.seen = ("=",), []
        if vllm_engine is not None:
            vllm_engine.close()
    assert [_key(c) for c in out["vllm"]] == [_key(c) for c in out["hf"]] and seen["vllm"] == seen["hf"]
    ended = [t for t in seen["vllm"] if t.endswith(stop)]   # the special token is in the text step() read
    assert len(ended) >= 3 and all(stop not in t[:-len(stop)] for t in ended), seen
    assert all(tok.eos_token not in t for t in seen["vllm"])


def test_two_turn_environment_trains_through_vllm(vllm_model_dir, tiny_data, tmp_path):
    """generation.engine: vllm with an environment (two turns, "=" ends a turn): two steps with eval, the env/
    metrics as with transformers, and the engine's log-probs (model tokens only) agree with the trainer's."""
    _import_engine()
    from lowmem_grpo.metrics import read_metrics
    from lowmem_grpo.train import Trainer

    d = recipe_dict(vllm_model_dir, tiny_data, tmp_path / "run", rewards={"functions": []},
                    environment={"name": "toy_envs:Scripted", "max_total_tokens": 14,
                                 "observation_template": " {observation} "},
                    generation={"engine": "vllm", "num_generations": 4, "max_new_tokens": 5,
                                "kv_cache_memory_bytes": 32 << 20},
                    train={"steps": 2, "eval_every": 1, "eval_max_prompts": 4})
    trainer = Trainer(recipe_from_dict(d), **QUIET)
    try:
        out = trainer.fit()
    finally:
        trainer.close()
    observation = trainer.tokenizer(" +1 ", add_special_tokens=False)["input_ids"]
    assert out["first_eval"]["n"] > 0 and out["final_eval"] is not None
    rows = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["env/turns"] == 2.0 and row["env/errors"] == 0 and row["env/tokens"] == len(observation)
        assert row["reward/environment"] is not None
        assert row["completion/mean_length"] <= 10
        assert row["loss"] is not None and math.isfinite(row["loss"])
        assert row["rollout/logprob_abs_diff"] is not None and row["rollout/logprob_abs_diff"] < 1e-4, row
    assert "eval/accuracy" in rows[0]
