"""The fences around what lowmem_grpo uses of peft's and bitsandbytes' internals.

Each library's undocumented attributes are read or written in one function here (`peft_internals()`,
`bnb_internals()`, `experts_internals()` for transformers' mixture-of-experts modules; vLLM's are in `lowmem_grpo.rollout.vllm.vllm_internals()`, which stays there because
vllm is optional and must be imported after that module sets its environment). Each function records the
version it was checked against, checks its assumptions every time it is called, and raises
`InternalsError` naming the library, the installed version, the checked version and what broke. So an
upgrade that moves an internal fails at once with a message, not later with wrong numbers.
tests/test_internals.py breaks each assumption on purpose and sees its fence fail.

Also here: `quiet_bitsandbytes_kernels_warning()`, which drops bitsandbytes' log line about the optional
`kernels` package being absent (it reads as an error; nothing is wrong).
"""

from __future__ import annotations

import importlib
import inspect
import logging
from dataclasses import dataclass
from types import SimpleNamespace

PEFT_VERSION_CHECKED = "0.21.2"
BNB_VERSION_CHECKED = "0.50.2"


class InternalsError(RuntimeError):
    """An internal of a third-party library is not where (or what) lowmem_grpo expects."""


def fence_error(library: str, installed: str, checked: str, problems: list[str]) -> InternalsError:
    """The one message every fence gives: library, installed version, checked version, what broke."""
    return InternalsError(
        f"{library} {installed} is not what lowmem_grpo expects (checked against {library} {checked}): "
        + "; ".join(problems)
        + f". Install {library}=={checked}, or update lowmem_grpo for {library} {installed}.")


def raise_if_broken(library: str, installed: str, checked: str, problems: list[str]) -> None:
    if problems:
        raise fence_error(library, installed, checked, problems)


def names_used(function) -> frozenset:
    """Attribute and global names a function's bytecode refers to (a cheap 'does it still read X')."""
    code = getattr(inspect.unwrap(function), "__code__", None) if function is not None else None
    return frozenset(code.co_names) if code is not None else frozenset()


def _class_at(module_name: str, attr: str, problems: list[str]):
    """module_name.attr if it is a class, else None with a problem noted."""
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        problems.append(f"{module_name}.{attr} is gone ({type(exc).__name__}: {exc})")
        return None
    if not isinstance(obj, type):
        problems.append(f"{module_name}.{attr} is no longer a class")
        return None
    return obj


# ----------------------------------------------------------------------------------------------------
# peft
# ----------------------------------------------------------------------------------------------------

# What peft's LoRA forward reads, and so what the vLLM engine's fast path reproduces: for each active
# adapter present in lora_A, result = base(x) + lora_B(lora_A(lora_dropout(x))) * scaling, unless the
# adapter has a lora_variant (DoRA...), or the layer's adapters are disabled or merged.
PEFT_FORWARD_NAMES = ("base_layer", "disable_adapters", "merged", "active_adapters", "lora_A", "lora_B",
                      "lora_dropout", "scaling", "lora_variant")


@dataclass
class LoraBranch:
    """One active adapter of a peft LoRA layer. variant: DoRA or another LoRA variant, whose forward is
    not B(A(dropout(x))) * scaling."""

    name: str
    dropout: object
    a: object
    b: object
    scaling: float
    variant: bool


@dataclass
class LoraState:
    """A peft LoRA layer right now. off: adapters disabled or merged (the base layer alone computes it)."""

    base_layer: object
    off: bool
    branches: list


def peft_internals() -> SimpleNamespace:
    """Everything lowmem_grpo uses of peft beyond its documented API, checked against peft 0.21.2.

    - `lora_types`: peft's plain LoRA linear layers, peft.tuners.lora.layer.Linear (dense base) and
      peft.tuners.lora.bnb.Linear4bit (4-bit base, when bitsandbytes imports), matched by exact type.
    - `lora_state(module)`: a LoraState read from one such layer: get_base_layer(), disable_adapters,
      merged, and per active adapter its lora_dropout, lora_A, lora_B, scaling and lora_variant entries.

    Checked on every call: both classes exist and their forward reads PEFT_FORWARD_NAMES; a LoRA layer
    built through peft's public API (inject_adapter_in_model) has those attributes, with the expected
    types, and computes base(x) + B(A(x)) * scaling.
    """
    import peft

    problems: list[str] = []
    classes = [("peft.tuners.lora.layer", "Linear")]
    try:
        import bitsandbytes  # noqa: F401  (peft defines its 4-bit LoRA layer only when this imports)

        classes.append(("peft.tuners.lora.bnb", "Linear4bit"))
    except ImportError:
        pass
    types = []
    for module_name, attr in classes:
        cls = _class_at(module_name, attr, problems)
        if cls is None:
            continue
        missing = [n for n in PEFT_FORWARD_NAMES if n not in names_used(getattr(cls, "forward", None))]
        if missing:
            problems.append(f"{module_name}.{attr}.forward no longer reads {', '.join(missing)}")
        types.append(cls)
    if not problems:
        problems += _probe_peft_lora(types[0])
    raise_if_broken("peft", peft.__version__, PEFT_VERSION_CHECKED, problems)

    def lora_state(module) -> LoraState:
        try:
            branches = [LoraBranch(name, module.lora_dropout[name], module.lora_A[name], module.lora_B[name],
                                   module.scaling[name], name in module.lora_variant)
                        for name in module.active_adapters if name in module.lora_A]
            return LoraState(module.get_base_layer(), bool(module.disable_adapters or module.merged), branches)
        except (AttributeError, KeyError, TypeError) as exc:
            raise fence_error("peft", peft.__version__, PEFT_VERSION_CHECKED, [
                f"reading a {type(module).__name__} LoRA layer failed ({type(exc).__name__}: {exc})"]) from exc

    return SimpleNamespace(version=peft.__version__, checked=PEFT_VERSION_CHECKED, lora_types=tuple(types),
                           lora_state=lora_state)


def _probe_peft_lora(lora_linear: type) -> list[str]:
    """Build a 3->2 LoRA layer through peft's public API and check what lora_state reads from it."""
    import torch
    from peft import LoraConfig, inject_adapter_in_model

    class Probe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(3, 2)

    problems: list[str] = []
    with torch.random.fork_rng(devices=[]), torch.no_grad():  # peft initialises lora_A from the global RNG
        try:
            model = inject_adapter_in_model(LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=["proj"]),
                                            Probe())
            layer = model.proj
        except Exception as exc:
            return [f"building a LoRA layer through peft's public API failed ({type(exc).__name__}: {exc})"]
        if type(layer) is not lora_linear:
            return [f"a LoRA layer on torch.nn.Linear is a {type(layer).__module__}.{type(layer).__qualname__}, "
                    "not peft.tuners.lora.layer.Linear"]
        expected = {"lora_A": torch.nn.ModuleDict, "lora_B": torch.nn.ModuleDict,
                    "lora_dropout": torch.nn.ModuleDict, "scaling": dict, "lora_variant": dict,
                    "merged": bool, "disable_adapters": bool, "active_adapters": list}
        for name, kind in expected.items():
            try:
                value = getattr(layer, name)
            except Exception as exc:
                problems.append(f"a LoRA layer has no `{name}` ({type(exc).__name__}: {exc})")
                continue
            if not isinstance(value, kind):
                problems.append(f"a LoRA layer's `{name}` is a {type(value).__name__}, not a {kind.__name__}")
        base = getattr(layer, "get_base_layer", None)
        if not callable(base) or base() is not getattr(layer, "base_layer", None):
            problems.append("a LoRA layer's get_base_layer() no longer returns its base_layer")
        if problems:
            return problems
        if layer.merged or layer.disable_adapters or layer.active_adapters != ["default"]:
            problems.append(f"a fresh LoRA layer reads merged={layer.merged}, disable_adapters="
                            f"{layer.disable_adapters}, active_adapters={layer.active_adapters}")
        a = layer.lora_A["default"] if "default" in layer.lora_A else None
        b = layer.lora_B["default"] if "default" in layer.lora_B else None
        if type(a) is not torch.nn.Linear or type(b) is not torch.nn.Linear:
            return problems + [f"lora_A/lora_B hold {type(a).__name__}/{type(b).__name__}, not torch.nn.Linear"]
        if layer.scaling.get("default") != 2.0:  # lora_alpha / r
            problems.append(f"scaling is {layer.scaling.get('default')!r} for lora_alpha=4, r=2 (expected 2.0)")
        gen = torch.Generator().manual_seed(0)
        b.weight.copy_(torch.randn(b.weight.shape, generator=gen))
        x = torch.randn(4, 3, generator=gen)
        want = layer.base_layer(x) + b(a(x)) * 2.0
        got = layer(x)
        if not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
            problems.append(f"a LoRA layer's forward is not base(x) + B(A(x)) * scaling "
                            f"(max difference {(got - want).abs().max().item():.2e})")
    return problems


# ----------------------------------------------------------------------------------------------------
# bitsandbytes
# ----------------------------------------------------------------------------------------------------

BNB_REPACK_FLAG = "support_avx512bf16_for_cpu"
BNB_KERNELS_LOGGER = "bitsandbytes.backends.cpu.ops"


def bnb_internals() -> SimpleNamespace:
    """Everything lowmem_grpo uses of bitsandbytes beyond its documented API, checked against 0.50.2.

    - `disable_cpu_repack(module)`: sets a Linear4bit's `support_avx512bf16_for_cpu` to False. With it
      True (AVX512-BF16 CPUs), Linear4bit.forward repacks the weight in place on the first eval no-grad
      forward, after which backward through the layer is wrong (see model.disable_cpu_4bit_repack).
    - `kernels_logger`: the name of the logger (bitsandbytes/backends/cpu/ops.py's module logger) that
      warns when the optional `kernels` package is absent; quiet_bitsandbytes_kernels_warning filters it.

    Checked on every call: bitsandbytes.nn.Linear4bit exists, its __init__ sets and its forward reads the
    flag; that module's `logger` has that name.
    """
    import bitsandbytes

    problems: list[str] = []
    linear4bit = _class_at("bitsandbytes.nn", "Linear4bit", problems)
    if linear4bit is not None:
        for method in ("__init__", "forward"):
            if BNB_REPACK_FLAG not in names_used(getattr(linear4bit, method, None)):
                problems.append(f"bitsandbytes.nn.Linear4bit.{method} no longer uses `{BNB_REPACK_FLAG}` "
                                "(the flag that turns off its in-place CPU repack of 4-bit weights)")
    try:
        ops_logger = getattr(importlib.import_module(BNB_KERNELS_LOGGER), "logger", None)
        if not isinstance(ops_logger, logging.Logger) or ops_logger.name != BNB_KERNELS_LOGGER:
            problems.append(f"{BNB_KERNELS_LOGGER}.logger is not the logger named {BNB_KERNELS_LOGGER!r}")
    except ImportError as exc:
        problems.append(f"{BNB_KERNELS_LOGGER} is gone ({exc})")
    raise_if_broken("bitsandbytes", bitsandbytes.__version__, BNB_VERSION_CHECKED, problems)

    def disable_cpu_repack(module) -> None:
        setattr(module, BNB_REPACK_FLAG, False)

    return SimpleNamespace(version=bitsandbytes.__version__, checked=BNB_VERSION_CHECKED, Linear4bit=linear4bit,
                           disable_cpu_repack=disable_cpu_repack, kernels_logger=BNB_KERNELS_LOGGER)


TRANSFORMERS_VERSION_CHECKED = "5.19.0"
EXPERTS_LAYOUT_FLAGS = ("has_gate", "is_concatenated", "is_transposed", "has_bias")


def experts_internals() -> SimpleNamespace:
    """What experts4bit.py uses of transformers' mixture-of-experts modules beyond its plugin API
    (ExpertsInterface.register, PreTrainedModel.set_experts_implementation), checked against 5.19.0:

    - `use_experts_implementation` (the decorator of every experts class) sets the layout flags has_gate,
      is_concatenated, is_transposed and has_bias on each instance, and gives the class `_apply_gate`: act(gate) * up
      of a concatenated [gate | up] product, which the NF4 forward calls as the eager loop does.

    Checked on every call, on a probe class decorated here: the flags exist, `_apply_gate` computes that.
    """
    import torch
    import transformers
    from transformers.integrations import moe

    problems: list[str] = []
    if not callable(getattr(getattr(moe, "ExpertsInterface", None), "register", None)):
        problems.append("transformers.integrations.moe.ExpertsInterface.register is gone")
    if not callable(getattr(transformers.PreTrainedModel, "set_experts_implementation", None)):
        problems.append("PreTrainedModel.set_experts_implementation is gone")
    decorator = getattr(moe, "use_experts_implementation", None)
    if decorator is None:
        problems.append("transformers.integrations.moe.use_experts_implementation is gone")
    else:
        class Probe(torch.nn.Module):
            def __init__(self, config):
                super().__init__()
                self.act_fn = torch.nn.functional.silu

            def forward(self, hidden_states, top_k_index, top_k_weights):
                return hidden_states

        probe = decorator(Probe)(SimpleNamespace(_experts_implementation="eager"))
        missing = [f for f in EXPERTS_LAYOUT_FLAGS if not hasattr(probe, f)]
        if missing:
            problems.append(f"use_experts_implementation no longer sets {', '.join(missing)} on an experts module")
        x = torch.tensor([[1.0, -2.0, 3.0, 4.0]])
        try:
            gated = probe._apply_gate(x)
            if gated.shape != (1, 2) or not torch.allclose(gated, torch.nn.functional.silu(x[:, :2]) * x[:, 2:]):
                problems.append("an experts module's _apply_gate no longer computes act(gate) * up of [gate | up]")
        except Exception as exc:   # noqa: BLE001 (any failure of the probe is the fence's finding)
            problems.append(f"an experts module's _apply_gate fails ({type(exc).__name__}: {exc})")
    raise_if_broken("transformers", transformers.__version__, TRANSFORMERS_VERSION_CHECKED, problems)
    return SimpleNamespace(version=transformers.__version__, checked=TRANSFORMERS_VERSION_CHECKED,
                           ExpertsInterface=moe.ExpertsInterface, layout_flags=EXPERTS_LAYOUT_FLAGS)


class AbsentKernelsFilter(logging.Filter):
    """Drops bitsandbytes' warning "Failed to load CPU gemm_4bit_forward from kernels-community: No module
    named 'kernels'": `kernels` is an optional package; without it bitsandbytes uses its built-in CPU
    kernel, which is what lowmem_grpo runs on. Any other failure to load it (kernels installed but
    broken) still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        absent = any(isinstance(a, ModuleNotFoundError) and a.name == "kernels" for a in args)
        return not (absent and "kernels-community" in str(record.msg))


def quiet_bitsandbytes_kernels_warning() -> None:
    """Install AbsentKernelsFilter on bitsandbytes' CPU-ops logger. Needs no import of bitsandbytes and
    must run before its first import (which is when it warns): lowmem_grpo.model calls it at import."""
    log = logging.getLogger(BNB_KERNELS_LOGGER)
    if not any(isinstance(f, AbsentKernelsFilter) for f in log.filters):
        log.addFilter(AbsentKernelsFilter())


__all__ = ["InternalsError", "peft_internals", "bnb_internals", "experts_internals", "quiet_bitsandbytes_kernels_warning",
           "fence_error", "raise_if_broken", "names_used", "LoraState", "LoraBranch", "PEFT_VERSION_CHECKED",
           "BNB_VERSION_CHECKED"]
