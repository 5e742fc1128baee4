"""Run the quickstart task once per GRPO variant and tabulate what each update did.

    python scripts/run_variants.py [--steps 150] [--out runs/variants] [--only mean rloo ...]

Variants (recipes/quickstart.yaml otherwise, on one warm-started base built as scripts/quickstart.py does):
the four advantage modes with the quickstart's kl_target none (so "mean_std" is also the "kl none" run),
then kl_target ref (beta 0.04), mirror (mu 2) and both (mu 2), all with mean_std and k3, and both (mu 2)
with the k2 estimator; then one run per option of docs/algorithm.md §13-§18 and per shaping reward. Runs are
sequential.
For each: held-out accuracy before/after (greedy, 200 problems), the mean over the run's steps of
update/frac_pos_up and update/frac_neg_down (docs/algorithm.md §8: did preferred completions become more likely and
dispreferred ones less?), and whether every diagnostic key is in every step row of metrics.jsonl.
Results accumulate in OUT/summary.json, so a run cut short keeps the variants that finished.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import statistics
import time
from pathlib import Path

import torch

from lowmem_grpo.diagnostics import STEP_KEYS
from lowmem_grpo.metrics import read_metrics
from lowmem_grpo.recipe import load_recipe
from lowmem_grpo.train import Trainer

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "quickstart.yaml"

VARIANTS = {
    "mean_std": ["algorithm.advantage=mean_std"],  # = kl_target none
    "mean": ["algorithm.advantage=mean"],
    "sign": ["algorithm.advantage=sign"],
    "rloo": ["algorithm.advantage=rloo"],
    "kl_ref": ["algorithm.kl_target=ref"],
    "kl_mirror_mu2": ["algorithm.kl_target=mirror", "algorithm.mu=2"],
    "kl_both_mu2": ["algorithm.kl_target=both", "algorithm.mu=2"],
    # k3's exp(lp_other - lp) explodes on tokens pushed far below the other policy; k2's gradient is linear
    "kl_both_mu2_k2": ["algorithm.kl_target=both", "algorithm.mu=2", "algorithm.kl_estimator=k2"],
    # docs/algorithm.md §13-§18 (issue 16). A ratio differs from 1 only on a batch's second update, so the
    # ratio variants run at mu 2 beside a plain mu 2 baseline.
    "mu2": ["algorithm.mu=2"],
    "gspo_mu2": ["algorithm.importance_sampling_level=sequence", "algorithm.mu=2"],
    "cispo_mu2": ["algorithm.clip=cispo", "algorithm.mu=2"],
    "delta_mu2": ["algorithm.delta=1.5", "algorithm.mu=2"],
    # TRL 1.16's newest losses (docs/algorithm.md §5 LUSPO, §14.2 VESPO), and several updates per generation (§7)
    "luspo_mu2": ["algorithm.aggregation=sequence_sum", "algorithm.importance_sampling_level=sequence",
                  "algorithm.mu=2"],
    "vespo_mu2": ["algorithm.clip=vespo", "algorithm.aggregation=token_mean", "algorithm.mu=2"],
    "minibatches2": ["algorithm.minibatches=2"],
    "sampler_token_truncate": ["algorithm.sampler_correction=token_truncate"],
    "sampler_token_mask": ["algorithm.sampler_correction=token_mask", "algorithm.sampler_correction_min=0.5"],
    "sampler_sequence_truncate": ["algorithm.sampler_correction=sequence_truncate"],
    "sampler_sequence_mask": ["algorithm.sampler_correction=sequence_mask", "algorithm.sampler_correction_min=0.5"],
    "mask_truncated": ["algorithm.mask_truncated_completions=true"],
    "top_entropy_0.2": ["algorithm.top_entropy_quantile=0.2"],
    "entropy_coef_0.01": ["algorithm.entropy_coef=0.01"],
    "entropy_target_0.3": ["algorithm.entropy_coef=0.01", "algorithm.entropy_target=0.3"],
    "scale_batch": ["algorithm.scale_rewards=batch"],
    "scale_none": ["algorithm.scale_rewards=none"],   # the same advantages as "mean"
    "math_format_sum": ["rewards.functions=[{function: math}, {function: format, weight: 0.5}]"],
    "math_format_normalize_then_sum": ["rewards.functions=[{function: math}, {function: format, weight: 0.5}]",
                                       "algorithm.reward_aggregation=normalize_then_sum"],
    "dynamic_sampling": ["algorithm.dynamic_sampling=true"],
    "math_overlong": ["rewards.functions=[{function: math}, {function: overlong, kwargs: {buffer: 2}}]"],
    "math_repetition": ["rewards.functions=[{function: math}, {function: repetition, kwargs: {ngram: 1}}]"],
    # docs/algorithm.md §24: bf16 compute with the decoder's training passes under autocast, and without it
    "bf16_autocast": ["model.compute_dtype=bfloat16", "model.autocast=true"],
    "bf16_plain": ["model.compute_dtype=bfloat16", "model.autocast=false"],
}


def _quickstart():
    spec = importlib.util.spec_from_file_location("quickstart", ROOT / "scripts" / "quickstart.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _mean(values):
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def summarise(run_dir: Path, result: dict, seconds: float) -> dict:
    rows = read_metrics(run_dir)
    steps = [r for r in rows if "loss" in r]
    reward_keys = {k for r in steps for k in r if k.startswith("reward/") and k.count("/") == 1} - {
        "reward/mean", "reward/std", "reward/skipped"}
    wanted = set(STEP_KEYS) | reward_keys | {f"{k}/std" for k in reward_keys}
    missing = sorted({k for r in steps for k in wanted if k not in r})
    last = steps[-1] if steps else {}
    return {
        "steps": len(steps),
        "acc_before": result["first_eval"]["accuracy"] if result["first_eval"] else None,
        "acc_after": result["final_eval"]["accuracy"] if result["final_eval"] else None,
        "frac_pos_up": _mean(r["update/frac_pos_up"] for r in steps),
        "frac_neg_down": _mean(r["update/frac_neg_down"] for r in steps),
        "logp_change_pos": _mean(r["update/logp_change_pos"] for r in steps),
        "logp_change_neg": _mean(r["update/logp_change_neg"] for r in steps),
        "mu_ran": _mean(r["update/mu_ran"] for r in steps),
        "success_rate_last20": _mean(r["success_rate"] for r in steps[-20:]),
        "kl_ref_last": last.get("kl/ref"), "kl_mirror_last": last.get("kl/mirror"),
        "p_ref": last.get("kl/p_ref"), "p_star": last.get("kl/p_star"),
        "missing_keys": missing, "seconds": round(seconds, 1),
        "notes": notes(steps),
    }


def notes(steps: list[dict]) -> str:
    """The option's own figures over the run (docs/algorithm.md §15-§18), where it logs any."""
    out = []
    for key, label in (("sampler/weight_mean", "IS weight"), ("sampler/masked_fraction", "masked"),
                       ("entropy/kept_fraction", "kept"), ("vespo/weight_mean", "VESPO weight")):
        m = _mean(r.get(key) for r in steps)
        if m is not None:
            out.append(f"{label} {m:.3f}")
    coefs = [r["entropy/coef"] for r in steps if r.get("entropy/coef") is not None]
    if coefs and coefs[-1]:
        out.append(f"entropy coef {coefs[0]:.3g} -> {coefs[-1]:.3g}")
    if any(r.get("dynamic/draws") is not None for r in steps):
        extra = sum(r["dynamic/extra_rollouts"] for r in steps)
        out.append(f"{extra} extra rollouts, {sum(r['dynamic/groups_discarded'] for r in steps)} groups discarded, "
                   f"{sum(r['dynamic/groups_short'] for r in steps)} short")
    return "; ".join(out)


def fmt(v, spec=".3f"):
    return "-" if v is None else format(v, spec)


def table(summary: dict) -> str:
    lines = ["| variant | steps | held-out before | held-out after | frac_pos_up | frac_neg_down | "
             "dlogp A>0 | dlogp A<0 | mu ran | success (last 20) | p_ref / p* | keys | time |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in summary.items():
        pstar = f"{fmt(s['p_ref'])} / {fmt(s['p_star'])}" if s["p_star"] is not None else "-"
        keys = "all present" if not s["missing_keys"] else "MISSING " + ", ".join(s["missing_keys"])
        lines.append(f"| {name} | {s['steps']} | {fmt(s['acc_before'], '.1%')} | {fmt(s['acc_after'], '.1%')} | "
                     f"{fmt(s['frac_pos_up'])} | {fmt(s['frac_neg_down'])} | {fmt(s['logp_change_pos'], '+.4f')} | "
                     f"{fmt(s['logp_change_neg'], '+.4f')} | {fmt(s['mu_ran'], '.2f')} | "
                     f"{fmt(s['success_rate_last20'])} | {pstar} | {keys} | {s['seconds']:.0f}s | {s.get('notes', '')} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=150, help="GRPO steps per variant (the quickstart runs 400)")
    ap.add_argument("--out", default="runs/variants", help="base model, data, one run per variant, summary.json")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", nargs="*", choices=sorted(VARIANTS), help="run only these variants")
    args = ap.parse_args()
    out = Path(args.out)
    base_dir, data_dir = out / "base", out / "data"
    if not (base_dir / "config.json").is_file():
        _quickstart().build_base(base_dir, data_dir, print)
    summary_path = out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    for name in args.only or list(VARIANTS):
        run_dir = out / name
        shutil.rmtree(run_dir, ignore_errors=True)
        recipe = load_recipe(RECIPE, [
            f"model.name_or_path={base_dir}", f"data.train_path={data_dir / 'train.jsonl'}",
            f"data.eval_path={data_dir / 'test.jsonl'}", f"output.dir={run_dir}", f"seed={args.seed}",
            f"train.steps={args.steps}", "train.eval_every=0", f"output.save_every={args.steps}", "output.log_every=25",
            *VARIANTS[name]])
        print(f"[variants] {name}: {' '.join(VARIANTS[name])}, {args.steps} steps", flush=True)
        t0 = time.time()
        result = Trainer(recipe, log=lambda *a: print(*a, flush=True)).fit()
        summary[name] = summarise(run_dir, result, time.time() - t0)
        summary_path.write_text(json.dumps(summary, indent=1))
        print(json.dumps({name: summary[name]}), flush=True)
    print(table(summary))


if __name__ == "__main__":
    torch.set_num_threads(max(1, torch.get_num_threads()))
    main()
