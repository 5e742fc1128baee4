"""The CUDA check: one command that runs tests/gpu and prints one table of peak VRAM and s/step.

    python scripts/gpu_check.py                 # on a CUDA machine: the tests, then every row
    python scripts/gpu_check.py --dry-run       # anywhere: the plan (rows, models, what runs), nothing run
    python scripts/gpu_check.py --rows qwen1.5b-512 llama8b-20k --skip-tests --out results/
    python scripts/gpu_check.py --rows qwen1.5b-512 --skip-tests --skip-trl --no-autocast   # the A/B of model.autocast

GPU-only (a CPU machine gets a clear message and exit code 2; CI runs only --dry-run). Needs the `bench`
extra (TRL) and bitsandbytes with its CUDA library; docs/benchmarks.md says which wheels a bare GPU machine
needs and how to carry them.

Each row is one model shape (random weights built from the shipped config.json in lowmem_grpo/model_configs,
as scripts/bench_memory.py does; nothing is downloaded), 4-bit NF4 + LoRA r=16, bf16 compute, one prompt,
G completions of exactly L tokens (EOS suppressed), beta 0.04 (the reference pass runs). Two steps: the
first warms up, the second is timed. Peaks are torch.cuda.max_memory_allocated (the CUDA context, ~0.5 GiB in
nvidia-smi, is not counted, as in the memory model) and the memory model's prediction is printed beside each
with its error. TRL's GRPOTrainer runs the same model and step where the row says so. "HF tok/s" is the
transformers engine's sampled tokens per second in the timed step. "resv/alloc" is the caching allocator's reserved
peak over the allocated one: what the card must hold beyond the memory model's figure, which the trainer's budget
allows for with memory.ALLOCATOR_SLACK.

Update-only rows (`update only` in the plan, `scripted` in the table) skip sampling in both trainers:
completions of exactly L random tokens come from a scripted engine (20K tokens x 8 through transformers generate
would take most of the lease), handed to lowmem-grpo as its engine and to TRL through GRPOTrainer's
rollout_func, the same G x L tokens to both; so the row measures the reference pass and the update at that
length, where TRL's [tokens x vocab] logits dominate its peak. Our prediction there is the memory model's
static + train phase. A TRL run out of CUDA memory is a figure, not a failure: its column says OOM, and
ours/TRL is bounded by TRL's allocated peak when it failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "scripts" / "bench_memory.py"
sys.path[:0] = [str(ROOT), str(BENCH.parent)]   # lowmem_grpo, and bench_memory's recipe for --from-results

from lowmem_grpo.hub import MODEL_CONFIGS  # noqa: E402  (the shipped config.json files, named like hub ids)
from lowmem_grpo.memory import ALLOCATOR_SLACK  # noqa: E402


@dataclass(frozen=True)
class Row:
    name: str
    model: str              # hub id, its shape from lowmem_grpo/model_configs/<model>/config.json; or scripts/moe_shapes/...
    length: int             # completion tokens, exactly
    micro_batch: int
    g: int = 8
    offload: bool = False   # train.offload_activations
    autocast: bool = True   # model.autocast (the decoder's training passes under bf16 autocast, as TRL's bf16 runs)
    update_only: bool = False  # scripted completions (both trainers): measures the update, not sampling
    trl: bool = True        # also run TRL's GRPOTrainer on the same model and step
    steps: int = 2          # the last is timed; 1 for the big shapes (a 7B step samples for minutes)

    @property
    def config(self) -> Path:
        return ROOT / self.model if self.model.startswith("scripts/") else MODEL_CONFIGS / self.model


# The recipes' lengths (gsm8k: 1.5B at 512, math: 7B at 1024) and the anchors': Unsloth's 1.5B GRPO figure and
# its Llama-3.1-8B at 20K context, G = 8. The 1.5B update rows measure TRL where its logits grow past the model:
# at 4K with the recipe's micro-batch, at 16K with the 20K rows' micro-batch 1. TRL has no activation offload: it
# runs on the offload-off 20K row only.
ROWS = [
    Row("qwen1.5b-512", "Qwen/Qwen2.5-1.5B-Instruct", 512, 4),
    Row("qwen1.5b-4k", "Qwen/Qwen2.5-1.5B-Instruct", 4096, 4, update_only=True),
    Row("qwen1.5b-16k", "Qwen/Qwen2.5-1.5B-Instruct", 16384, 1, update_only=True),
    Row("qwen7b-1024", "Qwen/Qwen2.5-7B-Instruct", 1024, 4, steps=1),
    Row("llama8b-512", "meta-llama/Llama-3.1-8B-Instruct", 512, 4, steps=1),
    Row("llama8b-20k", "meta-llama/Llama-3.1-8B-Instruct", 20000, 1, update_only=True, steps=1),
    Row("llama8b-20k-offload", "meta-llama/Llama-3.1-8B-Instruct", 20000, 1, offload=True, update_only=True, trl=False,
        steps=1),
    # A mixture of experts: Qwen3-30B-A3B's layers (8 of 48: 16 GiB in bf16 fits the machine's disk), its experts in
    # NF4 here and in bf16 under TRL (what BitsAndBytesConfig leaves them in)
    Row("qwen3moe-8l-512", "scripts/moe_shapes/qwen3-30b-a3b-8-layers", 512, 4, steps=1),
]


def recorded_row(result: dict) -> Row:
    """The row of a results.json; rows recorded before model.autocast existed ran without it."""
    return Row(**{"autocast": False, **result["row"]})


def plan_lines(rows: list[Row], tests: bool) -> list[str]:
    out = ["plan:"]
    if tests:
        out.append("  pytest tests/gpu (NF4 + LoRA vs dequantized twin, chunked log-probs fp32/bf16, activation offload, "
                   "preflight on a simulated small card, a short quickstart)")
    for r in rows:
        what = "update only (scripted completions)" if r.update_only else "sample + update"
        who = ("lowmem-grpo only" if not r.trl else
               "lowmem-grpo and TRL (TRL's completions scripted too, through rollout_func)" if r.update_only else
               "lowmem-grpo and TRL")
        out.append(f"  {r.name}: {r.model} shape ({r.config.relative_to(ROOT)}), G={r.g}, L={r.length}, "
                   f"micro-batch {r.micro_batch}, offload {'on' if r.offload else 'off'}, "
                   f"autocast {'on' if r.autocast else 'off'}, {what}, {r.steps} step(s); "
                   f"{who}")
    return out


def run_bench_child(row: Row, kind: str, workdir: Path, timeout: float) -> dict:
    env = {**os.environ, "BENCH_MEMORY_DEVICE": "cuda", "BENCH_MEMORY_CONFIG": str(row.config)}
    if kind == "lowmem":
        opts = {"G": row.g, "offload": row.offload, "autocast": row.autocast, "scripted": row.update_only,
                "steps": row.steps}
        args = ["lowmem", str(workdir), str(row.length), str(row.micro_batch), json.dumps(opts)]
    else:
        opts = {"G": row.g, "scripted": row.update_only, "steps": row.steps}
        args = ["trl", str(workdir), str(row.length), json.dumps(opts)]
    try:
        proc = subprocess.run([sys.executable, str(BENCH), "--child", *args], capture_output=True, text=True,
                              env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-4:]
    return {"error": " | ".join(tail) or f"exit {proc.returncode}"}


def build_model(row: Row, workdir: Path) -> None:
    """bench_memory's build (random weights of the row's shape, bf16, on the GPU), in a child process."""
    env = {**os.environ, "BENCH_MEMORY_DEVICE": "cuda", "BENCH_MEMORY_CONFIG": str(row.config)}
    code = f"import sys; sys.argv=['bench_memory']; sys.path.insert(0, {str(BENCH.parent)!r}); " \
           f"import bench_memory as b; from pathlib import Path; b.build(Path({str(workdir)!r}))"
    subprocess.run([sys.executable, "-c", code], env=env, check=True)


def predictions(row: Row, prompt_tokens: int) -> dict:
    """The memory model's prediction for a row, from this checkout's code (--from-results reprices old results):
    the whole run's peak and static + each phase, in MiB."""
    os.environ["BENCH_MEMORY_DEVICE"] = "cuda"  # bench_memory's compute dtype for a CUDA row: bf16 (read on import)
    import bench_memory

    from lowmem_grpo.memory import estimate_recipe

    opts = {"G": row.g, "offload": row.offload, "autocast": row.autocast, "steps": row.steps}
    recipe = bench_memory.bench_recipe(Path("unused"), row.length, row.micro_batch, opts)
    recipe = recipe.model_copy(update={"model": recipe.model.model_copy(update={"name_or_path": str(row.config)})})
    est, _, _ = estimate_recipe(recipe, "cuda", prompt_tokens)   # (a mixture's experts as loading stores them)
    static = sum(est.static.values())
    return {"predicted_mib": est.peak / 2**20,
            "predicted_phase_mib": {p: (static + sum(parts.values())) / 2**20 for p, parts in est.phases.items()}}


def reserved_over_allocated(ours: dict) -> Optional[float]:
    """The run's reserved peak (torch.cuda.max_memory_reserved) over its allocated peak: the share of the card the
    allocator's rounding and fragmentation took beyond what the memory model counts. None where not recorded
    (rows measured before it was)."""
    return ours["reserved_peak_mib"] / ours["peak_mib"] if ours.get("reserved_peak_mib") else None


def gib(mib: float) -> str:
    return f"{mib / 1024:.2f}"


def table(results: list[dict]) -> list[str]:
    head = (f"{'row':<20} {'G':>2} {'L':>6} {'mb':>2} {'offl':>4} {'ac':>3} {'compl':>8} | {'ours GiB':>8} {'pred GiB':>8} "
            f"{'err':>6} | {'TRL GiB':>7} {'ours/TRL':>8} | {'ours s/step':>11} {'TRL s/step':>10} | {'HF tok/s':>8} | "
            f"{'resv/alloc':>10}")
    out = [head, "-" * len(head)]
    for res in results:
        r, ours, trl = recorded_row(res), res["ours"], res.get("trl") or {"error": "not run"}
        lead = (f"{r.name:<20} {r.g:>2} {r.length:>6} {r.micro_batch:>2} {'on' if r.offload else 'off':>4} "
                f"{'on' if r.autocast else 'off':>3} {'scripted' if r.update_only else 'sampled':>8} | ")
        if "error" in ours:
            out.append(lead + f"lowmem-grpo failed: {ours['error'][-150:]}")
            continue
        pred = ours["predicted_phase_mib"]["train"] if r.update_only else ours["predicted_mib"]
        err = 100 * (pred - ours["peak_mib"]) / ours["peak_mib"]
        line = lead + f"{gib(ours['peak_mib']):>8} {gib(pred):>8} {err:>+5.1f}% | "
        if "error" in trl:
            line += f"{'-':>7} {'-':>8} | {ours['step_s']:>11.2f} {'-':>10} | "
        elif trl.get("oom"):  # TRL needed more than it held when it failed: ours/TRL is at most ours/that
            bound = f"<{ours['peak_mib'] / trl['peak_mib']:.2f}x"
            line += f"{'OOM':>7} {bound:>8} | {ours['step_s']:>11.2f} {'-':>10} | "
        else:
            line += (f"{gib(trl['peak_mib']):>7} {ours['peak_mib'] / trl['peak_mib']:>7.2f}x | "
                     f"{ours['step_s']:>11.2f} {trl['step_s']:>10.2f} | ")
        tps = ours.get("rollout_tokens_per_s")
        line += f"{tps:>8.0f}" if tps and not r.update_only else f"{'-':>8}"
        ratio = reserved_over_allocated(ours)
        line += f" | {ratio:>9.2f}x" if ratio else f" | {'-':>10}"
        out.append(line)
    out.append(f"resv/alloc: the caching allocator's reserved peak over torch's allocated peak; the trainer's budget "
               f"allows up to {1 / (1 - ALLOCATOR_SLACK):.2f}x (memory.ALLOCATOR_SLACK); '-': not recorded.")
    if any(recorded_row(res).update_only for res in results):
        out.append("compl scripted: no sampling; both trainers are handed the same G x L random tokens (TRL through "
                   "rollout_func): the reference pass + update. OOM: TRL ran out of CUDA memory.")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit (runs anywhere)")
    ap.add_argument("--rows", nargs="+", metavar="NAME", help=f"rows to run (default all): {', '.join(r.name for r in ROWS)}")
    ap.add_argument("--skip-tests", action="store_true", help="skip pytest tests/gpu")
    ap.add_argument("--skip-trl", action="store_true", help="skip every TRL run")
    ap.add_argument("--no-autocast", action="store_true",
                    help="run lowmem-grpo with model.autocast: false (the decoder without bf16 autocast), for an A/B")
    ap.add_argument("--out", default=None, help="folder for results.json and the children's details")
    ap.add_argument("--workdir", default="/tmp/lowmem_gpu_check", help="where the random-weight models are built")
    ap.add_argument("--child-timeout", type=float, default=900.0, help="seconds per child process")
    ap.add_argument("--from-results", nargs="+", metavar="JSON",
                    help="print the table of earlier runs' results.json (measured figures as they were), with the "
                         "memory model's predictions recomputed by this checkout's code; runs anywhere")
    args = ap.parse_args()
    if args.from_results:
        results = []
        for path in args.from_results:
            for res in json.loads(Path(path).read_text())["results"]:
                if "error" not in res["ours"]:  # rows measured before prompt_tokens was recorded: the bench prompt's 7
                    res["ours"].update(predictions(recorded_row(res), res["ours"].get("prompt_tokens", 7)))
                results.append(res)
        print("\n".join(table(results)))
        return 0

    known = {r.name: r for r in ROWS}
    unknown = [n for n in (args.rows or []) if n not in known]
    if unknown:
        ap.error(f"unknown row(s) {', '.join(unknown)}; known: {', '.join(known)}")
    rows = [known[n] for n in args.rows] if args.rows else list(ROWS)
    if args.skip_trl:
        rows = [Row(**{**asdict(r), "trl": False}) for r in rows]
    if args.no_autocast:
        rows = [Row(**{**asdict(r), "autocast": False}) for r in rows]
    missing = [str(r.config) for r in rows if not (r.config / "config.json").is_file()]
    if missing:
        print(f"error: no config.json in {', '.join(missing)}", file=sys.stderr)
        return 2
    print("\n".join(plan_lines(rows, not args.skip_tests)), flush=True)
    if args.dry_run:
        return 0

    import torch

    if not torch.cuda.is_available():
        print("error: scripts/gpu_check.py needs a CUDA GPU and torch.cuda.is_available() is False here. "
              "Use --dry-run to see the plan; the CPU figures come from scripts/bench_memory.py.", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name}, {props.total_memory / 2**30:.1f} GiB; torch {torch.__version__}", flush=True)
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)

    tests_summary = "skipped (--skip-tests)"
    if not args.skip_tests:
        t0 = time.time()
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-s", "-p", "no:cacheprovider",
                               str(ROOT / "tests" / "gpu")], capture_output=True, text=True, cwd=ROOT)
        print(proc.stdout[-6000:], proc.stderr[-2000:], flush=True)
        if out:
            (out / "gpu_tests.log").write_text(proc.stdout + proc.stderr)
        lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
        tests_summary = f"{lines[-1] if lines else 'no output'} ({time.time() - t0:.0f} s)"

    results = []
    for r in rows:
        workdir = Path(args.workdir) / r.model.replace("/", "--")
        t0 = time.time()
        try:
            build_model(r, workdir)
        except subprocess.CalledProcessError as exc:
            results.append({"row": asdict(r), "ours": {"error": f"model build failed: {exc}"}})
            continue
        print(f"[{r.name}] model ready in {time.time() - t0:.0f} s", flush=True)
        ours = run_bench_child(r, "lowmem", workdir, args.child_timeout)
        print(f"[{r.name}] lowmem-grpo: {json.dumps({k: v for k, v in ours.items() if k != 'estimate'})}", flush=True)
        trl = run_bench_child(r, "trl", workdir, args.child_timeout) if r.trl else None
        if trl is not None:
            print(f"[{r.name}] TRL: {json.dumps(trl)}", flush=True)
        results.append({"row": asdict(r), "ours": ours, "trl": trl})
        if out:
            (out / "results.json").write_text(json.dumps({"tests": tests_summary, "results": results}, indent=1))

    print(f"\ntests/gpu: {tests_summary}")
    print("\n".join(table(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
