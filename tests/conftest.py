"""Shared fixtures: a tiny local model folder and data, built once per session (no hub access)."""

from __future__ import annotations

import contextlib
import copy
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml

os.environ.setdefault("OMP_NUM_THREADS", "1")
# No test reaches the Hugging Face hub: `datasets` and `huggingface_hub` fail at once instead of retrying
# for half a minute (set before either is imported; subprocesses inherit it).
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"
# tests/ on the path of subprocesses too, so that recipes can name "user_rewards:<fn>".
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
torch.set_num_threads(1)

from lowmem_grpo import tiny  # noqa: E402


def pytest_collection_modifyitems(items):
    """The tests marked slow first, longest first by their marks' seconds (10 unless given; the rest keep their
    order). The README runs two pytest workers (`-n 2 --dist worksteal`): each takes half of this list in order,
    and an idle one takes half of what the other has left. So the long ones start at once and the short ones
    even out the end (a 3-minute test started last would run alone for 3 minutes)."""
    def seconds(item):
        mark = item.get_closest_marker("slow")
        return (mark.args[0] if mark.args else 10) if mark else 0

    items.sort(key=lambda item: -seconds(item))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A randomly initialised tiny Qwen2 model + char tokenizer, saved as a Hugging Face folder."""
    path = tmp_path_factory.mktemp("tiny_model")
    tok = tiny.build_tokenizer()
    model = tiny.build_model(tok, tiny.TinyModelSpec(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                                     intermediate_size=128), seed=0)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory) -> Path:
    """Like tiny_model_dir, with head_dim 32 (vLLM's CPU attention takes 32..512) and room for prompts
    longer than one 128-token KV block."""
    path = tmp_path_factory.mktemp("vllm_model")
    tok = tiny.build_tokenizer()
    model = tiny.build_model(tok, tiny.TinyModelSpec(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                                                     intermediate_size=128, max_position_embeddings=256), seed=0)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> tuple[Path, Path]:
    path = tmp_path_factory.mktemp("tiny_data")
    train, test = tiny.split_addition_data(n_train=300, n_test=40, seed=7)
    tiny.write_jsonl(train, path / "train.jsonl")
    tiny.write_jsonl(test, path / "test.jsonl")
    return path / "train.jsonl", path / "test.jsonl"


def recipe_dict(model_dir, data, run_dir, **sections) -> dict:
    """A small, fast recipe for tests; `sections` update sections by name."""
    d = {
        "model": {"name_or_path": str(model_dir), "compute_dtype": "float32", "load_in_4bit": True},
        "lora": {"r": 4, "alpha": 8},
        "data": {"train_path": str(data[0]), "eval_path": str(data[1])},
        "rewards": {"functions": [{"function": "math"}, {"function": "user_rewards:digit_count", "weight": 0.5}]},
        "generation": {"num_generations": 4, "max_new_tokens": 4},
        "algorithm": {"beta": 0.04},
        "optimizer": {"lr": 1e-2},
        "train": {"steps": 3, "prompts_per_step": 2, "micro_batch_size": 3, "eval_max_prompts": 8},
        "output": {"dir": str(run_dir), "save_every": 2, "log_every": 1},
        "seed": 3,
    }
    for name, values in sections.items():
        d.setdefault(name, {}).update(values) if isinstance(values, dict) else d.__setitem__(name, values)
    return d


def write_recipe(path: Path, d: dict) -> Path:
    path.write_text(yaml.safe_dump(d))
    return path


QUIET = dict(log=lambda *a: None)


def chat_tokenizer(template: str):
    """The tiny character tokenizer with `template` as its chat template (jinja, as a model folder's)."""
    tok = tiny.build_tokenizer()
    tok.chat_template = template
    return tok


def central_differences(f, x: list, h: float = 1e-6) -> list:
    """d sum(f(x)) / d x_k for every k, by central differences: the gradient a hand-written formula implies."""
    out = []
    for k in range(len(x)):
        up, dn = list(x), list(x)
        up[k] += h
        dn[k] -= h
        out.append((sum(f(up)) - sum(f(dn))) / (2 * h))
    return out


def losses_by_step(run_dir) -> dict:
    from lowmem_grpo.metrics import read_metrics

    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if r.get("loss") is not None}


def straight_and_resumed(d: dict, tmp_path: Path, steps: int = 4, stop_at: int = 2):
    """Run `d` for `steps` straight (tmp_path/full); separately run `stop_at` steps, then resume to `steps`
    (tmp_path/cut). Returns (losses straight, losses cut + resumed, the resumed Trainer)."""
    from lowmem_grpo.recipe import recipe_from_dict
    from lowmem_grpo.train import Trainer

    d = copy.deepcopy(d)
    d["output"]["dir"], d["train"]["steps"] = str(tmp_path / "full"), steps
    Trainer(recipe_from_dict(d), **QUIET).fit()
    d["output"]["dir"], d["train"]["steps"] = str(tmp_path / "cut"), stop_at
    Trainer(recipe_from_dict(d), **QUIET).fit()
    d["train"]["steps"] = steps
    resumed = Trainer(recipe_from_dict(d), run_dir=tmp_path / "cut", resume=True, **QUIET)
    assert resumed.step == stop_at
    resumed.fit()
    return losses_by_step(tmp_path / "full"), losses_by_step(tmp_path / "cut"), resumed


@contextlib.contextmanager
def one_cpu_shared_with(spinners: int):
    """This process, and the programs it runs (judged code, a tool call), on one CPU with `spinners` busy processes,
    each in a session of its own (the scheduler shares a CPU equally between sessions where autogroup applies, between
    threads elsewhere): a program run meanwhile gets at most 1 / (spinners + 1) of a CPU, however idle the machine."""
    before = os.sched_getaffinity(0)
    cpu = min(before)
    procs = []
    try:
        os.sched_setaffinity(0, {cpu})   # (inherited by what this process starts)
        for _ in range(spinners):
            procs.append(subprocess.Popen([sys.executable, "-S", "-c", "while True: pass"], start_new_session=True))
        deadline = time.monotonic() + 60
        while any(psutil.Process(p.pid).cpu_times().user < 0.05 for p in procs):   # spinning, past their start-up
            assert time.monotonic() < deadline, "the busy processes did not start"
            time.sleep(0.02)
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()
        os.sched_setaffinity(0, before)
