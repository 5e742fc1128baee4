"""What a training step costs, and what grows with the dataset (issue 14).

    OMP_NUM_THREADS=1 python scripts/bench_step.py [--rounds 2] [--threads 2] [--sizes 2000 100000 1000000]
                                                   [--no-step] [--no-data] [--no-train] [--old]

Needs the `bench` extra (TRL). Not a test: figures depend on the machine (give its cores and load with them).

Step time, side by side (--no-step to skip): the quickstart configuration (recipes/quickstart.yaml: its
warm-started base from runs/quickstart/, built as scripts/quickstart.py builds it when missing; NF4 + LoRA
r=16, G=8, 64 prompts a step, lr 3e-3, sequence-mean loss, no KL, gradient checkpointing) through
lowmem-grpo and through TRL's GRPOTrainer with the same settings (generation with transformers on the same
4-bit model, the math reward on the row's answer), each in its own process with --threads torch threads,
alternated over --rounds. Each runs --step-steps steps; the first WARMUP_STEPS are not timed. Printed:
s/step of each, lowmem-grpo's phases (select, rollout, reward, pack, no-grad passes, update, diagnostics),
the success rate of the timed steps (a check that both did the same work) and the ratio.

Data (--no-data to skip): JSONL files of two-number addition rows like the quickstart's
(tiny.addition_rows, operands 0..9999 so that most prompts differ), written once under --out (default
runs/bench/data) and reused. For each size:
- prompt selection: `batch_indices` for 64 prompts a step over --steps steps; the one-off cost of an
  epoch's order (computed when the epoch's first batch is drawn) apart, then the mean and the largest
  step that starts no epoch. With --old, also one step of the previous per-prompt algorithm (sizes up to
  100,000 rows: it takes 28 s a step at 860,000).
- start-up, in a fresh process: from opening the data as the trainer does (`prompt_sets` with the tiny
  tokenizer) to the first batch of 64 examples rendered, and the growth of resident memory (VmRSS) over
  it, i.e. what the data holds (its index, the start-up check, the cache of rendered examples).
- for the largest size, unless --no-train: time from `train` start (Trainer(recipe) with the quickstart
  recipe and a random tiny model, preflight and eval off) to the end of its first step, in a fresh process.

The last line is for scripts: step_time_ratio_vs_trl=X select_ms_1m=Y first_step_s_1m=Z data_rss_mib_1m=W,
NA where a figure was not measured.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPTS_PER_STEP = 64
WARMUP_STEPS = 5  # steps of each trainer not timed (allocator, caches, first-call work)
LAST_LINE_KEYS = ("step_time_ratio_vs_trl", "select_ms_1m", "first_step_s_1m", "data_rss_mib_1m")


# --- datasets ----------------------------------------------------------------------------------------

def dataset(folder: Path, n: int) -> Path:
    """A JSONL file of n addition rows (made once; reused while it has n lines)."""
    path = folder / f"addition-{n}.jsonl"
    if path.is_file():
        with open(path, "rb") as f:
            if sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b"")) == n:
                return path
    from lowmem_grpo import tiny

    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        for k, start in enumerate(range(0, n, 100_000)):
            for row in tiny.addition_rows(min(100_000, n - start), seed=k, hi=9999):
                f.write(json.dumps(row) + "\n")
    tmp.replace(path)
    return path


# --- prompt selection --------------------------------------------------------------------------------

def old_batch_indices(n: int, batch_size: int, step: int, seed: int) -> list[int]:
    """The per-prompt algorithm this replaced: a full shuffle for every prompt of the step."""
    out = []
    for pos in range(step * batch_size, (step + 1) * batch_size):
        epoch, offset = divmod(pos, n)
        order = list(range(n))
        random.Random(f"{seed}:{epoch}").shuffle(order)
        out.append(order[offset])
    return out


def bench_select(n: int, steps: int, old: bool, seed: int = 0) -> dict:
    from lowmem_grpo import data

    data._EPOCHS.clear()
    t0 = time.perf_counter()
    data.batch_indices(n, PROMPTS_PER_STEP, 0, seed)  # builds epoch 0's order
    epoch_ms = 1e3 * (time.perf_counter() - t0)
    times, plain = [], []
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        data.batch_indices(n, PROMPTS_PER_STEP, step, seed)
        dt = 1e3 * (time.perf_counter() - t0)
        times.append(dt)
        first, last = step * PROMPTS_PER_STEP, (step + 1) * PROMPTS_PER_STEP - 1
        if first // n == last // n and first % n:  # this step starts no epoch
            plain.append(dt)
    out = {"rows": n, "epoch_order_ms": epoch_ms, "select_mean_ms": statistics.fmean(times),
           "select_max_ms": max(plain) if plain else float("nan"), "steps": steps}
    if old and n <= 100_000:
        t0 = time.perf_counter()
        old_batch_indices(n, PROMPTS_PER_STEP, 1, seed)
        out["old_select_ms"] = 1e3 * (time.perf_counter() - t0)
    return out


# --- start-up (fresh processes) ----------------------------------------------------------------------

def _vmrss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status (Linux only)")


def child_startup(path: str) -> dict:
    """In this (fresh) process: open the data as the trainer does and render the first batch."""
    from lowmem_grpo import tiny
    from lowmem_grpo.data import batch_indices, prompt_sets
    from lowmem_grpo.recipe import DataConfig

    tok = tiny.build_tokenizer()
    tok("0+0=", add_special_tokens=False)  # warm the tokenizer before the baseline
    cfg = DataConfig(train_path=path)
    before = _vmrss_mib()
    t0 = time.perf_counter()
    train = prompt_sets(cfg, tok)["train"]
    t_open = time.perf_counter() - t0
    batch = [train.examples[i] for i in batch_indices(len(train), PROMPTS_PER_STEP, 0, 0)]
    t_first = time.perf_counter() - t0
    assert len(batch) == PROMPTS_PER_STEP
    return {"open_s": t_open, "first_batch_s": t_first, "data_rss_mib": _vmrss_mib() - before,
            "rows": len(train), "checked": train.checked}


def child_first_step(path: str) -> dict:
    """In this (fresh) process: Trainer(recipe) and its first step, timed from the process's launch
    (interpreter start and imports included, as for `lowmem-grpo train`) and from Trainer(recipe)."""
    import torch

    from lowmem_grpo.recipe import load_recipe
    from lowmem_grpo.train import Trainer

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    model, run = os.environ["BENCH_STEP_MODEL"], os.environ["BENCH_STEP_RUN"]
    recipe = load_recipe(ROOT / "recipes" / "quickstart.yaml", [
        f"model.name_or_path={model}", f"data.train_path={path}", "data.eval_path=\"\"",
        "train.steps=1", "train.preflight=false", "train.eval_every=0", f"output.dir={run}"])
    before = _vmrss_mib()
    t0 = time.perf_counter()
    trainer = Trainer(recipe, log=lambda *a: None)
    t_init = time.perf_counter() - t0
    trainer.train_step()
    t_step = time.perf_counter() - t0
    return {"trainer_init_s": t_init, "trainer_step_s": t_step, "rss_growth_mib": _vmrss_mib() - before,
            "first_step_s": time.time() - float(os.environ["BENCH_STEP_LAUNCHED"])}


def tiny_model(folder: Path) -> Path:
    """The quickstart's model shape with random weights (the step's cost, not its accuracy, is measured)."""
    from lowmem_grpo import tiny

    tok = tiny.build_tokenizer()
    tiny.build_model(tok, tiny.TinyModelSpec(), seed=0).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def run_child(kind: str, path: Path, **env: str) -> dict:
    env = {**os.environ, **env, "PYTHONPATH": str(ROOT), "BENCH_STEP_LAUNCHED": repr(time.time())}
    p = subprocess.run([sys.executable, __file__, "--child", kind, str(path)], capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise RuntimeError(f"{kind} child failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


# --- step time: lowmem-grpo against TRL's GRPOTrainer on the quickstart configuration ---------------------

def quickstart_base(out: Path) -> tuple[Path, Path]:
    """The quickstart's warm-started base and its data (runs/quickstart/, reused when present, else built
    as scripts/quickstart.py builds it: about two minutes)."""
    base, data = ROOT / "runs" / "quickstart" / "base", ROOT / "runs" / "quickstart" / "data"
    if not (base / "config.json").is_file() or not (data / "train.jsonl").is_file():
        sys.path.insert(0, str(ROOT / "scripts"))
        from quickstart import build_base

        build_base(base, data, print)
    return base, data / "train.jsonl"


def quickstart_recipe(base: Path, train: Path, run_dir: Path, steps: int) -> dict:
    """recipes/quickstart.yaml on this base and data, evaluation and preflight off (not part of a step)."""
    import yaml

    d = yaml.safe_load((ROOT / "recipes" / "quickstart.yaml").read_text())
    d["model"]["name_or_path"], d["data"]["train_path"] = str(base), str(train)
    d["data"].pop("eval_path", None)
    d["train"].update(steps=steps, eval_every=0, preflight=False)
    d["output"].update(dir=str(run_dir), save_every=10**6, samples_every=0)
    d["output"]["tensorboard"] = False
    return d


def _step_env() -> tuple[Path, Path, int, int]:
    e = os.environ
    return Path(e["BENCH_STEP_BASE"]), Path(e["BENCH_STEP_TRAIN"]), int(e["BENCH_STEP_STEPS"]), int(e["BENCH_STEP_THREADS"])


def child_step_lowmem(run: str) -> dict:
    """In this (fresh) process: the quickstart's steps through lowmem-grpo, each phase timed."""
    import torch

    base, train, steps, threads = _step_env()
    run_dir = Path(run)

    from lowmem_grpo.metrics import PHASES
    from lowmem_grpo.recipe import recipe_from_dict
    from lowmem_grpo.train import Trainer

    torch.set_num_threads(threads)
    trainer = Trainer(recipe_from_dict(quickstart_recipe(base, train, run_dir, steps)), log=lambda *a: None)
    rows = []
    for _ in range(steps):
        t0 = time.perf_counter()
        row = trainer.train_step().row
        trainer.step += 1
        rows.append((time.perf_counter() - t0, row))
    trainer.close()
    timed = rows[WARMUP_STEPS:]
    phases = {p: statistics.mean(r[f"time/{p}_s"] or 0.0 for _, r in timed) for p in PHASES}
    return {"step_s": statistics.mean(t for t, _ in timed), "phases": phases,
            "success_rate": statistics.mean(r["success_rate"] for _, r in timed)}


def child_step_trl(run: str) -> dict:
    """In this (fresh) process: the same configuration through TRL's GRPOTrainer (the bench extra)."""
    import torch
    import yaml
    from datasets import Dataset
    from peft import LoraConfig
    from bench_memory import trl_step_timer  # (scripts/ is on the path: this file runs from there)
    from trl import GRPOConfig, GRPOTrainer

    from lowmem_grpo.model import load_base_model, load_tokenizer
    from lowmem_grpo.recipe import ModelConfig
    from lowmem_grpo.rewards.math import math_reward

    base, train, steps, threads = _step_env()
    run_dir = Path(run)
    q = yaml.safe_load((ROOT / "recipes" / "quickstart.yaml").read_text())
    g, t = q["generation"], q["train"]
    cfg = ModelConfig(name_or_path=str(base), compute_dtype="float32", load_in_4bit=True)
    tok = load_tokenizer(cfg)
    model = load_base_model(cfg)  # the same NF4 load as lowmem-grpo's

    def exact_sum(completions, answer, **kw):  # the quickstart's reward: the math built-in on the row's answer
        return math_reward(completions, rows=[{"answer": a} for a in answer])

    timer = trl_step_timer()
    args = GRPOConfig(
        output_dir=str(run_dir), per_device_train_batch_size=t["prompts_per_step"] * g["num_generations"],
        num_generations=g["num_generations"], max_completion_length=g["max_new_tokens"], max_steps=steps,
        beta=0.0, learning_rate=q["optimizer"]["lr"], temperature=g["temperature"], loss_type="grpo",
        lr_scheduler_type="constant", adam_beta2=0.99, max_grad_norm=1.0, gradient_checkpointing=True,
        use_cpu=True, bf16=False, fp16=False, report_to=[], save_strategy="no", logging_steps=1, seed=0,
        disable_tqdm=True, dataloader_num_workers=0)
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    ds = Dataset.from_list([{"prompt": tok.bos_token + r["prompt"], "answer": r["answer"]} for r in rows])
    peft_cfg = LoraConfig(r=q["lora"]["r"], lora_alpha=q["lora"]["alpha"], target_modules="all-linear",
                          task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=exact_sum, args=args, train_dataset=ds, processing_class=tok,
                          peft_config=peft_cfg, callbacks=[timer])
    torch.set_num_threads(threads)
    trainer.train()
    acc = [h["rewards/exact_sum/mean"] for h in trainer.state.log_history if "rewards/exact_sum/mean" in h]
    return {"step_s": statistics.mean(timer.times[WARMUP_STEPS:]),
            "success_rate": statistics.mean(acc[WARMUP_STEPS:]) if acc else None}


def step_part(args) -> dict:
    """s/step of the quickstart configuration through both trainers, each in its own process, alternated
    over --rounds; lowmem-grpo's phases; the ratio of the means."""
    base, train = quickstart_base(Path(args.out))
    env = dict(BENCH_STEP_BASE=str(base), BENCH_STEP_TRAIN=str(train), BENCH_STEP_STEPS=str(args.step_steps),
               BENCH_STEP_THREADS=str(args.threads))
    ours, trl = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.rounds):
            ours.append(run_child("step_lowmem", Path(tmp) / f"lowmem-{k}", **env))
            trl.append(run_child("step_trl", Path(tmp) / f"trl-{k}", **env))
    mean_ours, mean_trl = statistics.fmean(o["step_s"] for o in ours), statistics.fmean(t["step_s"] for t in trl)
    print(f"quickstart configuration ({args.step_steps} steps, the first {WARMUP_STEPS} not timed; {args.threads} "
          f"torch threads; {args.rounds} alternated round(s)):")
    print(f"  lowmem-grpo {mean_ours:.3f} s/step  " + " ".join(f"{o['step_s']:.3f}" for o in ours))
    print(f"  TRL         {mean_trl:.3f} s/step  " + " ".join(f"{t['step_s']:.3f}" for t in trl))
    phases = {k: statistics.fmean(o["phases"][k] for o in ours) for k in ours[0]["phases"]}
    print("  lowmem-grpo phases (s/step): " + ", ".join(f"{k} {v:.3f}" for k, v in phases.items()))
    print(f"  success rate over the timed steps: lowmem-grpo {statistics.fmean(o['success_rate'] for o in ours):.3f}, "
          f"TRL {statistics.fmean(t['success_rate'] for t in trl if t['success_rate'] is not None):.3f}")
    print(f"  ratio {mean_ours / mean_trl:.2f}x TRL's step time")
    return {"step_time_ratio_vs_trl": f"{mean_ours / mean_trl:.3f}"}


# --- parts -------------------------------------------------------------------------------------------

def data_part(args) -> dict:
    """Selection and start-up figures for each size; the 1M-row ones for the last line."""
    figures = {}
    print(f"machine: {os.cpu_count()} cores (shared with other work), OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}")
    print(f"{'rows':>9} {'epoch order':>12} {'select mean':>12} {'select max':>11} {'old select':>11} "
          f"{'open':>7} {'1st batch':>9} {'data RSS':>9} {'checked':>8}")
    for n in args.sizes:
        path = dataset(Path(args.out), n)
        sel = bench_select(n, args.steps, args.old)
        up = run_child("startup", path)
        old = f"{sel['old_select_ms']:9.1f}ms" if "old_select_ms" in sel else f"{'-':>11}"
        print(f"{n:>9} {sel['epoch_order_ms']:10.1f}ms {sel['select_mean_ms']:10.4f}ms {sel['select_max_ms']:9.4f}ms "
              f"{old} {up['open_s']:6.2f}s {up['first_batch_s']:8.2f}s {up['data_rss_mib']:6.1f}MiB {up['checked']:>8}")
        if n == 1_000_000:
            figures["select_ms_1m"] = f"{sel['select_mean_ms']:.4f}"
            figures["data_rss_mib_1m"] = f"{up['data_rss_mib']:.1f}"
    if not args.no_train:
        n = max(args.sizes)
        with tempfile.TemporaryDirectory() as tmp:
            step = run_child("first_step", dataset(Path(args.out), n), BENCH_STEP_MODEL=str(tiny_model(Path(tmp) / "model")),
                             BENCH_STEP_RUN=str(Path(tmp) / "run"))
        print(f"train start to first step, {n} rows: {step['first_step_s']:.2f}s from process launch; "
              f"{step['trainer_step_s']:.2f}s from Trainer(recipe) ({step['trainer_init_s']:.2f}s to build it: model, "
              f"data, engine; then one step of {PROMPTS_PER_STEP} prompts x 8); RSS growth {step['rss_growth_mib']:.0f} MiB")
        if n == 1_000_000:
            figures["first_step_s_1m"] = f"{step['first_step_s']:.2f}"
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[2000, 100_000, 1_000_000])
    ap.add_argument("--steps", type=int, default=200, help="selection steps timed per size")
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench" / "data"), help="where the datasets are written")
    ap.add_argument("--old", action="store_true", help="also time one step of the old per-prompt selection")
    ap.add_argument("--no-train", action="store_true", help="skip the time from train start to the first step")
    ap.add_argument("--step-steps", type=int, default=30, help="steps per trainer in the step-time comparison")
    ap.add_argument("--rounds", type=int, default=2, help="alternated runs of each trainer in the step-time comparison")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of both trainers in the step-time comparison")
    ap.add_argument("--no-step", action="store_true", help="skip the step-time comparison with TRL")
    ap.add_argument("--no-data", action="store_true", help="skip the data figures (selection, start-up)")
    ap.add_argument("--child", nargs=2, metavar=("KIND", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, path = args.child
        print(json.dumps({"startup": child_startup, "first_step": child_first_step, "step_lowmem": child_step_lowmem,
                          "step_trl": child_step_trl}[kind](path)))
        return
    figures = dict.fromkeys(LAST_LINE_KEYS, "NA")
    if not args.no_step:
        figures.update(step_part(args))
    if not args.no_data:
        figures.update(data_part(args))
    print(" ".join(f"{k}={figures[k]}" for k in LAST_LINE_KEYS))


if __name__ == "__main__":
    main()
