"""Which tensors are alive at the peak of one micro-batch's update: a tensor-level trace.

    python scripts/trace_memory.py --tokens 8192 16384                      # Llama-3.1-8B's width, 2 layers
    python scripts/trace_memory.py --tokens 1024 --hidden 1024 --intermediate 3584 --vocab 32000   # CPU-sized
    python scripts/trace_memory.py --tokens 8192 --autocast                 # as the trainer runs by default
    python scripts/trace_memory.py --tokens 2048 4096 --hidden 256 --intermediate 512 --heads 4 --kv-heads 2 \
        --vocab 2048 --layers 4 --autocast --peft-as-on-cuda               # on CPU, peft's LoRA inputs as on CUDA

Builds a small model of a real model's width (random weights, bf16, 4-bit NF4 + LoRA r=16 as the trainer loads
it), then runs the trainer's update path on one sequence of T tokens: completion_logprobs, the loss, backward.
On CUDA it first prints the allocator's peak above the weights (torch.cuda.max_memory_allocated); then,
anywhere, it runs the same pass under a dispatch mode that records every tensor an op creates and when its
storage dies, and prints the tensors alive at the highest point, grouped by shape and dtype. This is how the
memory model's fp32-copies term was found (docs/benchmarks.md, "On a GPU"). The slope of the peak between
two lengths is the per-token cost of the layers' recomputation; --autocast runs the decoder under bf16
autocast, as the trainer does with model.autocast (its default in bf16), and without it as model.autocast: false.

GPU figures need a CUDA machine (not run in CI); on a CPU it traces the CPU path. --peft-as-on-cuda (CPU, with
--autocast): peft casts each LoRA input to the adapters' fp32 unless `torch.is_autocast_enabled()`, which asks
about CUDA's autocast only, so on CPU it casts (and autocast casts back: a bf16 copy per LoRA module) where on
CUDA it does not; this makes that check answer for CPU's autocast, to trace on CPU what CUDA keeps.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


class LiveTensors(TorchDispatchMode):
    """Bytes of the storages that ops create inside the mode, while they live; `peak` and what was alive then.
    Views and in-place results share an input's storage and are not counted again; storages made before the
    mode (the weights) are never counted."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple] = {}
        self.current = self.peak = 0
        self.at_peak: list[tuple[int, tuple]] = []

    def _sweep(self) -> None:
        for key in [k for k, (ref, _, _) in self.live.items() if ref.expired()]:
            self.current -= self.live.pop(key)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)}
        self._sweep()
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if storage.nbytes() and key not in self.live and key not in inputs:
                self.live[key] = (StorageWeakRef(storage), storage.nbytes(), (tuple(t.shape), str(t.dtype)))
                self.current += storage.nbytes()
                if self.current > self.peak:
                    self.peak = self.current
                    self.at_peak = [(n, what) for _, n, what in self.live.values()]
        return out


def build(folder: Path, hidden: int, intermediate: int, heads: int, kv_heads: int, vocab: int, layers: int,
          positions: int) -> None:
    from lowmem_grpo import tiny

    tok = tiny.build_tokenizer()
    spec = tiny.TinyModelSpec(hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                              intermediate_size=intermediate, vocab_size=vocab, max_position_embeddings=positions)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = tiny.build_tool_model(tok, spec).to(torch.bfloat16)  # Llama architecture
    finally:
        torch.set_default_dtype(old)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)


def update_pass(model, mb, device, autocast: bool = False) -> None:
    from lowmem_grpo.batch import completion_logprobs
    from lowmem_grpo.loss import aggregate

    logp = completion_logprobs(model, mb, 1.0, 1024, 8192, autocast=torch.bfloat16 if autocast else None)
    aggregate(logp, mb.weights.to(device)).backward()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384], help="completion lengths to trace")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--autocast", action="store_true", help="the decoder under bf16 autocast (model.autocast)")
    ap.add_argument("--peft-as-on-cuda", action="store_true",
                    help="CPU: torch.is_autocast_enabled() answers for CPU autocast, so peft skips its cast as on CUDA")
    args = ap.parse_args()
    if args.peft_as_on_cuda:
        cuda_check = torch.is_autocast_enabled   # no argument: CUDA's autocast (torch 2.13)
        torch.is_autocast_enabled = lambda *device: cuda_check(*device) if device else cuda_check("cpu")

    from lowmem_grpo import tiny
    from lowmem_grpo.batch import pack
    from lowmem_grpo.model import load_policy
    from lowmem_grpo.recipe import LoraConfig, ModelConfig

    folder = Path(tempfile.mkdtemp(prefix="trace_memory_"))
    build(folder, args.hidden, args.intermediate, args.heads, args.kv_heads, args.vocab, args.layers,
          max(args.tokens) + 16)
    model, _ = load_policy(ModelConfig(name_or_path=str(folder), compute_dtype="bfloat16", load_in_4bit=True),
                           LoraConfig(r=16, alpha=32))
    model.train()
    device = next(model.parameters()).device
    pad = tiny.build_tokenizer().pad_token_id
    for t in args.tokens:
        ids = torch.randint(4, 20, (t,)).tolist()
        mb = pack([[5, 6, 7]], [ids], torch.ones(1), 1, "token_mean", t, pad)[0]
        row = {"tokens": t, "autocast": args.autocast, "peft_as_on_cuda": args.peft_as_on_cuda, "device": device.type}
        if device.type == "cuda":
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            update_pass(model, mb, device, args.autocast)
            torch.cuda.synchronize()
            row["cuda_peak_above_weights_mib"] = round((torch.cuda.max_memory_allocated() - before) / 2**20, 1)
        model.zero_grad(set_to_none=True)
        with LiveTensors() as live:
            update_pass(model, mb, device, args.autocast)
        row["traced_peak_mib"] = round(live.peak / 2**20, 1)
        print(json.dumps(row), flush=True)
        count, size = Counter(), Counter()
        for n, what in live.at_peak:
            count[what] += 1
            size[what] += n
        for what, n in size.most_common(8):
            print(f"  {n / 2**20:9.1f} MiB  x{count[what]}  {what[0]} {what[1]}")


if __name__ == "__main__":
    main()
