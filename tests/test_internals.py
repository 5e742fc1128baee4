"""The fences around third-party internals (lowmem_grpo/internals.py, rollout/vllm.py's vllm_internals).

With the installed versions every fence passes. Then each assumption is broken on purpose (a class or
attribute removed or renamed, a method replaced) and the fence must raise InternalsError naming the
library, its installed version and the version it was checked against. Also: bitsandbytes' "Failed to load
... kernels" line never reaches a user who goes through lowmem_grpo.
"""

from __future__ import annotations

import functools
import logging
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import bitsandbytes
import peft
import peft.tuners.lora.bnb
import peft.tuners.lora.layer
import pytest
import torch
from peft.tuners.tuners_utils import BaseTunerLayer

import lowmem_grpo.model as M
from lowmem_grpo.internals import (BNB_KERNELS_LOGGER, BNB_VERSION_CHECKED, PEFT_VERSION_CHECKED,
                                   AbsentKernelsFilter, InternalsError, bnb_internals, peft_internals,
                                   quiet_bitsandbytes_kernels_warning)


def _assert_fence(fence, library: str, installed: str, checked: str, *fragments: str) -> str:
    with pytest.raises(InternalsError) as info:
        fence()
    message = str(info.value)
    assert f"{library} {installed}" in message and f"checked against {library} {checked}" in message, message
    for fragment in fragments:
        assert fragment in message, message
    return message


peft_fence = functools.partial(_assert_fence, peft_internals, "peft", peft.__version__, PEFT_VERSION_CHECKED)
bnb_fence = functools.partial(_assert_fence, bnb_internals, "bitsandbytes", bitsandbytes.__version__,
                              BNB_VERSION_CHECKED)


# ----------------------------------------------------------------------------------------------------
# peft
# ----------------------------------------------------------------------------------------------------

def test_peft_fence_passes_and_reads_a_lora_layer():
    fence = peft_internals()
    assert fence.version == peft.__version__ and fence.checked == PEFT_VERSION_CHECKED
    assert fence.lora_types == (peft.tuners.lora.layer.Linear, peft.tuners.lora.bnb.Linear4bit)
    model = peft.inject_adapter_in_model(peft.LoraConfig(r=4, lora_alpha=2, target_modules=["0"]),
                                         torch.nn.Sequential(torch.nn.Linear(5, 3)))
    state = fence.lora_state(model[0])
    assert state.base_layer is model[0].base_layer and state.off is False
    assert [(b.name, b.scaling, b.variant) for b in state.branches] == [("default", 0.5, False)]
    assert state.branches[0].a is model[0].lora_A["default"]


def test_peft_fence_leaves_the_global_rng_alone():
    """Its check builds a LoRA layer (random init): a training run's samples must not depend on it."""
    torch.manual_seed(3)
    want = torch.rand(4)
    torch.manual_seed(3)
    peft_internals()
    assert torch.equal(torch.rand(4), want)


@pytest.mark.parametrize("module, name", [(peft.tuners.lora.layer, "Linear"), (peft.tuners.lora.bnb, "Linear4bit")])
def test_peft_fence_fails_when_a_lora_class_is_gone(monkeypatch, module, name):
    monkeypatch.delattr(module, name)
    peft_fence(f"{module.__name__}.{name} is gone")


@pytest.mark.parametrize("cls", [peft.tuners.lora.layer.Linear, peft.tuners.lora.bnb.Linear4bit])
def test_peft_fence_fails_when_forward_stops_reading_lora_variant(monkeypatch, cls):
    def forward(self, x, *args, **kwargs):  # peft's forward, minus the variant dispatch
        result = self.base_layer(x)
        for name in self.active_adapters:
            result = result + self.lora_B[name](self.lora_A[name](self.lora_dropout[name](x))) * self.scaling[name]
        return result

    monkeypatch.setattr(cls, "forward", forward)
    peft_fence(f"{cls.__name__}.forward no longer reads", "lora_variant")


@pytest.mark.parametrize("name", ["lora_A", "lora_B", "lora_dropout", "scaling", "lora_variant"])
def test_peft_fence_fails_when_a_layer_attribute_is_renamed(monkeypatch, name):
    original = peft.tuners.lora.layer.LoraLayer.update_layer

    def update_layer(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        value = getattr(self, name)
        delattr(self, name)
        setattr(self, name + "_v2", value)
        return out

    monkeypatch.setattr(peft.tuners.lora.layer.LoraLayer, "update_layer", update_layer)
    peft_fence(name)


@pytest.mark.parametrize("name", ["merged", "disable_adapters", "active_adapters"])
def test_peft_fence_fails_when_a_layer_property_is_gone(monkeypatch, name):
    monkeypatch.delattr(BaseTunerLayer, name)
    peft_fence(name)


def test_peft_fence_fails_when_get_base_layer_changes(monkeypatch):
    original = peft.inject_adapter_in_model

    def inject(*args, **kwargs):  # a peft whose layers' get_base_layer() returns something else
        model = original(*args, **kwargs)
        for module in model.modules():
            if isinstance(module, BaseTunerLayer):
                module.get_base_layer = lambda: None
        return model

    monkeypatch.setattr(peft, "inject_adapter_in_model", inject)
    peft_fence("get_base_layer() no longer returns its base_layer")


def test_peft_fence_fails_when_the_lora_sum_changes(monkeypatch):
    """forward still reads every name, but no longer computes base(x) + B(A(x)) * scaling."""
    original = peft.tuners.lora.layer.Linear.forward

    @functools.wraps(original)
    def forward(self, x, *args, **kwargs):
        base = self.base_layer(x)
        return base + 2 * (original(self, x, *args, **kwargs) - base)

    monkeypatch.setattr(peft.tuners.lora.layer.Linear, "forward", forward)
    peft_fence("forward is not base(x) + B(A(x)) * scaling")


def test_peft_fence_fails_when_scaling_is_not_alpha_over_r(monkeypatch):
    original = peft.tuners.lora.layer.LoraLayer.update_layer

    def update_layer(self, adapter_name, *args, **kwargs):
        out = original(self, adapter_name, *args, **kwargs)
        self.scaling[adapter_name] = 1.0
        return out

    monkeypatch.setattr(peft.tuners.lora.layer.LoraLayer, "update_layer", update_layer)
    peft_fence("scaling is 1.0")


def test_peft_lora_state_fails_on_a_layer_it_cannot_read():
    fence = peft_internals()
    layer = SimpleNamespace(active_adapters=["default"])  # a LoRA layer as some other peft might lay it out
    _assert_fence(lambda: fence.lora_state(layer), "peft", peft.__version__, PEFT_VERSION_CHECKED,
                  "reading a SimpleNamespace LoRA layer failed")


# ----------------------------------------------------------------------------------------------------
# bitsandbytes
# ----------------------------------------------------------------------------------------------------

def test_bnb_fence_passes_and_disables_the_repack():
    fence = bnb_internals()
    assert fence.version == bitsandbytes.__version__ and fence.checked == BNB_VERSION_CHECKED
    assert fence.Linear4bit is bitsandbytes.nn.Linear4bit and fence.kernels_logger == BNB_KERNELS_LOGGER
    layer = bitsandbytes.nn.Linear4bit(4, 4)
    layer.support_avx512bf16_for_cpu = True
    assert M.disable_cpu_4bit_repack(torch.nn.Sequential(layer, torch.nn.Linear(4, 4))) == 1
    assert layer.support_avx512bf16_for_cpu is False


def test_bnb_fence_fails_when_linear4bit_is_gone(monkeypatch):
    monkeypatch.delattr(bitsandbytes.nn, "Linear4bit")
    bnb_fence("bitsandbytes.nn.Linear4bit is gone")


@pytest.mark.parametrize("method", ["__init__", "forward"])
def test_bnb_fence_fails_when_the_repack_flag_is_unused(monkeypatch, method):
    cls = bitsandbytes.nn.Linear4bit
    original = getattr(cls, method)
    monkeypatch.setattr(cls, method, lambda self, *args, **kwargs: original(self, *args, **kwargs))
    message = bnb_fence(f"Linear4bit.{method} no longer uses `support_avx512bf16_for_cpu`")
    # and the loader, which goes through the fence, refuses rather than leaving the repack on
    with pytest.raises(InternalsError, match="bitsandbytes"):
        M.disable_cpu_4bit_repack(torch.nn.Sequential())
    assert "in-place CPU repack" in message


def test_bnb_fence_fails_when_the_kernels_logger_moves(monkeypatch):
    import bitsandbytes.backends.cpu.ops as ops

    monkeypatch.setattr(ops, "logger", logging.getLogger("bitsandbytes.somewhere_else"))
    bnb_fence(f"{BNB_KERNELS_LOGGER}.logger is not the logger named")


# ----------------------------------------------------------------------------------------------------
# transformers' mixture-of-experts modules (experts4bit.py)
# ----------------------------------------------------------------------------------------------------

def _experts_fence(*fragments: str) -> str:
    import transformers

    from lowmem_grpo.internals import TRANSFORMERS_VERSION_CHECKED, experts_internals

    return _assert_fence(experts_internals, "transformers", transformers.__version__, TRANSFORMERS_VERSION_CHECKED,
                         *fragments)


def test_experts_fence_passes():
    from transformers.integrations.moe import ExpertsInterface

    from lowmem_grpo.internals import experts_internals

    fence = experts_internals()
    assert fence.ExpertsInterface is ExpertsInterface and fence.layout_flags == ("has_gate", "is_concatenated",
                                                                                  "is_transposed", "has_bias")


def test_experts_fence_fails_when_the_decorator_stops_setting_a_layout_flag(monkeypatch):
    from transformers.integrations import moe

    original = moe.use_experts_implementation

    def without_has_gate(cls=None, **kwargs):
        decorated = original(cls, **kwargs)
        init = decorated.__init__

        def __init__(self, *args, **kw):
            init(self, *args, **kw)
            del self.has_gate
        decorated.__init__ = __init__
        return decorated

    monkeypatch.setattr(moe, "use_experts_implementation", without_has_gate)
    _experts_fence("use_experts_implementation no longer sets has_gate")


def test_experts_fence_fails_when_apply_gate_computes_something_else(monkeypatch):
    import transformers
    from transformers.integrations import moe

    from lowmem_grpo import experts4bit, tiny

    # (the model first: its experts class is decorated when its module is imported, which must not happen under
    # the patch, or the class would keep the wrong gate for the rest of this process)
    config = transformers.Qwen3MoeConfig(**{**tiny.ARCH_SIZES, **tiny.MOE_LAYOUTS["Qwen3MoeConfig"]})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    monkeypatch.setattr(moe, "_default_apply_gate", lambda self, x: x.chunk(2, dim=-1)[1])
    _experts_fence("_apply_gate no longer computes act(gate) * up")
    # and quantizing experts, which registers through the fence, refuses rather than running a wrong gate
    with pytest.raises(InternalsError, match="transformers"):
        experts4bit.quantize_experts(model)


def test_experts_fence_fails_when_the_registry_is_gone(monkeypatch):
    from transformers.integrations import moe

    monkeypatch.setattr(moe.ExpertsInterface, "register", None)   # (inherited from GeneralInterface)
    _experts_fence("ExpertsInterface.register is gone")


# ----------------------------------------------------------------------------------------------------
# bitsandbytes' "kernels" warning
# ----------------------------------------------------------------------------------------------------

class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_absent_kernels_warning_is_dropped_and_nothing_else():
    quiet_bitsandbytes_kernels_warning()
    quiet_bitsandbytes_kernels_warning()  # idempotent
    log = logging.getLogger(BNB_KERNELS_LOGGER)
    assert sum(isinstance(f, AbsentKernelsFilter) for f in log.filters) == 1
    records = _Records()
    log.addHandler(records)
    try:
        fmt = "Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure ..."
        log.warning(fmt, ModuleNotFoundError("No module named 'kernels'", name="kernels"))  # as bitsandbytes logs it
        log.warning(fmt, ImportError("kernels 0.9 is too old"))  # kernels installed but broken: shown
        log.warning("something else: %s", ModuleNotFoundError("No module named 'kernels'", name="kernels"))
    finally:
        log.removeHandler(records)
    assert records.messages == [
        "Failed to load CPU gemm_4bit_forward from kernels-community: kernels 0.9 is too old. Please make sure ...",
        "something else: No module named 'kernels'"]


def test_loading_a_4bit_policy_prints_no_kernels_error(tiny_model_dir):
    """As a user runs it: a fresh process that loads the 4-bit policy through lowmem_grpo (bitsandbytes
    gets imported on the way) and runs it. Nothing in its output reads 'Failed to load'."""
    script = textwrap.dedent(f"""
        import torch
        from lowmem_grpo.model import load_policy
        from lowmem_grpo.recipe import LoraConfig, ModelConfig
        import bitsandbytes.functional as F
        cfg = ModelConfig(name_or_path={str(tiny_model_dir)!r}, compute_dtype="float32", load_in_4bit=True)
        model, tok = load_policy(cfg, LoraConfig(r=4, alpha=8))
        with torch.no_grad():
            model(input_ids=torch.tensor([[1, 2, 3]]))
        print("loaded 4-bit:", any(type(m).__name__ == "Linear4bit" for m in model.modules()),
              "avx512bf16:", F.has_avx512bf16())
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    output = out.stdout + out.stderr
    assert out.returncode == 0, output
    assert "loaded 4-bit: True" in out.stdout, output
    assert "Failed to load" not in output and "kernels-community" not in output, output


# ----------------------------------------------------------------------------------------------------
# vLLM
# ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def V():
    from test_vllm_engine import _import_engine  # skips without vllm, fails in CI

    return _import_engine()


@pytest.fixture()
def vllm_fence(V):
    return functools.partial(_assert_fence, V.vllm_internals, "vllm", V.vllm.__version__, V.VLLM_VERSION_CHECKED)


def test_vllm_fence_passes(V):
    fence = V.vllm_internals()
    assert fence.version == V.vllm.__version__ and fence.checked == V.VLLM_VERSION_CHECKED


@pytest.mark.parametrize("name", ["_WORLD", "_NODE_COUNT"])
def test_vllm_fence_fails_when_a_parallel_state_global_is_gone(V, vllm_fence, monkeypatch, name):
    monkeypatch.delattr(V.vllm_internals().parallel_state, name)
    vllm_fence(f"parallel_state.{name} is gone")


def test_vllm_fence_fails_when_destroy_is_gone(V, vllm_fence, monkeypatch):
    monkeypatch.delattr(V.vllm_internals().parallel_state, "destroy_distributed_environment")
    vllm_fence("destroy_distributed_environment is gone")


def test_vllm_fence_fails_when_cleanup_no_longer_calls_destroy(V, vllm_fence, monkeypatch):
    monkeypatch.setattr(V.vllm_internals().parallel_state, "cleanup_dist_env_and_memory", lambda shutdown_ray=False: None)
    vllm_fence("cleanup_dist_env_and_memory no longer calls destroy_distributed_environment")


@pytest.mark.parametrize("accessor, path", [("engine_core", "llm_engine.engine_core"),
                                            ("cache_config", "llm_engine.vllm_config.cache_config"),
                                            ("scheduler_config", "llm_engine.vllm_config.scheduler_config")])
def test_vllm_accessors_fail_when_the_path_is_gone(V, accessor, path):
    llm = SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=SimpleNamespace()))  # a later LLM's layout
    fence = V.vllm_internals()
    _assert_fence(lambda: getattr(fence, accessor)(llm), "vllm", V.vllm.__version__, V.VLLM_VERSION_CHECKED,
                  f"SimpleNamespace.{path} is gone")


def test_vllm_registry_accessor_fails_when_its_layout_changes(V, monkeypatch):
    from vllm import ModelRegistry

    fence = V.vllm_internals()
    monkeypatch.setattr(ModelRegistry, "models", {"XForCausalLM": SimpleNamespace()})
    _assert_fence(lambda: fence.implementation("XForCausalLM"), "vllm", V.vllm.__version__, V.VLLM_VERSION_CHECKED,
                  "ModelRegistry.models['XForCausalLM'] has no module_name")
    monkeypatch.setattr(ModelRegistry, "models", None)
    _assert_fence(lambda: fence.implementation("XForCausalLM"), "vllm", V.vllm.__version__, V.VLLM_VERSION_CHECKED,
                  "ModelRegistry.models is no dict")


def test_vllm_engine_core_needs_a_shutdown(V):
    llm = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=SimpleNamespace()))
    fence = V.vllm_internals()
    _assert_fence(lambda: fence.engine_core(llm), "vllm", V.vllm.__version__, V.VLLM_VERSION_CHECKED, "no shutdown()")


def test_keep_default_group_resets_only_vllms_globals(V, monkeypatch):
    ps = V.vllm_internals().parallel_state
    original = ps.destroy_distributed_environment
    monkeypatch.setattr(ps, "_WORLD", object())
    monkeypatch.setattr(ps, "_NODE_COUNT", 1)
    with V.vllm_internals().keep_default_group():
        ps.destroy_distributed_environment()  # what vLLM's shutdown calls
        assert ps._WORLD is None and ps._NODE_COUNT is None
    assert ps.destroy_distributed_environment is original


def test_engine_start_turns_a_broken_fence_into_an_engine_error(V, monkeypatch):
    """The engine checks both fences before vLLM starts, and says which library broke."""
    monkeypatch.delattr(V.vllm_internals().parallel_state, "_NODE_COUNT")
    with pytest.raises(V.EngineError, match=rf"vllm {V.vllm.__version__} .*_NODE_COUNT is gone"):
        V._Binding(None, True)
    monkeypatch.undo()
    monkeypatch.delattr(peft.tuners.lora.layer, "Linear")
    monkeypatch.setattr(V, "_PEFT", None)
    with pytest.raises(V.EngineError, match=rf"peft {peft.__version__} .*Linear is gone"):
        V._Binding(None, True)
