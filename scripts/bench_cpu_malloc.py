"""CPU only: GRPO step time and peak RSS against glibc's mmap threshold (memory.CPU_MMAP_THRESHOLD).

    OMP_NUM_THREADS=1 python scripts/bench_cpu_malloc.py [--recipe runs/quickstart/run-seed0/recipe.yaml]
                                                         [--thresholds 1 4 default] [--steps 5]

Runs the quickstart's recipe (written by scripts/quickstart.py, which must have run once) for one warm-up
step and --steps timed steps, each threshold in its own process (the setting is process-wide; "default"
leaves glibc's dynamic threshold alone). Prints seconds per step and peak RSS; the last line is for
scripts: `MiB=seconds/peak ...`. Why it matters: blocks at or above the threshold are mmapped, so freed
ones leave RSS at once, but each is page-faulted afresh on every use.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def child(recipe_path: str, threshold: str, steps: int, out_dir: str) -> dict:
    import lowmem_grpo.train as train
    from lowmem_grpo import memory
    from lowmem_grpo.recipe import load_recipe

    if threshold == "default":
        train.return_freed_memory_to_os = lambda: False
    else:
        memory.CPU_MMAP_THRESHOLD = int(threshold) << 20
    recipe = load_recipe(recipe_path, [f"output.dir={out_dir}", "train.preflight=false"])
    trainer = train.Trainer(recipe, log=lambda *a: None)
    trainer.train_step()
    trainer.step += 1
    t0 = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
        trainer.step += 1
    return {"step_s": (time.perf_counter() - t0) / steps, "peak_mib": memory.peak_memory_mib()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default=str(ROOT / "runs/quickstart/run-seed0/recipe.yaml"))
    ap.add_argument("--thresholds", nargs="+", default=["1", "4", "default"], help="MiB, or 'default'")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.recipe, args.child[0], int(args.child[1]), args.child[2])), flush=True)
        return
    if not Path(args.recipe).is_file():
        sys.exit(f"{args.recipe}: not found; run scripts/quickstart.py once (it writes the run's recipe.yaml)")
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_cpu_malloc_") as tmp:
        for thr in args.thresholds:
            p = subprocess.run([sys.executable, __file__, "--recipe", args.recipe, "--child", thr, str(args.steps),
                                str(Path(tmp) / f"run-{thr}")], capture_output=True, text=True)
            line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if p.returncode != 0 or line is None:
                sys.exit(f"threshold {thr} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
            r = results[thr] = json.loads(line[len("RESULT "):])
            label = "glibc default" if thr == "default" else f"{thr} MiB"
            print(f"{label:>14}: {r['step_s']:.3f} s/step, peak {r['peak_mib']:.0f} MiB", flush=True)
    print(" ".join(f"{thr}={r['step_s']:.3f}/{r['peak_mib']:.0f}" for thr, r in results.items()))


if __name__ == "__main__":
    main()
