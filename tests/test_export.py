"""`export` writes whole or not at all: a failure midway (a full disk, kill -9, a checkpoint rotated away by a run
that still trains, a base model that moved) leaves no --out that looks like a finished export, and --overwrite
replaces the earlier export only once the new one is complete."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import recipe_dict, write_recipe
from lowmem_grpo import checkpoint as ckpt
from lowmem_grpo.cli import main

DISK_FULL = "No space left on device"


def _fake_run(model_dir, data, run: Path) -> Path:
    """A run directory with one checkpoint (step 1) holding a fresh adapter of the tiny model: no training."""
    import torch
    from transformers import AutoModelForCausalLM

    from lowmem_grpo.model import attach_lora
    from lowmem_grpo.recipe import LoraConfig

    d = recipe_dict(model_dir, data, run)
    d["model"]["load_in_4bit"] = False
    adapter = run / "checkpoints" / "step-000001" / "adapter"
    adapter.parent.mkdir(parents=True)
    write_recipe(run / "recipe.yaml", d)
    model = attach_lora(AutoModelForCausalLM.from_pretrained(model_dir), LoraConfig(r=4, alpha=8),
                        gradient_checkpointing=False)
    model.save_pretrained(adapter)
    torch.save({"step": 1}, adapter.parent / "trainer_state.pt")
    return adapter


@pytest.fixture
def run(tiny_model_dir, tiny_data, tmp_path) -> Path:
    _fake_run(tiny_model_dir, tiny_data, tmp_path / "run")
    return tmp_path / "run"


def export(run, out, *args):
    return CliRunner().invoke(main, ["export", str(run), "--out", str(out), *map(str, args)])


def fingerprint(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def fail_merged_save(monkeypatch, error):
    """The merged model's save_pretrained writes part of a weights file, then fails as a full disk does."""
    from transformers import PreTrainedModel

    def save(self, out, *a, **k):
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "model.safetensors").write_bytes(b"\0" * 100)
        raise error(out)

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", save)


def disk_full_oserror(out):
    return OSError(28, DISK_FULL, str(Path(out) / "model.safetensors"))


def disk_full_safetensors(out):   # what safetensors really raises for it (seen on a full tmpfs)
    from safetensors import SafetensorError

    return SafetensorError(f"Error while serializing: I/O error: {DISK_FULL} (os error 28)")


def hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("error", [disk_full_oserror, disk_full_safetensors])
def test_a_write_failing_mid_merge_leaves_no_out_and_one_line(run, tmp_path, monkeypatch, error):
    fail_merged_save(monkeypatch, error)
    out = tmp_path / "exports" / "exp"   # exports/ does not exist yet: the export creates it, and removes it again
    res = export(run, out)
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output
    assert "Traceback" not in res.output, res.output
    [line] = [ln for ln in res.output.splitlines() if ln.startswith("error:")]   # one error line (CliRunner's
    # output holds stdout's lines and stderr's, not in the order a terminal would show them)
    assert line.startswith(f"error: --out {out}: cannot write the merged model there ({DISK_FULL}: "), line
    assert line.endswith("the export was not made, --out is left as it was"), line
    assert not (tmp_path / "exports").exists()
    # the checkpoint is untouched, and a later export into the same --out works
    monkeypatch.undo()
    assert export(run, out).exit_code == 0
    assert sorted(p.name for p in out.iterdir()) == ["adapter", "merged"] and hidden(out.parent) == []


def test_overwrite_keeps_the_earlier_export_until_the_new_one_is_complete(run, tmp_path, monkeypatch):
    out = tmp_path / "exp"
    assert export(run, out).exit_code == 0
    before = fingerprint(out)
    assert "merged/model.safetensors" in before and "merged/tokenizer_config.json" in before
    fail_merged_save(monkeypatch, disk_full_oserror)
    res = export(run, out, "--overwrite")
    assert res.exit_code == 2 and DISK_FULL in res.output and "--out is left as it was" in res.output, res.output
    assert fingerprint(out) == before and hidden(tmp_path) == []
    monkeypatch.undo()
    res = export(run, out, "--overwrite", "--adapter-only")
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in out.iterdir()) == ["adapter"] and hidden(tmp_path) == []


def test_kill_9_mid_export_leaves_no_out_and_the_next_export_cleans_up(run, tmp_path):
    """kill -9 after the merged weights are written, before the tokenizer (the audit's F5): no --out at all, a
    staging folder that is named as what it is; the next export removes it and is not refused."""
    out = tmp_path / "exp"
    code = ("import os, signal, sys\n"
            "from transformers import PreTrainedTokenizerBase\n"
            "PreTrainedTokenizerBase.save_pretrained = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)\n"
            "from lowmem_grpo.cli import main\n"
            f"sys.argv = ['lowmem-grpo', 'export', {str(run)!r}, '--out', {str(out)!r}]\n"
            "main()\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == -9, p.stderr
    assert not out.exists()
    [left] = hidden(tmp_path)
    assert left.startswith(".exp.partial-") and (tmp_path / left / "merged" / "model.safetensors").is_file()
    res = export(run, out)
    assert res.exit_code == 0, res.output
    assert f"removed {tmp_path / left}: the unfinished files of an export that was cut short" in res.output
    assert hidden(tmp_path) == [] and (out / "merged" / "tokenizer_config.json").is_file()


def test_leftovers_of_a_cut_short_overwrite(run, tmp_path):
    """Killed between --overwrite's renames: the earlier export, set aside, is put back when --out is missing (else
    removed: the new one is in); a staging folder of an export still running (a live pid) is left alone."""
    out = tmp_path / "exp"
    assert export(run, out, "--adapter-only").exit_code == 0
    before = fingerprint(out)
    dead = subprocess.Popen([sys.executable, "-c", ""])   # (a pid that is no longer running)
    dead.wait()
    os.replace(out, tmp_path / f".exp.old-{dead.pid}")
    (tmp_path / f".exp.partial-{dead.pid}" / "merged").mkdir(parents=True)
    live = tmp_path / f".exp.partial-{os.getppid()}"
    live.mkdir()
    res = export(run, out, "--adapter-only")
    assert res.exit_code == 2 and "the folder already holds an export (it holds: adapter/)" in res.output, res.output
    assert "put the earlier export back" in res.output and fingerprint(out) == before
    assert f"{live}: left alone, an export that is still running (pid {os.getppid()})" in res.output
    assert hidden(tmp_path) == [live.name]
    shutil.copytree(out, tmp_path / f".exp.old-{dead.pid}")   # killed after the new export went in
    res = export(run, out, "--adapter-only", "--overwrite")
    assert res.exit_code == 0 and "the earlier export replaced by an --overwrite that was cut short" in res.output
    assert hidden(tmp_path) == [live.name]


def test_merge_reads_its_own_copy_of_the_adapter(run, tmp_path, monkeypatch):
    """A run that trains (save_every 1, keep_last 1) deletes the checkpoint once the next one is in: right after
    export copied it, here. The merge reads the copy, so the export is still made, from that checkpoint."""
    adapter = run / "checkpoints" / "step-000001" / "adapter"
    saved = fingerprint(adapter)
    copytree = shutil.copytree

    def copy_then_rotate(src, dst, *a, **k):
        done = copytree(src, dst, *a, **k)
        if Path(src) == adapter:
            ckpt._remove(adapter.parent)
        return done

    monkeypatch.setattr(shutil, "copytree", copy_then_rotate)
    out = tmp_path / "exp"
    res = export(run, out)
    assert res.exit_code == 0, res.output
    assert not adapter.parent.exists() and fingerprint(out / "adapter") == saved
    assert (out / "merged" / "model.safetensors").is_file() and hidden(tmp_path) == []


def test_a_checkpoint_rotated_away_before_the_copy_is_named(run, tmp_path, monkeypatch):
    adapter = run / "checkpoints" / "step-000001" / "adapter"
    copytree = shutil.copytree

    def rotate_then_copy(src, dst, *a, **k):
        if Path(src) == adapter:
            ckpt._remove(adapter.parent)
        return copytree(src, dst, *a, **k)

    monkeypatch.setattr(shutil, "copytree", rotate_then_copy)
    out = tmp_path / "exp"
    res = export(run, out)
    assert res.exit_code == 2, res.output
    assert res.output.startswith("error: checkpoint step-000001 was removed while exporting (is the run still "
                                 "training? it keeps the last 2 checkpoints, output.keep_last); export again, or "
                                 "--step an existing one"), res.output
    assert not out.exists() and hidden(tmp_path) == []


def test_a_base_model_that_moved_is_refused_before_anything_is_written(tiny_data, tmp_path, tiny_model_dir):
    moved = tmp_path / "model"
    shutil.copytree(tiny_model_dir, moved)
    _fake_run(moved, tiny_data, tmp_path / "run")
    moved.rename(tmp_path / "model-elsewhere")
    out = tmp_path / "exp"
    res = export(tmp_path / "run", out)
    assert res.exit_code == 2, res.output
    assert f"model.name_or_path='{moved}': no such model folder" in res.output and "--adapter-only" in res.output
    assert not out.exists() and hidden(tmp_path) == []
    assert export(tmp_path / "run", out, "--adapter-only").exit_code == 0   # the adapter alone does not need it


def test_an_out_the_export_cannot_be_renamed_onto_is_refused(run, tmp_path, monkeypatch):
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    for out in (".", here, "sub/.."):
        res = export(run, out, "--adapter-only")
        assert res.exit_code == 2 and "is a mount point or the current folder" in res.output, res.output
        assert list(here.iterdir()) == [] and hidden(tmp_path) == []


def test_a_run_on_a_relative_base_path_records_the_absolute_one_in_its_adapter(tiny_model_dir, tiny_data, tmp_path,
                                                                             monkeypatch):
    """peft writes the model path it was given into adapter_config.json: a relative one ('base') was a hub id to peft
    anywhere else, and eval warned that the export was trained on another model (a red team's find). The trainer
    loads the anchored path (recipe.yaml's), so the checkpoint's and the export's adapters name the folder whole."""
    import json

    from conftest import QUIET
    from lowmem_grpo.recipe import recipe_from_dict
    from lowmem_grpo.train import Trainer

    monkeypatch.chdir(tiny_model_dir.parent)
    d = recipe_dict(tiny_model_dir.name, tiny_data, tmp_path / "run", train={"steps": 1, "preflight": False},
                    output={"save_every": 1})
    d["data"]["eval_path"] = ""
    Trainer(recipe_from_dict(d), **QUIET).fit()
    saved = json.loads((ckpt.latest(tmp_path / "run") / "adapter" / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == str(tiny_model_dir.resolve())
    res = CliRunner().invoke(main, ["export", str(tmp_path / "run"), "--out", str(tmp_path / "exp"), "--adapter-only"])
    assert res.exit_code == 0, res.output
    exported = json.loads((tmp_path / "exp" / "adapter" / "adapter_config.json").read_text())
    assert exported["base_model_name_or_path"] == str(tiny_model_dir.resolve())


def test_the_export_of_a_4bit_run_says_its_merged_model_is_on_the_full_precision_base(run, tmp_path):
    """A red team scored the quickstart's merged model 18.0% against the run's 19.0%: the merge is onto the
    full-precision base, the run's adapter was trained on the 4-bit one. A 4-bit run's export says so."""
    import yaml

    note = "note: the merged model is the adapter on the full-precision base"
    res = export(run, tmp_path / "full")
    assert res.exit_code == 0 and note not in res.output, res.output
    d = yaml.safe_load((run / "recipe.yaml").read_text())
    d["model"]["load_in_4bit"] = True
    (run / "recipe.yaml").write_text(yaml.safe_dump(d))
    res = export(run, tmp_path / "nf4")
    assert res.exit_code == 0 and note in res.output, res.output


class Interrupted(Exception):
    """What this test's SIGINT handler raises (not a KeyboardInterrupt, which would end the pytest session)."""


def test_a_ctrl_c_between_overwrites_renames_is_handled_after_them(run, tmp_path, monkeypatch):
    """A red team's find: a Ctrl-C right after --overwrite set the earlier export aside, before the new one was
    renamed into place, left no export at --out, and the finished new one was deleted with the staging folder."""
    import signal

    from lowmem_grpo import export as export_mod

    out = tmp_path / "exp"
    assert export(run, out, "--adapter-only").exit_code == 0
    real, calls = os.replace, []

    def replace_then_ctrl_c(src, dst):
        real(src, dst)
        calls.append(Path(dst).name)
        if len(calls) == 1:   # the earlier export was just set aside: the Ctrl-C comes now
            os.kill(os.getpid(), signal.SIGINT)

    def handler(signum, frame):
        raise Interrupted

    monkeypatch.setattr(export_mod.os, "replace", replace_then_ctrl_c)
    previous = signal.signal(signal.SIGINT, handler)
    try:
        with pytest.raises(Interrupted):
            export_mod.export_run(run, out, merged=False, overwrite=True, log=lambda *a: None)
    finally:
        signal.signal(signal.SIGINT, previous)
    monkeypatch.undo()
    assert calls[:2] == [f".exp.{export_mod.ASIDE}-{os.getpid()}", "exp"]   # both renames ran before the Ctrl-C
    assert sorted(p.name for p in out.iterdir()) == ["adapter"] and not ckpt.adapter_problem(out / "adapter")
    res = export(run, out, "--overwrite", "--adapter-only")   # what the Ctrl-C left beside it is cleaned up
    assert res.exit_code == 0 and hidden(tmp_path) == [], res.output


def test_ctrl_c_during_export_says_out_is_as_it_was_and_exits_130(tmp_path, monkeypatch):
    """click said "Aborted!" and exit 1; export leaves --out as it was (its temporary folder goes: the kill -9 and
    overwrite tests above), which is what a user needs to hear."""
    from click.testing import CliRunner

    from lowmem_grpo import export as export_module
    from lowmem_grpo.cli import main

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(export_module, "export_run", interrupted)
    result = CliRunner().invoke(main, ["export", str(tmp_path / "run"), "--out", str(tmp_path / "exp")])
    assert result.exit_code == 130, result.output
    assert f"interrupted (Ctrl-C): --out {tmp_path / 'exp'} is as it was before this export" in result.output
