"""pass@k against brute force, and `lowmem-grpo eval` against the trainer's own held-out number."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from fractions import Fraction
from math import comb

import pytest

from conftest import recipe_dict, write_recipe
from lowmem_grpo.evaluate import parse_ks, pass_at_k
from lowmem_grpo.metrics import read_metrics


def brute_pass_at_k(n: int, c: int, k: int) -> Fraction:
    """The fraction of k-subsets of n samples (c of them correct) that hold a correct one, by enumeration."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(samples[i] for i in s) for s in subsets), len(subsets))


def test_pass_at_k_equals_enumeration_of_subsets():
    checked = 0
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(float(brute_pass_at_k(n, c, k)), abs=1e-12), (n, c, k)
                checked += 1
    assert checked == sum(n * (n + 1) for n in range(1, 9))


def test_pass_at_k_edge_cases_and_large_n():
    assert pass_at_k(10, 0, 1) == 0.0 and pass_at_k(10, 0, 10) == 0.0       # nothing correct
    assert pass_at_k(10, 10, 1) == 1.0 and pass_at_k(5, 1, 5) == 1.0        # every k-subset holds a correct one
    assert pass_at_k(10, 3, 8) == 1.0                                       # n - c < k
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)                       # pass@1 is the fraction correct
    # Large n: the product form stays exact to float precision where the binomials are astronomically large.
    exact = 1 - Fraction(comb(1000 - 7, 500), comb(1000, 500))
    assert pass_at_k(1000, 7, 500) == pytest.approx(float(exact), rel=1e-12)
    for bad in [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)]:
        with pytest.raises(ValueError, match="pass_at_k needs"):
            pass_at_k(*bad)


def test_parse_ks():
    assert parse_ks("8,1, 8") == [1, 8]
    for bad in ("", "0", "1,x", "-2"):
        with pytest.raises(ValueError, match="comma-separated list of positive integers"):
            parse_ks(bad)
    assert parse_ks("1,1024") == [1, 1024]
    with pytest.raises(ValueError, match=r"--k '8,100000': at most 1024 \(each prompt is sampled max\(k\) times"):
        parse_ks("8,100000")


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "lowmem_grpo.cli", *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)


@pytest.mark.slow(35)
def test_eval_command_reproduces_the_trainers_final_accuracy(tiny_model_dir, tiny_data, tmp_path):
    """THE parity check: train via the CLI, then `lowmem-grpo eval RUN --k 1` gives exactly the final
    eval/accuracy (and mean reward, and count) the trainer wrote to metrics.jsonl."""
    # even_code_sum first: a binary reward that the tiny random model gets right on some prompts and not others,
    # so that the two accuracies agreeing means the same greedy completions, not two zeros.
    d = recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run", train={"steps": 3, "eval_max_prompts": 40},
                    rewards={"functions": [{"function": "user_rewards:even_code_sum"}, {"function": "math"}]})
    recipe = write_recipe(tmp_path / "r.yaml", d)
    p = _cli("train", str(recipe))
    assert p.returncode == 0, p.stderr
    final = [r for r in read_metrics(tmp_path / "run") if "eval/accuracy" in r][-1]
    assert final["step"] == 3
    assert 0 < final["eval/accuracy"] < 1, final  # a non-trivial number to reproduce

    p = _cli("eval", str(recipe), "--adapter", str(tmp_path / "run"), "--k", "1,4")
    assert p.returncode == 0, p.stderr
    assert "Loading weights" not in p.stderr, p.stderr   # off a terminal: transformers' loading bar stays out
    out = tmp_path / "run" / "eval" / "step-000003-test"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accuracy"] == final["eval/accuracy"]
    assert summary["mean_reward"] == final["eval/mean_reward"]
    assert summary["n"] == final["eval/n"] == 40
    assert f"greedy accuracy: {100 * final['eval/accuracy']:.1f}% ({summary['correct']}/40 prompts" in p.stdout
    assert summary["adapter"].endswith("step-000003/adapter")
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    greedy = [s for s in samples if s["mode"] == "greedy"]
    sampled = [s for s in samples if s["mode"] == "sample"]
    assert len(greedy) == 40 and len(sampled) == 40 * 4
    assert sum(s["correct"] for s in greedy) == summary["correct"]
    assert set(greedy[0]["rewards"]) == {"even_code_sum", "math"}
    # pass@k from the written samples, recomputed independently
    by_prompt: dict = {}
    for s in sampled:
        by_prompt.setdefault(s["prompt_index"], []).append(bool(s["correct"]))
    for k in (1, 4):
        want = sum(float(brute_pass_at_k(4, sum(v), k)) for v in by_prompt.values()) / len(by_prompt)
        assert summary[f"pass@{k}"] == pytest.approx(want, abs=1e-12)
    assert summary["pass@4"] >= summary["pass@1"]

    # The same checkpoint named as an adapter folder, on the training rows, to another folder.
    adapter = tmp_path / "run" / "checkpoints" / "step-000003" / "adapter"
    p = _cli("eval", str(recipe), "--adapter", str(adapter), "--split", "train", "--out", str(tmp_path / "ev-train"))
    assert p.returncode == 0, p.stderr
    train_summary = json.loads((tmp_path / "ev-train" / "summary.json").read_text())
    assert train_summary["split"] == "train" and train_summary["n"] == 40
    first_train_prompt = json.loads((tmp_path / "ev-train" / "samples.jsonl").read_text().splitlines()[0])["prompt"]
    assert first_train_prompt == json.loads(tiny_data[0].read_text().splitlines()[0])["prompt"]


@pytest.mark.slow(30)
def test_eval_of_an_exported_merged_model(tiny_model_dir, tiny_data, tmp_path):
    d = recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run", train={"steps": 1})
    recipe = write_recipe(tmp_path / "r.yaml", d)
    assert _cli("train", str(recipe)).returncode == 0
    assert _cli("export", str(tmp_path / "run"), "--out", str(tmp_path / "exp")).returncode == 0
    p = _cli("eval", str(recipe), "--model", str(tmp_path / "exp" / "merged"), "--set", "model.load_in_4bit=false",
             "--out", str(tmp_path / "ev"))
    assert p.returncode == 0, p.stderr
    summary = json.loads((tmp_path / "ev" / "summary.json").read_text())
    assert summary["model"] == str(tmp_path / "exp" / "merged") and summary["adapter"] is None
    assert summary["n"] == 8 and "pass@1" in summary
    assert "quantized again" not in p.stdout
    # The recipe's 4-bit load quantizes the merged weights again: said, with the setting that avoids it
    p = _cli("eval", str(recipe), "--model", str(tmp_path / "exp" / "merged"), "--out", str(tmp_path / "ev4"))
    assert p.returncode == 0, p.stderr
    assert "quantized again" in p.stdout and "model.load_in_4bit=false" in p.stdout


@pytest.mark.slow(20)
def test_eval_errors_are_named(tiny_model_dir, tiny_data, tmp_path):
    no_eval = recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run")
    no_eval["data"].pop("eval_path")
    recipe = write_recipe(tmp_path / "r.yaml", no_eval)
    p = _cli("eval", str(recipe))
    assert p.returncode == 2 and "--split test: the recipe has no held-out set" in p.stderr
    assert "Traceback" not in p.stderr
    p = _cli("eval", str(recipe), "--split", "train", "--adapter", str(tmp_path))
    assert p.returncode == 2 and f"--adapter {tmp_path}: not a run directory" in p.stderr
    assert "Traceback" not in p.stderr
    (tmp_path / "empty_run" / "checkpoints").mkdir(parents=True)
    p = _cli("eval", str(recipe), "--adapter", str(tmp_path / "empty_run"))
    assert p.returncode == 2 and "has no complete checkpoint yet" in p.stderr
    p = _cli("eval", str(recipe), "--k", "0,2")
    assert p.returncode == 2 and "positive integers" in p.stderr
    p = _cli("eval", str(recipe), "--model", str(tmp_path), "--split", "train")
    assert p.returncode == 2 and "not a model folder" in p.stderr and "Traceback" not in p.stderr


def test_eval_shows_progress_on_a_terminal(tiny_model_dir, tiny_data, tmp_path, monkeypatch, capsys):
    """On a terminal, a bar counts prompts through greedy then sampled decoding; in a log, no bar."""
    from lowmem_grpo import progress
    from lowmem_grpo.evaluate import run_eval
    from lowmem_grpo.recipe import recipe_from_dict

    recipe = recipe_from_dict(recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run"))
    for tty in (False, True):
        monkeypatch.setattr(progress, "use_bar", lambda mode, stream=None, tty=tty: tty)
        s = run_eval(recipe, name="r", ks=(1, 2), out_dir=str(tmp_path / f"ev{tty}"), log=lambda *a: None)
        err = capsys.readouterr().err
        n = s["prompts"]
        assert (f"{2 * n}/{2 * n}" in err and "eval" in err) == tty, err


def test_eval_decodes_in_the_wave_its_budget_holds(tiny_model_dir, tiny_data, tmp_path, monkeypatch):
    """`lowmem-grpo eval` with a memory budget that holds 3 sequences per generate call: no call decodes more
    (greedy in waves of 3 prompts, each prompt's 4 samples in two calls of 2), and the greedy records are
    those of an eval whose budget holds every call."""
    from lowmem_grpo import memory as mm
    from lowmem_grpo.data import prompt_set
    from lowmem_grpo.evaluate import run_eval
    from lowmem_grpo.model import load_tokenizer
    from lowmem_grpo.recipe import recipe_from_dict
    from lowmem_grpo.rollout.hf import HFEngine
    from transformers import AutoConfig

    recipe = recipe_from_dict(recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run", train={"eval_max_prompts": 7}))
    examples = prompt_set(recipe.data, load_tokenizer(recipe.model), "test").examples[:7]
    shape = mm.ModelShape.from_config(AutoConfig.from_pretrained(tiny_model_dir))
    w = mm.workload_from_recipe(recipe, max(len(e.prompt_ids) for e in examples), "cpu")
    holds_3 = sum(mm.static_terms(shape, w).values()) + sum(mm.decode_phase(shape, w, 3, "").values())
    sizes, real = [], HFEngine._generate

    def recording(self, prompts, params):
        sizes.append(len(prompts) * params.n)
        return real(self, prompts, params)

    monkeypatch.setattr(HFEngine, "_generate", recording)
    runs = {}
    for name, budget in (("roomy", None), ("tight", holds_3)):
        if budget is not None:
            monkeypatch.setattr(mm, "device_budget", lambda device: budget)
        sizes.clear()
        run_eval(recipe, name="r", ks=(1, 4), out_dir=str(tmp_path / name), log=lambda *a: None)
        runs[name] = ([json.loads(line) for line in (tmp_path / name / "samples.jsonl").read_text().splitlines()],
                      list(sizes))
    (roomy, roomy_sizes), (tight, tight_sizes) = runs["roomy"], runs["tight"]
    assert roomy_sizes == [7, 28]                           # this machine's memory: one call each, as before
    assert tight_sizes == [3, 3, 1] + [2, 2] * 7            # greedy waves of 3 prompts, then 4 samples a prompt
    greedy = [[r for r in rs if r["mode"] == "greedy"] for rs in (roomy, tight)]
    assert greedy[0] == greedy[1] and len(greedy[0]) == 7
    assert [(r["prompt_index"], r["sample"]) for r in tight if r["mode"] == "sample"] == \
        [(i, j) for i in range(7) for j in range(4)]


def _fake_run(tiny_model_dir, tiny_data, run, **lora):
    """A run directory with one checkpoint holding a fresh adapter of the tiny model (no training needed)."""
    import torch
    from transformers import AutoModelForCausalLM

    from lowmem_grpo.model import attach_lora
    from lowmem_grpo.recipe import LoraConfig

    d = recipe_dict(tiny_model_dir, tiny_data, run)
    d["model"]["load_in_4bit"] = False
    ckpt = run / "checkpoints" / "step-000001"
    ckpt.mkdir(parents=True)
    write_recipe(run / "recipe.yaml", d)
    model = attach_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir), LoraConfig(**{"r": 4, "alpha": 8, **lora}),
                        gradient_checkpointing=False)
    model.save_pretrained(ckpt / "adapter")
    torch.save({"step": 1}, ckpt / "trainer_state.pt")
    return ckpt / "adapter"


@pytest.mark.slow(15)
def test_damaged_checkpoints_and_folders_are_named_errors(tiny_model_dir, tiny_data, tmp_path):
    """export and eval on a truncated or corrupt adapter, one of another base model, an --out that cannot be
    written or that is the checkpoint itself, a model folder without its tokenizer: one line each, exit 2."""
    import shutil

    from click.testing import CliRunner

    from lowmem_grpo.cli import main

    def cli(*args):
        res = CliRunner().invoke(main, [str(a) for a in args])
        assert res.exit_code == 2 and isinstance(res.exception, SystemExit), (args, res.output, res.exception)
        return res.output

    recipe = tmp_path / "run.yaml"
    for name, damage, says in (
            ("cut", lambda a: (a / "adapter_model.safetensors").write_bytes(
                (a / "adapter_model.safetensors").read_bytes()[:-8]), "unreadable, truncated or corrupt"),
            ("cfg", lambda a: (a / "adapter_config.json").write_text("{not json"), "not a readable JSON file"),
            ("gone", lambda a: (a / "adapter_model.safetensors").unlink(), "no adapter_model.safetensors")):
        run = tmp_path / name
        damage(_fake_run(tiny_model_dir, tiny_data, run))
        shutil.copy(run / "recipe.yaml", recipe)
        out = cli("export", run, "--out", tmp_path / "exp", "--adapter-only")
        assert "checkpoint step-000001 cannot be exported" in out and says in out, out
        out = cli("eval", recipe, "--adapter", run, "--split", "train")
        assert f"--adapter: {run}" in out and says in out, out
    run = tmp_path / "run"
    adapter = _fake_run(tiny_model_dir, tiny_data, run, target_modules=["q_proj"], r=2)
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**cfg, "r": 8}))  # not the shape of its weights
    out = cli("export", run, "--out", tmp_path / "exp")
    assert "does not load onto model.name_or_path" in out and "size mismatch" in out, out
    out = cli("eval", recipe, "--adapter", run, "--split", "train", "--set", "model.load_in_4bit=false")
    assert "does not load onto model.name_or_path" in out and "size mismatch" in out, out
    # an --out inside the checkpoint: export would delete the adapter it is about to copy
    out = cli("export", run, "--out", adapter.parent, "--adapter-only")
    assert "would overwrite the checkpoint being exported" in out and (adapter / "adapter_config.json").is_file()
    (tmp_path / "afile").write_text("x")
    assert "cannot write the adapter there" in cli("export", run, "--out", tmp_path / "afile" / "sub", "--adapter-only")
    good = tmp_path / "good"
    _fake_run(tiny_model_dir, tiny_data, good)
    (tmp_path / "exp2").mkdir()
    (tmp_path / "exp2" / "merged").write_text("x")  # a file where the merged model's folder goes
    assert "the folder already holds an export (it holds: merged)" in cli("export", good, "--out", tmp_path / "exp2")
    assert "--out" in cli("eval", recipe, "--split", "train", "--out", tmp_path / "afile" / "sub")
    bare = tmp_path / "bare"  # a model folder without tokenizer files: transformers would build an empty tokenizer
    bare.mkdir()
    for f in tiny_model_dir.iterdir():
        if not f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, bare / f.name)
    assert "no tokenizer files" in cli("eval", recipe, "--model", bare, "--split", "train")


@pytest.mark.slow(15)
def test_no_judged_row_is_no_accuracy_not_zero(tiny_model_dir, tiny_data, tmp_path):
    """A reward that skips every completion (user_rewards:skip_all): 0 judged of 4 is no accuracy (None in the
    summary and metrics, not 0.0, which read as a model that got all wrong), and every line that prints it says
    why (the trainer's log, `train`'s summary, `eval`'s)."""
    from click.testing import CliRunner

    from lowmem_grpo.cli import main
    from lowmem_grpo.evaluate import accuracy_text, combine_greedy, run_eval
    from lowmem_grpo.recipe import recipe_from_dict

    why = "none: no row could be judged, the reward skipped all 4 completions"
    d = recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run", rewards={"functions": [{"function": "user_rewards:skip_all"}]},
                    train={"steps": 1, "eval_max_prompts": 4})
    recipe = write_recipe(tmp_path / "r.yaml", d)
    res = CliRunner().invoke(main, ["train", str(recipe)])
    assert res.exit_code == 0, res.output
    assert f"held-out accuracy at step 0: {why}" in res.output and f"held-out accuracy after: {why}" in res.output
    evals = [r for r in read_metrics(tmp_path / "run") if "eval/accuracy" in r]
    assert [(r["eval/accuracy"], r["eval/n"], r["eval/prompts"]) for r in evals] == [(None, 0, 4), (None, 0, 4)]
    lines = []
    summary = run_eval(recipe_from_dict(d), name="r", out_dir=str(tmp_path / "ev"), log=lines.append)
    assert summary["accuracy"] is None and summary["n"] == 0
    assert json.loads((tmp_path / "ev" / "summary.json").read_text())["accuracy"] is None
    assert lines[0].startswith(f"greedy accuracy: {why}")
    parts = [{"accuracy": None, "correct": 0, "n": 0, "prompts": 2, "mean_reward": 0.0}] * 2
    assert combine_greedy(parts)["accuracy"] is None and accuracy_text(combine_greedy(parts)).startswith("none:")
    assert accuracy_text({"accuracy": 0.0, "prompts": 4}) == "0.0%"   # judged and all wrong: a real 0


@pytest.mark.slow(15)
def test_export_refuses_an_out_that_holds_files(tiny_model_dir, tiny_data, tmp_path):
    """`export RUN --out E` then `export RUN --out E --step 1 --adapter-only` left step 1's adapter/ beside the
    earlier merged/, silently. Now an --out that holds anything is refused, naming it and what it holds; --overwrite
    replaces an earlier export (all of it), and never removes what is not an export's."""
    from click.testing import CliRunner

    from lowmem_grpo.cli import main

    run = tmp_path / "run"
    _fake_run(tiny_model_dir, tiny_data, run)
    exp = tmp_path / "exp"

    def export(*args):
        return CliRunner().invoke(main, ["export", str(run), "--out", str(exp), *args])

    assert export().exit_code == 0 and sorted(p.name for p in exp.iterdir()) == ["adapter", "merged"]
    stamp = (exp / "merged" / "config.json").stat().st_mtime_ns
    res = export("--step", "1", "--adapter-only")
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output
    assert res.output == (f"error: --out {exp}: the folder already holds an export (it holds: adapter/, merged/); "
                          "choose another --out, or pass --overwrite to replace it\n")
    assert (exp / "merged" / "config.json").stat().st_mtime_ns == stamp   # untouched
    res = export("--step", "1", "--adapter-only", "--overwrite")
    assert res.exit_code == 0, res.output
    assert [p.name for p in exp.iterdir()] == ["adapter"]   # the earlier merged model went with the earlier export
    (exp / "notes.txt").write_text("mine")
    res = export("--overwrite")
    assert res.exit_code == 2 and "the folder is not empty, and not an earlier export (it holds: adapter/, notes.txt)" \
        in res.output
    assert (exp / "notes.txt").read_text() == "mine" and (exp / "adapter" / "adapter_config.json").is_file()
    (tmp_path / "empty").mkdir()   # an empty folder is a new one
    assert CliRunner().invoke(main, ["export", str(run), "--out", str(tmp_path / "empty"), "--adapter-only"]).exit_code == 0


def test_summary_lines_count_samples_in_english():
    from lowmem_grpo.evaluate import summary_lines

    s = {"accuracy": 0.5, "correct": 1, "n": 2, "mean_reward": 0.5, "split": "test", "pass@1": 0.5,
         "samples_per_prompt": 1, "temperature": 1.0, "out": "o"}
    assert "(1 sample per prompt at temperature 1.0)" in summary_lines(s, [1])[1]
    assert "(8 samples per prompt at temperature 1.0)" in summary_lines({**s, "samples_per_prompt": 8}, [1])[1]


def test_ctrl_c_during_eval_keeps_what_was_done(tiny_model_dir, tiny_data, tmp_path, monkeypatch):
    """An eval of 1,000+ prompts takes a while: a Ctrl-C in its sampled pass writes the greedy completions and
    the samples done so far, and a summary.json that says it was interrupted (its figures need the whole eval);
    the CLI then exits 130 with that line."""
    from lowmem_grpo import evaluate
    from lowmem_grpo.recipe import recipe_from_dict
    from lowmem_grpo.rollout.hf import HFEngine

    recipe = recipe_from_dict(recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run", train={"eval_max_prompts": 6}))
    real, calls = HFEngine._generate, []

    def interrupted_at_the_third_call(self, prompts, params):
        calls.append(len(prompts))
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self, prompts, params)

    monkeypatch.setattr(HFEngine, "_generate", interrupted_at_the_third_call)
    monkeypatch.setattr(evaluate, "EVAL_BATCH", 4)   # greedy: calls of 4 + 2 prompts; sampled: 2 prompts a call
    with pytest.raises(evaluate.EvalInterrupted, match=r"interrupted: 6 greedy and 0 sampled completions of 6 prompts "
                                                       r"are in .*/ev/samples.jsonl"):
        evaluate.run_eval(recipe, name="r", ks=(1, 2), out_dir=str(tmp_path / "ev"), log=lambda *a: None)
    rows = [json.loads(line) for line in (tmp_path / "ev" / "samples.jsonl").read_text().splitlines()]
    assert [r["mode"] for r in rows] == ["greedy"] * 6 and [r["prompt_index"] for r in rows] == list(range(6))
    summary = json.loads((tmp_path / "ev" / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["greedy_done"] == 6 and "accuracy" not in summary
