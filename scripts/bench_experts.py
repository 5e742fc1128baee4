"""A mixture of experts with its routed experts in NF4 (model.quantize_experts) against the same mixture with them in
compute dtype (the baseline, what bitsandbytes' 4-bit loading alone gives): weight bytes, peak memory and the time
of one training pass (forward + backward of LoRA on attention, through every MoE layer), same model, same run.

    OMP_NUM_THREADS=1 python scripts/bench_experts.py [--experts 32] [--hidden 512] [--layers 4] [--tokens 512]
    python scripts/bench_experts.py --device cuda --dtype bfloat16     # GPU-only, not run in CI

A Qwen3-MoE built locally with random weights (nothing downloaded), saved in the compute dtype, loaded as the trainer
loads it (model.load_base_model: 4-bit NF4 linears; experts staged and quantized, or left). Each configuration runs
in its own process; the first pass warms up, the second is timed. "loaded" is the memory held once the model is
loaded (RSS on CPU, after returning freed memory to the OS; torch.cuda.memory_allocated on CUDA); the peak is the
process's peak RSS (CPU: the staged compute-dtype experts included, as loading holds them in host memory) or
torch.cuda.max_memory_allocated (CUDA) over loading and both passes. The memory model's base-weight figure is
printed beside each. Not a test: figures depend on the machine. The last line is for scripts:
experts_bytes_ratio=W loaded_ratio=X peak_ratio=Y pass_time_ratio=Z (NF4 over compute dtype).
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


def build(folder: Path, a) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=1024, hidden_size=a.hidden, intermediate_size=2 * a.hidden, num_hidden_layers=a.layers,
        num_attention_heads=8, num_key_value_heads=2, head_dim=a.hidden // 8, num_experts=a.experts,
        num_experts_per_tok=a.top_k, moe_intermediate_size=a.hidden, max_position_embeddings=4096)
    transformers.AutoModelForCausalLM.from_config(config).to(getattr(torch, a.dtype)).save_pretrained(folder)


def peak_mib(device: str) -> float:
    import resource

    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def resident_mib(device: str) -> float:
    import gc

    import psutil
    import torch

    gc.collect()
    if device == "cuda":
        return torch.cuda.memory_allocated() / 2**20
    from lowmem_grpo.memory import return_freed_memory_to_os

    return_freed_memory_to_os()
    return psutil.Process().memory_info().rss / 2**20


def child(folder: str, nf4: bool, a) -> dict:
    import torch

    from lowmem_grpo import memory as mm
    from lowmem_grpo.model import attach_lora, load_base_model
    from lowmem_grpo.recipe import LoraConfig, ModelConfig

    cfg = ModelConfig(name_or_path=folder, compute_dtype=a.dtype, quantize_experts=nf4)
    model = load_base_model(cfg, device=a.device)
    experts = sum(t.numel() * t.element_size() for n, t in [*model.named_parameters(), *model.named_buffers()]
                  if ".experts." in n)
    shape = mm.ModelShape.from_config(model.config)
    predicted = mm.base_weight_bytes(shape, mm.Workload(compute_bytes=mm.DTYPE_BYTES[a.dtype], experts_nf4=nf4))
    resident = resident_mib(a.device)   # after loading: the staged copy (host memory) has gone
    policy = attach_lora(model, LoraConfig(r=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    ids = torch.randint(0, 1024, (1, a.tokens), generator=torch.Generator().manual_seed(0)).to(a.device)
    times = []
    for _ in range(2):
        policy.zero_grad(set_to_none=True)
        if a.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        policy(input_ids=ids).logits.float().log_softmax(-1)[..., 0].mean().backward()
        if a.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return {"experts_mib": experts / 2**20, "predicted_base_mib": predicted / 2**20, "peak_mib": peak_mib(a.device),
            "resident_mib": resident, "pass_s": times[-1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--child", nargs=2, metavar=("FOLDER", "NF4"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child[0], a.child[1] == "1", a)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        build(Path(tmp), a)
        rows = {}
        for nf4 in (False, True):
            out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--child", tmp, str(int(nf4))],
                                 capture_output=True, text=True, check=True)
            rows[nf4] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"Qwen3-MoE: {a.layers} layers, hidden {a.hidden}, {a.experts} experts (top-{a.top_k}), {a.tokens} tokens, "
          f"{a.dtype} on {a.device}")
    print(f"{'experts':<12}{'experts MiB':>12}{'base (model)':>14}{'loaded MiB':>12}{'peak MiB':>10}{'pass s':>9}")
    for nf4, r in rows.items():
        print(f"{'NF4' if nf4 else a.dtype:<12}{r['experts_mib']:>12.1f}{r['predicted_base_mib']:>14.1f}"
              f"{r['resident_mib']:>12.0f}{r['peak_mib']:>10.0f}{r['pass_s']:>9.3f}")
    base, q = rows[False], rows[True]
    print(f"experts_bytes_ratio={q['experts_mib'] / base['experts_mib']:.3f} "
          f"loaded_ratio={q['resident_mib'] / base['resident_mib']:.3f} peak_ratio={q['peak_mib'] / base['peak_mib']:.3f} "
          f"pass_time_ratio={q['pass_s'] / base['pass_s']:.2f}")


if __name__ == "__main__":
    main()
