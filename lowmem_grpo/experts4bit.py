"""A mixture of experts' routed experts in 4-bit NF4.

transformers 5 keeps a MoE layer's routed experts as two 3-D tensors ([experts, 2 x width, hidden] gate/up and
[experts, hidden, width] down), not as linear layers, so bitsandbytes' 4-bit loading leaves them in the compute
dtype: for Qwen3-30B-A3B 54 of its 56 GiB (docs/algorithm.md §25). `quantize_experts` stores each expert's two
matrices in NF4 instead (bitsandbytes.functional.quantize_4bit, Linear4bit's 64-weight blocks), and runs the layer
by an experts implementation registered through transformers' plugin API (ExpertsInterface,
`set_experts_implementation`): each expert that a token is routed to multiplies with bnb.matmul_4bit, which
dequantizes its weight inside the product, forward and backward, so no dequantized expert outlives its product.

Quantized experts are frozen: peft no longer sees them (they are buffers), so LoRA trains the attention and the
dense and shared-expert MLP layers, as the memory model counts (`lowmem-grpo estimate`). The layouts quantized are
the common one (gate and up concatenated, [out, in] matrices, no bias: Qwen2/3-MoE, Mixtral, OLMoE, DeepSeek-V3,
...); another (gpt-oss's transposed, biased experts) stays in the compute dtype, said at start-up.

Checked on CPU (tests/test_experts4bit.py) against a twin whose experts hold the dequantized weights in the
model's own forward: outputs, input and LoRA gradients equal. model.load_base_model stages a mixture in host
memory and quantizes onto the device (so loading needs the experts' compute-dtype bytes there once); that path
onto a GPU has not run (tests/gpu/test_cuda.py holds its test; docs/benchmarks.md, "The next GPU run").
"""

from __future__ import annotations

from typing import Optional

import torch

IMPLEMENTATION = "lowmem_nf4"
BLOCKSIZE = 64
PROJECTIONS = ("gate_up_proj", "down_proj")


# Where configs give their number of routed experts (Qwen-MoE, Mixtral, DeepSeek)
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def routed_experts(config) -> int:
    """The routed experts per MoE layer a config declares; 0 (or 1) for a dense model."""
    return max(int(getattr(config, key, 0) or 0) for key in EXPERT_COUNT_KEYS)


def is_experts(module: torch.nn.Module) -> bool:
    """A module of routed experts as transformers 5 writes them: its class decorated by use_experts_implementation
    (which sets the layout flags) and its experts as 3-D parameters, or already quantized here."""
    if not hasattr(module, "is_transposed"):
        return False
    params = module._parameters
    return hasattr(module, "nf4_shapes") or all(
        isinstance(params.get(p), torch.nn.Parameter) and params[p].dim() == 3 for p in PROJECTIONS)


# The common layout (internals.experts_internals checks that transformers still sets these flags)
HANDLED_LAYOUT = {"has_gate": True, "is_concatenated": True, "is_transposed": False, "has_bias": False}


def layout_problem(module: torch.nn.Module) -> Optional[str]:
    """Why these experts cannot be quantized here, or None: only the common layout is."""
    wrong = [f"{k}={getattr(module, k, None)}" for k, v in HANDLED_LAYOUT.items() if getattr(module, k, None) is not v]
    return f"{type(module).__name__} has {', '.join(wrong)}" if wrong else None


def _quantize(weight: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed [experts, n/2, 1] uint8, absmax [experts, n/64] float32, the NF4 code) of a 3-D weight, expert by
    expert, each moved to `device` first (one expert's compute-dtype copy there at a time). On the meta device
    (the memory model's copy) only their shapes."""
    experts, n = weight.shape[0], weight.shape[1] * weight.shape[2]
    if weight.is_meta:
        return (torch.empty(experts, (n + 1) // 2, 1, dtype=torch.uint8, device="meta"),
                torch.empty(experts, -(-n // BLOCKSIZE), device="meta"), torch.empty(16, device="meta"))
    import bitsandbytes.functional as F

    packed, absmax = [], []
    for e in range(experts):
        q, state = F.quantize_4bit(weight[e].to(device).contiguous(), blocksize=BLOCKSIZE, quant_type="nf4",
                                   compress_statistics=False)
        packed.append(q)
        absmax.append(state.absmax)
    return torch.stack(packed), torch.stack(absmax), state.code


def quantize_experts(model: torch.nn.Module, device=None) -> tuple[int, list[str]]:
    """Store every routed-experts module of `model` in NF4, on `device` (default: where each weight is), and
    switch the model to the implementation that runs them. Returns (modules quantized, why they were not); with
    any layout not handled, none is quantized."""
    modules = [m for m in model.modules() if is_experts(m) and not hasattr(m, "nf4_shapes")]
    problems = sorted({p for m in modules if (p := layout_problem(m))})
    if not modules or problems:
        return 0, problems
    register()
    for m in modules:
        m.nf4_shapes, m.nf4_dtype = {}, m._parameters[PROJECTIONS[0]].dtype
        for proj in PROJECTIONS:
            weight = m._parameters.pop(proj).data   # (the compute-dtype tensor goes with its last reference)
            packed, absmax, code = _quantize(weight, device or weight.device)
            m.nf4_shapes[proj] = tuple(weight.shape[1:])
            m.register_buffer(f"{proj}_nf4", packed)
            m.register_buffer(f"{proj}_absmax", absmax)
            del weight
        m.register_buffer("nf4_code", code)   # (NF4's 16 values: the same for every weight)
    model.set_experts_implementation(IMPLEMENTATION)
    return len(modules), []


def _state(module: torch.nn.Module, proj: str, expert: int):
    import bitsandbytes.functional as F

    return F.QuantState(absmax=getattr(module, f"{proj}_absmax")[expert], shape=module.nf4_shapes[proj],
                        code=module.nf4_code, blocksize=BLOCKSIZE, quant_type="nf4", dtype=module.nf4_dtype)


def dequantized(module: torch.nn.Module, proj: str) -> torch.Tensor:
    """One projection of all experts back in the compute dtype, [experts, out, in] (tests, export checks)."""
    import bitsandbytes.functional as F

    packed = getattr(module, f"{proj}_nf4")
    return torch.stack([F.dequantize_4bit(packed[e], _state(module, proj, e)) for e in range(packed.shape[0])])


def nf4_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' eager experts loop (the tokens routed to each expert, gate/up, the gate, down, weighted and
    added back), each product by bnb.matmul_4bit on the expert's NF4 weight."""
    import bitsandbytes as bnb

    out = torch.zeros_like(hidden_states)
    with torch.no_grad():
        # (the count from the weights themselves: each family's class names its own attribute for it)
        routed = torch.nn.functional.one_hot(top_k_index, num_classes=self.gate_up_proj_nf4.shape[0]).permute(2, 1, 0)
        hit = torch.greater(routed.sum(dim=(-1, -2)), 0).nonzero().flatten().tolist()
    for e in hit:
        slot, token = torch.where(routed[e])
        x = hidden_states[token]
        gate_up = bnb.matmul_4bit(x, self.gate_up_proj_nf4[e].t(), quant_state=_state(self, "gate_up_proj", e))
        y = bnb.matmul_4bit(self._apply_gate(gate_up), self.down_proj_nf4[e].t(),
                            quant_state=_state(self, "down_proj", e))
        out.index_add_(0, token, (y * top_k_weights[token, slot, None]).to(out.dtype))
    return out


def register() -> None:
    """Make IMPLEMENTATION a name transformers' set_experts_implementation accepts (its public registry), once the
    fence has checked what else the forward relies on."""
    from .internals import experts_internals

    experts_internals().ExpertsInterface.register(IMPLEMENTATION, nf4_experts_forward)
