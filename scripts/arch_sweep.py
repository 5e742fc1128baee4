"""Run the CLI on a tiny random model of each decoder family (lowmem_grpo.tiny.ARCH_CLASSES): `train` (4-bit base +
LoRA, 2 steps), `estimate` and `export`, and print each command's exit status and the largest difference between
the engine's log-probs of its samples and the trainer's (rollout/logprob_abs_diff_max; ~1e-7 where they agree).

    OMP_NUM_THREADS=1 .venv/bin/python scripts/arch_sweep.py [--engine vllm] [--out DIR] [KIND ...]

With --engine vllm the shapes take vLLM's CPU limits (head_dim 32, a vocabulary of 64 that vLLM does not pad).
A failing command shows its last line: a named error is the expected outcome for what is refused. About 5 s
per family with the transformers engine on 2 cores. docs/algorithm.md §10-§12 and the README's "Models"
section cite what it found.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from lowmem_grpo import tiny

VLLM_SIZES = dict(vocab_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32)


def run(args: list[str], log: Path) -> tuple[int, str]:
    p = subprocess.run([sys.executable, "-m", "lowmem_grpo.cli", *args], capture_output=True, text=True)
    log.write_text(p.stdout + p.stderr)
    lines = [line for line in (p.stdout + p.stderr).splitlines() if line.strip()]
    return p.returncode, (lines[-1][:160] if lines else "")


def sweep(kind: str, root: Path, engine: str) -> str:
    folder = root / kind
    model = tiny.save_arch_model(kind, folder / "model", **(VLLM_SIZES if engine == "vllm" else {}))
    recipe = {"model": {"name_or_path": str(model), "compute_dtype": "float32", "load_in_4bit": True},
              "lora": {"r": 4, "alpha": 8},
              "data": {"train_path": str(root / "train.jsonl"), "eval_path": str(root / "test.jsonl")},
              "rewards": {"functions": [{"function": "math"}]},
              "generation": {"num_generations": 4, "max_new_tokens": 4, "engine": engine},
              "optimizer": {"lr": 0.01},
              "train": {"steps": 2, "prompts_per_step": 2, "micro_batch_size": 3, "eval_max_prompts": 4},
              "output": {"dir": str(folder / "run"), "save_every": 2, "log_every": 1}, "seed": 3}
    (folder / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    train, last = run(["train", str(folder / "recipe.yaml")], folder / "train.log")
    est, _ = run(["estimate", str(folder / "recipe.yaml")], folder / "estimate.log")
    export, _ = run(["export", str(folder / "run"), "--out", str(folder / "export")], folder / "export.log")
    metrics = folder / "run" / "metrics.jsonl"
    diffs = [r["rollout/logprob_abs_diff_max"] for r in map(json.loads, metrics.read_text().splitlines())
             if r.get("rollout/logprob_abs_diff_max") is not None] if metrics.exists() else []
    gap = f"{max(diffs):.1e}" if diffs else "-"
    return f"{kind:<12} train {train}  estimate {est}  export {export}  logprob gap {gap:>8}" + \
        ("" if train == 0 else f"  | {last}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kinds", nargs="*", help=f"families to run (default: all of {', '.join(tiny.ARCH_CLASSES)})")
    ap.add_argument("--engine", choices=["hf", "vllm"], default="hf")
    ap.add_argument("--out", default=None, help="where the models, runs and logs go (default: a temporary folder)")
    a = ap.parse_args()
    unknown = [k for k in a.kinds if k not in tiny.ARCH_CLASSES]
    if unknown:
        ap.error(f"unknown families {unknown}; known: {', '.join(tiny.ARCH_CLASSES)}")
    root = Path(a.out or tempfile.mkdtemp(prefix="arch-sweep-"))
    root.mkdir(parents=True, exist_ok=True)
    train, test = tiny.split_addition_data(n_train=100, n_test=20, seed=7)
    tiny.write_jsonl(train, root / "train.jsonl")
    tiny.write_jsonl(test, root / "test.jsonl")
    print(f"engine {a.engine}; models, runs and logs under {root}")
    for kind in a.kinds or list(tiny.ARCH_CLASSES):
        print(sweep(kind, root, a.engine), flush=True)


if __name__ == "__main__":
    main()
