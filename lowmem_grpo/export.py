"""Export a run: the LoRA adapter, and a merged standalone model in Hugging Face format.

The merge goes into the base loaded unquantized (float32 by default, or bfloat16/float16), never into
the 4-bit weights: merging into NF4 re-quantizes the sum (a 0.03 logit drift on a tiny model, measured),
and dequantizing after the LoRA wrappers are attached fails. After merging, the merged model's logits are
compared with base + adapter on a probe input; the max difference is reported and checked.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Optional

import torch

from . import checkpoint as ckpt
from .hub import folder_contents
from .model import DTYPES, load_adapter, load_base_model, load_tokenizer
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


def prepare_out(out_dir: Path, overwrite: bool) -> None:
    """Refuse an --out that holds anything: exporting into it would leave the earlier files beside the new ones
    (an adapter of one step next to a merged model of another), silently. With `overwrite`, an earlier export's
    adapter/ and merged/ are removed first; other files are not an export's, and are never removed."""
    if not out_dir.is_dir():
        return   # new (created below), or not a folder (mkdir says so)
    try:
        held = list(out_dir.iterdir())
    except OSError as exc:
        raise ExportError(f"--out {out_dir}: cannot list the folder ({exc.strerror or exc})") from None
    if not held:
        return
    if any(p.name not in EXPORT_ENTRIES for p in held):
        raise ExportError(f"--out {out_dir}: the folder is not empty, and not an earlier export "
                          f"({folder_contents(out_dir)}); choose another --out (a new or empty folder)")
    if not overwrite:
        raise ExportError(f"--out {out_dir}: the folder already holds an export ({folder_contents(out_dir)}); choose "
                          "another --out, or pass --overwrite to replace it")
    try:
        for path in held:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
    except OSError as exc:
        raise ExportError(f"--out {out_dir}: cannot remove the earlier export ({exc})") from None


def export_run(run_dir, out_dir, dtype: str = "float32", merged: bool = True, step: Optional[int] = None,
               tolerance: float = 1e-5, log=print, overwrite: bool = False) -> dict:
    """RUN's checkpoint (the latest complete one, or `step`) into OUT/adapter and, with `merged`, OUT/merged.
    OUT must be new or empty; `overwrite` replaces an earlier export there (prepare_out)."""
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    recipe_path = run_dir / "recipe.yaml"
    if not recipe_path.is_file():
        raise ExportError(f"{run_dir}: not a run directory (no recipe.yaml)")
    recipe = load_recipe(recipe_path)
    adapter = find_adapter(run_dir, step)
    problem = ckpt.adapter_problem(adapter)
    if problem:
        raise ExportError(f"checkpoint {adapter.parent.name} cannot be exported: {problem}")
    src = adapter.resolve()
    for entry in EXPORT_ENTRIES:   # what an --overwrite removes must not hold the checkpoint, nor lie inside it
        dst = (out_dir / entry).resolve()
        if src == dst or dst in src.parents or src in dst.parents:
            raise ExportError(f"--out {out_dir}: its {entry}/ would overwrite the checkpoint being exported ({adapter}); "
                              "choose a folder outside it")
    prepare_out(out_dir, overwrite)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        shutil.copytree(adapter, out_dir / "adapter")
    except OSError as exc:
        raise ExportError(f"--out {out_dir}: cannot write the adapter there ({exc})") from None
    log(f"[lowmem-grpo] adapter ({adapter.parent.name}) -> {out_dir / 'adapter'}")
    report = {"adapter": str(out_dir / "adapter"), "checkpoint": adapter.parent.name}
    if merged:
        report.update(merge_adapter(recipe.model, adapter, out_dir / "merged", dtype, tolerance, probe_data=recipe.data))
        log(f"[lowmem-grpo] merged model -> {report['merged']} (max |logit diff| vs base + adapter: {report['max_logit_diff']:.2e})")
    return report


def merge_adapter(model_cfg, adapter: Path, out: Path, dtype: str = "float32", tolerance: float = 1e-5,
                  probe_data=None) -> dict:
    if out.exists() and not out.is_dir():  # transformers' save_pretrained only logs this, and writes nothing
        raise ExportError(f"{out}: exists and is not a folder; the merged model is written there as a folder "
                          "(remove it, or choose another --out)")
    cfg = model_cfg.model_copy(update={"compute_dtype": dtype})
    tokenizer = load_tokenizer(cfg)
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
                return [torch.tensor([e.prompt_ids]) for e in PromptSet(path, data_cfg, tokenizer, limit=4).examples]
            except DataError:
                pass
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, min(vocab_size, len(tokenizer)), (2, 16), generator=g)]


__all__ = ["export_run", "merge_adapter", "prepare_out", "ExportError", "DTYPES"]
