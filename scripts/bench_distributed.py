"""One process with T threads against T processes with one thread each, on the same recipe (issue 18).

    python scripts/bench_distributed.py [--procs 2] [--steps 20] [--rounds 2]      # step time
    python scripts/bench_distributed.py --learn [--procs 2] [--seed 0]             # whole quickstart runs

Not a test: figures depend on the machine (give its cores and load with them).

Step time (default): the quickstart configuration (recipes/quickstart.yaml on its warm-started base from
runs/quickstart/, built as scripts/quickstart.py builds it when missing; NF4 + LoRA r=16, G=8, 64 prompts a
step), evaluation, preflight and checkpoints off, run by `lowmem-grpo train` as
  - baseline: one process, OMP_NUM_THREADS=--procs (torch uses that many threads);
  - distributed: `lowmem-grpo train --nproc --procs` (torchrun, gloo), OMP_NUM_THREADS=1 in each process;
the same prompts per step in total, alternated over --rounds. The first WARMUP_STEPS of each run are not
timed. Printed: the median s/step of each, the per-phase medians (process 0's clock; "gather" is the wait
for the other processes' rollouts), the success rate of the timed steps, and the ratio.

--learn: the whole quickstart (its 400 steps, with the held-out eval before and after) once as one process
and once as --procs processes, same seed; prints both runs' held-out accuracy before and after.

The last line is for scripts: step_time_ratio_nproc_vs_threads=X (distributed s/step over one process's).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WARMUP_STEPS = 3


def quickstart_base() -> tuple[Path, Path]:
    """The quickstart's warm-started base and its data folder (built when missing: about two minutes)."""
    base, data = ROOT / "runs" / "quickstart" / "base", ROOT / "runs" / "quickstart" / "data"
    if not (base / "config.json").is_file() or not (data / "train.jsonl").is_file():
        sys.path.insert(0, str(ROOT / "scripts"))
        from quickstart import build_base

        build_base(base, data, print)
    return base, data


def overrides(base: Path, data: Path, run_dir: Path, steps: int | None) -> list[str]:
    out = [f"model.name_or_path={base}", f"data.train_path={data / 'train.jsonl'}", f"output.dir={run_dir}",
           "output.tensorboard=false", "output.samples_every=0"]
    if steps is None:   # --learn: the quickstart as it is, held-out eval included
        return out + [f"data.eval_path={data / 'test.jsonl'}"]
    return out + ["data.eval_path=''", f"train.steps={steps}", "train.eval_every=0", "train.preflight=false",
                  "output.save_every=1000000"]


def run(procs: int, threads: int, sets: list[str], log: Path) -> float:
    """`lowmem-grpo train` on the quickstart recipe: one process (procs=1) or --nproc procs; seconds taken."""
    cmd = [sys.executable, "-m", "lowmem_grpo", "train", str(ROOT / "recipes" / "quickstart.yaml")]
    cmd += (["--nproc", str(procs)] if procs > 1 else []) + [f"--set={s}" for s in sets]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT).returncode
    if rc != 0:
        sys.exit(f"{' '.join(cmd)} failed ({rc}); see {log}")
    return time.perf_counter() - t0


def step_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "eval/accuracy" not in r]


def timed(rows: list[dict]) -> dict:
    rows = rows[WARMUP_STEPS:]
    from lowmem_grpo.metrics import PHASES

    return {"step": statistics.median(r["time/step_s"] for r in rows),
            "phases": {p: statistics.median(r[f"time/{p}_s"] or 0.0 for r in rows) for p in PHASES},
            "success": statistics.mean(r["success_rate"] for r in rows)}


def bench_steps(args, base: Path, data: Path) -> None:
    out = ROOT / "runs" / "bench" / "distributed"
    out.mkdir(parents=True, exist_ok=True)
    configs = {f"1 process x {args.procs} threads": (1, args.procs),
               f"{args.procs} processes x 1 thread": (args.procs, 1)}
    results: dict = {name: [] for name in configs}
    for rnd in range(args.rounds):
        for name, (procs, threads) in configs.items():
            run_dir = out / f"p{procs}-t{threads}-r{rnd}"
            run(procs, threads, overrides(base, data, run_dir, args.steps), out / f"p{procs}-t{threads}-r{rnd}.log")
            results[name].append(timed(step_rows(run_dir)))
            print(f"round {rnd + 1}: {name}: {results[name][-1]['step']:.3f} s/step", flush=True)
    print(f"\nquickstart configuration, {args.steps} steps per run ({WARMUP_STEPS} untimed), {args.rounds} round(s), "
          f"{os.cpu_count()} cores")
    medians = {}
    for name, rs in results.items():
        medians[name] = statistics.median(r["step"] for r in rs)
        phases = {p: statistics.median(r["phases"][p] for r in rs) for p in rs[0]["phases"]}
        print(f"{name:>26}: {medians[name]:.3f} s/step  success {100 * statistics.mean(r['success'] for r in rs):.1f}%  "
              + "  ".join(f"{p} {v:.3f}" for p, v in phases.items() if v))
    one, dist = medians.values()
    print(f"ratio ({args.procs} processes / 1 process): {dist / one:.2f}")
    print(f"step_time_ratio_nproc_vs_threads={dist / one:.3f}")


def bench_learn(args, base: Path, data: Path) -> None:
    out = ROOT / "runs" / "bench" / "distributed-learn"
    out.mkdir(parents=True, exist_ok=True)
    for procs in (1, args.procs):
        threads = args.procs if procs == 1 else 1
        run_dir = out / f"p{procs}-seed{args.seed}"
        took = run(procs, threads, overrides(base, data, run_dir, None) + [f"seed={args.seed}"], out / f"{run_dir.name}.log")
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        evals = [r for r in rows if "eval/accuracy" in r]
        print(f"{procs} process(es) x {threads} thread(s): held-out accuracy {100 * evals[0]['eval/accuracy']:.1f}% -> "
              f"{100 * evals[-1]['eval/accuracy']:.1f}% (steps {evals[0]['step']} -> {evals[-1]['step']}), "
              f"{took:.0f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", type=int, default=2, help="processes (and the one process's threads)")
    ap.add_argument("--steps", type=int, default=20, help="steps per timed run")
    ap.add_argument("--rounds", type=int, default=2, help="times each configuration is run, alternated")
    ap.add_argument("--learn", action="store_true", help="whole quickstart runs instead: held-out before/after")
    ap.add_argument("--seed", type=int, default=0, help="--learn: the runs' seed")
    args = ap.parse_args()
    base, data = quickstart_base()
    (bench_learn if args.learn else bench_steps)(args, base, data)


if __name__ == "__main__":
    main()
