"""Peak memory and step time of one GRPO step: lowmem-grpo against TRL's GRPOTrainer, same model, same run.

    OMP_NUM_THREADS=1 python scripts/bench_memory.py [--lengths 128 512 1024] [--skip-trl] [--hidden 256]
        [--update-only]
    python scripts/bench_memory.py --device cuda --model-config lowmem_grpo/model_configs/Qwen/Qwen2.5-1.5B-Instruct \
        --lengths 512

Needs the `bench` extra (pip install -e '.[bench]': TRL). Not a test: figures depend on the machine.
--device cuda is GPU-only and not run in CI: bf16 compute, weights saved in bf16, and every peak is
torch.cuda.max_memory_allocated (the CUDA context, ~0.5 GiB in nvidia-smi, is not counted, as in the
memory model). --model-config takes a real model's shape and vocabulary from its config.json, with
random weights (nothing is downloaded). A mixture of experts' config (scripts/moe_shapes/: a Qwen3-MoE for the CPU, and
Qwen3-30B-A3B's layers for a GPU) is built from its config.json as it is; lowmem-grpo then stores its routed experts in
NF4 (model.quantize_experts), TRL's child loads it as a TRL user's BitsAndBytesConfig does, experts in the compute
dtype.

The model is built locally (no download): Qwen2 architecture with Qwen2.5's real vocabulary (151,936) and
a small hidden size so a step runs on CPU; loaded as a 4-bit NF4 base + LoRA r=16 on all linear layers by
both trainers. One step = sampling G = 8 completions of exactly L tokens for one prompt through
transformers generate (EOS suppressed so every completion has length L), the reference pass (beta 0.04,
adapters off), and one optimizer step with gradient checkpointing. Each configuration runs in its own
process; the first step warms up, the second is timed; the peak is the process's peak RSS over both.
--update-only skips sampling in both trainers: each is handed the same G completions of exactly L random tokens
(lowmem-grpo through a scripted engine, TRL through its rollout_func), so a step is the reference pass and the
update at that length, and lowmem-grpo's prediction is the memory model's static + train phase.

Also measured, each in its own process: the loss phase alone (log-probs of the 8 x L completion tokens
from their final hidden states, the GRPO loss, backward) through the chunked kernel and through the naive
full-logits path, reported as the growth of RSS over the phase.

Each process's floor (peak RSS once its trainer is built, before step 1: runtime, imports, the 4-bit model)
is printed too, and the step's own cost above it: at small L the floor is most of either peak.

The memory model's prediction (lowmem_grpo/memory.py) is printed beside each lowmem-grpo peak. The last
line is for scripts: peak_ratio_vs_trl=X step_time_ratio_vs_trl=Y loss_peak_1024_over_128=Z (X, Y at the
shortest length).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import psutil  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lowmem_grpo.memory import peak_rss_mib  # noqa: E402  (VmHWM: this process's own peak, not its parent's)

G = 8
# --hidden, --device and --model-config reach the child processes through these variables.
_HIDDEN = int(os.environ.get("BENCH_MEMORY_HIDDEN", "256"))
DEVICE = os.environ.get("BENCH_MEMORY_DEVICE", "cpu")
MODEL_CONFIG = os.environ.get("BENCH_MEMORY_CONFIG")  # a folder holding a config.json: that model's shape
DTYPE = "bfloat16" if DEVICE == "cuda" else "float32"  # the compute dtype (and the saved weights' dtype)


def _shape() -> tuple[dict, int, bool, bool, int, bool]:
    """(layer shape, vocabulary, tied embeddings, Llama architecture, positions, mixture of experts): a real model's
    config.json, or the small CPU default (Qwen2). A Llama config is built as Llama (with tiny.build_tool_model's
    q/k/v biases: 0.1% of the weights), a mixture of experts from its own config, anything else as Qwen2."""
    if not MODEL_CONFIG:
        return (dict(hidden_size=_HIDDEN, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=3 * _HIDDEN),
                151_936, True, False, 2048, False)
    from lowmem_grpo.experts4bit import EXPERT_COUNT_KEYS

    c = json.loads((Path(MODEL_CONFIG) / "config.json").read_text())
    c = c.get("text_config", c)
    return (dict(hidden_size=c["hidden_size"], num_layers=c["num_hidden_layers"], num_heads=c["num_attention_heads"],
                 num_kv_heads=c.get("num_key_value_heads", c["num_attention_heads"]),
                 intermediate_size=c["intermediate_size"]),
            c["vocab_size"], bool(c.get("tie_word_embeddings", False)), c.get("model_type") == "llama",
            max(2048, min(int(c.get("max_position_embeddings", 2048)), 32768)),
            max(int(c.get(k) or 0) for k in EXPERT_COUNT_KEYS) > 1)


SHAPE, VOCAB, TIED, LLAMA, MAX_POSITIONS, MOE = _shape()
LORA_R, LORA_ALPHA, BETA, LR = 16, 32, 0.04, 1e-5
PROMPT = "12+34="


def peak_mib() -> float:
    """This process's peak: VRAM allocated by torch on CUDA, else resident memory (VmHWM)."""
    if DEVICE == "cuda":
        import torch

        return torch.cuda.max_memory_allocated() / 2**20
    return peak_rss_mib()


def reset_peak_rss() -> bool:
    """Linux: reset this process's RSS high-water mark (VmHWM, which peak_rss_mib reads), so that a
    phase's peak excludes set-up transients. False where /proc/self/clear_refs is not writable."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_mib() -> float:
    return psutil.Process().memory_info().rss / 2**20


def build(workdir: Path) -> None:
    """The benchmark model (random weights, saved in the compute dtype) and a one-row prompt file, saved
    once per shape and dtype."""
    import torch

    from lowmem_grpo import tiny

    marker = workdir / "model" / "bench_shape.json"
    want = json.dumps({"shape": SHAPE, "vocab": VOCAB, "tied": TIED, "dtype": DTYPE, "llama": LLAMA,
                       "positions": MAX_POSITIONS,
                       **({"moe": (Path(MODEL_CONFIG) / "config.json").read_text()} if MOE else {})}, sort_keys=True)
    if marker.is_file() and marker.read_text() == want:
        return
    tok = tiny.build_tokenizer()
    spec = tiny.TinyModelSpec(vocab_size=VOCAB, max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=TIED, **SHAPE)
    # On CUDA the random weights are drawn on the GPU in the compute dtype: an 8B model's fp32 CPU init and cast
    # take minutes, this takes seconds.
    with torch.device(DEVICE), _default_dtype(getattr(torch, DTYPE)):
        if MOE:
            model = moe_model(tok).to(getattr(torch, DTYPE))
        else:
            model = (tiny.build_tool_model if LLAMA else tiny.build_model)(tok, spec, seed=0).to(getattr(torch, DTYPE))
    model.save_pretrained(workdir / "model")
    tok.save_pretrained(workdir / "model")
    tiny.write_jsonl([{"prompt": PROMPT, "answer": "46"}] * 4, workdir / "prompts.jsonl")
    marker.write_text(want)  # last: a build cut short is redone


def moe_model(tok):
    """The mixture of MODEL_CONFIG's config.json, random weights, with the tokenizer's special tokens."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(MODEL_CONFIG)
    config.update(dict(pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                       max_position_embeddings=MAX_POSITIONS))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        setattr(model.generation_config, key, getattr(tok, key))
    return model


@contextlib.contextmanager
def _default_dtype(dtype):
    import torch

    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def never_eos(model) -> None:
    # A random model hits EOS at random; both trainers must generate exactly L tokens to be comparable.
    model.generation_config.eos_token_id = None
    model.generation_config.suppress_tokens = None


# ----------------------------------------------------------------------------------------------------
# Children: one configuration per process
# ----------------------------------------------------------------------------------------------------

class ExactLengthEngine:
    """--scripted: completions of exactly max_new_tokens random (non-special) tokens, drawn at once. Measures the
    update at lengths where sampling them would take most of the run (20K tokens x G); the rollout phase's KV
    cache is then not allocated, and the figure to compare is the memory model's static + train phase. TRL's
    scripted child draws from it too (tokens()), so both trainers get the same completions."""

    def __init__(self, vocab: int, special: set[int], seed: int = 0):
        import torch

        self.ok = torch.tensor([i for i in range(min(vocab, 32000)) if i not in special])
        self.g = torch.Generator().manual_seed(seed)

    def tokens(self, n: int) -> list[int]:
        import torch

        return self.ok[torch.randint(len(self.ok), (n,), generator=self.g)].tolist()

    def generate(self, prompts, params):
        from lowmem_grpo.rollout.base import Completion

        return [Completion(i, self.tokens(params.max_new_tokens), truncated=True)
                for i in range(len(prompts)) for _ in range(params.n)]

    def close(self):
        pass


def phase_peaks(trainer, peaks: dict, reserved: dict) -> None:
    """CUDA: record torch's allocated peak of each phase of a step (rollout, the no-grad passes, the update)
    into `peaks`, and the caching allocator's reserved peak into `reserved` (MiB, the largest over steps), by
    wrapping the trainer's phase methods. Reserved over allocated is what memory.ALLOCATOR_SLACK allows for."""
    import torch

    def wrap(name, fn):
        def measured(*a, **kw):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            out = fn(*a, **kw)
            torch.cuda.synchronize()
            peaks[name] = max(peaks.get(name, 0.0), torch.cuda.max_memory_allocated() / 2**20)
            reserved[name] = max(reserved.get(name, 0.0), torch.cuda.max_memory_reserved() / 2**20)
            return out
        return measured

    for name, attr in (("rollout", "rollout"), ("no_grad", "no_grad_logprobs"), ("train", "run_updates")):
        setattr(trainer, attr, wrap(name, getattr(trainer, attr)))


def bench_recipe(workdir: Path, length: int, micro_batch: int, opts: dict):
    """The recipe every lowmem-grpo child runs (opts: G, offload, autocast, steps; see child_lowmem)."""
    from lowmem_grpo.recipe import recipe_from_dict

    g = opts.get("G", G)
    return recipe_from_dict({
        "model": {"name_or_path": str(workdir / "model"), "compute_dtype": DTYPE, "load_in_4bit": True,
                  "autocast": opts.get("autocast", True)},
        "lora": {"r": LORA_R, "alpha": LORA_ALPHA},
        "data": {"train_path": str(workdir / "prompts.jsonl")},
        "rewards": {"functions": [{"function": "exact"}]},
        "generation": {"num_generations": g, "max_new_tokens": length, "temperature": 1.0},
        "algorithm": {"beta": BETA},
        "optimizer": {"lr": LR},
        "train": {"steps": opts.get("steps", 2), "prompts_per_step": 1, "micro_batch_size": micro_batch,
                  "offload_activations": bool(opts.get("offload"))},
        "output": {"dir": str(workdir / f"run-lowmem-{length}")},
    })


def child_lowmem(workdir: Path, length: int, micro_batch: int, opts: dict) -> dict:
    """opts: G (completions), offload (train.offload_activations), scripted (ExactLengthEngine), steps (the last is
    timed)."""
    from lowmem_grpo.memory import estimate
    from lowmem_grpo.train import Trainer

    recipe = bench_recipe(workdir, length, micro_batch, opts)
    shutil.rmtree(recipe.output.dir, ignore_errors=True)   # an earlier run's, with --workdir reused: a fresh run
    steps = recipe.train.steps
    trainer = Trainer(recipe, log=lambda *a: None)
    loaded = peak_mib()  # runtime, imports, 4-bit model, LoRA, optimizer: before any step
    # On CPU the safetensors weights are memory-mapped and become resident as they are first read; every
    # generation step reads the whole embedding / LM head. Read it once: the floor any step sits on.
    for w in {id(m.weight): m.weight for m in (trainer.model.get_input_embeddings(),
                                                trainer.model.get_output_embeddings())}.values():
        float(w.float().sum())
    resident = loaded if DEVICE == "cuda" else max(loaded, rss_mib())
    never_eos(trainer.model)
    if opts.get("scripted"):
        trainer.engine = ExactLengthEngine(trainer.model.config.vocab_size, set(trainer.tokenizer.all_special_ids))
    peaks: dict = {}
    reserved: dict = {}
    if DEVICE == "cuda":
        phase_peaks(trainer, peaks, reserved)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        row = trainer.train_step().row
        trainer.step += 1
        times.append(time.perf_counter() - t0)
    assert row["completion/mean_length"] == length, row["completion/mean_length"]
    prompt_tokens = len(trainer.train_set.longest_prompt())
    est = estimate(*trainer.memory_model(prompt_tokens))   # (a mixture's experts and adapters as loaded)
    static = sum(est.static.values())
    return {"peak_mib": max([peak_mib(), loaded, *peaks.values()]), "loaded_mib": loaded, "resident_mib": resident,
            "prompt_tokens": prompt_tokens,
            "step_s": times[-1], "predicted_mib": est.peak / 2**20, "predicted_phase": est.peak_phase,
            "phase_peak_mib": peaks, **({"reserved_peak_mib": max(reserved.values())} if reserved else {}),
            "predicted_phase_mib": {p: (static + sum(parts.values())) / 2**20 for p, parts in est.phases.items()},
            "rollout_tokens_per_s": row.get("time/rollout_tokens_per_s"), "rollout_s": row.get("time/rollout_s"),
            "estimate": est.lines()}


def trl_step_timer():
    """A TRL (transformers Trainer) callback that records each optimizer step's wall-clock seconds in .times."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times, self.t0 = [], 0.0

        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self.t0)

    return StepTimer()


def child_trl(workdir: Path, length: int, opts: dict) -> dict:
    """opts: G (completions), scripted (TRL samples nothing: its rollout_func hands it ExactLengthEngine's G completions
    of exactly L tokens, so the step is its reference pass + update, as lowmem-grpo's scripted one), steps (the last is
    timed). Out of CUDA memory is a result: {"oom": true, "peak_mib": allocated peak when it failed}."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    from lowmem_grpo.model import load_base_model, load_tokenizer
    from lowmem_grpo.recipe import ModelConfig

    g, steps, scripted = opts.get("G", G), opts.get("steps", 2), bool(opts.get("scripted"))
    # the same NF4 load as lowmem-grpo's, but a mixture's routed experts stay in the compute dtype, as
    # from_pretrained(quantization_config=BitsAndBytesConfig(load_in_4bit=True)) leaves them for a TRL user
    cfg = ModelConfig(name_or_path=str(workdir / "model"), compute_dtype=DTYPE, load_in_4bit=True, quantize_experts=False)
    tok = load_tokenizer(cfg)
    model = load_base_model(cfg)
    never_eos(model)

    engine, handed = None, []  # handed: completions per rollout_func call
    if scripted:
        engine = ExactLengthEngine(model.config.vocab_size, set(tok.all_special_ids))
        os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"  # rollout_func's experimental-API warning: not an error's tail

    def scripted_rollout(prompts, trainer):
        # TRL's sampler already repeats each prompt G times in the slice: one completion per entry, the prompts
        # tokenized as TRL's own generate path does, logprobs None as that path returns (no vLLM correction).
        handed.append(len(prompts))
        return {"prompt_ids": trainer.processing_class(text=prompts)["input_ids"],
                "completion_ids": [engine.tokens(length) for _ in prompts], "logprobs": None}

    timer = trl_step_timer()
    args = GRPOConfig(
        output_dir=str(workdir / f"run-trl-{length}"), per_device_train_batch_size=g, num_generations=g,
        max_completion_length=length, max_steps=steps, beta=BETA, learning_rate=LR, temperature=1.0,
        gradient_checkpointing=True, use_cpu=DEVICE == "cpu", bf16=DTYPE == "bfloat16", fp16=False, report_to=[], save_strategy="no",
        logging_steps=1, seed=0, loss_type="grpo", disable_tqdm=True, dataloader_num_workers=0,
    )
    peft_cfg = LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, target_modules="all-linear", task_type="CAUSAL_LM")
    ds = Dataset.from_list([{"prompt": tok.bos_token + PROMPT}] * 4)
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                          train_dataset=ds, processing_class=tok, peft_config=peft_cfg, callbacks=[timer],
                          rollout_func=scripted_rollout if scripted else None)
    torch.set_num_threads(1)
    loaded = peak_mib()
    try:
        trainer.train()
    except torch.OutOfMemoryError as exc:  # CUDA only (TRL's [tokens x vocab] logits at long L): the figure itself
        return {"oom": True, "peak_mib": peak_mib(), "loaded_mib": loaded, "scripted": scripted,
                "message": str(exc).split("\n")[0][:300]}
    logged = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    lengths = [h[f"completions/{k}_length"] for h in logged for k in ("mean", "min", "max")]
    assert len(logged) == steps and all(abs(m - length) < 1e-6 for m in lengths), lengths
    assert not scripted or handed == [g] * steps, f"rollout_func handed {handed} completions, expected {g} per step"
    return {"peak_mib": peak_mib(), "loaded_mib": loaded, "step_s": timer.times[-1], "scripted": scripted,
            "completion_length": logged[-1]["completions/mean_length"]}


def child_loss(length: int, impl: str, chunk_tokens: int, chunk_vocab: int) -> dict:
    """Log-probs of G x L completion tokens from their hidden states, the GRPO loss, backward to the hidden
    states (a frozen head, as under LoRA). Reported: the phase's peak above the memory before it (RSS on
    CPU, torch's allocated VRAM on CUDA)."""
    import torch

    from lowmem_grpo.logprobs import reference_log_probs, selective_log_softmax
    from lowmem_grpo.loss import LossOptions, grpo_token_loss
    from lowmem_grpo.memory import return_freed_memory_to_os

    cuda = DEVICE == "cuda"
    if not cuda:
        return_freed_memory_to_os()  # as the trainer does on CPU
    torch.manual_seed(0)
    n, d = G * length, SHAPE["hidden_size"]
    kw = {"device": DEVICE, "dtype": getattr(torch, DTYPE)}  # head and hidden states in the compute dtype
    head = torch.randn(VOCAB, d, **kw).mul_(0.02)
    hidden = torch.randn(n, d, requires_grad=True, **kw)
    targets = torch.randint(0, VOCAB, (n,), device=DEVICE)
    adv = torch.randn(n, device=DEVICE)
    logp_ref = torch.randn(n, device=DEVICE) - 12.0
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() / 2**20
    else:
        before = rss_mib()
        reset_peak_rss()  # where it cannot (not Linux), set-up transients may count as the phase's
    if impl == "chunked":
        logp = selective_log_softmax(hidden, head, targets, chunk_rows=chunk_tokens, chunk_vocab=chunk_vocab)
    else:
        logp = reference_log_probs(hidden, head, targets)
    tl = grpo_token_loss(logp, logp.detach(), logp_ref, adv, LossOptions(beta=BETA, eps_low=0.2, eps_high=0.2))
    tl.loss.mean().backward()
    assert hidden.grad is not None and torch.isfinite(hidden.grad).all()
    return {"phase_mib": peak_mib() - before, "peak_mib": peak_mib()}


def cuda_free_mib() -> float:
    import torch

    return torch.cuda.mem_get_info()[0] / 2**20


def run_child(args: list[str]) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"error": " | ".join(tail) or f"exit {proc.returncode}"}


# ----------------------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024])
    ap.add_argument("--micro-batch", type=int, default=G, help="lowmem-grpo micro_batch_size (TRL does all G at once)")
    ap.add_argument("--chunk-tokens", type=int, default=1024)
    ap.add_argument("--chunk-vocab", type=int, default=8192)
    ap.add_argument("--skip-trl", action="store_true")
    ap.add_argument("--update-only", action="store_true",
                    help="both trainers are handed scripted completions (no sampling): the reference pass + update")
    ap.add_argument("--hidden", type=int, default=None, help="model width (default 256; MLP 3x, 4 heads)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default=DEVICE,
                    help="cuda: bf16 compute, peaks from torch.cuda.max_memory_allocated (GPU only, not run in CI)")
    ap.add_argument("--model-config", default=MODEL_CONFIG,
                    help="a folder with a config.json (e.g. lowmem_grpo/model_configs/Qwen/Qwen2.5-1.5B-Instruct): "
                         "that model's shape and vocabulary, random weights")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, rest = args.child[0], args.child[1:]
        if kind == "lowmem":
            out = child_lowmem(Path(rest[0]), int(rest[1]), int(rest[2]), json.loads(rest[3]) if len(rest) > 3 else {})
        elif kind == "trl":
            out = child_trl(Path(rest[0]), int(rest[1]), json.loads(rest[2]) if len(rest) > 2 else {})
        else:
            out = child_loss(int(rest[0]), rest[1], int(rest[2]), int(rest[3]))
        print("RESULT " + json.dumps(out), flush=True)
        return

    if args.hidden and args.model_config:
        ap.error("--hidden and --model-config both set the model's shape: give one")
    config = str(Path(args.model_config).resolve()) if args.model_config else None
    if config and not (Path(config) / "config.json").is_file():
        ap.error(f"--model-config {args.model_config}: no config.json there")
    if (args.hidden and args.hidden != _HIDDEN) or args.device != DEVICE or config != MODEL_CONFIG:
        # Re-run with the shape and device in the environment, where the children read them.
        os.environ.update({"BENCH_MEMORY_HIDDEN": str(args.hidden or _HIDDEN), "BENCH_MEMORY_DEVICE": args.device})
        if config:
            os.environ["BENCH_MEMORY_CONFIG"] = config
        sys.exit(subprocess.call([sys.executable, __file__, *sys.argv[1:]]))
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench_memory_"))
    build(workdir)
    what = "peak VRAM (torch.cuda.max_memory_allocated)" if DEVICE == "cuda" else "peak RSS"
    arch = f"mixture of experts ({args.model_config})" if MOE else "Llama" if LLAMA else "Qwen2"
    print(f"model: {arch}, vocab {VOCAB:,}, {SHAPE}, tied embeddings {TIED}, {DTYPE}, NF4 + LoRA r={LORA_R}; G={G}, "
          f"beta={BETA}; {DEVICE}, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}; lowmem micro_batch_size="
          f"{args.micro_batch}; memory: {what}; completions: "
          f"{'scripted for both trainers (update only)' if args.update_only else 'sampled'}")
    print(f"\n{'L':>5} | {'lowmem peak':>11} {'predicted':>10} {'err':>6} | {'TRL peak':>9} | {'peak ratio':>10} | "
          f"{'lowmem s/step':>13} {'TRL s/step':>10} {'time ratio':>10}")
    steps, opts = {}, json.dumps({"scripted": args.update_only})
    for length in args.lengths:
        ours = run_child(["lowmem", str(workdir), str(length), str(args.micro_batch), opts])
        trl = {"error": "skipped"} if args.skip_trl else run_child(["trl", str(workdir), str(length), opts])
        if trl.get("oom"):
            trl = {"error": f"out of CUDA memory ({trl['peak_mib']:.0f} MiB allocated when it failed)"}
        steps[length] = (ours, trl)
        if "error" in ours:
            print(f"{length:>5} | lowmem-grpo failed: {ours['error']}")
            continue
        pred = ours["predicted_phase_mib"]["train"] if args.update_only else ours["predicted_mib"]
        err = 100 * (pred - ours["peak_mib"]) / ours["peak_mib"]
        line = f"{length:>5} | {ours['peak_mib']:>7.0f} MiB {pred:>6.0f} MiB {err:>+5.0f}% | "
        if "error" in trl:
            line += f"{'-':>9} | {'-':>10} | {ours['step_s']:>11.2f} s {'-':>10} {'-':>10}   (TRL: {trl['error']})"
        else:
            line += (f"{trl['peak_mib']:>5.0f} MiB | {ours['peak_mib'] / trl['peak_mib']:>9.2f}x | "
                     f"{ours['step_s']:>11.2f} s {trl['step_s']:>8.2f} s {ours['step_s'] / trl['step_s']:>9.2f}x")
        print(line, flush=True)

    # Both processes pay a floor before their first step: torch, transformers, peft and bitsandbytes (whose
    # import calls torch.compile, which loads dynamo/inductor/sympy: ~70 MiB) and the 4-bit model. The
    # step's own cost is the peak above that floor. The first step also pages in the memory-mapped
    # embedding / LM head (generation reads all of it), so "floor + weights read" bounds any trainer's peak.
    print(f"\nabove each process's floor ({what} once the trainer is built, before step 1):")
    for length, (ours, trl) in steps.items():
        if "error" in ours or "error" in trl:
            continue
        a, b = ours["peak_mib"] - ours["loaded_mib"], trl["peak_mib"] - trl["loaded_mib"]
        print(f"{length:>5} | lowmem-grpo floor {ours['loaded_mib']:>5.0f} MiB, step +{a:>5.0f} MiB | TRL floor "
              f"{trl['loaded_mib']:>5.0f} MiB, step +{b:>5.0f} MiB | step ratio {a / b:.2f}x", flush=True)
        if DEVICE == "cuda":
            continue  # on CUDA the weights were copied to the GPU while loading: the floor holds them
        print(f"{'':>5} | lowmem-grpo floor with the embedding read once: {ours['resident_mib']:.0f} MiB = "
              f"{ours['resident_mib'] / trl['peak_mib']:.3f}x TRL's peak (a step that allocated nothing)", flush=True)

    print(f"\nloss phase alone (log-probs + loss + backward of {G} x L tokens), growth over the phase:")
    print(f"{'L':>5} | {'chunked':>10} | {'naive (full logits)':>19} | {'naive/chunked':>13}")
    phase = {}
    for length in args.lengths:
        c = run_child(["loss", str(length), "chunked", str(args.chunk_tokens), str(args.chunk_vocab)])
        # The naive path holds logits, their log_softmax and the logits' gradient: 3 x tokens x vocab fp32.
        need = 3 * G * length * VOCAB * 4 / 2**20
        avail = (cuda_free_mib() if DEVICE == "cuda" else psutil.virtual_memory().available / 2**20)
        if need > 0.8 * avail:
            n = {"error": f"not run: needs ~{need / 1024:.1f} GiB, {avail / 1024:.1f} GiB available"}
        else:
            n = run_child(["loss", str(length), "naive", "0", "0"])
        phase[length] = c
        cs = f"{c['phase_mib']:>6.0f} MiB" if "error" not in c else "failed"
        ns = f"{n['phase_mib']:>15.0f} MiB" if "error" not in n else f"failed ({n['error'][-60:]})"
        ratio = f"{n['phase_mib'] / c['phase_mib']:>12.1f}x" if "error" not in c and "error" not in n else "-"
        print(f"{length:>5} | {cs:>10} | {ns:>19} | {ratio:>13}", flush=True)

    short, long_ = min(args.lengths), max(args.lengths)
    ours, trl = steps[short]
    peak_ratio = ours["peak_mib"] / trl["peak_mib"] if "error" not in ours and "error" not in trl else float("nan")
    time_ratio = ours["step_s"] / trl["step_s"] if "error" not in ours and "error" not in trl else float("nan")
    ok = "error" not in phase[short] and "error" not in phase[long_]
    loss_ratio = phase[long_]["phase_mib"] / phase[short]["phase_mib"] if ok else float("nan")
    print(f"\npeak_ratio_vs_trl={peak_ratio:.3f} step_time_ratio_vs_trl={time_ratio:.3f} "
          f"loss_peak_{long_}_over_{short}={loss_ratio:.3f}")


if __name__ == "__main__":
    main()
