"""A long unattended run: what a run leaves behind must not grow with its steps or its restarts.

A soak run (thousands of tiny-model steps, the code reward, kill -9 and resume) found RSS, fds, threads and step
time flat; this checks the same bounds on a few steps, each a count: checkpoints kept, files in the run folder,
metrics rows, and the processes, open files, threads and temp folders a run and its resume leave in the process.
"""

from __future__ import annotations

import gc
import json
import os
import tempfile

import psutil
import pytest

from conftest import QUIET, recipe_dict
from lowmem_grpo import checkpoint as ckpt
from lowmem_grpo.metrics import read_metrics
from lowmem_grpo.recipe import recipe_from_dict
from lowmem_grpo.rewards.code import code_reward
from lowmem_grpo.train import Trainer

# Programs a policy may write that outlive their run if the sandbox lets them: a forked child, a subprocess, a
# thread, all sleeping past the timeout.
LINGERING = [
    "import os, time\nif os.fork() == 0:\n    time.sleep(60)\n",
    "import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n",
    "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True).start()\ntime.sleep(60)\n",
]


def lingering_code(completions, **_):
    """The code reward on LINGERING programs, one per completion (a reward function of this test's recipe)."""
    programs = [LINGERING[i % len(LINGERING)] for i in range(len(completions))]
    return code_reward([f"```python\n{p}```" for p in programs], rows=[{"tests": ["assert True"]}] * len(programs),
                       timeout=1.0, allow_weak_sandbox=True)


def _held() -> dict:
    """What this process holds that a run could leak: child processes, open files, threads. After a collection, so
    that only what a run keeps alive counts (tests/test_train.py checks a finished Trainer is freed without one)."""
    gc.collect()
    me = psutil.Process()
    return {"children": {p.pid for p in me.children(recursive=True)}, "fds": len(os.listdir("/proc/self/fd")),
            "threads": me.num_threads()}


@pytest.mark.slow(20)
def test_a_run_and_its_resume_leave_nothing_growing_behind(tiny_model_dir, tiny_data, tmp_path, monkeypatch):
    temp = tmp_path / "tmp"   # the sandbox's working folders (tempfile.mkdtemp) go here, counted below
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    run = tmp_path / "run"
    d = recipe_dict(tiny_model_dir, tiny_data, run, train={"steps": 4, "eval_every": 2, "eval_max_prompts": 2},
                    output={"save_every": 1, "keep_last": 2, "samples_every": 1})
    d["rewards"]["functions"].append({"function": "test_soak:lingering_code", "weight": 0.1})
    d["generation"]["num_generations"] = 2

    before = _held()["children"]   # (what earlier tests in this process may have left: not this run's)
    Trainer(recipe_from_dict(d), **QUIET).fit()
    after_run = _held()
    d["train"]["steps"] = 8
    Trainer(recipe_from_dict(d), run_dir=run, resume=True, **QUIET).fit()
    after_resume = _held()

    assert after_run["children"] <= before and after_resume["children"] <= before   # every sandboxed program gone
    for held in ("fds", "threads"):   # (the first run's thread pools, torch's, are made once per process)
        assert after_resume[held] == after_run[held], held
    assert list(temp.iterdir()) == []
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000007", "step-000008"]   # keep_last
    assert sorted(p.name for p in run.iterdir() if p.name != "tensorboard") == \
        [".lock", "checkpoints", "metrics.jsonl", "recipe.yaml", "samples.jsonl"]
    steps = [r["step"] for r in read_metrics(run) if "loss" in r]
    assert steps == list(range(1, 9))   # one row a step, none twice across the resume
    samples = [json.loads(line)["step"] for line in (run / "samples.jsonl").read_text().splitlines()]
    assert samples == list(range(1, 9))
    assert ckpt.latest(run).name == "step-000008"
