"""Metrics sinks (JSONL, TensorBoard, a fake W&B), the samples table, and the progress display."""

from __future__ import annotations

import io
import json
import sys
import types

import numpy as np
import pytest

from conftest import recipe_dict
from lowmem_grpo import sinks
from lowmem_grpo.metrics import read_metrics
from lowmem_grpo.progress import Progress, use_bar
from lowmem_grpo.recipe import recipe_from_dict
from lowmem_grpo.train import Trainer, TrainingError


class FakeWandb(types.ModuleType):
    """Records what the glue hands to wandb."""

    def __init__(self):
        super().__init__("wandb")
        self.inits, self.logs, self.finished = [], [], 0
        self.util = types.SimpleNamespace(generate_id=lambda: "fake-id-1")
        fake = self

        class Table:
            def __init__(self, columns, data):
                self.columns, self.data = columns, data

        class Run:
            def log(self, data, step=None):
                fake.logs.append((step, data))

            def finish(self):
                fake.finished += 1

        self.Table, self._Run = Table, Run

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return self._Run()


def test_tensorboard_wandb_samples_and_bar(tiny_model_dir, tiny_data, tmp_path, monkeypatch, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    run = tmp_path / "run"
    d = recipe_dict(tiny_model_dir, tiny_data, run, train={"steps": 4, "eval_max_prompts": 4},
                    output={"tensorboard": True, "wandb_project": "my-proj", "samples_every": 2, "progress": "bar",
                            "save_every": 2})
    lines = []
    t = Trainer(recipe_from_dict(d), log=lines.append)
    assert t.metrics.names == ["JsonlSink", "TensorBoardSink", "WandbSink"]
    t.fit()
    rows = read_metrics(run)
    step_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in step_rows] == [1, 2, 3, 4]

    # TensorBoard: every finite number of every row, read back from the event file, equals metrics.jsonl's.
    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0}).Reload()
    tags = set(acc.Tags()["scalars"])
    expected = {}
    for r in rows:
        for k, v in sinks.scalars(r).items():
            expected.setdefault(k, []).append((r["step"], v))
    assert {"loss", "reward/mean", "success_rate", "kl", "eval/accuracy", "nonfinite/skipped_total"} <= tags
    assert tags == set(expected)
    for tag, want in expected.items():
        got = [(e.step, e.value) for e in acc.Scalars(tag)]
        assert got == [(s, float(np.float32(v))) for s, v in want], tag
    assert "samples/text_summary" in acc.Tags()["tensors"]  # add_text is stored as a tensor summary
    assert [e.step for e in acc.Tensors("samples/text_summary")] == [2, 4]
    text = acc.Tensors("samples/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "| prompt | completion | reward | reward/math | reward/digit_count |" in text

    # samples.jsonl: steps 2 and 4, with per-function rewards of the right completions.
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [2, 4]
    rec = samples[0]["samples"][0]
    assert set(rec) == {"prompt", "completion", "reward", "reward/math", "reward/digit_count"}
    assert rec["reward"] == pytest.approx(rec["reward/math"] + 0.5 * rec["reward/digit_count"])
    assert len(samples[0]["samples"]) == 8  # 2 prompts x G=4, under the 16-row cap

    # W&B: one init with the project, the recipe and a resumable id; every row logged at its step; tables.
    (init,) = fake.inits
    assert init["project"] == "my-proj" and init["resume"] == "allow" and init["id"] == "fake-id-1"
    assert init["config"]["train"]["steps"] == 4 and init["config"]["output"]["wandb_project"] == "my-proj"
    scalar_logs = [(s, x) for s, x in fake.logs if "samples" not in x]
    assert [s for s, _ in scalar_logs] == [r["step"] for r in rows]
    assert all(x == sinks.scalars(r) for (_, x), r in zip(scalar_logs, rows))
    tables = [(s, x["samples"]) for s, x in fake.logs if "samples" in x]
    assert [s for s, _ in tables] == [2, 4]
    assert tables[0][1].columns == list(rec) and tables[0][1].data[0] == [rec[c] for c in rec]
    assert fake.finished == 1
    assert (run / "wandb_id.txt").read_text() == "fake-id-1"

    # The bar went to stderr (rate and count), the summary lines through the log, one per step.
    err = capsys.readouterr().err
    assert "GRPO" in err and "4/4" in err and ("step/s" in err or "s/step" in err) and "gen tok/s" in err
    assert all(r["time/rollout_tokens_per_s"] > 0 for r in step_rows)  # completions' tokens / the rollout's seconds
    assert sum(line.startswith("step ") for line in lines) == 4


def test_resume_purges_tensorboard_and_samples_of_rerun_steps(tiny_model_dir, tiny_data, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    d = recipe_dict(tiny_model_dir, tiny_data, run, train={"steps": 3, "preflight": False},
                    output={"tensorboard": True, "samples_every": 1, "save_every": 2})
    d["data"]["eval_path"] = ""
    Trainer(recipe_from_dict(d), log=lambda *a: None).fit()  # checkpoint at 2 and 3
    import shutil

    shutil.rmtree(run / "checkpoints" / "step-000003")  # as if the run died after step 3's metrics
    d["train"]["steps"] = 4
    t = Trainer(recipe_from_dict(d), run_dir=run, resume=True, log=lambda *a: None)
    t.fit()
    acc = EventAccumulator(str(run / "tensorboard")).Reload()
    assert [e.step for e in acc.Scalars("loss")] == [1, 2, 3, 4]  # step 3 once: the first one was purged
    loss = {r["step"]: r["loss"] for r in read_metrics(run) if "loss" in r}
    assert [e.value for e in acc.Scalars("loss")] == [float(np.float32(loss[s])) for s in (1, 2, 3, 4)]
    assert [json.loads(x)["step"] for x in (run / "samples.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


def test_missing_sinks_are_clear_errors(tmp_path, monkeypatch):
    base = {"model": {"name_or_path": "m"}, "data": {"train_path": "t.jsonl"}}
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb fails, as when it is not installed
    r = recipe_from_dict({**base, "output": {"wandb_project": "p", "tensorboard": False}})
    with pytest.raises(sinks.SinkError, match=r"output.wandb_project is 'p' but wandb is not installed"):
        sinks.open_sinks(tmp_path, r.output, {}, None)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    assert not sinks.tensorboard_available()
    r = recipe_from_dict({**base, "output": {"tensorboard": True}})
    with pytest.raises(sinks.SinkError, match=r"output.tensorboard is true but tensorboard is not installed"):
        sinks.open_sinks(tmp_path, r.output, {}, None)
    r = recipe_from_dict({**base, "output": {"tensorboard": "auto"}})  # auto: quietly off
    assert sinks.open_sinks(tmp_path, r.output, {}, None).names == ["JsonlSink"]


def test_trainer_reports_a_missing_sink_as_a_training_error(tiny_model_dir, tiny_data, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    d = recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run", output={"wandb_project": "p"})
    with pytest.raises(TrainingError, match="wandb is not installed"):
        Trainer(recipe_from_dict(d), log=lambda *a: None)


class _Stream(io.StringIO):
    def __init__(self, tty):
        super().__init__()
        self.tty = tty

    def isatty(self):
        return self.tty


def test_progress_bar_only_on_a_terminal():
    assert use_bar("auto", _Stream(True)) and not use_bar("auto", _Stream(False))
    assert use_bar("bar", _Stream(False)) and not use_bar("lines", _Stream(True))
    for tty in (True, False):
        stream, logged = _Stream(tty), []
        with Progress(total=5, initial=2, mode="auto", log=logged.append, stream=stream) as p:
            for step in (3, 4, 5):
                p.update({"reward/mean": 0.5, "success_rate": 0.25, "kl": 0.01})
                p.log(f"step {step}")
        assert logged == ["step 3", "step 4", "step 5"]
        out = stream.getvalue()
        if tty:
            assert "5/5" in out and "reward 0.500" in out and "solved 0.25" in out
        else:
            assert out == ""  # a log file gets the summary lines only, no bar
