"""Whether a run may start or go on in its folder: the rules, apart from the loop that trains.

A run folder holds the run's recipe.yaml (its settings, local paths made absolute: `anchored`), its
checkpoints (checkpoint.py) and its metrics. A new run refuses a folder that holds another run's, or a
recipe.yaml it would write over. A resume refuses to change what its checkpoints were made with
(FIXED_ON_RESUME), checked twice: against the run's recipe.yaml, and against the record each checkpoint
keeps of them (recipe.yaml can be edited, a red team's find). Each check returns the problem's text, or
raises ResumeError from a checkpoint it cannot use; the trainer turns both into its TrainingError.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from . import checkpoint as ckpt
from .recipe import Recipe

# What a resumed run cannot change: its checkpoints were made with them (the base, the adapter's shape, the
# optimizer's state), or the resume restores them instead (seed: the RNG streams; output.dir: the run's folder).
FIXED_ON_RESUME = ("model", "lora", "optimizer.name", "seed", "output.dir")


class ResumeError(Exception):
    """A checkpoint this run cannot continue from: damaged, newer, or made with other fixed settings."""


def resume_command(run_dir, processes: int = 1) -> str:
    """The command that continues the run in `run_dir` (with --nproc for a run of several processes)."""
    return f"lowmem-grpo train{f' --nproc {processes}' if processes > 1 else ''} --resume {run_dir}"


def fixed_values(recipe: Recipe) -> dict:
    """{key: value} of every FIXED_ON_RESUME setting (each field of a section named whole), as a run's
    checkpoints keep them."""
    def leaves(value, key: str) -> dict:
        if isinstance(value, dict):
            return {k: v for name, sub in value.items() for k, v in leaves(sub, f"{key}.{name}").items()}
        return {key: value}

    dumped, out = anchored(recipe).model_dump(mode="json"), {}
    for key in FIXED_ON_RESUME:
        head, *rest = key.split(".")
        out.update({k: v for k, v in leaves(dumped[head], head).items() if not rest or k == key})
    return out


def resume_changes(before: dict, after: dict, log=print) -> list[str]:
    """The fixed_values that differ, as 'key (old -> new)'. But for one: a base model folder that is gone may be
    named anew (found by a red team: a moved folder blocked the resume for good); said in the log."""
    out = []
    for key, old in before.items():
        new = after.get(key)
        if old == new:
            continue
        if key == "model.name_or_path" and isinstance(old, str) and old.startswith("/") and not Path(old).exists():
            log(f"[lowmem-grpo] model.name_or_path: {old} is gone; the run goes on with {new} (it must be the same "
                "base model: the checkpoint's adapter was trained on that one)")
            continue
        out.append(f"{key} ({old!r} -> {new!r})")
    return out


def anchored(recipe: Recipe) -> Recipe:
    """The recipe as a run folder keeps it (recipe.yaml): local paths absolute, so that a resume, eval or export
    from another directory finds the same model and data (a relative model folder read from elsewhere was taken
    for a hub id, and retried for a minute)."""
    def local(value: str) -> str:
        return str(Path(value).resolve()) if value and not value.startswith("hf:") and Path(value).exists() else value

    return recipe.model_copy(update={
        "model": recipe.model.model_copy(update={"name_or_path": local(recipe.model.name_or_path)}),
        "data": recipe.data.model_copy(update={"train_path": local(recipe.data.train_path),
                                               "eval_path": local(recipe.data.eval_path)}),
        "output": recipe.output.model_copy(update={"dir": str(Path(recipe.output.dir).resolve())})})


def new_run_problem(run_dir: Path, command: str) -> Optional[str]:
    """Why a new run may not start in `run_dir` (`command` continues what is there), or None."""
    if held := ckpt.earlier_run(run_dir):
        return (f"{run_dir} already holds a run ({held}): continue it with `{command}`, or train into another "
                "folder (--set output.dir=...), or delete that one")
    if (run_dir / "recipe.yaml").is_file():
        # a run writes its own recipe.yaml there: a user's recipe in that folder would be overwritten (found by
        # a red team: output.dir=. replaced the recipe being trained, comments and all)
        return (f"{run_dir} holds a recipe.yaml, which a run writes its own copy over: train into a folder of its "
                "own (--set output.dir=...); if it is an earlier run's that stopped before its first step, continue "
                f"it with `{command}`, or delete it")
    return None


def recipe_change_problem(run_dir: Path, recipe: Recipe) -> Optional[str]:
    """Why `recipe` may not resume the run in `run_dir`: it changes a FIXED_ON_RESUME setting of the run's
    recipe.yaml (which would be ignored, or break). None when it changes none, or recipe.yaml is unreadable
    (the caller read it: nothing to compare with)."""
    from .recipe import load_recipe

    try:
        before = load_recipe(run_dir / "recipe.yaml")
    except Exception:
        return None
    changed = resume_changes(fixed_values(before), fixed_values(recipe), log=lambda *a: None)
    if not changed:
        return None
    return (f"a resumed run cannot change {'; '.join(changed)}: its checkpoints were made with the run's values "
            f"({run_dir / 'recipe.yaml'}). Start a new run for that (--set output.dir=...), or resume without "
            "those --set.")


def adapter_problem(checkpoint: Path, lora) -> Optional[str]:
    """Why the checkpoint's adapter cannot be loaded for the recipe's `lora` section (damaged, or another
    shape), or its trainer_state.pt is not a whole file, or None: checked before any model is loaded."""
    if problem := ckpt.adapter_problem(checkpoint / "adapter"):
        return damaged(checkpoint, problem)
    if problem := ckpt.trainer_state_file_problem(checkpoint / "trainer_state.pt"):
        return damaged(checkpoint, f"{checkpoint / 'trainer_state.pt'}: {problem}")
    if problem := ckpt.adapter_mismatch(checkpoint / "adapter", lora):
        return (f"cannot resume from {checkpoint}: {problem}. Was recipe.yaml edited? A resumed run keeps these: "
                "put them back, or start a new run.")
    return None


def read_trainer_state(checkpoint: Path, recipe: Recipe, loop_fields: set, params: list, log=print) -> dict:
    """The checkpoint's trainer state (checkpoint.load_trainer_state), made with the recipe's fixed settings;
    ResumeError when it is newer than this lowmem-grpo, damaged, or made with others."""
    try:
        saved = ckpt.load_trainer_state(checkpoint, loop_fields=loop_fields, params=params)
    except ckpt.NewerFormat as exc:   # not damaged: this lowmem-grpo is older than the run's
        raise ResumeError(f"cannot resume from {checkpoint}: trainer_state.pt: {exc}") from None
    except ckpt.TrainerStateError as exc:
        raise ResumeError(damaged(checkpoint, f"trainer_state.pt: {exc}")) from None
    except Exception as exc:  # torch.load of a cut file: EOFError, RuntimeError, UnpicklingError, ...
        raise ResumeError(damaged(checkpoint, f"trainer_state.pt: unreadable, truncated or corrupt "
                                              f"({type(exc).__name__}: {exc})")) from None
    made_with = saved.get("extra", {}).get("fixed")   # (older checkpoints: recipe.yaml's word only)
    if isinstance(made_with, dict):   # the run folder itself may move: output.dir is where it is now
        changed = resume_changes({k: v for k, v in made_with.items() if k != "output.dir"}, fixed_values(recipe), log)
        if changed:
            raise ResumeError(f"cannot resume from {checkpoint}: it was made with other settings than the run's "
                              f"recipe.yaml now says: {'; '.join(changed)}. Was recipe.yaml edited? A resumed run "
                              "keeps these: put them back, or start a new run.")
    return saved


def data_change_note(saved: dict, rows: int, step: int) -> Optional[str]:
    """A warning when the training data now holds another number of usable rows than when the checkpoint was
    made (`saved`: its trainer state): the prompt order is a function of the seed, the step and that count
    (data.batch_indices), so from step `step` + 1 on the run draws other prompts than the uninterrupted run
    would have (found by a red team: a resume after the data file grew by one row reshuffled without a word)."""
    before = saved.get("extra", {}).get("train_rows")   # (older checkpoints: not recorded)
    if not isinstance(before, int) or before == rows:
        return None
    return (f"[lowmem-grpo] warning: the training data now holds {rows} usable rows, and the checkpoint was made "
            f"with {before}: from step {step + 1} on the run draws its prompts in another order than the run would "
            "have without the change (some prompts of this pass over the data come again, others not at all)")


def damaged(checkpoint: Path, problem: str) -> str:
    """The error for a checkpoint that cannot be read (written whole, so damaged since: a copy cut short, a disk)."""
    return (f"cannot resume from {checkpoint}: {problem}. Move that folder out of {checkpoint.parent} to resume from "
            "the checkpoint before it.")
