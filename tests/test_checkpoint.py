"""Checkpoints: trainer_state.pt is checked on resume (entries, format, loop fields, optimizer shapes), and a save
that fails (a full disk) leaves no partial folder and says the earlier checkpoints are intact."""

from __future__ import annotations

import errno
import shutil

import pytest
import torch
from safetensors.torch import save_file

from conftest import QUIET, recipe_dict
from lowmem_grpo import checkpoint as ckpt
from lowmem_grpo.recipe import recipe_from_dict
from lowmem_grpo.train import LoopState, Trainer, TrainingError

LOOP_FIELDS = {"nonfinite_run", "nonfinite_total", "p_ref", "entropy_coef"}


class FakeAdapter:
    """What checkpoint.save needs of a model: save_pretrained; `fail` is raised once its files are half written."""

    def __init__(self, fail: BaseException | None = None):
        self.fail = fail

    def save_pretrained(self, path):
        path.mkdir(parents=True)
        (path / "adapter_config.json").write_text("{}")
        save_file({"w": torch.zeros(4, 8)}, str(path / "adapter_model.safetensors"))
        if self.fail is not None:
            raise self.fail


def _training(shapes=((4, 8), (8, 4))):
    """Trainable tensors, and an AdamW over them that took one step (so its state holds exp_avg)."""
    params = [torch.nn.Parameter(torch.randn(*s)) for s in shapes]
    opt = torch.optim.AdamW(params, lr=1e-3)
    sum((p * p).sum() for p in params).backward()
    opt.step()
    return params, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)


def _save(run, step, model=None, mkdir=True, **kw):
    params, opt, sched = _training(**kw)
    if mkdir:
        run.mkdir(parents=True, exist_ok=True)   # (the trainer makes its run folder: a save does not make it again)
    path = ckpt.save(run, step, model or FakeAdapter(), opt, sched, extra={"loop": {"nonfinite_run": 0}})
    return path, params


def _rewrite(path, edit):
    state = torch.load(path / "trainer_state.pt", weights_only=False)
    edit(state)
    torch.save(state, path / "trainer_state.pt")


def test_loop_fields_are_the_trainers():
    assert LOOP_FIELDS == set(LoopState.__dataclass_fields__)


# -- reading: what a resume cannot use is one clear sentence ------------------------------------------------

def test_a_checkpoint_is_written_with_its_format_and_loads_checked(tmp_path):
    path, params = _save(tmp_path, 3)
    saved = ckpt.load_trainer_state(path, loop_fields=LOOP_FIELDS, params=params)
    assert saved["format"] == ckpt.FORMAT and saved["step"] == 3
    assert ckpt.load_trainer_state(path)["step"] == 3   # (the checks need neither argument)


def test_an_old_checkpoint_without_format_still_loads(tmp_path):
    path, params = _save(tmp_path, 2)
    _rewrite(path, lambda s: (s.pop("format"), s.pop("rng_per_process")))   # as written before either existed
    saved = ckpt.load_trainer_state(path, loop_fields=LOOP_FIELDS, params=params)
    assert saved["step"] == 2 and "format" not in saved and len(ckpt.rng_states(saved)) == 1


@pytest.mark.parametrize("key", ["optimizer", "scheduler", "step", "extra", "rng"])
def test_a_missing_entry_is_named(tmp_path, key):
    path, params = _save(tmp_path, 2)
    _rewrite(path, lambda s: s.pop(key))
    with pytest.raises(ckpt.TrainerStateError, match=f"no '{key}' entry"):
        ckpt.load_trainer_state(path, loop_fields=LOOP_FIELDS, params=params)


def test_an_entry_of_the_wrong_type_is_named(tmp_path):
    path, params = _save(tmp_path, 2)
    _rewrite(path, lambda s: s.update(step="2"))
    with pytest.raises(ckpt.TrainerStateError, match="its 'step' entry is a str, not a int"):
        ckpt.load_trainer_state(path)
    _rewrite(path, lambda s: s.update(step=2, optimizer={"state": {}}))
    with pytest.raises(ckpt.TrainerStateError, match="not a torch optimizer's state_dict"):
        ckpt.load_trainer_state(path)
    _rewrite(path, lambda s: s.update(optimizer={"state": {}, "param_groups": []}, rng={"torch": 1}))
    with pytest.raises(ckpt.TrainerStateError, match="RNG state is incomplete"):
        ckpt.load_trainer_state(path)


def test_a_newer_format_says_upgrade(tmp_path):
    path, params = _save(tmp_path, 2)
    _rewrite(path, lambda s: s.update(format=ckpt.FORMAT + 1))
    with pytest.raises(ckpt.NewerFormat, match=rf"written by a newer lowmem-grpo \(format {ckpt.FORMAT + 1}; this one "
                                               rf"reads up to {ckpt.FORMAT}\): upgrade"):
        ckpt.load_trainer_state(path, loop_fields=LOOP_FIELDS, params=params)


def test_an_unknown_loop_field_says_upgrade(tmp_path):
    path, params = _save(tmp_path, 2)
    _rewrite(path, lambda s: s["extra"]["loop"].update(new_field_from_v2=1))
    with pytest.raises(ckpt.NewerFormat, match="does not know \\(new_field_from_v2\\): upgrade"):
        ckpt.load_trainer_state(path, loop_fields=LOOP_FIELDS, params=params)


def test_an_optimizer_state_of_other_shapes_is_refused(tmp_path):
    # lora.r=8's tensors in an r=4 run; then one tensor more than the run trains
    path, _ = _save(tmp_path, 2, shapes=((8, 8), (8, 8)))
    params = _training(((4, 8), (8, 4)))[0]
    with pytest.raises(ckpt.TrainerStateError, match=r"the optimizer state is for 2 tensors of shapes 8x8 and this run "
                                                     r"trains 2 of shapes 4x8, 8x4 .*lora.r"):
        ckpt.load_trainer_state(path, params=params)
    path, _ = _save(tmp_path, 4, shapes=((4, 8), (8, 4), (4, 8)))
    with pytest.raises(ckpt.TrainerStateError, match="optimizer state is for 3 tensors .* this run trains 2 "):
        ckpt.load_trainer_state(path, params=params)
    assert ckpt.optimizer_state_problem(_training()[1].state_dict(), params) is None
    assert ckpt.optimizer_state_problem(torch.optim.AdamW(params).state_dict(), params) is None   # (no step yet)


def test_a_trainer_state_of_another_step_is_refused(tmp_path):
    path, _ = _save(tmp_path, 2)
    other, _ = _save(tmp_path, 4)
    shutil.copy(path / "trainer_state.pt", other / "trainer_state.pt")
    with pytest.raises(ckpt.TrainerStateError, match="holds step 2, its folder is step-000004"):
        ckpt.load_trainer_state(other)


def test_resume_refuses_a_damaged_trainer_state_before_any_rollout(tiny_model_dir, tiny_data, tmp_path,
                                                                      monkeypatch):
    run = tmp_path / "run"
    d = recipe_dict(tiny_model_dir, tiny_data, run, train={"steps": 1, "preflight": False},
                    output={"save_every": 1})
    d["data"]["eval_path"] = ""
    Trainer(recipe_from_dict(d), **QUIET).fit()
    last = ckpt.latest(run)
    good = (last / "trainer_state.pt").read_bytes()
    d["train"]["steps"] = 2
    monkeypatch.setattr(Trainer, "fit", lambda self: pytest.fail("a rollout from a checkpoint it cannot use"))

    def wider(state):   # exp_avg of a lora.r=8 run: twice the rows
        for entry in state["optimizer"]["state"].values():
            for k in ("exp_avg", "exp_avg_sq"):
                entry[k] = torch.cat([entry[k], entry[k]])

    for edit, message in [(lambda s: s.pop("optimizer"), "no 'optimizer' entry"),
                          (wider, r"the optimizer state is for \d+ tensors of shapes .* and this run trains"),
                          (lambda s: s["extra"]["loop"].update(new_field_from_v2=1), "new_field_from_v2.*upgrade"),
                          (lambda s: s.update(format=ckpt.FORMAT + 1), "newer lowmem-grpo.*upgrade")]:
        (last / "trainer_state.pt").write_bytes(good)
        _rewrite(last, edit)
        with pytest.raises(TrainingError, match=f"cannot resume from {last}: trainer_state.pt: .*{message}"):
            Trainer(recipe_from_dict(d), run_dir=run, resume=True, **QUIET)
    # a checkpoint from before the format number resumes
    (last / "trainer_state.pt").write_bytes(good)
    _rewrite(last, lambda s: s.pop("format"))
    resumed = Trainer(recipe_from_dict(d), run_dir=run, resume=True, **QUIET)
    assert resumed.step == 1
    resumed.close()


# -- writing: a full disk leaves the earlier checkpoints and no partial folder ----------------------------

def _tmp_folders(run):
    return sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith(".tmp-"))


@pytest.mark.parametrize("where", ["adapter", "trainer_state"])
def test_a_full_disk_while_saving_raises_a_clear_error_and_leaves_no_partial_folder(tmp_path, monkeypatch, where):
    run = tmp_path / "run"
    _save(run, 1)
    full = OSError(errno.ENOSPC, "No space left on device")
    if where == "trainer_state":   # what torch.save raises on a full disk
        full = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1088 vs 1005")
        monkeypatch.setattr(ckpt.torch, "save", lambda *a, **k: (_ for _ in ()).throw(full))
    with pytest.raises(ckpt.CheckpointWriteError) as err:
        _save(run, 2, model=FakeAdapter(full if where == "adapter" else None))
    msg = str(err.value)
    assert str(run / "checkpoints" / "step-000002") in msg
    assert ("No space left on device" if where == "adapter" else "unexpected pos") in msg
    assert "earlier checkpoints are intact" in msg and "step-000001" in msg and " free on that filesystem" in msg
    assert err.value.cause is full and err.value.folder.name == "step-000002"
    assert _tmp_folders(run) == []
    assert [p.name for p in ckpt.complete_checkpoints(run)] == ["step-000001"]
    monkeypatch.undo()
    assert ckpt.load_trainer_state(ckpt.latest(run))["step"] == 1


def test_an_error_other_than_a_write_error_still_removes_the_partial_folder(tmp_path):
    run = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        _save(run, 1, model=FakeAdapter(KeyboardInterrupt()))
    assert _tmp_folders(run) == [] and ckpt.latest(run) is None


def test_a_stale_tmp_folder_is_removed_at_the_next_save(tmp_path):
    run = tmp_path / "run"
    _save(run, 1)
    stale = run / "checkpoints" / ".tmp-step-000002"   # a save killed (kill -9) midway
    (stale / "adapter").mkdir(parents=True)
    (stale / "adapter" / "adapter_model.safetensors").write_bytes(b"\0" * 1000)
    _save(run, 3)
    assert _tmp_folders(run) == []
    assert [p.name for p in ckpt.complete_checkpoints(run)] == ["step-000001", "step-000003"]


def test_a_resume_on_data_of_another_row_count_warns_that_the_prompt_order_changes(tiny_model_dir, tiny_data,
                                                                                    tmp_path):
    """The prompt order is a function of the row count (data.batch_indices): a resume after the data file gained a
    row drew other prompts without a word (a red team's find). The same data says nothing; more rows warn."""
    data = tmp_path / "train.jsonl"
    shutil.copy(tiny_data[0], data)
    run = tmp_path / "run"
    d = recipe_dict(tiny_model_dir, (data, tiny_data[1]), run, train={"steps": 1, "preflight": False},
                    output={"save_every": 1})
    d["data"]["eval_path"] = ""
    Trainer(recipe_from_dict(d), **QUIET).fit()
    d["train"]["steps"] = 2
    for grown in (False, True):
        if grown:
            with data.open("a") as f:
                f.write('{"prompt": "1+1=", "answer": "2"}\n')
        said = []
        Trainer(recipe_from_dict(d), run_dir=run, resume=True, log=said.append).close()
        warned = [line for line in said if "usable rows" in line]
        assert warned == ([] if not grown else [
            "[lowmem-grpo] warning: the training data now holds 301 usable rows, and the checkpoint was made with "
            "300: from step 2 on the run draws its prompts in another order than the run would have without the "
            "change (some prompts of this pass over the data come again, others not at all)"])


def test_bad_held_out_rows_skipped_at_start_up_are_said(tiny_model_dir, tiny_data, tmp_path):
    """Only the training set's skips were logged: 7 of 20 held-out rows without an answer went unsaid, and the
    held-out accuracy covered 13 (a red team's find)."""
    rows = tiny_data[1].read_text().splitlines()[:20]
    held_out = tmp_path / "test.jsonl"
    held_out.write_text("".join((r if i % 3 else '{"prompt": "1+2="}') + "\n" for i, r in enumerate(rows)))
    d = recipe_dict(tiny_model_dir, (tiny_data[0], held_out), tmp_path / "run", train={"steps": 1, "preflight": False})
    d["data"]["on_bad_row"] = "skip"
    said = []
    Trainer(recipe_from_dict(d), log=said.append).close()
    noted = [line for line in said if "held-out rows" in line]
    assert len(noted) == 1 and noted[0].startswith(
        "[lowmem-grpo] skipped 7 bad held-out rows (first: row 1: missing field 'answer'"), said


# -- the disk and the filesystem ---------------------------------------------------------------------------

def test_a_save_into_a_run_folder_that_went_is_refused_and_does_not_make_it_again(tmp_path):
    """A red team's find: with the run folder deleted (or moved) mid-run, save made run/checkpoints/ again, and the run
    finished into a bare folder of checkpoints that neither --resume nor export accepted (no recipe.yaml)."""
    run = tmp_path / "run"
    _save(run, 1)
    shutil.rmtree(run)
    with pytest.raises(ckpt.CheckpointWriteError, match=rf"could not write the checkpoint {run}/checkpoints/step-000002:"
                                                        rf" the run folder {run} is gone \(deleted or moved"):
        _save(run, 2, mkdir=False)
    assert not run.exists()


def test_write_text_atomic_flushes_and_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path, monkeypatch):
    """recipe.yaml (what resume and export read) was renamed into place unflushed, so a power cut could leave it
    empty; a write that failed (a full disk) left its .tmp- file behind; a plain resume wrote the same text again."""
    path = tmp_path / "recipe.yaml"
    synced = []
    real_fsync = ckpt.os.fsync
    monkeypatch.setattr(ckpt.os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    ckpt.write_text_atomic(path, "a: 1\n")
    assert path.read_text() == "a: 1\n" and len(synced) == 2   # the file, then its folder
    ckpt.write_text_atomic(path, "a: 1\n")
    assert len(synced) == 2   # the same text: not written again

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt.os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        ckpt.write_text_atomic(path, "a: 2\n")
    assert path.read_text() == "a: 1\n" and sorted(p.name for p in tmp_path.iterdir()) == ["recipe.yaml"]


def test_write_text_atomic_removes_the_temp_file_of_a_write_cut_short(tmp_path):
    """Found by a soak run: a kill -9 mid-write left .tmp-recipe.yaml in the run folder, and every resume after it
    (the same text: not written again) kept it there for good."""
    path = tmp_path / "recipe.yaml"
    ckpt.write_text_atomic(path, "a: 1\n")
    (tmp_path / ".tmp-recipe.yaml").write_text("a:")   # the killed write's
    ckpt.write_text_atomic(path, "a: 1\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe.yaml"] and path.read_text() == "a: 1\n"


def _lora_checkpoint(run, step):
    """A checkpoint whose adapter folder passes adapter_problem (a lora.r=4, alpha=8 adapter's config)."""
    import json

    path, _ = _save(run, step)
    (path / "adapter" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    return path


@pytest.mark.parametrize("cut", ["half", "last_bytes", "empty"])
def test_a_truncated_trainer_state_is_refused_naming_the_file_before_any_model_loads(tiny_model_dir, tiny_data,
                                                                                     tmp_path, monkeypatch, cut):
    """A red team's find: a cut trainer_state.pt (a copy cut short, a disk) was found only after the model had
    loaded (minutes, for a large one), as "trainer_state.pt: OSError: [Errno 22] Invalid argument"."""
    from lowmem_grpo import resume, train
    from lowmem_grpo.recipe import LoraConfig

    run = tmp_path / "run"
    path = _lora_checkpoint(run, 2)
    assert resume.adapter_problem(path, LoraConfig(r=4, alpha=8)) is None   # a whole one passes
    state = path / "trainer_state.pt"
    data = state.read_bytes()
    state.write_bytes({"half": data[: len(data) // 2], "last_bytes": data[:-10], "empty": b""}[cut])
    monkeypatch.setattr(train, "load_policy", lambda *a, **k: pytest.fail("the model loaded first"))
    d = recipe_dict(tiny_model_dir, tiny_data, run)
    with pytest.raises(TrainingError, match=rf"^cannot resume from {path}: {state}: (truncated or corrupt|an empty "
                                            rf"file).*\. Move that folder out of {run / 'checkpoints'} to resume from "
                                            "the checkpoint before it"):
        Trainer(recipe_from_dict(d), run_dir=run, resume=True, **QUIET)
