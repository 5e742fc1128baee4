"""Export a run: the LoRA adapter, and a merged standalone model in Hugging Face format.

The merge goes into the base loaded unquantized (float32 by default, or bfloat16/float16), never into
the 4-bit weights: merging into NF4 re-quantizes the sum (a 0.03 logit drift on a tiny model, measured),
and dequantizing after the LoRA wrappers are attached fails. After merging, the merged model's logits are
compared with base + adapter on a probe input; the max difference is reported and checked.

An export is written whole or not at all: into a staging folder beside --out (`.OUT.partial-PID`), starting
with a copy of the checkpoint's adapter (the merge reads that copy, so a checkpoint that a training run rotates
away meanwhile cannot break it), flushed to disk, then renamed into place. --overwrite sets the earlier export
aside (`.OUT.old-PID`) only then, and deletes it after the new one is in. What an export killed midway leaves
there is cleaned up by the next export into the same --out (clear_leftovers).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import threading
from pathlib import Path
from typing import Optional

import torch
from safetensors import SafetensorError

from . import checkpoint as ckpt
from .data import PROMPT_RECORD
from .durable import fsync_dir, fsync_tree
from .hub import folder_contents, model_path_problem, tokenizer_files_problem
from .model import DTYPES, AdapterLoadError, load_adapter, load_base_model, load_tokenizer
from .progress import library_bars, use_bar
from .recipe import load_recipe


class ExportError(Exception):
    pass


def find_adapter(run_dir: Path, step: Optional[int] = None) -> Path:
    found = ckpt.complete_checkpoints(run_dir)
    if step is not None:
        found = [p for p in found if p.name == f"{ckpt.PREFIX}{step:06d}"]
    if not found:
        raise ExportError(f"{run_dir}: no complete checkpoint{f' for step {step}' if step is not None else ''}")
    return found[-1] / "adapter"


EXPORT_ENTRIES = ("adapter", "merged")   # what an export writes into --out
STAGING, ASIDE = "partial", "old"        # .OUT.partial-PID: being written; .OUT.old-PID: the export --overwrite replaces


def side_path(out_dir: Path, kind: str, pid: Optional[int] = None) -> Path:
    """Where an export into out_dir stages (kind STAGING) or sets the earlier export aside (ASIDE): beside it, so
    that a rename moves it into place (a rename within one filesystem is atomic)."""
    return out_dir.parent / f".{out_dir.name}.{kind}-{os.getpid() if pid is None else pid}"


def _alive(pid: int) -> bool:
    if pid == os.getpid():   # this process exports one at a time: its own leftover is a cut-short earlier call's
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # another user's process
        return True
    return True


def clear_leftovers(out_dir: Path, log=print) -> None:
    """What an export killed midway left beside out_dir: its staging folder (removed), or, killed between
    --overwrite's renames, the earlier export set aside (put back where out_dir is missing, else removed: the new
    one is in). Those of an export still running (its pid is alive) are left alone."""
    pattern = re.compile(re.escape(f".{out_dir.name}.") + f"({STAGING}|{ASIDE})-([0-9]+)")
    try:
        found = sorted(p for p in out_dir.parent.iterdir() if pattern.fullmatch(p.name))
    except OSError:   # no parent yet, or it cannot be listed (the export's own write says so)
        return
    for path in found:
        kind, pid = pattern.fullmatch(path.name).groups()
        if _alive(int(pid)):
            log(f"[lowmem-grpo] {path}: left alone, an export that is still running (pid {pid}) writes it")
        elif kind == ASIDE and not os.path.lexists(out_dir):
            os.replace(path, out_dir)
            log(f"[lowmem-grpo] {out_dir}: put the earlier export back (an --overwrite cut short had set it aside "
                f"as {path.name})")
        else:
            shutil.rmtree(path, ignore_errors=True)
            what = "the unfinished files of an export" if kind == STAGING else "the earlier export replaced by an --overwrite"
            log(f"[lowmem-grpo] removed {path}: {what} that was cut short (pid {pid})")


def prepare_out(out_dir: Path, overwrite: bool) -> bool:
    """Whether out_dir holds an earlier export that the new one replaces (only with `overwrite`; it is replaced only
    once the new one is complete). Refuses an --out that holds anything else: exporting into it would leave the
    earlier files beside the new ones (an adapter of one step next to a merged model of another), silently; other
    files are not an export's, and are never removed. Removes nothing."""
    if not os.path.lexists(out_dir):
        return False
    if not out_dir.is_dir():
        raise ExportError(f"--out {out_dir}: exists and is not a folder; choose a new or empty folder")
    try:
        cwd = Path.cwd()
    except OSError:   # (a working folder that was deleted)
        cwd = None
    if os.path.ismount(out_dir) or (cwd is not None and out_dir.resolve() in (cwd, *cwd.parents)):
        # the export is renamed into place: a mount point cannot be, and a working folder would be left deleted
        raise ExportError(f"--out {out_dir}: is a mount point or the current folder, which the finished export "
                          f"cannot be renamed onto; choose a folder inside it (e.g. {out_dir / 'export'})")
    try:
        held = list(out_dir.iterdir())
    except OSError as exc:
        raise ExportError(f"--out {out_dir}: cannot list the folder ({exc.strerror or exc})") from None
    if not held:
        return False
    if any(p.name not in EXPORT_ENTRIES for p in held):
        raise ExportError(f"--out {out_dir}: the folder is not empty, and not an earlier export "
                          f"({folder_contents(out_dir)}); choose another --out (a new or empty folder)")
    if not overwrite:
        raise ExportError(f"--out {out_dir}: the folder already holds an export ({folder_contents(out_dir)}); choose "
                          "another --out, or pass --overwrite to replace it")
    return True


def _base_problem(model_cfg) -> Optional[str]:
    """Why the merge could not load the run's base model (checked before anything is written), or None."""
    if problem := model_path_problem(model_cfg.name_or_path):
        return problem
    folder = Path(model_cfg.name_or_path).expanduser()
    if folder.is_dir() and (problem := tokenizer_files_problem(folder)):
        return f"model.name_or_path={model_cfg.name_or_path!r}: {problem}"
    return None


def _removed_message(adapter: Path, keep_last: int) -> str:
    return (f"checkpoint {adapter.parent.name} was removed while exporting (is the run still training? it keeps the "
            f"last {keep_last} checkpoints, output.keep_last); export again, or --step an existing one")


def _write_error(out_dir: Path, what: str, exc: Exception, where: Optional[Path] = None) -> ExportError:
    """One line for an OSError (or safetensors' own error for one) while writing: what, the errno text, the path."""
    if isinstance(exc, shutil.Error) and exc.args and isinstance(exc.args[0], list) and exc.args[0]:
        src, dst, why = exc.args[0][0]   # copytree: (src, dst, reason) per file that failed
        reason, where = str(why), dst
    elif isinstance(exc, OSError):
        reason = exc.strerror or str(exc)
        where = exc.filename or where
    else:   # SafetensorError: "Error while serializing: I/O error: No space left on device (os error 28)"
        found = re.search(r"I/O error: (.*?)(?: \(os error \d+\))?$", str(exc))
        reason = found.group(1) if found else str(exc)
    return ExportError(f"--out {out_dir}: cannot {what} ({reason}{f': {where}' if where else ''}); the export was "
                       "not made, --out is left as it was")


def _commit(staging: Path, out_dir: Path, replace: bool) -> None:
    """The complete export in staging, flushed, renamed to out_dir; with `replace`, the earlier export there is
    set aside first, and deleted only once the new one is in."""
    fsync_tree(staging)
    if not replace:
        os.replace(staging, out_dir)   # (onto an empty folder too; onto one that is no longer empty, it fails)
        fsync_dir(out_dir.parent)
        return
    aside = side_path(out_dir, ASIDE)
    with _signals_held():   # a Ctrl-C between the two renames left no export at --out, and the new one deleted
        os.replace(out_dir, aside)
        try:
            os.replace(staging, out_dir)
        except BaseException:
            os.replace(aside, out_dir)
            raise
    fsync_dir(out_dir.parent)
    shutil.rmtree(aside, ignore_errors=True)   # (a crash here leaves it: clear_leftovers removes it)


@contextlib.contextmanager
def _signals_held():
    """Ctrl-C and SIGTERM held back until the block is done, then handled as they would have been (found by a red
    team: a Ctrl-C between --overwrite's two renames left --out missing, the earlier export set aside, and the
    finished new one was removed). Python handlers, not a signal mask: the kernel hands a process's signal to any
    thread that does not block it (torch's, tqdm's), and Python runs its handler in the main thread all the same."""
    if threading.current_thread() is not threading.main_thread():   # (only there can handlers be set; nor does a
        yield                                                       # signal interrupt another thread's code)
        return
    caught: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: caught.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)   # (None: not set from Python)
        for sig in dict.fromkeys(caught):
            if callable(previous[sig]):
                previous[sig](sig, None)   # (Python's own for SIGINT: KeyboardInterrupt)
            elif previous[sig] == signal.SIG_DFL:
                os.kill(os.getpid(), sig)   # (SIGTERM's default: the process ends, as it would have)


def export_run(run_dir, out_dir, dtype: str = "float32", merged: bool = True, step: Optional[int] = None,
               tolerance: float = 1e-5, log=print, overwrite: bool = False) -> dict:
    """RUN's checkpoint (the latest complete one, or `step`) into OUT/adapter and, with `merged`, OUT/merged.
    OUT must be new or empty; `overwrite` replaces an earlier export there (prepare_out). All of it is written
    into a staging folder first and renamed into place when complete: a failure leaves OUT as it was."""
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    if out_dir.is_symlink() or out_dir.name in ("", ".", ".."):   # a link: the export goes where it points; "..": a name
        out_dir = out_dir.resolve()
    recipe_path = run_dir / "recipe.yaml"
    if not recipe_path.is_file():
        raise ExportError(f"{run_dir}: not a run directory (no recipe.yaml)")
    recipe = load_recipe(recipe_path)
    keep_last = recipe.output.keep_last
    adapter = find_adapter(run_dir, step)
    problem = ckpt.adapter_problem(adapter)
    if problem:
        if not adapter.parent.is_dir():
            raise ExportError(_removed_message(adapter, keep_last))
        raise ExportError(f"checkpoint {adapter.parent.name} cannot be exported: {problem}")
    src = adapter.resolve()
    for entry in EXPORT_ENTRIES:   # what an --overwrite removes must not hold the checkpoint, nor lie inside it
        dst = (out_dir / entry).resolve()
        if src == dst or dst in src.parents or src in dst.parents:
            raise ExportError(f"--out {out_dir}: its {entry}/ would overwrite the checkpoint being exported ({adapter}); "
                              "choose a folder outside it")
    if merged and (problem := _base_problem(recipe.model)):
        raise ExportError(f"{problem} (the merge loads the base model the run was trained on; --adapter-only exports "
                          "the adapter alone)")
    clear_leftovers(out_dir, log)
    replace = prepare_out(out_dir, overwrite)
    # the folders above --out that this export creates: removed again when it fails
    created = [p for p in (out_dir.parent, *out_dir.parent.parents) if not os.path.lexists(p)]
    staging = side_path(out_dir, STAGING)
    log(f"[lowmem-grpo] exporting {adapter.parent.name}: written into {staging}, renamed to {out_dir} when complete")
    what, where, done = "write the adapter there", staging / "adapter", False
    try:
        try:
            out_dir.parent.mkdir(parents=True, exist_ok=True)
            staging.mkdir()
            shutil.copytree(adapter, staging / "adapter")
        except OSError:
            if not adapter.parent.is_dir():   # rotated away by a run that trains (checkpoint._remove)
                raise ExportError(_removed_message(adapter, keep_last)) from None
            raise
        if problem := ckpt.adapter_problem(staging / "adapter"):   # (a copy of files that were being deleted)
            raise ExportError(_removed_message(adapter, keep_last) if not adapter.parent.is_dir() else
                              f"checkpoint {adapter.parent.name}: its copy is incomplete: {problem}")
        report = {"adapter": str(out_dir / "adapter"), "checkpoint": adapter.parent.name}
        if merged:
            what, where = "write the merged model there", staging / "merged"
            try:
                report.update(merge_adapter(recipe.model, staging / "adapter", staging / "merged", dtype, tolerance,
                                            probe_data=recipe.data))
            except AdapterLoadError as exc:   # it names the staged copy, which is about to go: name the checkpoint
                raise AdapterLoadError(str(exc).replace(str(staging / "adapter"), str(adapter))) from None
            report["merged"] = str(out_dir / "merged")
            record = staging / "adapter" / PROMPT_RECORD   # the merged model is the adapter's: eval checks it too
            if record.is_file():
                shutil.copyfile(record, staging / "merged" / PROMPT_RECORD)
        what, where = "move the finished export into place", out_dir
        _commit(staging, out_dir, replace)
        done = True
    except (OSError, SafetensorError) as exc:   # (safetensors raises its own error for a failed write: a full disk)
        raise _write_error(out_dir, what, exc, where) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if not done:
            for p in created:   # (deepest first; one that is not empty stays, and so do those above it)
                try:
                    p.rmdir()
                except OSError:
                    break
    log(f"[lowmem-grpo] adapter ({adapter.parent.name}) -> {report['adapter']}")
    if merged:
        log(f"[lowmem-grpo] merged model -> {report['merged']} (max |logit diff| vs base + adapter: {report['max_logit_diff']:.2e})")
        if recipe.model.load_in_4bit:   # (a red team: the quickstart's merged model scored 18.0% where the run had 19.0%)
            log("[lowmem-grpo] note: the merged model is the adapter on the full-precision base; the run trained and "
                "evaluated it on the 4-bit base, so its answers can differ a little from the run's (`lowmem-grpo eval "
                "--adapter` scores what the run trained)")
    return report


def merge_adapter(model_cfg, adapter: Path, out: Path, dtype: str = "float32", tolerance: float = 1e-5,
                  probe_data=None) -> dict:
    if out.exists() and not out.is_dir():  # transformers' save_pretrained only logs this, and writes nothing
        raise ExportError(f"{out}: exists and is not a folder; the merged model is written there as a folder "
                          "(remove it, or choose another --out)")
    cfg = model_cfg.model_copy(update={"compute_dtype": dtype})
    tokenizer = load_tokenizer(cfg)
    with library_bars(use_bar("auto")):   # transformers' loading bars: on a terminal only, not in a log
        base = load_base_model(cfg, quantized=False)
    model = load_adapter(base, str(adapter), model_cfg.name_or_path, is_trainable=False).eval()
    probes = _probe_ids(tokenizer, model.config.vocab_size, probe_data)
    with torch.no_grad():
        before = torch.cat([model(input_ids=p).logits.float().flatten() for p in probes])
        merged = model.merge_and_unload()
        after = torch.cat([merged(input_ids=p).logits.float().flatten() for p in probes])
    diff = (before - after).abs().max().item()
    # Relative to the logit scale: an fp32 forward of base + adapter is itself only that exact (measured on
    # the quickstart model, |logit| up to 18: 2.1e-5 from a float64 evaluation; the merged model 1.5e-5).
    scale = max(1.0, before.abs().max().item())
    if dtype == "float32" and diff > tolerance * scale:
        raise ExportError(f"merged logits drift {diff:.2e} from base + adapter (allowed {tolerance:.0e} x max|logit| {scale:.1f})")
    with library_bars(use_bar("auto")):
        merged.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {"merged": str(out), "max_logit_diff": diff, "max_abs_logit": scale, "dtype": dtype}


def _probe_ids(tokenizer, vocab_size: int, data_cfg=None) -> list[torch.Tensor]:
    """Inputs for the drift check: the run's own first prompts when its data is still there (random token
    strings are ill-conditioned: an fp32 forward of them is ~1e-4 off float64 even without any merge),
    else random tokens."""
    from .data import DataError, PromptSet

    for path in (getattr(data_cfg, "eval_path", ""), getattr(data_cfg, "train_path", "")):
        if path and Path(path).is_file():
            try:
                return [torch.tensor([e.prompt_ids]) for e in PromptSet(path, data_cfg, tokenizer, limit=4,
                                                                                 reset_fills=True).examples]
            except DataError:
                pass
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, min(vocab_size, len(tokenizer)), (2, 16), generator=g)]


__all__ = ["export_run", "merge_adapter", "prepare_out", "ExportError", "DTYPES"]
