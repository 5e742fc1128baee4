"""The tool-use demo's pieces (scripts/tool_demo.py, docs/benchmarks.md): its tokenizer, data and supervised
rows, its reward, and a few GRPO steps with the built-in python tool on a tiny model."""

from __future__ import annotations

import math
import random

import torch

from conftest import QUIET, recipe_dict
from lowmem_grpo import tiny
from lowmem_grpo.environment import EnvironmentFactory, PythonTool
from lowmem_grpo.recipe import EnvironmentConfig, recipe_from_dict

TOK = tiny.build_tool_tokenizer()


def test_tool_tokenizer_round_trips_the_tool_text_and_keeps_the_old_one(tmp_path):
    text = "123*456=" + tiny.tool_call("123*456=") + tiny.tool_observation("56088") + "56088"
    ids = TOK.encode(text, add_special_tokens=False)
    assert TOK.decode(ids) == text and TOK.unk_token_id not in ids
    assert TOK.convert_ids_to_tokens(ids)[8:10] == ["<python>", "print("]          # the markup: one token each
    err = "error: the code does not parse: SyntaxError: '(' was never closed"
    assert TOK.decode(TOK.encode(err, add_special_tokens=False)) == err
    # Saved next to the demo's model, the trainer's AutoTokenizer loads it as it was built (tiny.build_tool_model).
    from transformers import AutoTokenizer

    model = tiny.build_tool_model(TOK, tiny.TinyModelSpec(hidden_size=32, num_layers=1, intermediate_size=32))
    model.save_pretrained(tmp_path)
    TOK.save_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path).encode(text, add_special_tokens=False) == ids
    old = tiny.build_tokenizer()                                                   # the quickstart's: unchanged
    assert len(old) == 4 + len(tiny.CHARS) and old.encode("47+38=", add_special_tokens=False) == \
        [old.convert_tokens_to_ids(c) for c in "47+38="]


def test_products_are_disjoint_and_the_supervised_rows_use_the_tool_as_the_environment_would():
    train, test = tiny.split_product_data(n_train=300, n_test=50, seed=3)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    a, b = map(int, train[0]["prompt"].rstrip("=").split("*"))
    assert 100 <= a <= 999 and 100 <= b <= 999 and train[0]["answer"] == str(a * b)
    rows = tiny.tool_sft_rows(train, seed=0, other_share=0.1)
    tool = [r for r in rows if len(r) == 4]
    preferred = sum(tiny.prefers_tool(r["prompt"]) for r in train)
    assert preferred <= len(tool) <= preferred + 0.25 * (len(train) - preferred)
    # The tool call runs in the real sandbox and its observation, through the default template, is the
    # supervised text's environment segment exactly.
    env = EnvironmentFactory(EnvironmentConfig(name="python", kwargs={"allow_weak_sandbox": True}))
    template = EnvironmentConfig().observation_template
    for (prompt, _), (call, trained), (obs, env_trained), (answer, _) in tool[:3]:
        observation, reward, done = env.make().step(call)
        assert template.format(observation=observation) == obs and not done and reward is None
        assert trained and not env_trained and tiny.final_answer(prompt + call + obs + answer) == answer
    # Environment text is context only: no label on it.
    ids, att, lab = tiny.segments_batch(TOK, [tool[0]])
    kept = [TOK.decode([i]) for i, l in zip(ids[0].tolist(), lab[0].tolist()) if l != -100]
    assert "".join(kept) == tool[0][1][0] + tool[0][3][0] + TOK.eos_token


def test_reward_reads_the_number_after_the_tools_output():
    rows = [{"answer": "56088"}] * 5
    texts = ["56088",                                                    # a direct answer
             "<python>print(123*456)</python>\n<output>\n56088\n</output>\n56088",   # copied
             "<python>print(123*456)</python>\n<output>\n56088\n</output>\n",        # not copied
             "<python>print(123*456)</python>",                          # a call that ran nothing
             "<python>print(123*456)</python>\n<output>\n56088\n</output>\n56089"]
    assert tiny.tool_answer_reward(texts, prompts=["123*456="] * 5, rows=rows) == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert [tiny.is_tool_call(t) for t in texts] == [False, True, True, True, True]
    assert tiny.simulated_tool("<python>print(12*3)</python>") == tiny.tool_observation("36")
    assert tiny.simulated_tool("<python>import os</python>") == tiny.tool_observation("error")


def _tool_model(path):
    """A tiny model given a short supervised pass on tool-using rows only, so that it calls the tool."""
    train, test = tiny.split_product_data(n_train=200, n_test=20, seed=5)
    model = tiny.build_tool_model(TOK, tiny.TinyModelSpec(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                                     intermediate_size=128, max_position_embeddings=96), seed=0)
    rows = tiny.tool_sft_rows(train, other_share=1.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rng = random.Random(0)
    for _ in range(60):
        ids, att, lab = tiny.segments_batch(TOK, rng.sample(rows, 16))
        model(input_ids=ids, attention_mask=att, labels=lab).loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(path / "model")
    TOK.save_pretrained(path / "model")
    tiny.write_jsonl(train, path / "train.jsonl")
    tiny.write_jsonl(test, path / "test.jsonl")
    return model, test


def test_a_few_grpo_steps_with_the_python_tool(tmp_path):
    from lowmem_grpo.metrics import read_metrics
    from lowmem_grpo.train import Trainer

    model, test = _tool_model(tmp_path)
    probe = tiny.greedy_tool_eval(model, TOK, test)
    assert probe["tool_call_rate"] > 0.25, probe
    d = recipe_dict(tmp_path / "model", (tmp_path / "train.jsonl", tmp_path / "test.jsonl"), tmp_path / "run",
                    rewards={"functions": [{"function": "lowmem_grpo.tiny:tool_answer_reward"}]},
                    environment={"name": "python", "kwargs": {"allow_weak_sandbox": True}, "max_turns": 2,
                                 "max_total_tokens": 48, "observation_max_tokens": 16},
                    generation={"num_generations": 4, "max_new_tokens": 24},
                    train={"steps": 2, "prompts_per_step": 2, "micro_batch_size": 8, "eval_max_prompts": 4})
    out = Trainer(recipe_from_dict(d), **QUIET).fit()
    assert out["final_eval"]["n"] == 4
    rows = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["loss"]) and r["env/errors"] == 0 for r in rows)
    assert sum(r["env/tool_calls"] for r in rows) > 0 and max(r["env/turns"] for r in rows) > 1


class _CallingEngine:
    """Each sequence still at its prompt calls the tool on that prompt's product; after the output it stops."""

    def generate(self, prompts, params):
        from lowmem_grpo.rollout.base import Completion

        out = []
        for i, p in enumerate(prompts):
            text = TOK.decode(p, skip_special_tokens=True)
            turn = tiny.tool_call(text) if text.endswith("=") else ""
            ids = TOK.encode(turn, add_special_tokens=False)
            out.append(Completion(i, ids if turn else [TOK.eos_token_id], False, [-0.1] * max(1, len(ids)),
                                  stopped_by=tiny.TOOL_CLOSE if turn else None))
        return out


def test_a_rounds_tool_calls_run_together_and_land_in_order():
    """rollout/turns.py runs a round's Python-tool calls on a thread pool: each episode gets its own call's output."""
    from lowmem_grpo.data import Example
    from lowmem_grpo.rollout.base import SamplingParams
    from lowmem_grpo.rollout.turns import STEP_WORKERS, TurnLimits, run_episodes

    rows = tiny.product_rows(STEP_WORKERS + 4, seed=11)
    ex = [Example(r, r["prompt"], [TOK.bos_token_id] + TOK.encode(r["prompt"], add_special_tokens=False)) for r in rows]
    env = EnvironmentFactory(EnvironmentConfig(name="python", kwargs={"allow_weak_sandbox": True}))
    limits = TurnLimits(max_turns=2, max_total_tokens=64, observation_max_tokens=32)
    out = run_episodes(_CallingEngine(), TOK, ex, SamplingParams(n=1, max_new_tokens=32), env, limits)
    for c, r in zip(out, rows):
        env_text = TOK.decode([t for t, e in zip(c.token_ids, c.env_mask) if e])
        assert env_text == tiny.tool_observation(r["answer"]) and c.env.turns == 2 and c.env.error is None
        assert dict(c.env.counters)["tool_calls"] == 1
