"""Evaluation: greedy accuracy (the trainer's `eval/accuracy`) and pass@k from sampled completions.

One implementation: `Trainer.evaluate` calls `greedy` on its held-out prompts, and `lowmem-grpo eval`
(`run_eval`) calls the same `greedy` on the same prompts (`data.prompt_set`, first
`train.eval_max_prompts`), through the same rollout engine and `Rewards`, so a checkpoint's number
there equals the trainer's number for it.

A completion is correct when it is solved (diagnostics.solved: the recipe's first reward function scores
it >= 1, a right answer for the built-in verifiable rewards; with an environment and no reward functions,
the environment's summed reward, docs/algorithm.md §20); a completion that function skips (None) is not
counted. Training's success_rate uses the same rule. With an environment, every completion here is an
episode it drives (rollout/turns.py), greedy or sampled as below.

pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code"): per prompt, n completions
sampled at generation.temperature, c of them correct; pass@k = 1 - C(n-c, k) / C(n, k), the unbiased
estimate of "at least one of k samples is correct", averaged over prompts.
"""

from __future__ import annotations

import errno
import filecmp
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from dataclasses import replace
from typing import Callable, Optional, Sequence

import torch

from .diagnostics import solved
from .rollout import make_engine
from .rollout.base import EVAL_BATCH, EngineConfig, SamplingParams
from .rollout.turns import completion_texts, context_tokens as engine_context, prompt_text, score


class EvalError(Exception):
    """A `lowmem-grpo eval` option that cannot be used (e.g. an --out that cannot be written)."""


class EvalInterrupted(EvalError):
    """Ctrl-C during an eval: what was done is written; the CLI exits 130 with this message."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n-c, k) / C(n, k), computed as 1 - prod_{i=n-c+1..n} (1 - k/i): no large binomials, no
    cancellation. n samples, c correct, 1 <= k <= n."""
    if not (isinstance(n, int) and isinstance(c, int) and isinstance(k, int)):
        raise TypeError("pass_at_k takes integers n, c, k")
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n (got n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0   # every k-subset holds a correct sample
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def _record(result, i: int) -> tuple[dict, Optional[float]]:
    """Per-function scores and total of completion i (None where skipped)."""
    per = {name: (None if math.isnan(v[i]) else float(v[i])) for name, v in result.per_function.items()}
    total = float(result.total[i])
    return per, (None if math.isnan(total) else total)


def _generate(engine, rollout: Optional[Callable], examples: list, params: SamplingParams) -> list:
    """The completions: `rollout(examples, params)` when given (an environment's episodes, docs/algorithm.md
    §20), else the engine's."""
    return rollout(examples, params) if rollout is not None else engine.generate([e.prompt_ids for e in examples], params)


def greedy(engine, tokenizer, rewards, examples, max_new_tokens: int, batch_size: int = EVAL_BATCH,
           records: Optional[list] = None, done: Callable[[int], None] = lambda n: None,
           rollout: Optional[Callable] = None, first_index: int = 0, step: int = 0) -> dict:
    """Greedy completions, one per prompt (scored as after `step` training steps): accuracy (correct / counted; None
    when none was counted), mean_reward (total reward summed
    with skips as 0, over all prompts), n (prompts counted), correct and prompts (all of them, skipped ones
    too). `records` gets one dict per prompt, numbered from `first_index` (a process's share starts there).
    `rollout(examples, params)`: how completions are made, when not engine.generate (an environment)."""
    correct, counted, reward_sum = 0, 0, 0.0
    for i in range(0, len(examples), batch_size):
        chunk = examples[i: i + batch_size]
        completions = _generate(engine, rollout, chunk, SamplingParams(n=1, max_new_tokens=max_new_tokens, greedy=True))
        texts = completion_texts(tokenizer, completions)
        result = score(rewards, texts, completions, [chunk[c.prompt_index] for c in completions], step, tokenizer=tokenizer)
        judged = solved(result)
        correct += int(judged.correct.sum())
        counted += judged.counted
        reward_sum += float(torch.nan_to_num(result.total).sum())
        done(len(chunk))
        if records is not None:
            for j, (c, text) in enumerate(zip(completions, texts)):
                per, total = _record(result, j)
                records.append({"mode": "greedy", "prompt_index": first_index + i + j, "sample": 0,
                                "prompt": prompt_text(c, chunk[j]), "completion": text, "rewards": per, "total": total,
                                "correct": judged.at(j), "truncated": c.truncated})
    return {"accuracy": accuracy(correct, counted), "mean_reward": reward_sum / max(1, len(examples)), "n": counted,
            "correct": correct, "prompts": len(examples)}


def accuracy(correct: int, counted: int) -> Optional[float]:
    """correct / counted; None when no completion was judged (0/0 is no accuracy: reported as 0.0 it read as a
    model that got everything wrong)."""
    return correct / counted if counted else None


def accuracy_text(result: dict) -> str:
    """A greedy result's accuracy as the trainer, `train` and `eval` print it: '42.0%', or why there is none."""
    if result["accuracy"] is not None:
        return f"{100 * result['accuracy']:.1f}%"
    return (f"none: no row could be judged, the reward skipped all {result['prompts']} completions (it returns None "
            "for a row it cannot judge, e.g. countdown on a row without numbers, or an environment episode that ended "
            "in an error)")


def combine_greedy(parts: Sequence[dict]) -> dict:
    """`greedy`'s result over all prompts from its results over disjoint shares of them (one per process,
    docs/algorithm.md §21). The reward sums are recovered from the means: exact for the prompt counts of an
    eval, to the last bit or two."""
    if len(parts) == 1:
        return parts[0]
    correct, counted = sum(p["correct"] for p in parts), sum(p["n"] for p in parts)
    prompts = sum(p["prompts"] for p in parts)
    reward_sum = sum(p["mean_reward"] * p["prompts"] for p in parts)
    return {"accuracy": accuracy(correct, counted), "mean_reward": reward_sum / max(1, prompts), "n": counted,
            "correct": correct, "prompts": prompts}


def sampled(engine, tokenizer, rewards, examples, params: SamplingParams, ks: Sequence[int],
            batch_size: int = EVAL_BATCH, records: Optional[list] = None, done: Callable[[int], None] = lambda n: None,
            rollout: Optional[Callable] = None) -> dict:
    """params.n samples per prompt; pass@k for each k in `ks` (<= params.n), averaged over the prompts
    with at least k scored samples (a prompt whose samples the first reward skips is left out)."""
    check_ks(ks, params.n)
    return pass_at_k_table(sampled_counts(engine, tokenizer, rewards, examples, params, batch_size, records, done,
                                          rollout), params, ks)


def check_ks(ks: Sequence[int], n: int) -> None:
    if not ks or max(ks) > n:
        raise ValueError(f"every k must be <= the samples per prompt ({n}); got {list(ks)}")


def sampled_counts(engine, tokenizer, rewards, examples, params: SamplingParams, batch_size: int = EVAL_BATCH,
                   records: Optional[list] = None, done: Callable[[int], None] = lambda n: None,
                   rollout: Optional[Callable] = None, first_index: int = 0) -> list[tuple[int, int]]:
    """params.n samples per prompt: (scored samples, correct samples) per prompt. `records` gets one dict per
    sample, prompts numbered from `first_index`."""
    per_prompt: list[tuple[int, int]] = []
    step = max(1, batch_size // params.n)
    for i in range(0, len(examples), step):
        chunk = examples[i: i + step]
        completions = _generate(engine, rollout, chunk, params)
        texts = completion_texts(tokenizer, completions)
        result = score(rewards, texts, completions, [chunk[c.prompt_index] for c in completions], tokenizer=tokenizer)
        counts = [[0, 0] for _ in chunk]
        judged = solved(result)
        for j, c in enumerate(completions):
            per, total = _record(result, j)
            ok = judged.at(j)
            if ok is not None:
                counts[c.prompt_index][0] += 1
                counts[c.prompt_index][1] += int(ok)
            if records is not None:
                records.append({"mode": "sample", "prompt_index": first_index + i + c.prompt_index, "sample": j % params.n,
                                "prompt": prompt_text(c, chunk[c.prompt_index]), "completion": texts[j], "rewards": per,
                                "total": total, "correct": ok, "truncated": c.truncated})
        per_prompt += [tuple(x) for x in counts]
        done(len(chunk))
    return per_prompt


def pass_at_k_table(per_prompt: Sequence[tuple[int, int]], params: SamplingParams, ks: Sequence[int]) -> dict:
    """pass@k for each k, averaged over the prompts with at least k scored samples, from sampled_counts."""
    out: dict = {"samples_per_prompt": params.n, "temperature": params.temperature}
    for k in sorted(set(ks)):
        scores = [pass_at_k(n, c, k) for n, c in per_prompt if n >= k]
        out[f"pass@{k}"] = sum(scores) / len(scores) if scores else None
        out[f"pass@{k}/prompts"] = len(scores)
    return out


MAX_K = 1024   # samples a prompt; all are kept in memory and written to samples.jsonl, so the cap bounds both


def parse_ks(text: str) -> list[int]:
    """'1,8' -> [1, 8]; ValueError naming what is wrong."""
    try:
        ks = sorted({int(x) for x in str(text).split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"--k {text!r}: expected a comma-separated list of positive integers, e.g. 1,8") from None
    if not ks or ks[0] < 1:
        raise ValueError(f"--k {text!r}: expected a comma-separated list of positive integers, e.g. 1,8")
    if ks[-1] > MAX_K:
        raise ValueError(f"--k {text!r}: at most {MAX_K} (each prompt is sampled max(k) times, and every completion "
                         "is kept for samples.jsonl)")
    return ks


# ----------------------------------------------------------------------------------------------------
# `lowmem-grpo eval`: what to load, what to run, what to write
# ----------------------------------------------------------------------------------------------------

def resolve_adapter(path: str) -> tuple[Path, Optional[Path]]:
    """(adapter folder, run directory or None) for --adapter: a run directory (its latest complete
    checkpoint), a checkpoint folder, an export folder (with adapter/), or an adapter folder."""
    from . import checkpoint as ckpt
    from .model import ModelLoadError

    p = Path(path)
    if (p / "adapter_config.json").is_file():
        return p, None
    if (p / "adapter" / "adapter_config.json").is_file():
        return p / "adapter", None
    if (p / "checkpoints").is_dir():
        latest = ckpt.latest(p)
        if latest is None:
            raise ModelLoadError(f"--adapter {path}: the run directory has no complete checkpoint yet")
        return latest / "adapter", p
    raise ModelLoadError(f"--adapter {path}: not a run directory (with checkpoints/), a checkpoint or export folder "
                         "(with adapter/), or an adapter folder (with adapter_config.json)")


def _trained_on(adapter: Path, run_dir: Optional[Path]) -> list[tuple[str, str]]:
    """(base model name, where it is recorded) for an adapter: its adapter_config.json's base_model_name_or_path,
    and the model.name_or_path of its run's recipe.yaml (`run_dir`, or the run of a RUN/checkpoints/step-N/adapter
    folder). What cannot be read is left out (adapter_problem names a broken config when the adapter loads)."""
    import yaml

    found = []
    try:
        base = json.loads((adapter / "adapter_config.json").read_text(encoding="utf-8")).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        base = None
    if isinstance(base, str) and base:
        found.append((base, str(adapter / "adapter_config.json")))
    if run_dir is None and adapter.parent.parent.name == "checkpoints":
        run_dir = adapter.parent.parent.parent
    if run_dir is not None and (run_dir / "recipe.yaml").is_file():
        try:
            name = (yaml.safe_load((run_dir / "recipe.yaml").read_text(encoding="utf-8")) or {})["model"]["name_or_path"]
        except (OSError, ValueError, yaml.YAMLError, KeyError, TypeError):
            name = None
        if isinstance(name, str) and name:
            found.append((name, str(run_dir / "recipe.yaml")))
    return found


def _same_model(a: str, b: str) -> bool:
    """The same name, or two paths to the same local folder."""
    if a == b:
        return True
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    try:
        return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()
    except OSError:
        return False


def check_adapter_base(adapter: Path, run_dir: Optional[Path], base: str) -> Optional[str]:
    """Before an adapter is applied to the recipe's model.name_or_path (`base`): ModelLoadError when `base` is the
    merged model of an export of this very adapter (EXPORT/merged beside an EXPORT/adapter holding the same weights:
    the adapter would be applied twice); else a warning naming both when the adapter records another base (one can
    move, or be a hub id here and a local snapshot there, so not a refusal), or None."""
    from .model import ModelLoadError

    folder, weights = Path(base).expanduser(), adapter / "adapter_model.safetensors"
    exported = folder.parent / "adapter" / "adapter_model.safetensors"
    try:
        twice = (folder / "config.json").is_file() and exported.is_file() and weights.is_file() and \
            filecmp.cmp(exported, weights, shallow=False)
    except OSError:
        twice = False
    trained_on = _trained_on(adapter, run_dir)
    if twice:
        was = f", or apply the adapter to the base it was trained on ({trained_on[0][0]})" if trained_on else ""
        raise ModelLoadError(f"--adapter {adapter}: model.name_or_path={base!r} is the merged model exported with this "
                             f"adapter (its weights are those of {exported.parent}): the base already contains this "
                             f"adapter, which would be applied twice. Evaluate the merged model alone (--model {base}, "
                             f"without --adapter){was}")
    if not trained_on or any(_same_model(name, base) for name, _ in trained_on):
        return None
    where: dict = {}
    for name, source in trained_on:
        where.setdefault(name, []).append(source)
    names = "; ".join(f"{name!r} (in {', '.join(sources)})" for name, sources in where.items())
    return (f"warning: --adapter {adapter} was trained on {names}, not on the recipe's model.name_or_path={base!r}, to "
            "which it is applied now: unless that is the same model (a moved folder, a hub id and its local copy), "
            "these figures are not the adapter's (a merged export, for one, already holds an adapter)")


def _check_out(out: Path) -> None:
    """That eval can write its files into `out` (which exists), before any work: its files are not folders, and a
    file can be created there (and an existing one replaced)."""
    for name in ("samples.jsonl", "summary.json"):
        p = out / name
        if p.is_dir():
            raise EvalError(f"--out {out}: {p} is a folder; eval writes a file of that name there (remove it, or choose "
                            "another --out)")
        if p.exists():
            try:
                open(p, "ab").close()   # (appends nothing: the file is replaced when the eval is done)
            except OSError as exc:
                raise EvalError(f"--out {out}: cannot replace {p}: {exc.strerror or exc}") from None
    try:
        fd, probe = tempfile.mkstemp(dir=out, prefix=".eval-write-probe-")
    except OSError as exc:
        raise EvalError(f"--out {out}: cannot write a file there: {exc.strerror or exc}") from None
    os.close(fd)
    os.unlink(probe)


def _load(recipe, adapter: Optional[Path], model_dir: Optional[str]):
    from .hub import tokenizer_files_problem
    from .model import (AdapterLoadError, ModelLoadError, load_base_model, load_policy, load_tokenizer,
                        stop_token_problem, vocabulary_problem)

    if model_dir:
        if not (Path(model_dir) / "config.json").is_file():
            raise ModelLoadError(f"--model {model_dir}: not a model folder (no config.json); "
                                 "give a merged/standalone model, e.g. EXPORT/merged")
        # without them transformers builds an empty tokenizer: every prompt would be no tokens at all
        if problem := tokenizer_files_problem(Path(model_dir)):
            raise ModelLoadError(f"--model {model_dir}: {problem}")
        cfg = recipe.model.model_copy(update={"name_or_path": str(model_dir)})
        model, tokenizer = load_base_model(cfg), load_tokenizer(cfg)
        if problem := vocabulary_problem(model, tokenizer) or stop_token_problem(model, tokenizer):   # (as load_policy)
            raise ModelLoadError(f"--model {model_dir}: {problem}")
        return model, tokenizer
    try:
        return load_policy(recipe.model, recipe.lora, adapter_path=str(adapter) if adapter else None)
    except AdapterLoadError as exc:
        raise ModelLoadError(f"--adapter: {exc}") from None


def run_eval(recipe, *, name: str, adapter: Optional[str] = None, model_dir: Optional[str] = None,
             split: str = "test", ks: Sequence[int] = (1,), out_dir: Optional[str] = None, log=print,
             world=None) -> dict:
    """Greedy accuracy and pass@k of the recipe's model (+ adapter, or a merged model) on `split`;
    writes OUT/samples.jsonl (one line per completion) and OUT/summary.json, and returns the summary.
    Under torchrun (`world`, docs/algorithm.md §21) each process takes a contiguous share of the prompts,
    samples with its own stream, and process 0 writes the whole."""
    from . import distributed
    from .data import DataError, hold_to_engine_context, prompt_drift, prompt_set
    from .model import context_tokens
    from .rewards import Rewards

    world = world or distributed.World()
    adapter_dir, run_dir = resolve_adapter(adapter) if adapter else (None, None)
    if out_dir is None:
        out_dir = (run_dir / "eval" / f"{adapter_dir.parent.name}-{split}") if run_dir else Path(f"eval-{name}")
    if world.main:  # now, not after the whole eval: an --out that cannot be written fails before any work
        try:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise EvalError(f"--out {out_dir}: cannot create the folder ({exc})") from None
        _check_out(Path(out_dir))
        _remove_results(Path(out_dir), PART_FILES)   # an earlier interrupted eval's shares: not this eval's
    if adapter_dir is not None and not model_dir:
        if warning := check_adapter_base(adapter_dir, run_dir, recipe.model.name_or_path):
            log(warning)
    rewards, g = Rewards.from_recipe(recipe), recipe.generation   # (before the model: a bad reward fails fast)
    from .progress import library_bars, use_bar

    with library_bars(use_bar("auto") and world.main):   # transformers' loading bar: on a terminal only
        model, tok = _load(recipe, adapter_dir, model_dir)
    if model_dir and recipe.model.load_in_4bit and world.main:
        # The merged model's weights are the 4-bit base's dequantized plus the adapter's product: quantizing them
        # again measures a third model, neither the trained one nor the one written (found by a red team)
        log(f"note: --model {model_dir} is loaded in 4-bit (NF4), as the recipe's model.load_in_4bit says: its "
            "figures are of the model quantized again, not of its full-precision weights; --set "
            "model.load_in_4bit=false evaluates those (the trained policy itself: --adapter RUN)")
    pset = prompt_set(recipe.data, tok, split, require_answer=rewards.reads_answer, context_tokens=context_tokens(model),
                      reset_fills=bool(recipe.environment.name))
    if pset is None:
        raise DataError("--split test: the recipe has no held-out set; set data.eval_path or data.eval_fraction "
                        "(or use --split train)")
    trained = model_dir or adapter_dir   # the folder whose weights were trained (an export's merged model: its own)
    if trained and world.main and (warning := prompt_drift(trained, pset)):
        log(warning)
    examples = pset.examples[: recipe.train.eval_max_prompts]
    bad_rows = list(pset.skipped)   # on_bad_row=skip: the rows left out (read after the examples: a late-found one too)
    first, stop = distributed.shard_bounds(len(examples), world)
    mine, greedy_records, sample_records = examples[first:stop], [], []
    summary = {"recipe": name, "split": split, "adapter": str(adapter_dir) if adapter_dir else None,
               "model": str(model_dir or recipe.model.name_or_path), "environment": recipe.environment.name or None,
               "prompts": len(examples), "max_new_tokens": g.max_new_tokens,
               "rows_skipped": len(bad_rows), "rows_skipped_first": bad_rows[:10]}
    # A bar on a terminal (prompts done, greedy then sampled): an eval of 1,000+ prompts takes a while.
    bar = None
    if use_bar("auto") and world.main:
        from tqdm import tqdm

        bar = tqdm(total=2 * len(mine), unit="prompt", desc="eval", file=sys.stderr, dynamic_ncols=True)
    done = bar.update if bar is not None else (lambda n: None)
    wave = eval_wave(recipe, model, mine, max(ks))
    batch = min(wave or EVAL_BATCH, EVAL_BATCH)
    engine_cfg = EngineConfig.from_recipe(recipe, wave)
    engine = make_engine(replace(engine_cfg, seed=distributed.sampling_seed(engine_cfg.seed, world)), model, tok)
    errors = None   # with an environment: its episodes' errors, counted (_EnvErrors)
    try:
        if (note := hold_to_engine_context([pset], engine_context(engine), context_tokens(model),
                                           recipe.generation.engine, recipe.data.max_prompt_tokens)) and world.main:
            log(f"note: {note}")
        rollout = errors = _EnvErrors(_episodes(recipe, engine, tok, pset)) if recipe.environment.name else None
        mine_greedy = greedy(engine, tok, rewards, mine, g.max_new_tokens, batch_size=batch, records=greedy_records,
                             done=done, rollout=rollout, first_index=first)
        torch.manual_seed(distributed.sampling_seed(recipe.seed, world))   # reproducible for a given recipe seed
        params = SamplingParams.from_generation(g, n=max(ks))
        counts = sampled_counts(engine, tok, rewards, mine, params, batch_size=batch, records=sample_records, done=done,
                                rollout=rollout, first_index=first)
    except KeyboardInterrupt:
        # Each process writes what it has: with several (torchrun passed the SIGINT to every one) nothing is
        # gathered, so each share goes to its own part files.
        part = f".part-{world.rank}-of-{world.size}" if world.size > 1 else ""
        if part and world.main:   # an earlier eval's whole results would pass for this one's (found by a red team)
            _remove_results(Path(out_dir), ("samples.jsonl", "summary.json"))
        share = f"{len(mine)} of the {len(examples)} prompts (process {world.rank})" if part else f"{len(examples)} prompts"
        _write_results(Path(out_dir), greedy_records + sample_records,
                       {**summary, **env_error_summary([errors.counts()] if errors else None), "interrupted": True,
                        "greedy_done": len(greedy_records),
                        "samples_done": len(sample_records), **({"process": world.rank, "processes": world.size,
                                                                  "prompts_here": len(mine)} if part else {})}, part)
        raise EvalInterrupted(f"interrupted: {len(greedy_records)} greedy and {len(sample_records)} sampled completions "
                              f"of {share} are in {out_dir}/samples{part}.jsonl (summary{part}.json says "
                              "interrupted; its figures need the whole eval)") from None
    finally:
        engine.close()
        if bar is not None:
            bar.close()
    summary.update(combine_greedy(distributed.gather(mine_greedy, world)))
    summary.update(pass_at_k_table(distributed.gather_lists(counts, world), params, ks))
    summary.update(env_error_summary(distributed.gather(errors.counts(), world) if errors else None))
    records = distributed.gather_lists(greedy_records, world) + distributed.gather_lists(sample_records, world)
    if not world.main:
        return summary
    out = Path(out_dir)
    *figures, wrote = summary_lines({**summary, "out": str(out)}, ks)
    for line in figures:   # before the files: a write that fails then loses no figure
        log(line)
    _write_results(out, records, summary)
    summary["out"] = str(out)
    log(wrote)
    return summary


PART_FILES = ("samples.part-*-of-*.jsonl", "summary.part-*-of-*.json")


def _remove_results(out: Path, patterns: Sequence[str]) -> None:
    """Remove an earlier eval's files of these names (glob patterns) from `out`."""
    for pattern in patterns:
        for path in out.glob(pattern):
            if path.is_file():
                path.unlink()


def _write_results(out: Path, records: list, summary: dict, part: str = "") -> None:
    """OUT/samples{part}.jsonl (one line per completion) and OUT/summary{part}.json; part: one process's share of
    an interrupted eval, else ''. EvalError naming the file that cannot be written (a full disk, a folder of that
    name) and why."""
    path = out
    try:
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"samples{part}.jsonl"
        with open(path, "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
        path = out / f"summary{part}.json"
        path.write_text(json.dumps(summary, indent=2) + "\n")
    except OSError as exc:
        why = exc.strerror or errno.errorcode.get(exc.errno or 0) or str(exc)
        raise EvalError(f"cannot write {path}: {why}" + (" (the figures above are not saved)" if not part else "")) \
            from None


def eval_wave(recipe, model, examples: list, samples: int) -> Optional[int]:
    """The most sequences one generate call may decode in this device's memory (memory.fit_sequences: the
    static memory + one call's KV cache, prefill and logits), when that is fewer than eval would decode at once
    (EVAL_BATCH prompts, or one prompt's `samples`); None otherwise, and where the memory model does not apply."""
    from .memory import MemoryModelError, device_budget, fit_sequences, model_workload

    device = "cuda" if next(model.parameters()).is_cuda else "cpu"
    budget = device_budget(device)
    if budget is None or not examples:
        return None
    try:
        shape, workload = model_workload(recipe, model, max(len(e.prompt_ids) for e in examples), device)
    except MemoryModelError:
        return None
    most = max(EVAL_BATCH, samples)
    wave = fit_sequences(shape, workload, budget, most)
    return wave if wave < most else None


def _episodes(recipe, engine, tokenizer, pset) -> Optional[Callable]:
    """With environment.name, the rollout through its episodes (as the trainer's, docs/algorithm.md §20)."""
    if not recipe.environment.name:
        return None
    from .environment import EnvironmentFactory
    from .rollout.turns import TurnLimits, runner

    return runner(engine, tokenizer, EnvironmentFactory(recipe.environment), TurnLimits.from_recipe(recipe.environment),
                  pset.render_message)


class _EnvErrors:
    """The environment's rollout, counting the episodes (greedy and sampled) that an environment error ended and
    keeping the first error's text: such episodes are skipped, so without this an eval whose environment always
    fails would report 0/0 prompts and say nothing of why."""

    def __init__(self, rollout: Callable):
        self.rollout, self.episodes, self.errors, self.first = rollout, 0, 0, None

    def __call__(self, examples: list, params: SamplingParams) -> list:
        completions = self.rollout(examples, params)
        failed = [c.env.error for c in completions if c.env is not None and c.env.error]
        self.episodes += len(completions)
        self.errors += len(failed)
        self.first = self.first or (failed[0] if failed else None)
        return completions

    def counts(self) -> tuple[int, int, Optional[str]]:
        return self.episodes, self.errors, self.first


def env_error_summary(parts: Optional[Sequence[tuple]]) -> dict:
    """summary.json's env_episodes, env_errors and env_first_error from each process's _EnvErrors.counts() (process
    0's first error first); None each without an environment."""
    if parts is None:
        return {"env_episodes": None, "env_errors": None, "env_first_error": None}
    return {"env_episodes": sum(p[0] for p in parts), "env_errors": sum(p[1] for p in parts),
            "env_first_error": next((p[2] for p in parts if p[2]), None)}


def env_error_line(s: dict) -> Optional[str]:
    """The line that says how many episodes an environment error ended (as training logs the first one), or None
    when none did."""
    if not s.get("env_errors"):
        return None
    return (f"environment {s['environment']!r}: {s['env_errors']} of {s['env_episodes']} episodes (greedy and sampled) "
            f"ended in an environment error, and are skipped: not counted in the accuracy or pass@k; the first: "
            f"{s['env_first_error']}")


def summary_lines(s: dict, ks: Sequence[int]) -> list[str]:
    """The printed summary: each figure with the prompts it covers, the prompts the reward skipped (not counted),
    and the rows of the data skipped as bad (data.on_bad_row=skip); the last line names the files written."""
    prompts = s.get("prompts", s["n"])
    notes = [f"{s['correct']}/{s['n']} prompts", f"mean reward {s['mean_reward']:.3f}"]
    if 0 < s["n"] < prompts:   # (with none counted, accuracy_text says so)
        why = "the reward skipped" + (", or an environment error ended," if s.get("environment") else "")
        notes.append(f"{prompts - s['n']} of the {prompts} prompts not counted: {why} "
                     f"{'its completion' if prompts - s['n'] == 1 else 'their completions'}")
    if s.get("rows_skipped"):
        first = s["rows_skipped_first"][0] if s.get("rows_skipped_first") else ""
        first = first if len(first) <= 200 else first[:200] + "..."
        notes.append(f"{s['rows_skipped']} row{'s' * (s['rows_skipped'] != 1)} skipped as bad" +
                     (f": first: {first}" if first else ""))
    lines = [f"greedy accuracy: {accuracy_text(s)} ({', '.join(notes[:2])}" +
             "".join(f"; {note}" for note in notes[2:]) + f") on {s['split']}"]
    if env := env_error_line(s):   # next to the figures it explains (0/0 prompts when every episode failed)
        lines.append(env)
    parts = [f"pass@{k}: " + ("n/a" if s[f"pass@{k}"] is None else f"{100 * s[f'pass@{k}']:.1f}%") +
             (f" ({s[f'pass@{k}/prompts']}/{prompts} prompts)" if f"pass@{k}/prompts" in s else "") for k in ks]
    n = s["samples_per_prompt"]
    left_out = any(s.get(f"pass@{k}/prompts", prompts) < prompts for k in ks)
    lines.append("  ".join(parts) + f"  ({n} sample{'s' * (n != 1)} per prompt at temperature {s['temperature']}" +
                 ("; a prompt counts for pass@k when the reward judged at least k of its samples" if left_out else "")
                 + ")")
    lines.append(f"wrote {s['out']}/samples.jsonl and {s['out']}/summary.json")
    return lines
