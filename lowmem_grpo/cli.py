"""`lowmem-grpo`: thin click commands over the library. Errors a user can fix are printed as one clear
message and exit 2; they never reach the user as a traceback."""

from __future__ import annotations

import math
import os
import re
import sys
from pathlib import Path
from typing import Optional

import click

from .recipe import RecipeError, load_recipe

def _user_errors() -> tuple:
    from .data import DataError
    from .distributed import DistributedError
    from .environment import EnvError
    from .evaluate import EvalError
    from .export import ExportError
    from .model import ModelLoadError
    from .rewards import RewardError
    from .rollout.base import EngineError
    from .memory import MemoryModelError
    from .sinks import SinkError
    from .train import TrainingError

    return (RecipeError, DataError, EngineError, EnvError, EvalError, ExportError, ModelLoadError, RewardError,
            TrainingError, MemoryModelError, DistributedError, SinkError)


SET_HELP = ("Override a recipe field, e.g. --set train.steps=10 or --set rewards.functions.0.weight=2 (an entry of a "
            "list by its index); the value is read as YAML, and a text field takes the text as written.")


def _run(fn, errors: tuple = ()):
    """Run a command's body; a user error (bad recipe, data, model, ...) is one line on stderr and exit 2.
    `errors` replaces the usual set, for commands that must not import the trainer (and torch)."""
    try:
        return fn()
    except (errors or _user_errors()) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)


def _launch(nproc: int, argv: list[str], recipe_path, overrides, shares_steps: bool = False) -> None:
    """The command in argv on nproc processes: torchrun launches them, does the rendezvous, and stops the job
    when one fails (distributed.launch). The recipe is read here first: a bad one is said once, before any process
    starts (each process said it, then torchrun its own lines; found by a red team), as are an nproc that cannot
    share a step's prompts (`shares_steps`: train) and more processes than GPUs."""
    from . import distributed
    from .recipe import prompts_share_problem

    if distributed.launched_size() > 1:
        raise click.UsageError("--nproc under torchrun: torchrun already started the processes; drop --nproc")
    r = _run(lambda: load_recipe(recipe_path, list(overrides)), errors=(RecipeError,))
    if problem := (shares_steps and prompts_share_problem(r.train.prompts_per_step, nproc)) or \
            distributed.gpus_problem(nproc):
        raise click.BadParameter(problem, param_hint="--nproc")
    timeout = distributed.shutdown_timeout_s(r.train.collective_timeout_s)
    _run(lambda: distributed.launch(nproc, argv, timeout), errors=(distributed.DistributedError,))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="lowmem-grpo")
def main():
    """GRPO on one GPU: a 4-bit base + LoRA, verifiable rewards."""
    # What a recipe names as 'module:attr' (reward functions, environments) is imported from the working
    # directory too, as under `python -m lowmem_grpo` and torchrun (--nproc). Last on the path, so that a
    # file there never shadows an installed package.
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())


DATA_ROWS_CHECKED = 100   # validate reads this many rows of each local data file: enough to find a field, fast


def data_problems(r, rows: int = DATA_ROWS_CHECKED) -> list[tuple[str, str]]:
    """(recipe key, message) for what training would stop on in the recipe's local data files, read from their first
    `rows` rows: a file that cannot be opened; a data.prompt_field or a data.template field that none of those
    rows has; else a row training refuses (with data.on_bad_row: error), by the checks data.py runs on a row before
    it tokenizes the prompt (`_row_problem`); and a data.eval_fraction split that a whole file read so cannot make.
    Hub splits are not fetched (nor is the model loaded: the prompts are not tokenized)."""
    from .data import ROW_SKIP_ADVICE, split_rows
    from .hub import is_hub
    from .rewards.options import BUILTINS
    from .sources import DataError, open_source

    # as the trainer's Rewards.reads_answer: every row needs data.answer_field when a built-in reward reads it
    require_answer = any(BUILTINS[spec.function].reads_answer for spec in r.rewards.functions if spec.function in BUILTINS)
    problems = []
    for key in ("data.train_path", "data.eval_path"):
        path = getattr(r.data, key.split(".")[1])
        if not path or is_hub(path):
            continue
        try:
            source = open_source(path, limit=rows)
            read = list(source.iter_rows())
        except DataError as exc:
            where = "" if Path(path).is_absolute() else " (a relative path is read from the current folder, then the " \
                                                        "recipe's)"
            problems.append((key, f"{exc}{where}"))
            continue
        head = [row for _, row in read if isinstance(row, dict)]
        whole = len(read) < rows
        if not head:   # a row that is not a mapping is an Unreadable, or a JSON value other than an object
            some = f"{'first ' if len(read) == rows else ''}{len(read)}"
            problems.append((key, f"{path}: no rows" if not read else f"{path}: none of its {some} rows can be read as "
                                  f"a row of fields (row 1: {str(read[0][1])[:200]})"))
            continue
        missing = _fields_missing(path, head, r.data, whole=whole)
        problems += missing + _countdown_problems(path, head, r, whole)
        reset_fills = bool(r.environment.name)
        bad = [(i, why) for i, row in read if (why := _row_problem(row, r.data, require_answer, reset_fills))]
        if bad and not missing and r.data.on_bad_row == "error":   # training stops at the first
            i, why = bad[0]
            line = source.line(i)
            where = f"row {i + 1}" + (f" (line {line})" if line not in (None, i + 1) else "")
            more = f"; {len(bad) - 1} more of its {'' if whole else 'first '}{len(read)} rows too" if len(bad) > 1 else ""
            problems.append((key, f"{path}: {where}: {why} ({ROW_SKIP_ADVICE}{more})"))
        elif bad and not missing and whole and len(bad) == len(read):   # with skip: none left to train on
            problems.append((key, f"{path}: no usable rows (data.on_bad_row: skip skips all {len(read)}; row "
                                  f"{bad[0][0] + 1}: {bad[0][1]})"))
        if key == "data.train_path" and r.data.eval_fraction and not r.data.eval_path and whole and not missing:
            try:   # the split train makes: held-out prompts apart from the trained ones (one distinct prompt: none)
                split_rows(head, r.data)
            except DataError as exc:
                problems.append(("data.eval_fraction", f"{path}: {exc}"))
    return problems


def data_notes(r, rows: int = DATA_ROWS_CHECKED) -> list[str]:
    """Notes on data settings that train takes without a word (found by a red team): a data.template that writes the
    reference answer into the prompt a reward judges against it, and a data.system_prompt that no prompt gets (text
    rows without data.chat_template: true; judged from the first `rows` rows of the local data files)."""
    import string

    from .data import is_chat
    from .hub import is_hub
    from .rewards.options import BUILTINS
    from .sources import DataError, open_source

    d, notes = r.data, []
    reads_answer = [spec.function for spec in r.rewards.functions
                    if spec.function in BUILTINS and BUILTINS[spec.function].reads_answer]
    named = {re.split(r"[.\[]", name, maxsplit=1)[0] for _, name, _, _ in string.Formatter().parse(d.template) if name}
    if reads_answer and d.answer_field in named:
        notes.append(f"note: data.template {d.template!r} writes the reference answer (data.answer_field "
                     f"{d.answer_field!r}) into the prompt, which {', '.join(reads_answer)} judges against it: the "
                     "model is given the answer")
    paths = [p for p in (d.train_path, d.eval_path) if p]
    if d.system_prompt and not d.chat_template and paths and not any(map(is_hub, paths)):
        def chat_rows(path) -> bool:   # (a file that cannot be read is data_problems')
            try:
                return any(isinstance(row, dict) and is_chat(row.get(d.prompt_field))
                           for _, row in open_source(path, limit=rows).iter_rows())
            except DataError:
                return True

        if not any(map(chat_rows, paths)):
            notes.append("note: data.system_prompt is set, but no prompt gets it: it goes with data.chat_template: "
                         "true, or first in a prompt of chat messages, and these rows are text with "
                         "data.chat_template false")
    return notes


def _row_problem(row, cfg, require_answer: bool, reset_fills: bool = False) -> Optional[str]:
    """Why training refuses this row of a data file, or None: the checks of data.py's PromptSet before it tokenizes
    the prompt (a row that cannot be read, data.check_fields, data.chat_messages for chat messages,
    data.fill_template for text)."""
    from .data import chat_messages, check_fields, fill_template, is_chat
    from .sources import DataError, Unreadable

    if isinstance(row, Unreadable):
        return str(row)
    if not isinstance(row, dict):
        return f"expected a JSON object (a row of fields), got {type(row).__name__}"
    try:
        check_fields(row, cfg, require_answer)
        prompt = row[cfg.prompt_field]
        chat_messages(prompt, cfg, reset_fills) if is_chat(prompt) else fill_template(row, cfg)
    except DataError as exc:
        return str(exc)
    return None


def model_problems(r) -> tuple[list[tuple[str, str]], list[str]]:
    """(problems, notes) of a model.name_or_path that is a local path, as train finds them at once (hub.py's
    model_path_problem, tokenizer_files_problem: a file, a folder without config.json, one without a tokenizer), a
    config.json that estimate refuses (memory.read_config, config_shape: not readable, no causal LM, sizes no model
    has), and a note when a completion alone passes the model's context (model.context_limit; Trainer._note_context
    says it with the prompts). A hub id is left to train: validate does not reach the hub."""
    from .hub import model_path_problem, tokenizer_files_problem, weights_problem

    name = str(r.model.name_or_path)
    path = Path(name).expanduser()
    if not (path.exists() or name.startswith((".", "/", "~")) or name.count("/") > 1):
        # (model_path_problem would ask the hub whether it can be reached); said, as "ok" read as checked (a red team)
        return [], [f"note: model.name_or_path {name!r} is a hub id, not checked here (validate does not reach the "
                    "hub); train loads it, offline from the local cache"]
    if problem := model_path_problem(name):   # (naming the path: "no such model folder" did not say which)
        return [("model.name_or_path", f"{name!r}: " + problem.removeprefix(f"model.name_or_path={name!r}: "))], []
    if problem := tokenizer_files_problem(path):
        return [("model.name_or_path", f"{name!r}: {problem}")], []
    # config.json read and checked as estimate reads it (transformers' config, no weights): validate said ok for one
    # that was no JSON, a BERT, a vocab_size "abc" or 0 layers (found by a red team). A causal LM the memory model
    # does not count (UnknownArchitecture) trains all the same.
    from .memory import MemoryModelError, UnknownArchitecture, config_shape, read_config
    from .model import ModelLoadError, context_limit, context_text, load_tokenizer

    try:
        config, _ = read_config(r.model)
        try:
            config_shape(config, name)
        except UnknownArchitecture:
            pass
        load_tokenizer(r.model)   # as train loads it: e.g. an end-of-sequence token it made up (model.made_up_eos)
    except (ModelLoadError, MemoryModelError) as exc:
        return [("model.name_or_path", f"{name!r}: {str(exc).removeprefix(f'model.name_or_path={name!r}: ')}")], []
    if problem := weights_problem(path):   # (found by a red team: validate passed a folder train could not load)
        return [("model.name_or_path", f"{name!r}: {problem}")], []
    limit = context_limit(config)
    field = "environment.max_total_tokens" if r.environment.name else "generation.max_new_tokens"
    completion = r.environment.max_total_tokens if r.environment.name else r.generation.max_new_tokens
    if limit is not None and completion >= limit:
        return [], [f"note: {field}={completion} alone comes to the model's {context_text(config)} (its "
                    f"config.json) or past it, before any prompt token: lower it, or use a model with a longer context"]
    return [], []


def _countdown_problems(path: str, head: list[dict], r, whole: bool) -> list[tuple[str, str]]:
    """(recipe key, message) for each countdown reward whose numbers_field / target_field none of `head` (a file's
    first rows; `whole`: all of them) has, or none of whose rows it can score: every completion would be skipped
    (found by a red team: the hub's `nums` with the default 'numbers' validated ok, then nothing was scored)."""
    from .rewards.countdown import _row
    from .rewards.options import CountdownOptions

    have = set().union(*(map(str, row) for row in head))
    shown = ", ".join(sorted(have)[:12]) + (f" and {len(have) - 12} more" if len(have) > 12 else "")
    rows = f"its {len(head)} rows" if whole else f"its first {len(head)} rows"
    problems = []
    for i, spec in enumerate(r.rewards.functions):
        if spec.function != "countdown":
            continue
        fields = {option: spec.kwargs.get(option, CountdownOptions.model_fields[option].default)   # (the schema's)
                  for option in ("numbers_field", "target_field")}
        absent = [(option, name) for option, name in fields.items() if name not in have]
        problems += [(f"rewards.functions.{i}.kwargs.{option}", f"names the row field {name!r}, which none of {rows} "
                      f"has, in {path} (they have: {shown}): set it to the data's field")
                     for option, name in absent]
        if not absent and not any(_row(row, *fields.values()) for row in head):
            first = head[0]
            got = ", ".join(f"{name}={first.get(name)!r} ({type(first.get(name)).__name__})"
                            for name in fields.values())
            problems.append((f"rewards.functions.{i}.function", f"countdown: none of {rows} in {path} has numbers "
                             f"(field {fields['numbers_field']!r}) as a non-empty list of integers and a target (field "
                             f"{fields['target_field']!r}) as an integer, so every completion would be skipped "
                             f"(row 1: {got})"))
    return problems


def _fields_missing(path: str, head: list[dict], cfg, whole: bool) -> list[tuple[str, str]]:
    """(recipe key, message) for each row field the recipe names (data.prompt_field, data.template's fields) that no
    row of `head` (a file's first rows; `whole`: all of them) has."""
    import string

    have = set().union(*(map(str, row) for row in head))
    named = [("data.prompt_field", cfg.prompt_field, repr(cfg.prompt_field))]
    for _, field, _, _ in string.Formatter().parse(cfg.template):   # (recipe.py checked the template's syntax)
        base = re.split(r"[.\[]", field, maxsplit=1)[0] if field else ""
        if base and base != "prompt":   # {prompt} is the prompt field's value
            named.append(("data.template", base, f"{{{base}}}"))
    rows = f"its {len(head)} rows" if whole else f"its first {len(head)} rows"
    shown = ", ".join(sorted(have)[:12]) + (f" and {len(have) - 12} more" if len(have) > 12 else "")
    return [(key, f"{what} names a field that none of {rows} has, in {path} (they have: {shown})")
            for key, field, what in dict.fromkeys(named) if field not in have]


@main.command()
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
def validate(recipe, overrides):
    """Check a recipe: report every problem at once, with its key path."""
    conventions: dict = {}
    notes: list[str] = []

    def check():
        r = load_recipe(recipe, list(overrides))
        # user reward functions: importable, and callable in their convention (lowmem-grpo's or TRL's)
        from .rewards import function_problems

        from .environment import environment_problems

        model, said = model_problems(r)
        notes.extend(said)
        problems = (model + function_problems(r.rewards, conventions, environment=bool(r.environment.name))
                    + environment_problems(r.environment) + data_problems(r))
        if problems:
            raise RecipeError(recipe, problems)
        return r

    r = _run(check, errors=(RecipeError,))   # no trainer (torch) import
    click.echo(f"{recipe}: ok ({r.train.steps} steps, G={r.generation.num_generations}, model {r.model.name_or_path})")
    for key, convention in conventions.items():
        spec = r.rewards.functions[int(key.rsplit(".", 1)[1])]
        click.echo(f"{key} ({spec.function}): called " + ("as TRL's GRPOTrainer calls reward functions" if convention == "trl"
                                                          else "with lowmem-grpo's convention (prompts=, rows=)"))
    from .rewards.judging import judging_notes
    from .rewards.options import first_function_problem

    # the first function is the one "solved" is read from (the recipe refuses what it can tell is wrong)
    _, first = first_function_problem([f.function for f in r.rewards.functions], bool(r.environment.name))
    for note in [*notes, *([first] if first else []), *data_notes(r), *judging_notes(r)]:
        click.echo(note)


@main.command()
@click.argument("recipe", type=click.Path(dir_okay=False), required=False)
@click.option("--resume", "resume_dir", type=click.Path(file_okay=False), help="Continue the run in this directory from its latest checkpoint.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
@click.option("--nproc", type=click.IntRange(min=1), default=1, show_default=True,
              help="Train with N processes on this machine (one GPU each; gloo on CPU): starts "
                   "torchrun --standalone --nproc_per_node N. For several machines, run torchrun with its own flags.")
def train(recipe, resume_dir, overrides, nproc):
    """Train with RECIPE, or continue a run with --resume RUN_DIR."""
    from . import distributed

    if not recipe and not resume_dir:
        raise click.UsageError("give a RECIPE, or --resume RUN_DIR")
    if recipe and resume_dir:  # the resumed run reads RUN_DIR/recipe.yaml: RECIPE would be silently ignored
        raise click.UsageError("give a RECIPE or --resume RUN_DIR, not both: a resumed run keeps its own "
                               "RUN_DIR/recipe.yaml (change a field with --set KEY=VALUE)")
    if resume_dir and not (Path(resume_dir) / "recipe.yaml").is_file():
        raise click.BadParameter(f"{resume_dir} is not a run directory (no recipe.yaml in it)", param_hint="--resume")
    if nproc > 1:
        args = ([recipe] if recipe else []) + (["--resume", resume_dir] if resume_dir else [])
        _launch(nproc, ["train", *args] + [f"--set={o}" for o in overrides],
                Path(resume_dir) / "recipe.yaml" if resume_dir else recipe, overrides, shares_steps=True)
        return
    from .evaluate import accuracy_text
    from .train import Trainer

    def go():
        r = load_recipe(Path(resume_dir) / "recipe.yaml" if resume_dir else recipe, list(overrides))
        try:
            with distributed.joined(r.train.collective_timeout_s) as world:
                trainer = Trainer(r, run_dir=Path(resume_dir) if resume_dir else None, resume=bool(resume_dir),
                                  world=world)
                out = trainer.fit()
        except KeyboardInterrupt:   # outside a step (loading, an eval), or a second Ctrl-C: click said "Aborted!"
            if distributed.launched_main():   # once, not once per process (the group is left by now)
                click.echo(f"\n{interrupted_note(Path(resume_dir or r.output.dir), distributed.launched_size())}",
                           err=True)
            sys.exit(130)   # as a shell reports a process that SIGINT ended
        if not world.main:
            return out
        for key, label in (("first_eval", "before"), ("final_eval", "after")):
            if out[key]:
                click.echo(f"held-out accuracy {label}: {accuracy_text(out[key])}")
        click.echo(f"run directory: {trainer.run_dir}  (export with: lowmem-grpo export {trainer.run_dir} --out DIR)")
        return out

    out = _run(go)
    distributed.end_worker()
    if out and out.get("signal") and distributed.launched_size() <= 1:
        # stopped, checkpointed, not finished: as a shell reports a process that signal ended (130 Ctrl-C, 143 SIGTERM),
        # so that `train && export` stops there (under torchrun, torchrun reports the job's end)
        sys.exit(128 + out["signal"])


def interrupted_note(run_dir: Path, processes: int = 1) -> str:
    """What a Ctrl-C outside a training step kept, and how to go on: the checkpoints written stay (a step's work
    since the last one is lost only to a second Ctrl-C), and a resume runs an eval the interruption cut. The
    resume keeps the run's number of processes (another restarts the sampling streams)."""
    from . import checkpoint as ckpt

    if not (run_dir / "recipe.yaml").is_file():
        return "[lowmem-grpo] interrupted (Ctrl-C) before the run wrote anything: run the same command again"
    last = ckpt.latest(run_dir)
    kept = f"the last checkpoint, {last}, is kept" if last is not None else "no checkpoint yet (it starts again)"
    nproc = f" --nproc {processes}" if processes > 1 else ""
    return f"[lowmem-grpo] interrupted (Ctrl-C); {kept}. Continue with: lowmem-grpo train{nproc} --resume {run_dir}"


@main.command()
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="A new or empty folder to write adapter/ and merged/ into (see --overwrite).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True,
              help="dtype of the merged model (the base is loaded unquantized in it).")
@click.option("--adapter-only", is_flag=True, help="Write only the adapter, no merged model.")
@click.option("--step", type=int, default=None, help="Export this checkpoint step instead of the latest.")
@click.option("--overwrite", is_flag=True,
              help="--out holds an earlier export: replace it (its adapter/ and merged/), once the new export is "
                   "complete. Without it, an --out that holds anything is refused.")
def export(run_dir, out_dir, dtype, adapter_only, step, overwrite):
    """Write the LoRA adapter and a merged standalone Hugging Face model."""
    from .export import export_run

    try:
        _run(lambda: export_run(run_dir, out_dir, dtype=dtype, merged=not adapter_only, step=step, overwrite=overwrite))
    except KeyboardInterrupt:   # export_run leaves nothing half-written (its temporary folder goes): say so
        click.echo(f"interrupted (Ctrl-C): --out {out_dir} is as it was before this export", err=True)
        sys.exit(130)   # as a shell reports a process that SIGINT ended


GiB = 2 ** 30
MIN_MEMORY = 64 * 2 ** 20   # holds no model at all: a smaller --memory is a unit mistake (8 read as bytes, KiB for GiB)
# A number without a unit is GiB; KB, MB, GB, TB (and K, M, G, T) are read as the binary units, as GPU makers mean
# them (an "8 GB" card has 8 GiB).
MEMORY_FORMS = ("e.g. 8GiB, 12GB, 512MiB or 8 (a number without a unit is GiB); units KiB, MiB, GiB, TiB, and KB, "
                "MB, GB, TB read as those")
MEMORY_UNITS = {"": GiB, "B": 1, **{prefix + suffix: 1024 ** power for power, prefix in enumerate("KMGT", start=1)
                                    for suffix in ("", "B", "IB")}}


MAX_MEMORY = 2 ** 50   # 1 PiB: more than any GPU or machine has; a larger --memory is a typo (1e30, 8e9 GiB)
# a plain decimal number, as written in a size: not float()'s other forms ('8_0' read as 80, other scripts' digits)
SIZE_NUMBER = re.compile(r"\+?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?", re.ASCII)


def parse_memory(text: str) -> int:
    """--memory SIZE in bytes: '8' (GiB), '8GiB', '12GB', '7.5G', '512MiB', '1TiB'. ValueError saying what is
    allowed, for text that is no size, or one below MIN_MEMORY or above MAX_MEMORY."""
    from .memory import fmt

    t = str(text).strip()
    unit = re.search(r"[A-Za-z]*$", t).group()
    number = t[: len(t) - len(unit)].strip()
    try:
        size = float(number) * MEMORY_UNITS[unit.upper()] if SIZE_NUMBER.fullmatch(number) else math.nan
        ok = math.isfinite(size) and size > 0
    except (ValueError, KeyError, OverflowError):
        ok = False
    if not ok:
        raise ValueError(f"{text!r}: expected a positive size, {MEMORY_FORMS}")
    if size > MAX_MEMORY:
        raise ValueError(f"{text!r} is {size / 2 ** 40:.4g} TiB, more than the {MAX_MEMORY // 2 ** 40} TiB (1 PiB) "
                         f"that any GPU or machine has; expected the GPU's (or with --device cpu, the RAM's) size, "
                         f"{MEMORY_FORMS}")
    if size < MIN_MEMORY:
        raise ValueError(f"{text!r} is {fmt(size) if size >= 2 ** 20 else f'{int(size)} bytes'}, below the "
                         f"{fmt(MIN_MEMORY)} that any model needs; expected the GPU's (or with --device cpu, the "
                         f"RAM's) size, {MEMORY_FORMS}")
    return int(size)


class MemorySize(click.ParamType):
    name = "size"

    def convert(self, value, param, ctx):
        try:
            return value if isinstance(value, int) else parse_memory(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


@main.command()
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.option("--memory", "size", type=MemorySize(), default=None, metavar="SIZE",
              help=f"The GPU's memory, {MEMORY_FORMS}. The budget is what the trainer takes on such a card (less "
                   "its CUDA context and 10% for the allocator); with --device cpu, the RAM to fit in. Default: what "
                   "this process can reach of this machine's GPU, less 10%, or its RAM with --device cpu.")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default="cuda", show_default=True,
              help="Where the run will train: cuda predicts torch's allocated peak, cpu the process RSS.")
@click.option("--nproc", type=click.IntRange(min=1), default=1, show_default=True,
              help="Processes the run will use (train --nproc N): each samples prompts_per_step / N prompts; the "
                   "figures are per process (per GPU).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
def estimate(recipe, size, device, nproc, overrides):
    """Predict a run's peak memory (a breakdown), and the largest micro-batch that fits, without loading weights."""
    from . import memory as mm
    from .hub import model_path_problem, shipped_model_config
    from .model import ModelLoadError
    from .recipe import prompts_share_problem

    def go():
        r = load_recipe(recipe, list(overrides))
        if problem := prompts_share_problem(r.train.prompts_per_step, nproc):   # as train --nproc refuses it
            raise click.BadParameter(problem, param_hint="--nproc")
        if size is None:
            budget = mm.device_budget(device)
        else:
            budget = mm.card_budget(size) if device == "cuda" else size
        if size is not None and budget < MIN_MEMORY:
            raise click.BadParameter(
                f"a {mm.fmt(size)} card leaves the trainer {mm.fmt(budget)} (its CUDA context takes "
                f"~{mm.fmt(mm.CUDA_CONTEXT)}, the allocator {mm.ALLOCATOR_SLACK:.0%} of the rest); give the card's "
                "whole memory, e.g. --memory 8GiB (or --device cpu for the RAM to fit in)", param_hint="--memory")
        # the model as train finds it (a shipped config needs neither a local folder nor the hub)
        name = r.model.name_or_path
        if not shipped_model_config(name) and (problem := model_path_problem(name)):
            raise ModelLoadError(problem)
        est, shape, workload = mm.estimate_recipe(r, device, processes=nproc, budget=budget)  # waves fit the budget
        click.echo(f"{recipe}: {r.model.name_or_path} (vocab {shape.vocab_size:,}, hidden {shape.hidden_size}, "
                   f"{shape.num_layers} layers), {device}" + (f", per process of {nproc}" if nproc > 1 else ""))
        click.echo("\n".join(est.lines()))
        if budget is None:
            click.echo("no budget: pass --memory SIZE (no GPU on this machine)")
            return
        if size is None:
            click.echo(mm.budget_note(device, budget))
        elif device == "cuda":
            click.echo(mm.card_note(size))
        advice = mm.advise(shape, workload, budget)
        click.echo("\n".join(advice.lines))
        if not advice.fits:
            sys.exit(1)

    _run(go)


@main.command(name="eval")
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.option("--adapter", type=click.Path(file_okay=False), default=None,
              help="A run directory (its latest complete checkpoint), a checkpoint or export folder, or an adapter folder.")
@click.option("--model", "model_dir", type=click.Path(file_okay=False), default=None,
              help="A merged/standalone model folder (e.g. EXPORT/merged), loaded without an adapter.")
@click.option("--split", type=click.Choice(["test", "train"]), default="test", show_default=True,
              help="test: the held-out set (data.eval_path or data.eval_fraction's split); train: the training rows.")
@click.option("--k", "ks", default="1", show_default=True, metavar="K[,K...]",
              help="pass@k for each k, from max(k) samples per prompt at generation.temperature.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Where samples.jsonl and summary.json go (default: RUN/eval/step-N-SPLIT, or ./eval-RECIPE).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
@click.option("--nproc", type=click.IntRange(min=1), default=1, show_default=True,
              help="Evaluate with N processes on this machine (torchrun), each a share of the prompts.")
def eval_cmd(recipe, adapter, model_dir, split, ks, out_dir, overrides, nproc):
    """Greedy accuracy (as the trainer computes it) and pass@k of a model on a recipe's prompts."""
    from . import distributed
    from .evaluate import EvalInterrupted, parse_ks, run_eval

    if adapter and model_dir:
        raise click.UsageError("give --adapter or --model, not both")
    try:
        k_list = parse_ks(ks)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--k") from None
    if nproc > 1:
        args = [recipe, f"--split={split}", f"--k={ks}"] + [f"--set={o}" for o in overrides]
        args += [f"--{name}={value}" for name, value in (("adapter", adapter), ("model", model_dir), ("out", out_dir))
                 if value]
        _launch(nproc, ["eval", *args], recipe, overrides)
        return

    def go():
        r = load_recipe(recipe, list(overrides))
        with distributed.joined(r.train.collective_timeout_s) as world:
            try:
                return run_eval(r, name=Path(recipe).stem, adapter=adapter, model_dir=model_dir, split=split,
                                ks=k_list, out_dir=out_dir, log=click.echo if world.main else (lambda *a: None),
                                world=world)
            except EvalInterrupted as exc:
                click.echo(str(exc), err=True)
                sys.exit(130)   # as a shell reports a process that SIGINT ended

    _run(go)
    distributed.end_worker()


@main.command()
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option("--out", "out_dir", default=None, type=click.Path(file_okay=False),
              help="Folder for the PNGs and report.md (default: RUN_DIR/report).")
def report(run_dir, out_dir):
    """Plot a run's metrics (PNG) and write a one-page Markdown summary."""
    from .report import ReportError, render

    res = _run(lambda: render(run_dir, out_dir), errors=(ReportError,))
    click.echo(f"wrote {res['report']} and {len(res['images'])} plots"
               + (f" ({res['skipped']} unreadable line(s) of metrics.jsonl skipped)" if res["skipped"] else ""))
    if res.get("left_out"):   # (said in report.md too: here, so that it is not missed)
        click.echo(res["left_out"])
    if res.get("not_drawn"):
        click.echo(f"not drawn: {', '.join(res['not_drawn'])}")


if __name__ == "__main__":
    main()
