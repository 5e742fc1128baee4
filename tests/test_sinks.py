"""Metrics sinks (JSONL, TensorBoard, a fake W&B), the samples table, and the progress display."""

from __future__ import annotations

import datetime
import errno
import io
import itertools
import json
import shutil
import sys
import types

import numpy as np
import pytest

from conftest import recipe_dict
from lowmem_grpo import sinks
from lowmem_grpo.metrics import json_line, read_metrics, read_metrics_file, text_ends
from lowmem_grpo.progress import Progress, library_bars, use_bar
from lowmem_grpo.recipe import OutputConfig, recipe_from_dict
from lowmem_grpo.train import Trainer, TrainingError


class FakeWandb(types.ModuleType):
    """Records what the glue hands to wandb."""

    def __init__(self, refuse=lambda kwargs: None):
        super().__init__("wandb")
        self.inits, self.logs, self.finished = [], [], 0
        ids = itertools.count(1)
        self.util = types.SimpleNamespace(generate_id=lambda: f"fake-id-{next(ids)}")
        self.refuse = refuse   # kwargs -> an exception for init to raise, or None
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
        if (exc := self.refuse(kwargs)) is not None:
            raise exc
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
    monkeypatch.setattr("lowmem_grpo.train.text_ends", lambda text: f"ends of {text}")   # (its own test: below)
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
    # each row's `sample`: the ends of the step's first completion (whole in the table)
    assert [r["sample"] for r in step_rows if r["step"] in (2, 4)] == \
        [f"ends of {s['samples'][0]['completion']}" for s in samples]

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
    """Read as `tensorboard --logdir` reads it (plugin_event_accumulator, whose purge differs from the legacy reader's:
    a fresh run's writer must write a session start too, or the server shows a re-run step twice; a red team's)."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

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
    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"tensors": 0}).Reload()
    assert [e.step for e in acc.Tensors("loss")] == [1, 2, 3, 4]  # step 3 once: the first one was purged
    loss = {r["step"]: r["loss"] for r in read_metrics(run) if "loss" in r}
    assert [float(tensor_util.make_ndarray(e.tensor_proto)) for e in acc.Tensors("loss")] == \
        [float(np.float32(loss[s])) for s in (1, 2, 3, 4)]
    assert [e.step for e in acc.Tensors("samples/text_summary")] == [1, 2, 3, 4]
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


def test_trainer_reports_a_missing_sink_as_a_training_error(tiny_model_dir, tiny_data, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)
    d = recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run", output={"wandb_project": "p"})
    with pytest.raises(TrainingError, match="wandb is not installed"):
        Trainer(recipe_from_dict(d), log=lambda *a: None)
    # off a terminal (output.progress auto), not transformers' "Loading weights" bar either (a red team's find)
    assert "Loading weights" not in capsys.readouterr().err


def test_a_sink_that_cannot_open_is_one_line_and_the_same_command_can_start_again(tiny_model_dir, tiny_data, tmp_path,
                                                                                  monkeypatch):
    """wandb.init raising (no login in a batch job) was a traceback, and left recipe.yaml, metrics.jsonl and
    wandb_id.txt, so the same command was then refused (found by a red team)."""
    class UsageError(Exception):
        pass

    fake = FakeWandb(refuse=lambda kw: UsageError("api_key not configured (no-tty).\ncall wandb.login(key=...)"))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    run = tmp_path / "run"
    d = recipe_dict(tiny_model_dir, tiny_data, run, train={"steps": 1, "preflight": False},
                    output={"wandb_project": "p", "tensorboard": True})
    d["data"]["eval_path"] = ""
    with pytest.raises(TrainingError) as err:
        Trainer(recipe_from_dict(d), log=lambda *a: None)
    assert str(err.value) == ("output.wandb_project='p': wandb.init failed: UsageError: api_key not configured (no-tty). "
                              "call wandb.login(key=...) (wandb login, or WANDB_MODE=offline, or set "
                              "output.wandb_project to empty)")
    assert not {"recipe.yaml", "metrics.jsonl", "wandb_id.txt", "tensorboard"} & {p.name for p in run.iterdir()}
    fake.refuse = lambda kw: None   # logged in: the same command starts
    t = Trainer(recipe_from_dict(d), log=lambda *a: None)
    t.fit()
    t.close()
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == [1] and (run / "recipe.yaml").is_file()
    assert (run / "wandb_id.txt").read_text() == fake.inits[-1]["id"]


def test_a_tensorboard_writer_that_cannot_open_is_a_sink_error_naming_the_setting(tmp_path):
    r = recipe_from_dict({"model": {"name_or_path": "m"}, "data": {"train_path": "t.jsonl"},
                          "output": {"tensorboard": True}})
    (tmp_path / "tensorboard").write_text("a file where the writer's folder goes")
    with pytest.raises(sinks.SinkError, match=r"^output.tensorboard=True: cannot open a TensorBoard writer in .*"
                                              r"tensorboard: \w+Error: .*, or set output.tensorboard: false\)$"):
        sinks.open_sinks(tmp_path, r.output, {}, None)
    assert not (tmp_path / "metrics.jsonl").exists()   # (the JSONL sink opens last)


def _output(**output):
    return recipe_from_dict({"model": {"name_or_path": "m"}, "data": {"train_path": "t.jsonl"},
                             "output": {"tensorboard": False, "wandb_project": "p", **output}}).output


def test_a_resume_rewinds_the_wandb_run_to_its_checkpoint(tmp_path, monkeypatch):
    """W&B ignores a step at or below the last it holds: a resume (kill after step K+1's row, before its checkpoint)
    rewinds the run to step K (resume_from), so that the re-run steps replace the stopped run's (a red team's find).
    Where W&B cannot rewind (offline, an older wandb or server refusing resume_from): resumed as it is, said in one
    line. A restart (-1: no checkpoint, the metrics go) is a new W&B run."""
    fake, lines = FakeWandb(), []
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    sinks.open_sinks(tmp_path, _output(), {}, None, log=lines.append).close()   # a fresh run
    assert fake.inits[-1]["resume"] == "allow" and "resume_from" not in fake.inits[-1]
    run_id = (tmp_path / "wandb_id.txt").read_text()
    s = sinks.open_sinks(tmp_path, _output(), {}, 2, log=lines.append)   # resumed from step 2's checkpoint
    s.write({"step": 3, "loss": 0.5})
    s.close()
    assert fake.inits[-1]["resume_from"] == f"{run_id}?_step=2" and fake.inits[-1]["id"] == run_id
    assert "resume" not in fake.inits[-1]   # (wandb refuses resume with resume_from)
    assert fake.logs[-1] == (3, {"loss": 0.5}) and lines == []

    fake.refuse = lambda kw: RuntimeError("failed to rewind run: run not found") if "resume_from" in kw else None
    sinks.open_sinks(tmp_path, _output(), {}, 2, log=lines.append).close()
    assert [k.get("resume") for k in fake.inits[-2:]] == [None, "allow"] and fake.inits[-1]["id"] == run_id
    assert lines == [f"[lowmem-grpo] W&B could not rewind run {run_id} to step 2 (RuntimeError: failed to rewind run: "
                     "run not found), so it is resumed as it is: W&B may keep the values the stopped run logged after "
                     "step 2 instead of their re-run (metrics.jsonl and TensorBoard hold the re-run's)"]

    monkeypatch.setenv("WANDB_MODE", "offline")
    lines.clear()
    sinks.open_sinks(tmp_path, _output(), {}, 2, log=lines.append).close()
    assert fake.inits[-1]["resume"] == "allow" and "resume_from" not in fake.inits[-1]
    assert len(lines) == 1 and lines[0].startswith(f"[lowmem-grpo] W&B offline mode (WANDB_MODE) cannot rewind run "
                                                   f"{run_id} to step 2: ")

    sinks.open_sinks(tmp_path, _output(), {}, -1, log=lines.append).close()   # a restart: its metrics went
    assert fake.inits[-1]["id"] != run_id and (tmp_path / "wandb_id.txt").read_text() == fake.inits[-1]["id"]


def test_values_of_any_shape_are_written_as_strict_json(tmp_path):
    """A reward's log_extra values (numpy arrays, lists with NaN, sets, datetimes, objects) killed the run where the
    sample table was written (`.item()` of an array), on every resume again, or wrote NaN, which strict readers
    refuse (found by a red team)."""
    import torch

    class Thing:
        def __str__(self):
            return "a thing"

    when = datetime.datetime(2025, 1, 2, 3, 4, 5)
    record = {"extra/arr": np.array([1.0, 2.0]), "extra/probs": [0.5, float("nan")], "extra/grid": np.array([[1, 2]]),
              "extra/t": torch.tensor([0.25, float("inf")]), "extra/scalar": np.float32(0.5), "extra/n": np.int64(3),
              "extra/t0": torch.tensor(2), "extra/flag": np.bool_(True), "extra/nested": {"a": (1, np.nan), 2: {3}},
              "extra/set": {"b", "a"}, "extra/when": when, "extra/thing": Thing(), "reward": float("-inf")}

    def strict(line):
        return json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in {line}"))

    sink = sinks.JsonlSink(tmp_path, None)
    sink.samples(1, [record])
    sink.write({"step": 1, "loss": float("nan"), "success_rate/per_prompt": [0.5, float("nan")], "lr": np.float64(1e-3)})
    sink.close()
    (got,) = strict((tmp_path / "samples.jsonl").read_text())["samples"]
    assert got == {"extra/arr": [1.0, 2.0], "extra/probs": [0.5, None], "extra/grid": [[1, 2]], "extra/t": [0.25, None],
                   "extra/scalar": 0.5, "extra/n": 3, "extra/t0": 2, "extra/flag": True,
                   "extra/nested": {"a": [1, None], "2": [3]}, "extra/set": ["a", "b"], "extra/when": str(when),
                   "extra/thing": "a thing", "reward": None}
    (row,) = [strict(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert row == {"step": 1, "loss": None, "success_rate/per_prompt": [0.5, None], "lr": 1e-3}
    assert json_line([float("nan")]) == "[null]\n"


def test_a_metrics_rows_sample_is_the_first_completions_ends():
    """The row's `sample` was the whole first completion (an environment's observations too) in every row; the sample
    tables keep whole completions (found by a red team)."""
    text = "a" * 1500 + "b" * 3000 + "c" * 1500
    cut = text_ends(text)
    assert cut == "a" * 1000 + " [... 4000 characters cut ...] " + "c" * 1000
    assert text_ends("short") == "short" and text_ends("x" * 2010) == "x" * 2010   # a cut must save something


def test_transformers_bars_are_off_only_where_the_run_shows_none():
    from transformers.utils import logging as hf_logging

    def bar():
        stream = io.StringIO()
        for _ in hf_logging.tqdm(range(3), desc="Loading weights", file=stream):
            pass
        return stream.getvalue()

    assert hf_logging.is_progress_bar_enabled() and "Loading weights" in bar()
    with library_bars(False):
        assert bar() == ""
    with library_bars(True):
        assert "Loading weights" in bar()
    assert hf_logging.is_progress_bar_enabled()   # as it was


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


def test_reward_functions_named_like_the_totals_keys_get_labels_of_their_own(monkeypatch):
    """A recipe's function called mean, std or skipped (environment, with an environment on) wrote its reward/<name>
    over the total's: reward/mean 5.0 for a total of 0 (found by a red team). One rule (Rewards._label) for the
    recipe's functions and the TRL API's."""
    import torch

    from lowmem_grpo import diagnostics as diag
    from lowmem_grpo.recipe import RewardsConfig
    from lowmem_grpo.rewards import Rewards

    module = types.ModuleType("named_like_totals")
    for name, score in (("mean", 5.0), ("std", 7.0), ("skipped", 3.0), ("environment", 2.0)):
        setattr(module, name, (lambda v: lambda completions, prompts, rows, **kw: [v] * len(completions))(score))
    monkeypatch.setitem(sys.modules, module.__name__, module)
    cfg = RewardsConfig(functions=[{"function": "math"}, *({"function": f"named_like_totals:{n}", "weight": 0.0}
                                                           for n in ("mean", "std", "skipped", "environment"))])
    rewards = Rewards(cfg, answer_field="answer")
    assert rewards.names == ["math", "mean_1", "std_2", "skipped_3", "environment"]
    assert Rewards(cfg, answer_field="answer", environment_weight=1.0).names == \
        ["math", "mean_1", "std_2", "skipped_3", "environment_4", "environment"]
    result = rewards([" 2", " 5"], ["1+1=", "1+1="], [{"answer": "2"}, {"answer": "2"}])
    row = diag.rollout_stats(result, torch.tensor([2, 2]), torch.tensor([False, False]), 2, torch.zeros(1, 2))
    assert (row["reward/mean"], row["reward/skipped"]) == (0.5, 0)   # the total's: math's only (the rest weigh 0)
    assert (row["reward/mean_1"], row["reward/std_2"], row["reward/skipped_3"]) == (5.0, 7.0, 3.0)


# -- the disk and the filesystem: a failed write, or a run folder that went, is one SinkError ------------------------

DISK_FULL = "No space left on device"


def _checkpoint(run, step):
    """What checkpoint.latest takes for a complete checkpoint."""
    folder = run / "checkpoints" / f"step-{step:06d}"
    (folder / "adapter").mkdir(parents=True)
    (folder / "trainer_state.pt").write_bytes(b"")


class FullDiskFile:
    """A metrics file on a disk that fills up: a write lands half, then fails, and so does every flush and the close
    (Python's buffered file retries what it holds), as on a full tmpfs."""

    def __init__(self, real):
        self.real, self.full = real, False

    def write(self, text):
        if self.full:
            self.real.write(text[: len(text) // 2])
            self.real.flush()
            raise OSError(errno.ENOSPC, DISK_FULL)
        return self.real.write(text)

    def flush(self):
        if self.full:
            raise OSError(errno.ENOSPC, DISK_FULL)
        self.real.flush()

    def fileno(self):
        return self.real.fileno()

    def close(self):
        self.real.close()
        if self.full:
            raise OSError(errno.ENOSPC, DISK_FULL)


def test_a_full_disk_while_appending_metrics_is_one_sink_error_naming_the_file_and_the_checkpoint(tmp_path,
                                                                                                  monkeypatch):
    """A red team's find: a full disk at a metrics row ended the run in three chained OSError tracebacks (the write,
    then the close of the file, twice), with nothing said of the checkpoint kept or how to go on."""
    run = tmp_path / "run"
    run.mkdir()
    _checkpoint(run, 2)
    sink = sinks.JsonlSink(run, None)
    sink.metrics._file = file = FullDiskFile(sink.metrics._file)
    sink.write({"step": 1})
    file.full = True

    class Other(sinks.Sink):   # a sink on the same full disk: its close fails too
        def write(self, row):
            pass

        def close(self):
            raise OSError(errno.ENOSPC, DISK_FULL)

    both = sinks.Sinks([sink, Other()])
    with pytest.raises(sinks.SinkError) as err:
        both.write({"step": 3, "loss": 0.5})
    assert str(err.value) == (f"cannot write {run / 'metrics.jsonl'} ({DISK_FULL}; "
                              f"{shutil.disk_usage(run).free // 1024} KiB free on that filesystem): the run stopped at "
                              f"step 3; its last checkpoint, {run / 'checkpoints' / 'step-000002'}, is kept: fix that "
                              f"(free some space there), then resume with: lowmem-grpo train --resume {run}")
    both.close()   # the error above is the one the run ends on: no second one from the closes
    assert read_metrics_file(run / "metrics.jsonl") == ([{"step": 1}], 1)   # the torn last line is skipped

    # samples.jsonl likewise; a run with no checkpoint yet says to start again
    shutil.rmtree(run / "checkpoints")
    sink = sinks.JsonlSink(run, None)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, DISK_FULL, str(run / "samples.jsonl"))

    monkeypatch.setattr(sinks, "open", full, raising=False)
    with pytest.raises(sinks.SinkError, match=rf"cannot write {run / 'samples.jsonl'} \({DISK_FULL}; .*\): the run "
                                              r"stopped at step 4; no checkpoint was written yet: .* start the run again"):
        sink.samples(4, [{"completion": "1"}])
    monkeypatch.undo()
    sink.close()
    # with no failed write, a failing close is not hidden
    with pytest.raises(OSError):
        sinks.Sinks([Other()]).close()


def test_a_resume_cuts_a_long_metrics_file_a_line_at_a_time(tmp_path):
    """Found by a soak run: a resume read metrics.jsonl whole to cut it back to the checkpoint, so its memory grew
    with the run (a 100,000-step run's 190 MB file: 520 MB more RAM at every resume). Now a line at a time."""
    import tracemalloc

    from lowmem_grpo.metrics import truncate_after

    path = tmp_path / "metrics.jsonl"
    row = {"loss": 0.1, "sample": "x" * 2000}   # (a step row is ~2 KB: ~100 keys, the sample's text)
    with open(path, "w") as f:
        for s in range(1, 10_001):   # 20 MB
            f.write(json_line({"step": s, **row}))
        f.write('{"step": 10001, "lo')   # cut by the crash
    tracemalloc.start()
    try:
        truncate_after(path, 9_000)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 * 2**20, peak / 2**20   # (read whole: 60 MB)
    rows, skipped = read_metrics_file(path)
    assert [r["step"] for r in rows] == list(range(1, 9_001)) and skipped == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_a_resume_on_a_full_disk_is_one_sink_error_and_leaves_metrics_as_they_were(tmp_path, monkeypatch):
    """A resume trims metrics.jsonl through a temp copy: on a full disk that copy failed with a traceback, and the
    empty metrics.jsonl.tmp stayed in the run folder (a red team's find, on a full tmpfs)."""
    from lowmem_grpo import durable

    run = tmp_path / "run"
    run.mkdir()
    text = "".join(json_line({"step": s, "loss": 0.1}) for s in range(1, 5))
    (run / "metrics.jsonl").write_text(text)

    class FullDisk(io.StringIO):
        """A temp copy on a full disk: its first 10 characters land, then ENOSPC (as a full tmpfs's flush)."""

        def __init__(self, path):
            super().__init__()
            self.path = path

        def write(self, data):
            with open(self.path, "a") as f:
                f.write(data[:max(0, 10 - self.tell())])
            super().write(data)
            raise OSError(errno.ENOSPC, DISK_FULL)   # (no file name, as the close of a full tmpfs's file)

    def full_for_temp_copies(path, mode="r", *args, **kwargs):
        return FullDisk(path) if str(path).endswith(".tmp") else open(path, mode, *args, **kwargs)

    monkeypatch.setattr(durable, "open", full_for_temp_copies, raising=False)   # (where the temp copy is written)
    with pytest.raises(sinks.SinkError, match=rf"^cannot write {run / 'metrics.jsonl'} \({DISK_FULL}; \d+ KiB free on "
                                              r"that filesystem\); nothing was trained: .* run the same command again"):
        sinks.open_sinks(run, OutputConfig(tensorboard=False), {}, 2)
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]
    assert (run / "metrics.jsonl").read_text() == text
    monkeypatch.undo()
    s = sinks.open_sinks(run, OutputConfig(tensorboard=False), {}, 2)
    s.close()
    assert [r["step"] for r in read_metrics(run)] == [1, 2]


@pytest.mark.parametrize("how", ["deleted", "moved", "replaced"])
def test_a_run_folder_that_goes_mid_run_is_one_sink_error(tmp_path, how):
    """A red team's find: a run folder deleted (or moved) mid-run was trained on to the end, its metrics written
    into the deleted file, its checkpoints into a new bare folder that neither --resume nor export accepted."""
    run = tmp_path / "run"
    run.mkdir()
    s = sinks.open_sinks(run, OutputConfig(tensorboard=False), {}, None)
    s.write({"step": 1})
    if how == "deleted":
        shutil.rmtree(run)
    else:
        run.rename(tmp_path / "moved")
        if how == "replaced":
            run.mkdir()
    with pytest.raises(sinks.SinkError, match=rf"^the run folder {run} was deleted.* while the run trained: stopped at "
                                              r"step 2, as nothing more of it could be kept there") as err:
        s.write({"step": 2})
    assert str(err.value).endswith(". If it was moved, continue the run from its new place: lowmem-grpo train --resume "
                                   "NEW_FOLDER") == (how != "deleted")
    s.close()
    assert how != "deleted" or not run.exists()
    if how != "deleted":   # the moved folder holds the rows written before
        assert [r["step"] for r in read_metrics(tmp_path / "moved")] == [1]


def test_a_full_disk_under_tensorboard_is_one_sink_error(tmp_path):
    """The TensorBoard writer's failed write was an OSError traceback, and its close raised one again."""
    tb = sinks.TensorBoardSink(tmp_path, None)
    tb.writer.close()

    class FullWriter:
        def add_scalar(self, *args):
            raise OSError(errno.ENOSPC, DISK_FULL)

        flush = close = add_text = add_scalar

    tb.writer = FullWriter()
    with pytest.raises(sinks.SinkError, match=rf"^output.tensorboard: cannot write {tmp_path / 'tensorboard'} "
                                              rf"\({DISK_FULL}; .*\): the run stopped at step 5; no checkpoint"):
        tb.write({"step": 5, "loss": 1.0})
    tb.close()
