"""A trainer you can leave running: non-finite guards, Ctrl-C, and kill -9 at random moments."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import QUIET, losses_by_step, recipe_dict, write_recipe
from lowmem_grpo import checkpoint as ckpt
from lowmem_grpo.metrics import read_metrics
from lowmem_grpo.recipe import recipe_from_dict
from lowmem_grpo.train import Trainer, TrainingError


# -- 6. numerical guards -------------------------------------------------------------------------------------

def test_nonfinite_steps_are_skipped_then_stop_the_run(tiny_model_dir, tiny_data, tmp_path, monkeypatch):
    import lowmem_grpo.train as train_mod

    run = tmp_path / "run"
    d = recipe_dict(tiny_model_dir, tiny_data, run, train={"steps": 9, "max_nonfinite_steps": 3, "eval_max_prompts": 4},
                    output={"save_every": 1, "keep_last": 20})
    t = Trainer(recipe_from_dict(d), **QUIET)
    poisoned = {3, 5, 6, 7}  # 1-based steps whose loss is NaN: one isolated, then three in a row
    orig = train_mod.aggregate
    # t.step is the number of finished steps, so step t.step + 1 is the one computing its loss.
    monkeypatch.setattr(train_mod, "aggregate",
                        lambda *a, **k: orig(*a, **k) * (float("nan") if t.step + 1 in poisoned else 1.0))
    with pytest.raises(TrainingError) as err:
        t.fit()
    msg = str(err.value)
    assert "3 steps in a row" in msg and "up to step 7" in msg and "max_nonfinite_steps=3" in msg
    assert str(run / "checkpoints" / "step-000006") in msg and f"--resume {run}" in msg

    # A skipped step is checkpointed as any other (save_every 1 here; the stopping step 7 is not): the latest is
    # step 6's and holds exactly the weights the model has now, step 4's (the skipped steps took no optimizer step).
    assert [p.name for p in ckpt.complete_checkpoints(run)] == [f"step-00000{i}" for i in range(1, 7)]
    latest = ckpt.latest(run)
    assert ckpt.load_trainer_state(latest)["step"] == 6
    saved = load_file(latest / "adapter" / "adapter_model.safetensors")
    live = {n: p.detach() for n, p in t.model.named_parameters() if p.requires_grad}
    assert len(saved) == len(live) > 0
    for name, tensor in saved.items():
        match = [v for k, v in live.items() if k.replace(".default", "").endswith(name.split("base_model.model.")[-1])]
        assert len(match) == 1, name
        assert torch.isfinite(tensor).all() and torch.equal(tensor, match[0].cpu()), name

    rows = {r["step"]: r for r in read_metrics(run) if "loss" in r or "nonfinite" in r}
    assert sorted(rows) == [1, 2, 3, 4, 5, 6, 7]
    assert [rows[s]["nonfinite"] for s in range(1, 8)] == [False, False, True, False, True, True, True]
    assert [rows[s]["nonfinite/consecutive"] for s in range(1, 8)] == [0, 0, 1, 0, 1, 2, 3]
    assert [rows[s]["nonfinite/skipped_total"] for s in range(1, 8)] == [0, 0, 1, 1, 2, 3, 4]

    # Resuming (no more NaN) continues from the last checkpoint, with the skip counters it saved.
    monkeypatch.setattr(train_mod, "aggregate", orig)
    resumed = Trainer(recipe_from_dict(d), run_dir=run, resume=True, **QUIET)
    assert resumed.step == 6 and resumed.state.nonfinite_total == 3 and resumed.state.nonfinite_run == 2


# -- 5. kill -9 at random moments, resume each time --------------------------------------------------------

def _spawn(args, log_path: Path) -> subprocess.Popen:
    # Own session: the kill reaches the trainer and any helper it started, and nothing else.
    return subprocess.Popen([sys.executable, "-m", "lowmem_grpo.cli", "train", *args], stdout=open(log_path, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})


def _tmp_dirs(root: Path) -> dict:
    try:
        return {(e.name, e.inode()) for e in os.scandir(root) if e.name.startswith(".tmp-")}
    except FileNotFoundError:
        return set()


def _wait(cond, proc, timeout=60.0, poll=0.0005) -> bool:
    """Poll cond() until true (True) or the process ends (False)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(poll)
    raise AssertionError("timed out waiting for the trainer")


# Compared bitwise with the uninterrupted run: everything but wall-clock time (and rates) and memory.
_VOLATILE = ("time/", "memory/")


@pytest.mark.slow(180)
def test_kill9_at_random_moments_then_resume_matches_straight_run(tiny_model_dir, tiny_data, tmp_path):
    steps, rng = 45, random.Random(20240607)  # room: the 16 moments use ~25 steps here, more on a faster machine
    d = recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run", train={"steps": steps, "preflight": False},
                    output={"save_every": 1, "keep_last": 2})
    d["data"]["eval_path"] = ""  # no evaluation: the test is about steps, checkpoints and metrics
    recipe = write_recipe(tmp_path / "r.yaml", d)
    run, root = tmp_path / "run", tmp_path / "run" / "checkpoints"
    # The moments: during start-up, while stepping, or mid-checkpoint (a fresh .tmp-step-* folder seen). The first
    # kill waits for a checkpoint, so that there is one to resume. Start-up moments fall between a process's
    # first output (loading the weights; the imports before it touch nothing) and the end of its first step:
    # loading, reading the checkpoint, cutting metrics.jsonl back to it, the first step. Process 0 times that
    # window (it differs from machine to machine). Half of them count from the first output, half from "resumed
    # from" (the checkpoint read): timed from the first output alone, a loaded machine's slower loading could put
    # every one of them before the checkpoint was read.
    kinds = ["startup", "resumed"] * 3 + ["stepping"] * 6 + ["checkpoint"] * 4
    rng.shuffle(kinds)
    kinds.remove("stepping"); kinds.insert(0, "stepping")
    killed, mid_checkpoint, after_resume, window_s = [], 0, 0, None
    for i, kind in enumerate(kinds):
        log = tmp_path / f"log{i}.txt"
        stale = _tmp_dirs(root)
        proc = _spawn([str(recipe)] if i == 0 else ["--resume", str(run)], log)
        output = _wait(lambda: log.stat().st_size > 0, proc, poll=0.005)
        began = time.monotonic()
        if kind in ("startup", "resumed"):
            if kind == "resumed":
                _wait(lambda: "resumed from" in log.read_text(), proc, poll=0.005)
            deadline = time.monotonic() + rng.uniform(0.0, window_s if kind == "startup" else window_s / 2)
            _wait(lambda: time.monotonic() > deadline or "| reward" in log.read_text(), proc, poll=0.005)
            alive = output and proc.poll() is None
            after_resume += alive and "resumed from" in log.read_text()
        elif kind == "stepping":
            first = (lambda: ckpt.latest(run) is not None) if i == 0 else (lambda: "| reward" in log.read_text())
            alive = output and _wait(first, proc, poll=0.01)
            window_s = window_s or time.monotonic() - began   # process 0: first output to first checkpoint
            time.sleep(rng.uniform(0.0, 0.3))
            alive = alive and proc.poll() is None
        else:
            alive = output and _wait(lambda: bool(_tmp_dirs(root) - stale), proc)
        if alive:
            os.killpg(proc.pid, signal.SIGKILL)
        rc = proc.wait(timeout=60)
        assert rc in (0, -signal.SIGKILL), (i, kind, rc, log.read_text()[-3000:])
        if rc == 0:
            break  # the run finished before this moment came: nothing left to kill
        killed.append(kind)
        if kind == "checkpoint" and _tmp_dirs(root) - stale:
            mid_checkpoint += 1
        assert ckpt.latest(run) is not None, (i, kind)
    assert len(killed) == len(kinds), killed  # sized (steps, sleeps) so that every moment lands before the end
    assert mid_checkpoint >= 1, "no kill landed while a checkpoint was being written"
    assert after_resume >= 1, f"no start-up kill landed after the checkpoint was read ({window_s:.2f} s window)"

    p = _spawn(["--resume", str(run)], tmp_path / "final.txt")
    assert p.wait(timeout=120) == 0, (tmp_path / "final.txt").read_text()[-3000:]
    assert ckpt.load_trainer_state(ckpt.latest(run))["step"] == steps
    assert len(ckpt.complete_checkpoints(run)) == 2 and not [n for n in os.listdir(root) if n.startswith(".")]

    d["output"]["dir"] = str(tmp_path / "straight")
    Trainer(recipe_from_dict(d), **QUIET).fit()

    def rows(path):
        out = {}
        for line in (path / "metrics.jsonl").read_text().splitlines():
            row = json.loads(line)  # every line whole: a line cut by a kill was dropped on resume
            assert row["step"] not in out, f"step {row['step']} twice in {path}"
            out[row["step"]] = {k: v for k, v in row.items() if not k.startswith(_VOLATILE)}
        return out

    cut, straight = rows(run), rows(tmp_path / "straight")
    assert sorted(cut) == list(range(1, steps + 1))
    for step in straight:
        assert cut[step] == straight[step], step
    assert any(r["loss"] for r in straight.values())


@pytest.mark.slow(70)
def test_kill9_with_dynamic_sampling_then_resume_matches_straight_run(tiny_model_dir, tiny_data, tmp_path):
    """Dynamic sampling (docs/algorithm.md §18) draws extra prompts by (seed, step, draw) and samples with the
    checkpointed RNG: kill -9 while stepping, resume, and every metric equals an uninterrupted run's."""
    steps, rng = 12, random.Random(7)
    d = recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run", train={"steps": steps, "preflight": False},
                    output={"save_every": 1, "keep_last": 2}, algorithm={"dynamic_sampling": True},
                    generation={"num_generations": 4, "max_new_tokens": 2},
                    rewards={"functions": [{"function": "user_rewards:even_code_sum"}]})
    d["data"]["eval_path"] = ""
    recipe = write_recipe(tmp_path / "r.yaml", d)
    run = tmp_path / "run"
    kills = 0
    for i in range(6):
        log = tmp_path / f"log{i}.txt"
        proc = _spawn([str(recipe)] if i == 0 else ["--resume", str(run)], log)
        first = (lambda: ckpt.latest(run) is not None) if i == 0 else (lambda: "| reward" in log.read_text())
        alive = _wait(first, proc, poll=0.01)
        time.sleep(rng.uniform(0.0, 0.4))
        if alive and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        rc = proc.wait(timeout=60)
        assert rc in (0, -signal.SIGKILL), (i, rc, log.read_text()[-3000:])
        if rc == 0:
            break
        kills += 1
    assert kills >= 3, kills
    p = _spawn(["--resume", str(run)], tmp_path / "final.txt")
    assert p.wait(timeout=120) == 0, (tmp_path / "final.txt").read_text()[-3000:]

    d["output"]["dir"] = str(tmp_path / "straight")
    Trainer(recipe_from_dict(d), **QUIET).fit()

    def rows(path):
        return {r["step"]: {k: v for k, v in r.items() if not k.startswith(_VOLATILE)}
                for r in map(json.loads, (path / "metrics.jsonl").read_text().splitlines())}

    cut, straight = rows(run), rows(tmp_path / "straight")
    assert sorted(cut) == list(range(1, steps + 1)) and cut == straight
    assert sum(r["dynamic/extra_rollouts"] for r in straight.values()) > 0  # the extra draws were exercised


# -- 4. Ctrl-C -----------------------------------------------------------------------------------------------

def _ctrl_c_run(tiny_model_dir, tiny_data, tmp_path, save_every: int):
    d = recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run", train={"steps": 500, "preflight": False},
                    output={"save_every": save_every, "keep_last": 2})
    d["data"]["eval_path"] = ""
    log = tmp_path / "log.txt"
    proc = _spawn([str(write_recipe(tmp_path / "r.yaml", d))], log)
    assert _wait(lambda: log.read_text().count("| reward") >= 3, proc, timeout=120, poll=0.01), log.read_text()
    return proc, log, tmp_path / "run"


@pytest.mark.slow
def test_first_ctrl_c_finishes_the_step_checkpoints_and_prints_resume(tiny_model_dir, tiny_data, tmp_path):
    proc, log, run = _ctrl_c_run(tiny_model_dir, tiny_data, tmp_path, save_every=1000)  # no periodic checkpoint
    assert ckpt.latest(run) is None
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 130, log.read_text()[-3000:]   # (a shell's code for SIGINT: the run is not done)
    out = log.read_text()
    assert "stopping after this step" in out and "Traceback" not in out
    last = max(r["step"] for r in read_metrics(run))
    assert f"stopped at step {last}; resume with: lowmem-grpo train --resume {run}" in out
    assert [p.name for p in ckpt.complete_checkpoints(run)] == [f"step-{last:06d}"]
    assert ckpt.load_trainer_state(ckpt.latest(run))["step"] == last and 3 <= last < 500
    resumed = Trainer(recipe_from_dict(_recipe_of(run)), run_dir=run, resume=True, **QUIET)
    assert resumed.step == last


@pytest.mark.slow
def test_sigterm_finishes_the_step_and_checkpoints_as_ctrl_c_does(tiny_model_dir, tiny_data, tmp_path):
    """Found by an audit: SIGTERM (docker stop, Slurm, Kubernetes) ended the run at once, 47 steps lost since the
    last checkpoint. It is handled as Ctrl-C now: the step finishes, is checkpointed, and train exits 143."""
    proc, log, run = _ctrl_c_run(tiny_model_dir, tiny_data, tmp_path, save_every=1000)  # no periodic checkpoint
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143, log.read_text()[-3000:]
    out = log.read_text()
    assert "SIGTERM: stopping after this step, checkpointed" in out and "Traceback" not in out
    last = max(r["step"] for r in read_metrics(run))
    assert [p.name for p in ckpt.complete_checkpoints(run)] == [f"step-{last:06d}"] and last >= 3


def _recipe_of(run: Path) -> dict:
    import yaml

    return yaml.safe_load((run / "recipe.yaml").read_text())


@pytest.mark.slow
def test_second_ctrl_c_aborts_and_keeps_the_last_checkpoint(tiny_model_dir, tiny_data, tmp_path):
    proc, log, run = _ctrl_c_run(tiny_model_dir, tiny_data, tmp_path, save_every=1)
    proc.send_signal(signal.SIGINT)
    # The second once the first was handled: two SIGINTs that land while the main thread is inside one C call
    # (a torch op) reach Python as one, and the run would then just finish its step.
    assert _wait(lambda: "stopping after this step" in log.read_text(), proc, timeout=60, poll=0.001), log.read_text()
    proc.send_signal(signal.SIGINT)
    rc = proc.wait(timeout=60)
    out = log.read_text()
    assert rc == 130 and "interrupted (Ctrl-C); the last checkpoint" in out and "Traceback" not in out, (rc, out[-3000:])
    # Whatever the second Ctrl-C cut (a step, a save), the latest complete checkpoint loads and resumes.
    latest = ckpt.latest(run)
    state = ckpt.load_trainer_state(latest)
    assert latest.name == f"step-{state['step']:06d}" and state["step"] >= 2  # 3 steps logged, the 3rd maybe unsaved
    adapter = load_file(latest / "adapter" / "adapter_model.safetensors")
    assert adapter and all(torch.isfinite(t).all() for t in adapter.values())
    resumed = Trainer(recipe_from_dict(_recipe_of(run)), run_dir=run, resume=True, **QUIET)
    assert resumed.step == state["step"]
    assert max(r["step"] for r in read_metrics(run)) == state["step"]  # rows after the checkpoint were dropped


# -- out of memory mid-run ------------------------------------------------------------------------------------

_CUDA_OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 7.63 GiB of which "
             "1.12 GiB is free. Of the allocated memory 5.90 GiB is allocated by PyTorch.")


def _out_of_memory_in_update(t: Trainer, at_step: int, at_update: int = 1) -> None:
    """Make the `at_update`-th update (of mu) of step `at_step` run out of memory in its first micro-batch's
    forward, with a CUDA error's type and text, as an update that outgrows the card would."""
    real_update, real_logprobs, calls = t.update, t.logprobs, []

    def out_of_memory(mb, **kw):
        raise torch.OutOfMemoryError(_CUDA_OOM)

    def update(batches, prev_objective=None):
        calls.append(t.step + 1)
        t.logprobs = out_of_memory if calls.count(at_step) == at_update and calls[-1] == at_step else real_logprobs
        return real_update(batches, prev_objective)

    t.update = update


def test_out_of_memory_in_an_update_checkpoints_the_last_step_and_resume_matches_a_straight_run(
        tiny_model_dir, tiny_data, tmp_path):
    """Before the step's first optimizer step nothing has moved: the error checkpoints the finished steps (no
    periodic checkpoint was due), with the RNG and loop state they left, so that a resume makes the same steps
    3-4 as a straight run (with the same recipe: the advised micro-batch gives the same result up to rounding)."""
    d = recipe_dict(tiny_model_dir, tiny_data, tmp_path / "cut", train={"steps": 4}, output={"save_every": 100})
    t = Trainer(recipe_from_dict(d), **QUIET)
    _out_of_memory_in_update(t, at_step=3)
    with pytest.raises(TrainingError) as err:
        t.fit()
    msg, run = str(err.value), tmp_path / "cut"
    assert msg.startswith("ran out of memory in the update phase of step 3 (OutOfMemoryError: CUDA out of memory. "
                          "Tried to allocate 2.00 GiB)"), msg
    assert "the memory model predicted" in msg and "set train.micro_batch_size: 1" in msg   # 3 // 2
    assert (f"Nothing lost: {run / 'checkpoints' / 'step-000002'} holds the 2 finished step(s). Resume with: "
            f"lowmem-grpo train --resume {run} --set train.micro_batch_size=1") in msg
    assert [p.name for p in ckpt.complete_checkpoints(run)] == ["step-000002"]
    assert max(r["step"] for r in read_metrics(run)) == 2

    resumed = Trainer(recipe_from_dict(d), run_dir=run, resume=True, **QUIET)
    assert resumed.step == 2
    resumed.fit()
    d["output"]["dir"] = str(tmp_path / "straight")
    Trainer(recipe_from_dict(d), **QUIET).fit()
    cut, straight = losses_by_step(run), losses_by_step(tmp_path / "straight")
    assert sorted(cut) == [1, 2, 3, 4]
    for step in (3, 4):
        assert cut[step] == straight[step], (step, cut[step], straight[step])


def test_out_of_memory_after_an_optimizer_step_writes_no_checkpoint_of_a_half_done_step(tiny_model_dir, tiny_data,
                                                                                       tmp_path):
    """mu = 2: the second update of step 2 runs out of memory after the first moved the weights. That state is
    no step's: nothing is saved, and the error says which checkpoint is the last (none here)."""
    d = recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run", train={"steps": 3}, algorithm={"mu": 2},
                    output={"save_every": 100})
    t = Trainer(recipe_from_dict(d), **QUIET)
    _out_of_memory_in_update(t, at_step=2, at_update=2)
    with pytest.raises(TrainingError) as err:
        t.fit()
    msg = str(err.value)
    assert msg.startswith("ran out of memory in the update phase of step 2"), msg
    assert "Nothing lost" not in msg and msg.endswith("No checkpoint yet."), msg
    assert ckpt.complete_checkpoints(tmp_path / "run") == []


def test_out_of_memory_in_held_out_evaluation_is_one_error_naming_it(tiny_model_dir, tiny_data, tmp_path,
                                                                     monkeypatch):
    d = recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run", train={"steps": 2}, output={"save_every": 1})
    t = Trainer(recipe_from_dict(d), **QUIET)
    real = t.evaluate
    monkeypatch.setattr(t, "evaluate", lambda: real() if t.step < 2 else (_ for _ in ()).throw(MemoryError()))
    with pytest.raises(TrainingError) as err:
        t.fit()
    msg = str(err.value)
    assert msg.startswith("ran out of memory in the held-out evaluation (MemoryError)"), msg
    assert f"Last checkpoint: {tmp_path / 'run' / 'checkpoints' / 'step-000002'}" in msg, msg


# -- the run folder: one process at a time, a restart, what a resume may change --------------------------------

def test_a_second_process_cannot_train_into_a_run_folder_in_use(tiny_model_dir, tiny_data, tmp_path):
    """Found by an audit: two runs started into one output.dir both ran to the end, interleaving their metrics
    (600 rows for 300 steps) and checkpoints. The folder is locked by the process training in it; the kernel
    drops the lock when that process dies, kill -9 included."""
    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom lowmem_grpo import checkpoint as c\n"
                               f"c.lock_run({str(run)!r})\nprint('locked', flush=True)\ntime.sleep(120)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        d = recipe_dict(tiny_model_dir, tiny_data, run, train={"preflight": False})
        with pytest.raises(TrainingError, match=rf"is in use: another lowmem-grpo process \(pid {holder.pid}\) is "
                                                r"training there"):
            Trainer(recipe_from_dict(d), **QUIET)
    finally:
        holder.kill()
        holder.wait()
    trainer = Trainer(recipe_from_dict(d), **QUIET)   # (the killed holder left no lock)
    trainer.close()


def test_a_run_stopped_before_its_first_checkpoint_starts_again_on_resume(tiny_model_dir, tiny_data, tmp_path):
    """Found by an audit: killed before its first checkpoint (output.save_every steps), a run was a dead end:
    --resume found no checkpoint, a fresh run was refused (the folder holds a run). Resuming it now starts it
    again from step 0, its metrics rows dropped."""
    run = tmp_path / "run"
    d = recipe_dict(tiny_model_dir, tiny_data, run, train={"steps": 2, "preflight": False, "eval_max_prompts": 2},
                    output={"save_every": 100})
    first = Trainer(recipe_from_dict(d), **QUIET)
    first.metrics.write({"step": 1, "loss": 0.5})   # a step made, then kill -9 (nothing checkpointed)
    first.close()
    assert ckpt.latest(run) is None and read_metrics(run)
    lines = []
    again = Trainer(recipe_from_dict(_recipe_of(run)), run_dir=run, resume=True, log=lines.append)
    assert again.step == 0 and not read_metrics(run)
    assert any("holds no complete checkpoint yet (output.save_every=100): the run starts again from step 0" in line
               for line in lines), lines
    assert again.fit()["step"] == 2 and [r["step"] for r in read_metrics(run) if "loss" in r] == [1, 2]


def test_a_resume_refuses_what_its_checkpoints_were_made_with_and_applies_new_optimizer_settings(
        tiny_model_dir, tiny_data, tmp_path):
    """Found by an audit: `--resume --set lora.r=4` trained on with the r=8 adapter (and `optimizer.name=adamw_8bit`
    ended in a KeyError), yet recipe.yaml said r: 4 from then on; `--set optimizer.lr=...` was silently ignored
    (torch's load_state_dict restores the checkpoint's lr, betas and weight decay). The base, the adapter, the
    optimizer, the seed and the folder are refused now, naming old and new; the optimizer's lr, betas and weight
    decay are the resume's."""
    run = tmp_path / "run"
    d = recipe_dict(tiny_model_dir, tiny_data, run, train={"steps": 2, "preflight": False, "eval_max_prompts": 2},
                    output={"save_every": 1}, optimizer={"lr": 1e-3, "warmup_steps": 4})
    Trainer(recipe_from_dict(d), **QUIET).fit()
    saved = _recipe_of(run)
    changed = json.loads(json.dumps(saved))
    changed["lora"]["r"], changed["seed"], changed["optimizer"]["name"] = 8, 5, "adamw_8bit"
    with pytest.raises(TrainingError, match=r"cannot change lora.r \(4 -> 8\); optimizer.name \('adamw' -> "
                                            r"'adamw_8bit'\); seed \(3 -> 5\)"):
        Trainer(recipe_from_dict(changed), run_dir=run, resume=True, **QUIET)
    assert _recipe_of(run) == saved   # (refused before recipe.yaml was rewritten)
    changed = json.loads(json.dumps(saved))
    changed["train"]["steps"] = 3
    changed["optimizer"].update(lr=5e-4, betas=[0.8, 0.95], weight_decay=0.25)
    resumed = Trainer(recipe_from_dict(changed), run_dir=run, resume=True, **QUIET)
    group = resumed.optimizer.param_groups[0]
    # 2 steps done of a 4-update warm-up: the next update's lr is the new lr x 3/4 (optimizer.warmup_steps)
    assert group["lr"] == pytest.approx(5e-4 * resumed.scheduler.lr_lambdas[0](resumed.scheduler.last_epoch))
    assert resumed.scheduler.last_epoch == 2 and tuple(group["betas"]) == (0.8, 0.95) and group["weight_decay"] == 0.25
    assert 0 < group["lr"] < 5e-4   # (still warming up)
    assert resumed.fit()["step"] == 3


def test_the_run_folder_keeps_local_paths_absolute_and_a_folder_that_cannot_be_made_is_named(
        tiny_model_dir, tiny_data, tmp_path, monkeypatch):
    """Found by an audit: recipe.yaml kept a relative model folder, which a resume from another directory took for
    a hub id (a minute of retries, then an error); an output.dir that is a file ended in FileExistsError."""
    monkeypatch.chdir(tiny_model_dir.parent)
    d = recipe_dict(tiny_model_dir.name, tiny_data, tmp_path / "run", train={"preflight": False})
    Trainer(recipe_from_dict(d), **QUIET).close()
    assert _recipe_of(tmp_path / "run")["model"]["name_or_path"] == str(tiny_model_dir.resolve())
    (tmp_path / "a_file").write_text("x")
    d["output"] = {"dir": str(tmp_path / "a_file")}
    with pytest.raises(TrainingError, match=r"output.dir='.*a_file': cannot make or write the run folder there"):
        Trainer(recipe_from_dict(d), **QUIET)


# -- a red team of crash safety and resume (each found failing) ---------------------------------------------------

def test_a_last_step_whose_loss_is_not_finite_is_still_checkpointed(tiny_model_dir, tiny_data, tmp_path, monkeypatch):
    """A skipped step wrote no checkpoint: when it was the last (or a save_every) step, the last good update was
    never saved, export wrote an older adapter than the final eval measured, and a resume ran it again."""
    import lowmem_grpo.train as train_mod

    run = tmp_path / "run"
    d = recipe_dict(tiny_model_dir, tiny_data, run, train={"steps": 3, "preflight": False, "eval_max_prompts": 2},
                    output={"save_every": 2})
    t = Trainer(recipe_from_dict(d), **QUIET)
    orig = train_mod.aggregate
    monkeypatch.setattr(train_mod, "aggregate", lambda *a, **k: orig(*a, **k) * (float("nan") if t.step == 2 else 1.0))
    assert t.fit()["step"] == 3
    assert [p.name for p in ckpt.complete_checkpoints(run)] == ["step-000002", "step-000003"]
    assert ckpt.load_trainer_state(ckpt.latest(run))["extra"]["loop"]["nonfinite_total"] == 1


def test_a_run_stopped_in_its_final_eval_runs_it_on_resume(tiny_model_dir, tiny_data, tmp_path, monkeypatch):
    """The last checkpoint is written before the final eval: a run stopped there (kill -9, Ctrl-C) resumed as
    'complete', and its held-out accuracy after training was never measured."""
    run = tmp_path / "run"
    d = recipe_dict(tiny_model_dir, tiny_data, run, train={"steps": 2, "preflight": False, "eval_max_prompts": 2},
                    output={"save_every": 1})
    t = Trainer(recipe_from_dict(d), **QUIET)
    real = Trainer.evaluate

    def stopped_in_final_eval(self):
        if self.step == 2:
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(Trainer, "evaluate", stopped_in_final_eval)
    with pytest.raises(KeyboardInterrupt):
        t.fit()
    monkeypatch.setattr(Trainer, "evaluate", real)
    assert not [r for r in read_metrics(run) if r["step"] == 2 and "eval/accuracy" in r]
    lines = []
    out = Trainer(recipe_from_dict(_recipe_of(run)), run_dir=run, resume=True, log=lines.append).fit()
    assert out["final_eval"] is not None and any("not its final held-out eval: running it" in x for x in lines)
    assert len([r for r in read_metrics(run) if r["step"] == 2 and "eval/accuracy" in r]) == 1
    lines.clear()
    again = Trainer(recipe_from_dict(_recipe_of(run)), run_dir=run, resume=True, log=lines.append).fit()
    assert again["final_eval"] is None and any("the run is complete" in x for x in lines)


def test_an_edited_recipe_yaml_cannot_change_what_the_checkpoint_was_made_with(tiny_model_dir, tiny_data, tmp_path):
    """Only --set was checked against the run's recipe.yaml: the file edited by hand changed the seed unnoticed,
    and lora.r 4 -> 8 trained on at r 4 while recipe.yaml said 8. The checkpoint keeps what it was made with."""
    import shutil

    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir, base)
    run = tmp_path / "run"
    d = recipe_dict(base, tiny_data, run, train={"steps": 1, "preflight": False, "eval_max_prompts": 2},
                    output={"save_every": 1})
    Trainer(recipe_from_dict(d), **QUIET).fit()
    edited = _recipe_of(run)
    edited["lora"]["r"] = 8   # caught before the model loads: the adapter's own config
    write_recipe(run / "recipe.yaml", edited)
    with pytest.raises(TrainingError, match=r"cannot resume from .*step-000001: its adapter was made with other "
                                            r"settings than the recipe says: lora.r \(4 -> 8\)"):
        Trainer(recipe_from_dict(edited), run_dir=run, resume=True, **QUIET)
    edited["lora"]["r"], edited["seed"] = 4, 5
    write_recipe(run / "recipe.yaml", edited)
    with pytest.raises(TrainingError, match=r"cannot resume from .*step-000001: it was made with other settings than "
                                            r"the run's recipe.yaml now says: seed \(3 -> 5\)"):
        Trainer(recipe_from_dict(edited), run_dir=run, resume=True, **QUIET)
    # a base model folder that moved may be named anew (it blocked the resume for good)
    moved = tmp_path / "moved"
    base.rename(moved)
    back = _recipe_of(run)
    back["lora"]["r"], back["seed"] = 4, 3
    write_recipe(run / "recipe.yaml", back)   # put back, as the error says
    back["model"]["name_or_path"] = str(moved)   # --set model.name_or_path=...
    lines = []
    resumed = Trainer(recipe_from_dict(back), run_dir=run, resume=True, log=lines.append)
    assert resumed.step == 1 and any(f"{base} is gone; the run goes on with {moved}" in x for x in lines), lines
    resumed.close()


def test_a_fresh_run_will_not_overwrite_a_recipe_yaml_in_its_folder(tiny_model_dir, tiny_data, tmp_path):
    """output.dir=. in a project folder replaced the user's recipe.yaml with the run's copy, comments and all."""
    run = tmp_path / "project"
    run.mkdir()
    (run / "recipe.yaml").write_text("# my recipe\n")
    d = recipe_dict(tiny_model_dir, tiny_data, run, train={"preflight": False})
    with pytest.raises(TrainingError, match=r"holds a recipe.yaml, which a run writes its own copy over"):
        Trainer(recipe_from_dict(d), **QUIET)
    assert (run / "recipe.yaml").read_text() == "# my recipe\n"


def test_ctrl_c_outside_a_step_exits_130_with_the_resume_command(tiny_model_dir, tiny_data, tmp_path, monkeypatch):
    """Ctrl-C in the step-0 eval, the final eval or loading printed click's 'Aborted!' and exit 1, no resume hint."""
    from click.testing import CliRunner

    from lowmem_grpo.cli import main

    run = tmp_path / "run"
    path = write_recipe(tmp_path / "r.yaml", recipe_dict(tiny_model_dir, tiny_data, run,
                                                         train={"steps": 1, "preflight": False, "eval_max_prompts": 2}))

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(Trainer, "evaluate", interrupted)
    res = CliRunner().invoke(main, ["train", str(path)])
    assert res.exit_code == 130 and "Aborted" not in res.output, res.output
    assert f"no checkpoint yet (it starts again). Continue with: lowmem-grpo train --resume {run}" in res.output


def test_a_full_disk_at_a_checkpoint_is_one_error_with_the_resume_command(tiny_model_dir, tiny_data, tmp_path,
                                                                          monkeypatch):
    """A checkpoint write that failed (a full disk) ended in torch's 'enforce fail ... unexpected pos' traceback."""
    run = tmp_path / "run"
    d = recipe_dict(tiny_model_dir, tiny_data, run, train={"steps": 2, "preflight": False, "eval_max_prompts": 2},
                    output={"save_every": 1})
    t = Trainer(recipe_from_dict(d), **QUIET)
    real = ckpt.save

    def full_at_step_2(run_dir, step, *args, **kwargs):
        if step == 2:
            raise ckpt.CheckpointWriteError(f"could not write the checkpoint {run_dir}/checkpoints/step-000002 "
                                            "(OSError: No space left on device)", run_dir, OSError(28, "full"))
        return real(run_dir, step, *args, **kwargs)

    monkeypatch.setattr(ckpt, "save", full_at_step_2)
    with pytest.raises(TrainingError, match=rf"step 2: could not write the checkpoint .*No space left on device\)\. "
                                            rf"Free some space there, then resume with: lowmem-grpo train --resume {run}"):
        t.fit()
    assert ckpt.latest(run).name == "step-000001"


@pytest.mark.parametrize("how, tensorboard", [("deleted", "auto"), ("moved", False)])
def test_a_run_folder_that_goes_mid_run_stops_the_run_and_is_not_made_again(tiny_model_dir, tiny_data, tmp_path,
                                                                            monkeypatch, how, tensorboard):
    """A red team's find: a run folder deleted (rm -rf) or moved (mv) mid-run was trained on to the end, exit 0: its
    metrics went into the deleted file, its checkpoints into a new bare folder at the old path that neither --resume
    nor export accepted (no recipe.yaml). Now the next metrics row stops it, and nothing is made at the old path;
    a moved run resumes from its new place."""
    import shutil

    from lowmem_grpo.sinks import SinkError

    run = tmp_path / "run"
    d = recipe_dict(tiny_model_dir, tiny_data, run, train={"steps": 4, "preflight": False, "eval_at_start": False},
                    output={"save_every": 1, "tensorboard": tensorboard})   # (off: it went on without a word)
    d["data"]["eval_path"] = ""
    real = ckpt.save

    def save_then_the_folder_goes(run_dir, step, *args, **kwargs):
        path = real(run_dir, step, *args, **kwargs)
        if step == 1:
            shutil.rmtree(run) if how == "deleted" else run.rename(tmp_path / "moved")
        return path

    monkeypatch.setattr(ckpt, "save", save_then_the_folder_goes)
    t = Trainer(recipe_from_dict(d), **QUIET)
    with pytest.raises(SinkError, match=rf"^the run folder {run} was deleted.* while the run trained: stopped at step 2"):
        t.fit()
    assert not run.exists()
    if how == "moved":
        monkeypatch.undo()
        moved = tmp_path / "moved"
        from lowmem_grpo.recipe import load_recipe

        resumed = Trainer(load_recipe(moved / "recipe.yaml"), run_dir=moved, resume=True, **QUIET)   # (as --resume)
        assert resumed.step == 1
        resumed.close()


def test_a_sink_error_mid_run_is_one_line_and_exit_2(capsys):
    """A full disk under metrics.jsonl, or the run folder gone mid-run, is a SinkError raised from inside the loop:
    the CLI printed it as the last line of a traceback (found by a red team). One line, exit 2, as other user errors."""
    from lowmem_grpo.cli import _run
    from lowmem_grpo.sinks import SinkError

    def step():
        raise SinkError("cannot write RUN/metrics.jsonl (No space left on device): the run stopped at step 3")

    with pytest.raises(SystemExit) as exit_:
        _run(step)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err == "error: cannot write RUN/metrics.jsonl (No space left on device): the run " \
                                          "stopped at step 3\n"
