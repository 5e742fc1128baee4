"""`lowmem-grpo`: thin click commands over the library. Errors a user can fix are printed as one clear
message and exit 2; they never reach the user as a traceback."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from .recipe import RecipeError, load_recipe

def _user_errors() -> tuple:
    from .data import DataError
    from .export import ExportError
    from .model import ModelLoadError
    from .rewards import RewardError
    from .rollout.base import EngineError
    from .memory import MemoryModelError
    from .train import TrainingError

    return (RecipeError, DataError, EngineError, ExportError, ModelLoadError, RewardError, TrainingError, MemoryModelError)


def _run(fn):
    try:
        return fn()
    except _user_errors() as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="lowmem-grpo")
def main():
    """GRPO on one GPU: a 4-bit base + LoRA, verifiable rewards."""


@main.command()
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a recipe field, e.g. --set train.steps=10.")
def validate(recipe, overrides):
    """Check a recipe: report every problem at once, with its key path."""
    r = _run(lambda: load_recipe(recipe, list(overrides)))
    click.echo(f"{recipe}: ok ({r.train.steps} steps, G={r.generation.num_generations}, model {r.model.name_or_path})")


@main.command()
@click.argument("recipe", type=click.Path(dir_okay=False), required=False)
@click.option("--resume", "resume_dir", type=click.Path(file_okay=False), help="Continue the run in this directory from its latest checkpoint.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a recipe field, e.g. --set train.steps=10.")
def train(recipe, resume_dir, overrides):
    """Train with RECIPE, or continue a run with --resume RUN_DIR."""
    from .train import Trainer

    if not recipe and not resume_dir:
        raise click.UsageError("give a RECIPE, or --resume RUN_DIR")

    def go():
        if resume_dir:
            r = load_recipe(Path(resume_dir) / "recipe.yaml", list(overrides))
            trainer = Trainer(r, run_dir=Path(resume_dir), resume=True)
        else:
            r = load_recipe(recipe, list(overrides))
            trainer = Trainer(r)
        out = trainer.fit()
        for key, label in (("first_eval", "before"), ("final_eval", "after")):
            if out[key]:
                click.echo(f"held-out accuracy {label}: {100 * out[key]['accuracy']:.1f}%")
        click.echo(f"run directory: {trainer.run_dir}  (export with: lowmem-grpo export {trainer.run_dir} --out DIR)")
        return out

    _run(go)


@main.command()
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Folder to write adapter/ and merged/ into.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True,
              help="dtype of the merged model (the base is loaded unquantized in it).")
@click.option("--adapter-only", is_flag=True, help="Write only the adapter, no merged model.")
@click.option("--step", type=int, default=None, help="Export this checkpoint step instead of the latest.")
def export(run_dir, out_dir, dtype, adapter_only, step):
    """Write the LoRA adapter and a merged standalone Hugging Face model."""
    from .export import export_run

    _run(lambda: export_run(run_dir, out_dir, dtype=dtype, merged=not adapter_only, step=step))


@main.command()
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.option("--memory", "memory", default=None, metavar="SIZE",
              help="Memory to fit in, e.g. 8GiB or 12GB (default: this machine's GPU, or its RAM with --device cpu).")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default="cuda", show_default=True,
              help="Where the run will train: cuda predicts torch's allocated peak, cpu the process RSS.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE")
def estimate(recipe, memory, device, overrides):
    """Predict a run's peak memory (a breakdown), and the largest micro-batch that fits, without loading weights."""
    from . import memory as mm

    def go():
        r = load_recipe(recipe, list(overrides))
        budget = mm.parse_size(memory) if memory else mm.device_budget(device)
        est, shape, workload = mm.estimate_recipe(r, device)
        click.echo(f"{recipe}: {r.model.name_or_path} (vocab {shape.vocab_size:,}, hidden {shape.hidden_size}, "
                   f"{shape.num_layers} layers), {device}")
        click.echo("\n".join(est.lines()))
        if budget is None:
            click.echo("no budget: pass --memory SIZE (no GPU on this machine)")
            return
        advice = mm.advise(shape, workload, budget)
        click.echo("\n".join(advice.lines))
        if not advice.fits:
            sys.exit(1)

    _run(go)


@main.command(name="eval")
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.option("--adapter", type=click.Path(file_okay=False), default=None, help="A LoRA adapter folder (e.g. RUN/checkpoints/step-N/adapter or EXPORT/adapter).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE")
def eval_cmd(recipe, adapter, overrides):
    """Greedy accuracy of the recipe's model (plus an adapter) on data.eval_path."""
    from .data import PromptSet
    from .model import load_policy
    from .rewards import Rewards
    from .rollout.base import make_engine
    from .train import evaluate

    def go():
        r = load_recipe(recipe, list(overrides))
        if not r.data.eval_path:
            raise RecipeError(recipe, [("data.eval_path", "is required for eval")])
        model, tok = load_policy(r.model, r.lora, adapter_path=adapter)
        examples = PromptSet(r.data.eval_path, r.data, tok, limit=r.train.eval_max_prompts).examples
        res = evaluate(make_engine(r.generation.engine, model, tok, r), tok, Rewards(r.rewards), examples,
                       r.generation.max_new_tokens)
        click.echo(f"held-out accuracy: {100 * res['accuracy']:.1f}% ({res['n']} prompts, mean reward {res['mean_reward']:.3f})")

    _run(go)


if __name__ == "__main__":
    main()
