"""End-to-end training on the tiny model: metrics, checkpoints, resume determinism, export, CLI."""

import os
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import QUIET, recipe_dict, straight_and_resumed, write_recipe
from lowmem_grpo import checkpoint as ckpt
from lowmem_grpo.metrics import read_metrics
from lowmem_grpo.recipe import load_recipe, recipe_from_dict
from lowmem_grpo.train import Trainer, TrainingError



def test_train_writes_metrics_and_checkpoints(tiny_model_dir, tiny_data, tmp_path):
    r = recipe_from_dict(recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run", train={"steps": 3}))
    out = Trainer(r, **QUIET).fit()
    rows = read_metrics(tmp_path / "run")
    steps = [row for row in rows if "loss" in row]
    assert [row["step"] for row in steps] == [1, 2, 3]
    for row in steps:
        for key in ("reward/mean", "success_rate", "kl", "entropy", "clip/fraction", "completion/mean_length",
                    "completion/truncated_fraction", "grad_norm", "time/step_s", "memory/peak_mib", "memory/now_mib"):
            assert key in row, key
        assert 0 < row["memory/now_mib"] <= row["memory/peak_mib"]   # (on CPU the resident set, under its peak)
        assert row["kl"] is not None and row["kl"] >= 0
    assert out["first_eval"] is not None and out["final_eval"] is not None
    assert [p.name for p in ckpt.complete_checkpoints(tmp_path / "run")] == ["step-000002", "step-000003"]
    assert (tmp_path / "run" / "recipe.yaml").is_file()


def test_lora_moves_and_base_does_not(tiny_model_dir, tiny_data, tmp_path):
    r = recipe_from_dict(recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run", train={"steps": 2},
                                     algorithm={"kl_target": "none"}))
    t = Trainer(r, **QUIET)
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    t.fit()
    moved = {n for n, p in t.model.named_parameters() if not torch.equal(before[n], p.detach())}
    assert moved and all("lora_" in n for n in moved)


@pytest.mark.parametrize("mu, minibatches", [(1, 1), (2, 1), (1, 2)])
def test_resume_gives_identical_losses(tiny_model_dir, tiny_data, tmp_path, mu, minibatches):
    """Run 4 steps straight; separately run 2, stop, resume to 4: the losses of steps 3-4 must be equal."""
    d = recipe_dict(tiny_model_dir, tiny_data, tmp_path / "full", train={"steps": 4}, output={"save_every": 2},
                    algorithm={"mu": mu, "minibatches": minibatches, "beta": 0.04})
    full, cut, _ = straight_and_resumed(d, tmp_path)
    assert sorted(cut) == [1, 2, 3, 4]
    for step in (3, 4):
        assert cut[step] == full[step], (step, cut[step], full[step])
    assert any(full[s] != 0 for s in full)


def test_half_written_checkpoint_is_never_picked(tiny_model_dir, tiny_data, tmp_path):
    r = recipe_from_dict(recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run", train={"steps": 2}))
    Trainer(r, **QUIET).fit()
    root = tmp_path / "run" / "checkpoints"
    (root / ".tmp-step-000009").mkdir()          # a save interrupted before its rename
    (root / "step-000010").mkdir()               # a folder with no trainer state
    shutil.copytree(root / "step-000002", root / "step-000002-old")   # a user's copy: not a step number
    assert ckpt.latest(tmp_path / "run").name == "step-000002"
    # a checkpoint damaged after it was written (a copy cut short): one error naming the file, no traceback
    for name in ("trainer_state.pt", "adapter/adapter_model.safetensors"):
        shutil.rmtree(root / "step-000002")
        shutil.copytree(root / "step-000002-old", root / "step-000002")
        data = (root / "step-000002" / name).read_bytes()
        (root / "step-000002" / name).write_bytes(data[: len(data) // 2])
        with pytest.raises(TrainingError, match=f"cannot resume from .*step-000002: .*{name.split('/')[-1]}"):
            Trainer(r, resume=True, **QUIET)


def test_export_merged_equals_base_plus_adapter(tiny_model_dir, tiny_data, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lowmem_grpo.export import export_run

    r = recipe_from_dict(recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run", train={"steps": 2},
                                     optimizer={"lr": 0.05}))
    Trainer(r, **QUIET).fit()
    report = export_run(tmp_path / "run", tmp_path / "out", **QUIET)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "merged", dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with_adapter = PeftModel.from_pretrained(base, str(tmp_path / "out" / "adapter"))
    ids = torch.randint(3, 20, (3, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = merged(input_ids=ids).logits, with_adapter(input_ids=ids).logits
        plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)(input_ids=ids).logits
    assert (a - b).abs().max() < 1e-5
    assert (a - plain).abs().max() > 1e-4  # the adapter was trained: the export is not the base
    assert report["max_logit_diff"] < 1e-5
    # the first training prompt, as a row and its tokens, travels with the weights (eval checks its prompts by it)
    import json

    from lowmem_grpo.data import PROMPT_RECORD, prompt_set

    first = prompt_set(r.data, with_adapter_tokenizer(tiny_model_dir), "train").examples[0]
    for folder in ("adapter", "merged"):
        record = json.loads((tmp_path / "out" / folder / PROMPT_RECORD).read_text())
        assert record == {"row": first.row, "prompt_ids": first.prompt_ids}


def with_adapter_tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "lowmem_grpo.cli", *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)


@pytest.mark.slow(35)
def test_cli_train_resume_export(tiny_model_dir, tiny_data, tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run",
                                                           train={"steps": 2}))
    p = _cli("train", str(recipe))
    assert p.returncode == 0, p.stderr
    assert "held-out accuracy before:" in p.stdout and "held-out accuracy after:" in p.stdout
    # the same recipe again: a fresh run would append to this one's metrics and resume from its checkpoints
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text()
    p = _cli("train", str(recipe))
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert f"{tmp_path / 'run'} already holds a run (checkpoints up to step-000002)" in p.stderr
    assert f"lowmem-grpo train --resume {tmp_path / 'run'}" in p.stderr
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == metrics
    p = _cli("train", "--resume", str(tmp_path / "run"), "--set", "train.steps=3")
    assert p.returncode == 0, p.stderr
    assert "resumed from" in p.stdout and "step     3" in p.stdout
    p = _cli("export", str(tmp_path / "run"), "--out", str(tmp_path / "exp"))
    assert p.returncode == 0, p.stderr
    # off a terminal, transformers' own bars stay out of the log (as train's: its loading bar)
    assert "Loading weights" not in p.stderr and "Writing model shards" not in p.stderr, p.stderr
    assert (tmp_path / "exp" / "merged" / "config.json").is_file()
    assert (tmp_path / "exp" / "adapter" / "adapter_config.json").is_file()
    p = _cli("export", str(tmp_path / "nothing"), "--out", str(tmp_path / "exp2"))
    assert p.returncode == 2 and "not a run directory" in p.stderr and "Traceback" not in p.stderr


def test_unavailable_engine_is_a_clear_error(tiny_model_dir, tiny_data, tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run",
                                                           generation={"engine": "vllm"}))
    # vllm hidden (a None entry in sys.modules makes `import vllm` fail), as on a machine without the extra:
    # the test means the same whether or not vllm is installed here (CI installs it).
    p = subprocess.run([sys.executable, "-c", "import sys; sys.modules['vllm'] = None; from lowmem_grpo.cli import main; "
                        "main()", "train", str(recipe)], capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert p.returncode == 2 and "generation.engine=vllm is not available" in p.stderr
    assert "Traceback" not in p.stderr


def test_loop_state_comes_back_from_the_checkpoint_not_the_metrics(tiny_model_dir, tiny_data, tmp_path):
    """p_ref (the reference's success rate, §4), the adapted entropy coefficient (§16) and the non-finite counters are saved in each checkpoint and
    restored from it: a resumed run whose metrics.jsonl was lost still has them."""
    d = recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run", train={"steps": 2, "preflight": False})
    t = Trainer(recipe_from_dict(d), **QUIET)
    t.fit()
    t.state.nonfinite_total = 5  # as if five steps had been skipped: the next save must carry it
    t.state.entropy_coef = 0.3   # as if algorithm.entropy_target had adapted it (§16)
    t.save()
    saved = ckpt.load_trainer_state(ckpt.latest(tmp_path / "run"))["extra"]["loop"]
    assert saved == {"nonfinite_run": 0, "nonfinite_total": 5, "p_ref": t.state.p_ref, "entropy_coef": 0.3}
    assert t.state.p_ref == read_metrics(tmp_path / "run")[1]["success_rate"]  # step 1's rate (row 0: eval)
    (tmp_path / "run" / "metrics.jsonl").unlink()
    resumed = Trainer(recipe_from_dict(d), run_dir=tmp_path / "run", resume=True, **QUIET)
    assert resumed.state == t.state and resumed.step == 2
    resumed.close()


class _Recording:
    """Wraps an engine and counts close() calls."""

    def __init__(self, inner):
        self.inner, self.closed = inner, 0

    def generate(self, prompts, params):
        return self.inner.generate(prompts, params)

    def close(self):
        self.closed += 1
        self.inner.close()


def test_the_engine_is_closed_on_every_way_out(tiny_model_dir, tiny_data, tmp_path, monkeypatch):
    import lowmem_grpo.train as train_mod
    from lowmem_grpo import evaluate as eval_mod
    from lowmem_grpo.rollout import make_engine

    made = []

    def recording(*a, **k):
        made.append(_Recording(make_engine(*a, **k)))
        return made[-1]

    monkeypatch.setattr(train_mod, "make_engine", recording)
    monkeypatch.setattr(eval_mod, "make_engine", recording)
    d = recipe_dict(tiny_model_dir, tiny_data, tmp_path / "a", train={"steps": 1, "preflight": False})
    Trainer(recipe_from_dict(d), **QUIET).fit()                       # 1. a run that ends
    assert made[-1].closed == 1

    t = Trainer(recipe_from_dict({**d, "output": {**d["output"], "dir": str(tmp_path / "b")}}), **QUIET)

    def boom(clock=None):
        raise RuntimeError("reward server down")

    monkeypatch.setattr(t, "train_step", boom)                        # 2. a run that fails mid-step
    with pytest.raises(RuntimeError, match="reward server down"):
        t.fit()
    assert made[-1].closed == 1

    bad = {**d, "output": {**d["output"], "dir": str(tmp_path / "c"), "tensorboard": True}}
    monkeypatch.setattr("lowmem_grpo.sinks.tensorboard_available", lambda: False)
    from lowmem_grpo.train import TrainingError
    with pytest.raises(TrainingError, match="tensorboard"):           # 3. a trainer that fails to start
        Trainer(recipe_from_dict(bad), **QUIET)
    assert made[-1].closed == 1

    from lowmem_grpo.evaluate import run_eval                        # 4. lowmem-grpo eval
    run_eval(recipe_from_dict(d), name="t", adapter=str(tmp_path / "a"), out_dir=str(tmp_path / "eval"), log=lambda *a: None)
    assert made[-1].closed == 1 and len(made) == 4


def test_shared_prompts_train_like_one_row_per_completion(tiny_model_dir, tiny_data, tmp_path, monkeypatch):
    """train.share_prompts: auto lays a group's completions behind one copy of the prompt (§12), false one
    row per completion (YAML's `off` means false too); step 1 samples the same completions either way and
    must give the same loss and gradient norm (float32: to ~1e-6)."""
    import lowmem_grpo.train as train_mod

    layouts = []
    real_pack = train_mod.pack

    def recording_pack(*a, **k):
        out = real_pack(*a, **k)
        layouts.append(any(mb.position_ids is not None for mb in out))
        return out

    monkeypatch.setattr(train_mod, "pack", recording_pack)
    rows = {}
    for share in ("auto", False):
        d = recipe_dict(tiny_model_dir, tiny_data, tmp_path / str(share), algorithm={"kl_target": "none"},
                        train={"steps": 1, "preflight": False, "micro_batch_size": 8, "share_prompts": share},
                        generation={"num_generations": 4, "max_new_tokens": 3})
        d["data"].pop("eval_path")
        Trainer(recipe_from_dict(d), **QUIET).fit()
        rows[share] = [r for r in read_metrics(tmp_path / str(share)) if "loss" in r][0]
    # (each run's start-up check packs its two probe samples one row each; then the step's batch)
    assert layouts == [False, True, False, False]
    assert rows["auto"]["completion/mean_length"] == rows[False]["completion/mean_length"]
    assert rows["auto"]["loss"] == pytest.approx(rows[False]["loss"], rel=1e-5, abs=1e-7)
    assert rows["auto"]["grad_norm"] == pytest.approx(rows[False]["grad_norm"], rel=1e-4)
    assert rows["auto"]["grad_norm"] > 0
    path = write_recipe(tmp_path / "r.yaml", {**d, "train": {**d["train"], "share_prompts": "auto"}})
    assert load_recipe(path, ["train.share_prompts=off"]).train.share_prompts is False  # YAML: off is false


def test_an_engine_that_samples_another_policy_is_refused_at_start_up(tiny_model_dir, tiny_data, tmp_path):
    """check_sampler_agreement (§11): the engine's log-probs of its own samples are the trainer's (~1e-6 in
    float32), the torch RNG is left as it was, and an engine whose log-probs are off by more than 1e-2 (as
    vLLM's were on Gemma 2, 3 and Cohere shapes) stops the run at start-up, naming the engine and the fix."""
    from dataclasses import replace

    trainer = Trainer(recipe_from_dict(recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run")), **QUIET)
    try:
        before = torch.get_rng_state()
        assert trainer.check_sampler_agreement() < 1e-4
        assert torch.equal(before, torch.get_rng_state())
        generate = trainer.engine.generate

        def off(prompts, params):
            return [replace(c, logprobs=[x + 0.05 for x in c.logprobs]) for c in generate(prompts, params)]

        trainer.engine.generate = off
        with pytest.raises(TrainingError, match=r"generation.engine=hf: its log-probs of its own samples differ from "
                                                r"the trainer's by 0.05 nats on average, 0.05 at most \(allowed 1e-2 in "
                                                r"float32\): the engine runs this model type \('qwen2'\) otherwise"):
            trainer.check_sampler_agreement()
    finally:
        trainer.close()


def test_resuming_a_finished_run_does_nothing_and_a_resumes_settings_are_kept(tiny_model_dir, tiny_data, tmp_path):
    """A run resumed at its last step says it is complete (no second final eval row); a resume's --set changes
    (more steps, the out-of-memory advice's smaller micro-batch) are written to RUN/recipe.yaml, so a later plain
    --resume and the report keep them."""
    run = tmp_path / "run"
    d = recipe_dict(tiny_model_dir, tiny_data, run, train={"steps": 2, "eval_every": 0})
    Trainer(recipe_from_dict(d), **QUIET).fit()
    rows = read_metrics(run)
    saved = load_recipe(run / "recipe.yaml")
    lines = []
    out = Trainer(saved, run_dir=run, resume=True, log=lines.append).fit()
    assert out["final_eval"] is None and out["step"] == 2 and read_metrics(run) == rows
    assert any("the run is complete: step 2 of train.steps=2" in line and "--set train.steps=N" in line for line in lines)
    lines.clear()
    more = load_recipe(run / "recipe.yaml", ["train.steps=3", "train.micro_batch_size=2"])
    Trainer(more, run_dir=run, resume=True, log=lines.append).fit()
    again = load_recipe(run / "recipe.yaml")
    assert again.train.steps == 3 and again.train.micro_batch_size == 2
    assert any("recipe.yaml now holds this resume's settings" in line for line in lines)
    assert [r["step"] for r in read_metrics(run) if "loss" in r][-1] == 3


def test_a_prompt_and_completion_past_the_models_context_are_noted(tiny_model_dir, tiny_data, tmp_path):
    """Found by an audit: prompt + generation.max_new_tokens past max_position_embeddings (64 for the tiny model)
    was silent: the start-up says so now, and not for a run that fits."""
    from lowmem_grpo.recipe import recipe_from_dict
    from lowmem_grpo.train import Trainer

    for new_tokens, said in ((60, True), (4, False)):
        lines = []
        d = recipe_dict(tiny_model_dir, tiny_data, tmp_path / f"run{new_tokens}", train={"preflight": False},
                        generation={"max_new_tokens": new_tokens})
        Trainer(recipe_from_dict(d), log=lines.append).close()
        noted = [line for line in lines if "past the model's max_position_embeddings=64" in line]
        assert bool(noted) == said, lines


def test_rows_are_held_to_an_engines_context_shorter_than_the_models(tiny_model_dir, tiny_data, tmp_path, monkeypatch):
    """Found by a red team: vLLM may take fewer tokens than the model's config gives (a LongRoPE model's pretraining
    length, a tokenizer's model_max_length); rows were checked against the config alone, and a longer prompt
    stopped the run mid-way. Start-up refuses data whose longest prompt does not fit, and otherwise holds the rows
    to the engine's context (here the transformers engine, told to take 20 or 7 tokens; the longest prompt is 7)."""
    from lowmem_grpo.data import DataError
    from lowmem_grpo.evaluate import run_eval
    from lowmem_grpo.rollout.hf import HFEngine

    lines = []
    monkeypatch.setattr(HFEngine, "context_tokens", lambda self: 20)
    d = recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run", train={"preflight": False})
    trainer = Trainer(recipe_from_dict(d), log=lines.append)
    try:
        assert any("takes 20 tokens for this model (its config: 64): a prompt of 20 tokens or more is a bad row" in line
                   for line in lines), lines
        with pytest.raises(DataError, match="prompt is 21 tokens, which fills the model's context"):
            trainer.train_set.render_row({"prompt": "1" * 17 + "+1=", "answer": "2"})
    finally:
        trainer.close()
    monkeypatch.setattr(HFEngine, "context_tokens", lambda self: 7)
    d = recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run2", train={"preflight": False})
    with pytest.raises(DataError, match="takes 7 tokens .*longest prompt is 7 tokens: set data.max_prompt_tokens below 7"):
        Trainer(recipe_from_dict(d), **QUIET)
    with pytest.raises(DataError, match="takes 7 tokens .*longest prompt is 7 tokens"):   # and `eval`, as the trainer
        run_eval(recipe_from_dict(d), name="r", out_dir=str(tmp_path / "ev"), log=lambda *a: None)


def test_a_prompt_that_fills_the_models_context_is_a_bad_row_in_training_and_eval(tiny_model_dir, tmp_path):
    """Found by a red team: a prompt of max_position_embeddings (64) tokens or more was only noted, then vLLM
    refused it mid-run with a 70-line traceback (transformers decoded past the model's positions). The trainer and
    `eval` give the model's context to the data: that row's error naming it, or a counted skip."""
    from lowmem_grpo import tiny
    from lowmem_grpo.data import DataError
    from lowmem_grpo.evaluate import run_eval

    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(5)]
    rows.insert(2, {"prompt": "1" * 60 + "+1=", "answer": "2"})   # BOS + 63 characters: 64 tokens
    for name in ("d.jsonl", "e.jsonl"):   # (the held-out file may not be the training file: one of each)
        tiny.write_jsonl(rows, tmp_path / name)
    data = (tmp_path / "d.jsonl", tmp_path / "e.jsonl")
    d = recipe_dict(tiny_model_dir, data, tmp_path / "run", train={"preflight": False, "eval_max_prompts": 8})
    with pytest.raises(DataError, match=r"row 3: prompt is 64 tokens, which fills the model's context \(64 tokens"):
        Trainer(recipe_from_dict(d), **QUIET)
    d = recipe_dict(tiny_model_dir, data, tmp_path / "run2", train={"preflight": False, "eval_max_prompts": 8})
    d["data"]["on_bad_row"] = "skip"
    trainer = Trainer(recipe_from_dict(d), **QUIET)
    try:
        assert (len(trainer.train_set), len(trainer.eval_set)) == (5, 5)
        assert trainer.train_set.skipped[0].startswith("row 3: prompt is 64 tokens, which fills the model's context")
    finally:
        trainer.close()
    summary = run_eval(recipe_from_dict(d), name="r", out_dir=str(tmp_path / "ev"), log=lambda *a: None)
    assert (summary["prompts"], summary["rows_skipped"]) == (5, 1), summary
    assert summary["rows_skipped_first"][0].startswith("row 3: prompt is 64 tokens")


def test_a_finished_trainer_is_freed_without_a_garbage_collection(tiny_model_dir, tiny_data, tmp_path):
    """Found by a red team: the optimizer's step hook closed over the Trainer, a cycle that kept the model, the
    optimizer state and two open data files alive after fit() and del until a full collection (a TRL-API sweep or a
    notebook held every run's). Reference counting alone frees it now."""
    import gc
    import weakref

    r = recipe_from_dict(recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run", train={"steps": 1}))
    t = Trainer(r, **QUIET)
    t.fit()
    assert t.optimizer_steps == 1   # (the hook still counts)
    gone = weakref.ref(t)
    gc.disable()
    try:
        del t
        assert gone() is None
    finally:
        gc.enable()
