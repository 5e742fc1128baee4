"""The tool-use demo: a tiny model learns, with GRPO, to hand 3-digit products to the Python tool.

    python scripts/tool_demo.py [--seed N] [--rebuild] [--steps N]

1. Builds a small Llama-architecture model (tiny.build_tool_model) and a character tokenizer that covers the tool syntax, and warm-starts
   it on 3-digit products (123*456=): about a third of its supervised examples call the tool,
   <python>print(123*456)</python>, see its output (environment text: context, never trained) and copy the
   number; the rest guess the product directly, which a 2-layer model cannot do. It stops once the greedy
   tool-call rate on training problems is 20-45% and those calls end in the right number. Saved to
   runs/tool_demo/base and reused (--rebuild to redo it).
2. Trains it with GRPO (recipes/tool_demo.yaml: 4-bit base + LoRA) with environment.name: python, the reward
   being the exact product after the tool's output (lowmem_grpo.tiny:tool_answer_reward).
3. Trains the same base the same way without the tool (no environment: a <python> call runs nothing).
4. Prints greedy held-out accuracy and tool-call rate before and after, for both runs.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import torch

from lowmem_grpo import tiny
from lowmem_grpo.evaluate import greedy as greedy_eval
from lowmem_grpo.recipe import load_recipe
from lowmem_grpo.train import Trainer

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "tool_demo.yaml"


class ToolDemoTrainer(Trainer):
    """The trainer, whose held-out eval also reports the greedy tool-call rate (completions holding a complete
    <python>...</python> call, run or not)."""

    def evaluate(self):
        if self.eval_set is None:
            return None
        records: list = []
        out = greedy_eval(self.engine, self.tokenizer, self.rewards, self.eval_set.examples[: self.recipe.train.eval_max_prompts],
                          self.recipe.generation.max_new_tokens, records=records, rollout=self.generator(self.eval_set))
        out["tool_call_rate"] = sum(tiny.is_tool_call(r["completion"]) for r in records) / max(1, len(records))
        return out


def build_base(base_dir: Path, data_dir: Path, log) -> None:
    train_rows, test_rows = tiny.split_product_data(n_train=4000, n_test=200, seed=4321)
    tiny.write_jsonl(train_rows, data_dir / "train.jsonl")
    tiny.write_jsonl(test_rows, data_dir / "test.jsonl")
    tok = tiny.build_tool_tokenizer()
    model = tiny.build_tool_model(tok, tiny.TinyModelSpec(max_position_embeddings=128), seed=0)
    log(f"[tool demo] warm-starting a {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M-parameter model on "
        "3-digit products (a third of the examples use the tool) ...")
    t0 = time.time()
    probe, steps = tiny.warm_start_tool(model, tok, train_rows, train_rows[:100], log=lambda *a: None)
    held = tiny.greedy_tool_eval(model, tok, test_rows)
    log(f"[tool demo] warm start: {steps} steps in {time.time() - t0:.0f}s; held-out (simulated tool): accuracy "
        f"{100 * held['accuracy']:.1f}%, tool calls {100 * held['tool_call_rate']:.1f}% "
        f"({100 * held['tool_accuracy']:.1f}% of them right)")
    if not 0.1 <= held["tool_call_rate"] <= 0.6:
        sys.exit(f"[tool demo] warm start left the tool-call rate at {100 * held['tool_call_rate']:.1f}%, outside 10-60%; "
                 "rerun with --rebuild")
    model.save_pretrained(base_dir)
    tok.save_pretrained(base_dir)


def run(name: str, overrides: list, run_dir: Path) -> tuple[dict, float]:
    recipe = load_recipe(RECIPE, overrides + [f"output.dir={run_dir}"])
    if run_dir.exists():
        shutil.rmtree(run_dir)
    print(f"[tool demo] GRPO {name}: {recipe.train.steps} steps x {recipe.train.prompts_per_step} prompts x "
          f"G={recipe.generation.num_generations}, 4-bit base + LoRA r={recipe.lora.r}")
    t0 = time.time()
    result = ToolDemoTrainer(recipe).fit()
    return result, time.time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0, help="seed of the GRPO runs")
    ap.add_argument("--rebuild", action="store_true", help="rebuild the warm-started base model")
    ap.add_argument("--steps", type=int, default=None, help="GRPO steps (default: the recipe's)")
    ap.add_argument("--out", default="runs/tool_demo", help="where the base, data and runs go")
    ap.add_argument("--skip-baseline", action="store_true", help="train only with the tool")
    args = ap.parse_args()
    t_all = time.time()
    out = Path(args.out)
    base_dir, data_dir = out / "base", out / "data"
    if args.rebuild or not (base_dir / "config.json").is_file():
        build_base(base_dir, data_dir, print)
    common = [f"model.name_or_path={base_dir}", f"data.train_path={data_dir / 'train.jsonl'}",
              f"data.eval_path={data_dir / 'test.jsonl'}", f"seed={args.seed}"]
    if args.steps is not None:
        common.append(f"train.steps={args.steps}")
    runs = [("with the tool", common, out / f"run-tool-seed{args.seed}")]
    if not args.skip_baseline:   # no environment: a completion is one turn of up to max_total_tokens tokens
        runs.append(("without the tool", common + ['environment.name=""', "generation.max_new_tokens=48"],
                     out / f"run-notool-seed{args.seed}"))
    figures = []
    for name, overrides, run_dir in runs:
        result, wall = run(name, overrides, run_dir)
        before, after = result["first_eval"], result["final_eval"]
        figures.append((name, before, after, wall))
        print(f"[tool demo] {name}: trained in {wall:.0f}s")
    print("\nheld-out (greedy, real sandbox)      accuracy before -> after   tool-call rate before -> after")
    for name, before, after, wall in figures:
        print(f"  GRPO {name:<17}              {100 * before['accuracy']:5.1f}% -> {100 * after['accuracy']:5.1f}%"
              f"        {100 * before['tool_call_rate']:5.1f}% -> {100 * after['tool_call_rate']:5.1f}%")
    print(f"[tool demo] total wall time {time.time() - t_all:.0f}s")


if __name__ == "__main__":
    main()
