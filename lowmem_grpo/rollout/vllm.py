"""Rollouts from an in-process vLLM engine that computes with the trainer's own modules.

One copy of the weights, no weight sync. vLLM builds its model with a quantization method of ours
(registered through vLLM's public plugin API, `register_quantization_config`) whose layers hold no
weights: when vLLM calls a linear layer, the method runs the trainer's modules for that layer (its
q/k/v projections for vLLM's fused `qkv_proj`, gate/up for `gate_up_proj`, o_proj and down_proj one to
one), whatever they are (a 4-bit bitsandbytes base + LoRA, a dense base + LoRA, or plain Linear layers
under full fine-tuning). The embedding and the LM head call the trainer's `embed_tokens` and `lm_head`.
The few remaining parameters (the norms) alias the trainer's storage. So an optimizer step is seen by
the next generate with nothing copied, `disable_adapter()` gives the reference policy, and the engine
adds only its KV cache and activations to the trainer's memory.

vLLM drives the scheduling, paged KV cache, attention kernels and sampling; the trainer's modules do
the matmuls. Plain LoRA layers over a dense or 4-bit base take a fast path (the base linear and the
LoRA branch are called directly, no peft dispatch; the LoRA branches of q/k/v and of gate/up are fused
into two matmuls; the sums are peft's bit for bit, except ~1e-7 for single-row inputs); anything else
(DoRA and other variants, custom layers) is called as a module, which is always correct. oneDNN's
`torch.ops.mkldnn._linear_pointwise` on the shared weights was tried for the base matmuls: +4% here,
not worth an internal op and log-probs that no longer match the trainer's exactly.

Side effects of an in-process engine, each handled here (tests/test_vllm_engine.py):
- `LLM(seed=...)` reseeds Python's, NumPy's and torch's global RNGs: their states are saved before the
  engine is built and restored after (else a resumed run would not replay the same samples).
- vLLM's CPU worker replaces `torch.set_num_threads` with a no-op: the original is put back, and the
  thread count restored.
- Shutting an engine down destroys torch.distributed's default process group: `close()` keeps a group
  that existed before the engine was built.
- The first generate that returns log-probs triggers `torch.compile` of vLLM's sampler helpers (tens
  of seconds on a small CPU): generate runs under `torch.compiler.set_stance("force_eager")`.
- Sleep mode does not exist on CPU. On CUDA the engine sleeps (level 1: KV cache released) between
  generates, so training gets that memory back.
- The KV cache is sized explicitly (`generation.kv_cache_memory_bytes`), else vLLM takes most of the
  machine (CPU) or of the GPU.
- The prefix cache would serve KV computed with old weights: it is reset before every generate, and a
  failed reset is an error. With an environment (docs/algorithm.md §20) each round of a step's episodes is
  one generate whose prompts are the prompt + the earlier turns + the environment's tokens: that prefix is
  recomputed from scratch each round (as the transformers engine does), never served from the previous
  round's decode, so both engines see the same numbers (tests/test_environment_vllm.py).
- Stop strings (an environment's turn markers) are vLLM's own, which need a tokenizer: the trainer's is saved
  next to the config.json vLLM builds from. Requests without stop strings are not detokenized (as before);
  with them, the stop string is kept in the output and the completion ends right after the token that
  completes it, as in the transformers engine (rollout/hf.py). One difference is left: vLLM decodes a
  completion's text after its prompt, the transformers engine decodes the new tokens alone; for a tokenizer
  whose first token decodes differently at the start of a text (SentencePiece's leading space) a stop string
  that starts with a space may then match one token apart in the first tokens of a turn.
- `max_num_seqs` is what one step decodes at once (prompts_per_step x num_generations, at least a greedy
  eval batch), not vLLM's default (256 on CPU and small GPUs, 1024 on 70 GB+ GPUs): its warm-up samples
  max_num_seqs rows of fp32 logits (256 x 151,936 x 4 B = 148 MiB, plus the sampler's copies) on top of
  the KV budget. Larger requests are decoded in waves. When the memory budget holds fewer sequences
  (EngineConfig.max_batch_sequences, memory.decode_waves) max_num_seqs is that wave: the KV cache is the
  fixed budget either way, the wave bounds the rows prefilled and sampled at once.

CUDA: **untested** (no GPU was available when this was written). The path is the same code with
`enforce_eager=True` (CUDA graphs would freeze the adapter on/off branch and the module calls) and sleep
mode level 1 around training; measure it before relying on it.

Every use of vLLM internals (anything beyond `LLM`, `SamplingParams` and the quantization plugin API)
is in `vllm_internals()`, checked against vllm 0.32.0; every use of peft's LoRA layers' internals (the
fast path) goes through `peft_internals()` (lowmem_grpo/internals.py). Both raise InternalsError, naming
the library and its version, when an assumption no longer holds.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import tempfile
import threading
import weakref
from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace
from typing import Callable, Optional

# The engine must live in this process (its layers call the trainer's modules): vLLM's V1 engine
# otherwise runs the model in a child process. Set before vllm is imported; vllm reads it lazily.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM is chatty; set it to see its log
_ENV_BEFORE_VLLM = dict(os.environ)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import vllm  # noqa: E402  (ImportError here is turned into EngineError by make_engine)
from vllm.exceptions import VLLMValidationError  # noqa: E402
from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase  # noqa: E402
from vllm.model_executor.layers.quantization import register_quantization_config  # noqa: E402
from vllm.model_executor.layers.quantization.base_config import (  # noqa: E402
    QuantizationConfig,
    QuantizeMethodBase,
)
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding  # noqa: E402

from ..internals import InternalsError, fence_error, names_used, peft_internals, raise_if_broken  # noqa: E402
from ..model import _base, context_limit, disable_cpu_4bit_repack, eval_mode, stop_token_ids  # noqa: E402
from .base import DEFAULT_KV_CACHE_BYTES, Completion, EngineConfig, EngineError, SamplingParams  # noqa: E402


def _restore_environment(before: dict) -> None:
    """Undo what vLLM wrote into os.environ (at import and while building an engine: LD_PRELOAD,
    LD_LIBRARY_PATH, LOCAL_WORLD_SIZE, TORCHINDUCTOR_*, ...), which every subprocess the trainer starts
    (reward sandboxes, math-verify workers) would inherit. VLLM_* variables stay: vLLM reads them."""
    for key in set(os.environ) | set(before):
        if key.startswith("VLLM_") or os.environ.get(key) == before.get(key):
            continue
        if key in before:
            os.environ[key] = before[key]
        else:
            del os.environ[key]


_restore_environment(_ENV_BEFORE_VLLM)

VLLM_VERSION_CHECKED = "0.32.0"
QUANTIZATION_NAME = "lowmem_grpo_shared"

# vLLM fuses some projections into one layer; the trainer (transformers) keeps them apart. The model
# class's own `packed_modules_mapping` (handed to the quantization config) takes precedence.
DEFAULT_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


# ----------------------------------------------------------------------------------------------------
# vLLM internals: the one place that touches them
# ----------------------------------------------------------------------------------------------------

def vllm_internals() -> SimpleNamespace:
    """Everything this engine uses from vLLM beyond its public API, checked against vllm 0.32.0.

    - `engine_core(llm)`: the in-process EngineCore client (llm.llm_engine.engine_core), whose
      `shutdown()` tears the engine down (LLM has no public close).
    - `keep_default_group()`: a context in which vllm.distributed.parallel_state's
      `destroy_distributed_environment()` (which EngineCore's shutdown calls through
      `cleanup_dist_env_and_memory`, and which destroys torch.distributed's default process group) only
      resets the module's `_WORLD` and `_NODE_COUNT`.
    - `cache_config(llm)`: the engine's CacheConfig (llm.llm_engine.vllm_config.cache_config).
    - `scheduler_config(llm)`: its SchedulerConfig (llm.llm_engine.vllm_config.scheduler_config).
    - `model_config(llm)`: its ModelConfig (llm.llm_engine.vllm_config.model_config: max_model_len).
    - `implementation(architecture)`: the module vLLM's model registry builds that architecture from
      (ModelRegistry.models[arch].module_name), or None for one it does not list. vLLM registers some
      architectures to its Transformers backend (vllm.model_executor.models.transformers), which wraps
      transformers' own classes and patches them for torch.compile: the trainer's model among them.

    Checked on every call: parallel_state has those names and cleanup_dist_env_and_memory calls
    destroy_distributed_environment through the module (so the swap takes effect). The accessors raise
    InternalsError when an LLM lacks the path. tests/test_internals.py breaks each on purpose;
    tests/test_vllm_engine.py::test_vllm_internals_are_where_we_expect checks them on a live engine.
    """
    from vllm.distributed import parallel_state as ps

    problems = [f"vllm.distributed.parallel_state.{name} is gone" for name in ("_WORLD", "_NODE_COUNT")
                if not hasattr(ps, name)]
    if not callable(getattr(ps, "destroy_distributed_environment", None)):
        problems.append("vllm.distributed.parallel_state.destroy_distributed_environment is gone")
    if "destroy_distributed_environment" not in names_used(getattr(ps, "cleanup_dist_env_and_memory", None)):
        problems.append("vllm.distributed.parallel_state.cleanup_dist_env_and_memory no longer calls "
                        "destroy_distributed_environment")
    raise_if_broken("vllm", vllm.__version__, VLLM_VERSION_CHECKED, problems)

    def follow(llm, path: str):
        obj = llm
        for name in path.split("."):
            try:
                obj = getattr(obj, name)
            except AttributeError as exc:
                raise fence_error("vllm", vllm.__version__, VLLM_VERSION_CHECKED,
                                  [f"{type(llm).__name__}.{path} is gone ({exc})"]) from exc
        return obj

    def engine_core(llm):
        core = follow(llm, "llm_engine.engine_core")
        if not callable(getattr(core, "shutdown", None)):
            raise fence_error("vllm", vllm.__version__, VLLM_VERSION_CHECKED,
                              [f"{type(llm).__name__}.llm_engine.engine_core has no shutdown()"])
        return core

    @contextlib.contextmanager
    def keep_default_group():
        def destroy_vllm_groups_only():
            ps._WORLD = None
            ps._NODE_COUNT = None

        original = ps.destroy_distributed_environment
        ps.destroy_distributed_environment = destroy_vllm_groups_only
        try:
            yield
        finally:
            ps.destroy_distributed_environment = original

    from vllm import ModelRegistry

    def implementation(architecture: str) -> Optional[str]:
        models = getattr(ModelRegistry, "models", None)
        if not isinstance(models, dict):
            raise fence_error("vllm", vllm.__version__, VLLM_VERSION_CHECKED, ["ModelRegistry.models is no dict"])
        entry = models.get(architecture)
        if entry is None:
            return None
        name = getattr(entry, "module_name", None)
        if not isinstance(name, str):
            raise fence_error("vllm", vllm.__version__, VLLM_VERSION_CHECKED,
                              [f"ModelRegistry.models[{architecture!r}] has no module_name"])
        return name

    return SimpleNamespace(version=vllm.__version__, checked=VLLM_VERSION_CHECKED, parallel_state=ps,
                           engine_core=engine_core, keep_default_group=keep_default_group, implementation=implementation,
                           cache_config=lambda llm: follow(llm, "llm_engine.vllm_config.cache_config"),
                           scheduler_config=lambda llm: follow(llm, "llm_engine.vllm_config.scheduler_config"),
                           model_config=lambda llm: follow(llm, "llm_engine.vllm_config.model_config"))


# ----------------------------------------------------------------------------------------------------
# Calling the trainer's modules: the fast path and the fallback
# ----------------------------------------------------------------------------------------------------

_PEFT: Optional[SimpleNamespace] = None


def _peft() -> SimpleNamespace:
    """peft_internals(), checked once per process (its check builds a small LoRA layer)."""
    global _PEFT
    if _PEFT is None:
        _PEFT = peft_internals()
    return _PEFT


def _dense(weight, bias, x):
    return F.linear(x, weight, bias)


def _lora(base: Callable, branches: list, x):
    """peft's plain LoRA forward: base(x) + B(A(x)) * scaling. addmm(result, h, B^T, alpha=scaling) does the
    last matmul, the scaling and the sum in one call, bit for bit as peft's three (tests check it)."""
    result = base(x)
    for a, b, b_bias, scaling in branches:
        xa = x if x.dtype == a.dtype else x.to(a.dtype)
        h = F.linear(xa, a)
        if b_bias is None and result.dim() == 2 and result.dtype == h.dtype:
            result = torch.addmm(result, h, b.t(), alpha=scaling)
        else:
            delta = F.linear(h, b, b_bias) * scaling
            result = result + (delta if delta.dtype == result.dtype else delta.to(result.dtype))
    return result


def _fused_lora(bases: list, a_cat: torch.Tensor, b_diag: torch.Tensor, scale: float, x):
    """Several LoRA layers on the same input (q/k/v, gate/up): their base outputs side by side, plus all
    LoRA branches in two matmuls (A stacked, B block-diagonal). Same sums as peft's, in fewer calls."""
    result = torch.cat([base(x) for base in bases], dim=-1)
    xa = x if x.dtype == a_cat.dtype else x.to(a_cat.dtype)
    h = F.linear(xa, a_cat)
    if result.dim() == 2 and result.dtype == h.dtype:
        return torch.addmm(result, h, b_diag.t(), alpha=scale)
    delta = F.linear(h, b_diag) * scale
    return result + (delta if delta.dtype == result.dtype else delta.to(result.dtype))


@dataclass
class Plan:
    """How one trainer module is called now. kind: "dense" (a plain torch Linear: F.linear on its
    weight), "lora" (plain LoRA over a dense or 4-bit base, computed directly), "base" (a LoRA layer whose
    adapters are off or merged: its base layer alone), or "module" (anything else, e.g. DoRA: the module
    itself is called)."""

    call: Callable
    kind: str
    base: Optional[Callable] = None
    branches: Optional[list] = None


def linear_call(module: torch.nn.Module, fast: bool = True) -> Plan:
    """How to compute module(x) for the module's current state (adapters on or off, merged or not).
    Plans are rebuilt before every generate, so an adapter switched off (reference policy) is honoured."""
    if not fast:
        return Plan(module, "module")
    if type(module) is torch.nn.Linear:
        return Plan(partial(_dense, module.weight, module.bias), "dense")
    peft = _peft()
    if type(module) in peft.lora_types:
        state = peft.lora_state(module)
        base_layer = state.base_layer
        base = partial(_dense, base_layer.weight, base_layer.bias) if type(base_layer) is torch.nn.Linear else base_layer
        if state.off:
            return Plan(base, "base")
        branches = []
        for br in state.branches:
            if br.variant:
                return Plan(module, "module")  # DoRA and other variants: peft's own forward
            if not (isinstance(br.dropout, torch.nn.Identity) or not br.dropout.training):
                return Plan(module, "module")
            if type(br.a) is not torch.nn.Linear or type(br.b) is not torch.nn.Linear:
                return Plan(module, "module")
            branches.append((br.a.weight, br.b.weight, br.b.bias, br.scaling))
        if not branches:
            return Plan(base, "base")
        return Plan(partial(_lora, base, branches), "lora", base, branches)
    return Plan(module, "module")


def fuse_plans(plans: list[Plan]) -> Optional[Callable]:
    """One call for several plain-LoRA modules that read the same input (None when they cannot fuse)."""
    if len(plans) < 2 or any(p.kind != "lora" or len(p.branches) != 1 for p in plans):
        return None
    a_list = [p.branches[0][0] for p in plans]
    b_list = [p.branches[0][1] for p in plans]
    if any(p.branches[0][2] is not None for p in plans) or len({a.dtype for a in a_list}) != 1:
        return None
    scalings = [float(p.branches[0][3]) for p in plans]
    a_cat = torch.cat(a_list, dim=0)
    if len(set(scalings)) == 1:
        scale = scalings[0]
    else:  # different alphas per module: fold each scaling into its block of B
        b_list, scale = [b * s for b, s in zip(b_list, scalings)], 1.0
    return partial(_fused_lora, [p.base for p in plans], a_cat, torch.block_diag(*b_list), scale)


# ----------------------------------------------------------------------------------------------------
# The quantization method: vLLM layers that run the trainer's modules
# ----------------------------------------------------------------------------------------------------

class _Binding:
    """The trainer's modules, by transformers name, for the engine being built."""

    def __init__(self, model, fast: bool):
        try:  # a broken assumption about vLLM's or peft's internals fails here, before vLLM starts
            vllm_internals()
            if fast:
                _peft()
        except InternalsError as exc:
            raise EngineError(f"generation.engine=vllm: {exc}") from exc
        self.base = _base(model)
        self.modules = dict(self.base.named_modules())
        self.fast = fast
        self.linear_methods: list["SharedLinearMethod"] = []
        self.embedding_methods: list["SharedEmbeddingMethod"] = []

    def refresh(self) -> None:
        for m in self.linear_methods:
            m.refresh(self.fast)
        for m in self.embedding_methods:
            m.refresh(self.fast)


_BINDING: Optional[_Binding] = None
_BINDING_LOCK = threading.Lock()


def _current_binding() -> _Binding:
    if _BINDING is None:
        raise EngineError(f"quantization={QUANTIZATION_NAME!r} is only usable through lowmem_grpo's VLLMEngine")
    return _BINDING


class SharedLinearMethod(LinearMethodBase):
    """A vLLM linear layer with no weight of its own: apply() concatenates the outputs of the trainer's
    modules for that layer (q/k/v for qkv_proj, gate/up for gate_up_proj, else the one module)."""

    def __init__(self, targets: list[torch.nn.Module], prefix: str):
        self.targets, self.prefix = targets, prefix
        self.calls: list[Callable] = list(targets)
        self.kinds: list[str] = ["module"] * len(targets)
        self.fused: Optional[Callable] = None

    def refresh(self, fast: bool) -> None:
        plans = [linear_call(t, fast) for t in self.targets]
        self.calls, self.kinds = [p.call for p in plans], [p.kind for p in plans]
        self.fused = fuse_plans(plans) if fast else None

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, **extra_weight_attrs):
        weight = torch.nn.Parameter(torch.empty(0, dtype=params_dtype), requires_grad=False)
        weight.weight_loader = _ignore_weights  # nothing is ever loaded into it (load_format="dummy")
        layer.register_parameter("weight", weight)
        widths = [int(getattr(t, "out_features", -1)) for t in self.targets]
        if -1 not in widths and sum(widths) != sum(output_partition_sizes):
            raise EngineError(f"vLLM layer {self.prefix} expects outputs {list(output_partition_sizes)}, "
                              f"the trainer's modules give {widths}")

    def process_weights_after_loading(self, layer) -> None:
        # Nothing to prepack (the default CPU method would prepack and drop the weight), and vLLM's own
        # bias is dropped: the trainer's modules add theirs.
        if getattr(layer, "bias", None) is not None:
            layer.register_parameter("bias", None)

    def apply(self, layer, x, bias=None):
        with torch.no_grad():
            if len(self.calls) == 1:
                return self.calls[0](x)
            if self.fused is not None:
                return self.fused(x)
            return torch.cat([call(x) for call in self.calls], dim=-1)


class SharedEmbeddingMethod(QuantizeMethodBase):
    """vLLM's embedding / LM head with no weight: embedding() calls the trainer's input embeddings,
    apply() its output embeddings (LM head). On CPU sharing `.data` would not do: the default method
    prepacks the LM head into a separate buffer."""

    def __init__(self, binding: _Binding, prefix: str):
        self.binding, self.prefix = binding, prefix
        self.embed = binding.base.get_input_embeddings()
        self.head = binding.base.get_output_embeddings()
        self.head_call: Callable = self.head
        self.padded_vocab = 0
        if self.embed is None or self.head is None:
            raise EngineError("the trainer's model has no input/output embeddings for vLLM to call")

    def refresh(self, fast: bool) -> None:
        self.head_call = linear_call(self.head, fast).call

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, **extra_weight_attrs):
        weight = torch.nn.Parameter(torch.empty(0, dtype=params_dtype), requires_grad=False)
        weight.weight_loader = _ignore_weights
        layer.register_parameter("weight", weight)
        self.padded_vocab = sum(output_partition_sizes)  # vLLM pads the vocabulary (to a multiple of 64)

    def process_weights_after_loading(self, layer) -> None:
        return

    def embedding(self, layer, input_):
        # The plain lookup, as vLLM's own embedding returns it: a transformers embedding module may scale its
        # output (Gemma 3's embed_scale), which vLLM's model code then applies a second time.
        with torch.no_grad():
            return F.embedding(input_, self.embed.weight)

    def apply(self, layer, x, bias=None):
        with torch.no_grad():
            logits = self.head_call(x)
            if bias is not None:
                logits = logits + bias
            if logits.shape[-1] < self.padded_vocab:  # vLLM slices its padding off the logits again
                logits = F.pad(logits, (0, self.padded_vocab - logits.shape[-1]))
            return logits


def _ignore_weights(*args, **kwargs) -> None:
    return None


def repack_aliased(vllm_model, aliased: set) -> None:
    """Run process_weights_after_loading again on each layer of vLLM's own quant methods that holds an
    aliased parameter: on CPU it packs the weight into a separate buffer (vLLM's unquantized embedding, which
    Gemma 2 and Cohere use as their tied LM head), and the first packing was of vLLM's dummy weights."""
    for module in vllm_model.modules():
        method = getattr(module, "quant_method", None)
        if method is None or isinstance(method, (SharedLinearMethod, SharedEmbeddingMethod)):
            continue
        if any(id(p) in aliased for p in module.parameters(recurse=False)):
            method.process_weights_after_loading(module)


@register_quantization_config(QUANTIZATION_NAME)
class SharedModulesConfig(QuantizationConfig):
    """A 'quantization' whose layers compute with the trainer's modules (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.binding = _current_binding()

    def get_name(self):
        return QUANTIZATION_NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict) -> "SharedModulesConfig":
        return cls()

    def get_quant_method(self, layer, prefix: str):
        if isinstance(layer, LinearBase):
            method = SharedLinearMethod(self._targets(prefix), prefix)
            self.binding.linear_methods.append(method)
            return method
        if isinstance(layer, VocabParallelEmbedding):  # ParallelLMHead is a subclass
            method = SharedEmbeddingMethod(self.binding, prefix)
            self.binding.embedding_methods.append(method)
            return method
        return None

    def _targets(self, prefix: str) -> list[torch.nn.Module]:
        parent, _, leaf = prefix.rpartition(".")
        packed = self.packed_modules_mapping or {}
        if prefix in self.binding.modules:   # the trainer fuses it too (Phi-3's, GLM-4's gate_up_proj)
            names = [leaf]
        else:
            names = packed.get(leaf) or DEFAULT_PACKED.get(leaf) or [leaf]
        full = [f"{parent}.{n}" if parent else n for n in names]
        missing = [n for n in full if n not in self.binding.modules]
        if missing:
            raise EngineError(f"vLLM layer {prefix!r} has no counterpart in the trainer's model (looked for "
                              f"{', '.join(missing)}); this architecture's module names differ between vLLM "
                              "and transformers, which the shared engine does not map yet")
        return [self.binding.modules[n] for n in full]


# ----------------------------------------------------------------------------------------------------
# Side effects of building / closing an in-process engine
# ----------------------------------------------------------------------------------------------------

@dataclass
class _ProcessState:
    py_rng: object
    np_rng: object
    torch_rng: torch.Tensor
    cuda_rng: Optional[list]
    set_num_threads: Callable
    num_threads: int
    environ: dict


def _save_process_state() -> _ProcessState:
    import numpy as np

    return _ProcessState(random.getstate(), np.random.get_state(), torch.get_rng_state(),
                         torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
                         torch.set_num_threads, torch.get_num_threads(), dict(os.environ))


def _restore_process_state(s: _ProcessState) -> None:
    import numpy as np

    random.setstate(s.py_rng)
    np.random.set_state(s.np_rng)
    torch.set_rng_state(s.torch_rng)
    if s.cuda_rng is not None:
        torch.cuda.set_rng_state_all(s.cuda_rng)
    torch.set_num_threads = s.set_num_threads  # vLLM's CPU worker swaps in a no-op
    if torch.get_num_threads() != s.num_threads:
        torch.set_num_threads(s.num_threads)
    _restore_environment(s.environ)


TRANSFORMERS_BACKEND = "vllm.model_executor.models.transformers"


def _check_native(model) -> None:
    """Refuse, before vLLM builds anything, an architecture vLLM would run through its Transformers backend:
    that backend patches transformers' own model classes in this process (the trainer's model then breaks),
    and it has no layers for the shared modules to stand in for. A mixture of experts is refused too: vLLM's fused
    experts layer holds the experts' weights itself, which the shared engine has no counterpart for."""
    from ..experts4bit import routed_experts

    config = _base(model).config
    arch = next(iter(getattr(config, "architectures", None) or []), None)
    experts = routed_experts(getattr(config, "text_config", None) or config)
    if experts > 1:
        raise EngineError(f"{arch or 'this model'} is a mixture of {experts} experts: the shared vLLM engine runs only "
                          "dense models (vLLM's fused experts layer would need the experts' weights copied into it, "
                          "the one copy this engine avoids); use generation.engine: hf")
    where = vllm_internals().implementation(arch) if arch else None
    if where is not None and where.startswith(TRANSFORMERS_BACKEND):
        raise EngineError(f"vLLM {vllm.__version__} runs {arch} through its Transformers backend, which patches "
                          "transformers' own model classes in this process (the trainer's among them); the shared "
                          "engine needs vLLM's own implementation of the architecture (Llama, Mistral, Qwen 2 and 3, "
                          "Gemma 1-3, Phi-3, GLM-4, Granite, Cohere, StableLM have one): use generation.engine: hf")


def _write_model_folder(model, tokenizer=None) -> tuple[str, bool]:
    """A folder holding the trainer's config.json, and its tokenizer when it can be saved: vLLM builds its
    model from it (load_format=dummy, weights never read) and never needs the hub or the model's quantization
    config. (folder, whether the tokenizer is there): vLLM's stop strings detokenize with it."""
    path = tempfile.mkdtemp(prefix="lowmem-grpo-vllm-")
    cfg = _base(model).config.to_dict()
    for key in ("quantization_config", "_pre_quantization_dtype"):
        cfg.pop(key, None)
    cfg["use_cache"] = True
    _yarn_context(cfg, context_limit(_base(model).config))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, default=str)
    saved = False
    if callable(getattr(tokenizer, "save_pretrained", None)):
        try:
            tokenizer.save_pretrained(path)
            saved = True
        except Exception:  # a tokenizer that cannot be saved: generation works, stop strings are refused
            saved = False
    return path, saved


def _yarn_context(cfg: dict, most: Optional[int]) -> None:
    """A YaRN config's context for vLLM as the trainer counts it (model.context_limit: factor x the pretraining
    length). vLLM 0.32 takes a YaRN config's max_position_embeddings as already scaled, so on a config that leaves it
    at the pretraining length (Qwen2.5's documented YaRN recipe does) it refused prompts the data had accepted, an
    EngineError mid-run (found by a red team). Its YaRN rotary embedding reads only `factor` and
    original_max_position_embeddings, so raising max_position_embeddings in the folder it builds from changes
    nothing else."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) == "yarn" \
            and "original_max_position_embeddings" in rope:
        if most and most > cfg.get("max_position_embeddings", 0):
            cfg["max_position_embeddings"] = most


def _model_dtype(model) -> torch.dtype:
    head = _base(model).get_output_embeddings()
    weight = getattr(head, "weight", None)
    if weight is not None and weight.is_floating_point():
        return weight.dtype
    return next(p.dtype for p in model.parameters() if p.is_floating_point())


_LIVE: "weakref.WeakSet" = weakref.WeakSet()  # the live engine (at most one)


# ----------------------------------------------------------------------------------------------------
# The engine
# ----------------------------------------------------------------------------------------------------

class VLLMEngine:
    """The rollout engine interface (rollout/base.py) over an in-process vLLM engine on the trainer's
    modules. One live engine per process (vLLM keeps process-wide state): close() one before building
    another; a second one closes the first."""

    def __init__(self, model, tokenizer, config: EngineConfig = EngineConfig(name="vllm"), *, fast_path: bool = True,
                 max_model_len: Optional[int] = None):
        self.config = config
        self.model, self.tokenizer = model, tokenizer
        self.cuda = next(model.parameters()).device.type == "cuda"
        self.eos = stop_token_ids(model, tokenizer)   # (the tokenizer's EOS first)
        self.closed, self.sleeping, self.llm, self.folder, self.shared = False, False, None, None, []
        self.stop_strings = False   # vLLM has the tokenizer (stop strings detokenize with it)
        _check_native(model)
        for other in list(_LIVE):
            other.close()
        disable_cpu_4bit_repack(model)
        self.binding = _Binding(model, fast_path)
        self.had_process_group = _dist_initialized()
        saved = _save_process_state()
        global _BINDING
        try:
            self.folder, self.stop_strings = _write_model_folder(model, tokenizer)
            with _BINDING_LOCK:
                _BINDING = self.binding
                try:
                    self.llm = vllm.LLM(
                        model=self.folder, skip_tokenizer_init=not self.stop_strings, load_format="dummy",
                        quantization=QUANTIZATION_NAME, dtype=str(_model_dtype(model)).replace("torch.", ""),
                        seed=int(config.seed),
                        kv_cache_memory_bytes=int(config.kv_cache_memory_bytes), enforce_eager=True,
                        tensor_parallel_size=1, max_model_len=max_model_len,
                        logprobs_mode="processed_logprobs", enable_sleep_mode=self.cuda,
                        **({"max_num_seqs": config.max_num_seqs} if config.max_num_seqs else {}),  # None: vLLM's
                    )
                finally:
                    _BINDING = None
            _restore_process_state(saved)
            self.shared = self._share_parameters()
            # One token now, so that what vLLM cannot run here (e.g. a head size its attention kernels lack)
            # fails at start-up rather than in the first training step.
            self.generate([[self.eos[0] if self.eos else 0]], SamplingParams(n=1, max_new_tokens=1, greedy=True))
        except Exception as exc:
            _restore_process_state(saved)
            self.close()
            if isinstance(exc, EngineError):
                raise
            raise EngineError(f"generation.engine=vllm cannot run this model here: {type(exc).__name__}: {exc}") from exc
        _LIVE.add(self)

    # -- set-up ----------------------------------------------------------------------------------------

    def _share_parameters(self) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """Alias every vLLM parameter that holds data (norms) to the trainer's tensor of the same name;
        fail if any is left unshared (it would silently hold random 'dummy' weights)."""
        trainer = dict(self.binding.base.named_parameters())
        pairs, problems = [], []

        def share(vllm_model):
            for name, param in vllm_model.named_parameters():
                if param.numel() == 0:
                    continue  # our weightless layers
                src = trainer.get(name)
                if src is None:
                    problems.append(f"{name}: no trainer parameter of that name")
                elif src.shape != param.shape or src.dtype != param.dtype or src.device != param.device:
                    problems.append(f"{name}: trainer has {tuple(src.shape)} {src.dtype} on {src.device}, "
                                    f"vLLM {tuple(param.shape)} {param.dtype} on {param.device}")
                else:
                    param.data = src.data
                    pairs.append((param, src))
            repack_aliased(vllm_model, {id(p) for p, _ in pairs})
            return len(pairs)

        self.llm.apply_model(share)
        if problems:
            raise EngineError("vLLM parameters left unshared with the trainer: " + "; ".join(problems))
        return pairs

    def _check_shared(self) -> None:
        """Re-alias any trainer tensor whose storage moved since (e.g. `.data` replaced, .to())."""
        for param, src in self.shared:
            if param.data.data_ptr() != src.data.data_ptr():
                param.data = src.data

    # -- sleep mode (CUDA only; untested) -------------------------------------------------------------

    def _sleep(self) -> None:
        if self.cuda and not self.sleeping:
            self.llm.sleep(level=1)
            self.sleeping = True

    def _wake(self) -> None:
        if self.cuda and self.sleeping:
            self.llm.wake_up()
            self.sleeping = False

    def context_tokens(self) -> int:
        """The most tokens (prompt + completion) vLLM takes for one sequence: it refuses a longer prompt."""
        return int(vllm_internals().model_config(self.llm).max_model_len)

    # -- generation ------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        if self.closed:
            raise EngineError("this vLLM engine was closed")
        requests, sps = to_requests(prompts, params, self.eos, stop_strings=self.stop_strings)
        with eval_mode(self.model), _eager_compile():
            self._wake()
            try:
                self._check_shared()
                self.binding.refresh()
                # Cached KV was computed with the previous weights (or adapters on/off), or, between an
                # environment's rounds, during decode: recompute every prompt, as the transformers engine does.
                if self.llm.reset_prefix_cache() is False:
                    raise EngineError("vLLM could not reset its prefix cache (requests still running?): the "
                                      "next generate would reuse KV computed with other weights")
                try:
                    outputs = self.llm.generate(requests, sps, use_tqdm=False)
                except VLLMValidationError as exc:   # e.g. a prompt past the context: one line, not a traceback
                    said = " ".join(str(exc).split())
                    raise EngineError(f"generation.engine=vllm refused a request: {said}") from None
            finally:
                self._sleep()
        return to_completions(outputs, self.eos)

    def fast_path_kinds(self) -> dict[str, list[str]]:
        """{vLLM layer prefix: how each trainer module behind it is called}, for tests and debugging."""
        self.binding.refresh()
        return {m.prefix: list(m.kinds) for m in self.binding.linear_methods}

    # -- teardown --------------------------------------------------------------------------------------

    def close(self) -> None:
        """Shut the engine down; a torch.distributed default group that existed before it is kept."""
        if self.closed:
            return
        self.closed = True
        _LIVE.discard(self)
        try:
            if self.llm is not None:
                _shutdown(self.llm, keep_default_group=self.had_process_group)
        finally:
            self.binding.linear_methods.clear()
            self.binding.embedding_methods.clear()
            self.llm = None
            self._cleanup_folder()

    def _cleanup_folder(self) -> None:
        if getattr(self, "folder", None):
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


# ----------------------------------------------------------------------------------------------------
# Requests and results
# ----------------------------------------------------------------------------------------------------

def to_requests(prompts: list[list[int]], params: SamplingParams, eos, stop_strings: bool = False):
    """vLLM requests (token ids) and their SamplingParams. `eos`: the ids that end a completion
    (model.stop_token_ids; one id or None also do). `stop_strings`: vLLM has a tokenizer, so
    SamplingParams.stop can be honoured (else they are an EngineError).

    Stop strings are vLLM's own, matched in the completion's text (detokenized with special tokens, as the
    transformers engine decodes it), kept in the output: vLLM ends the request at the token that completes
    one, and to_completions reports which one (Completion.stopped_by). Without stop strings nothing is
    detokenized.

    No per-request seed: in-process, vLLM's sampler draws from torch's global generator, so sampling
    follows the trainer's seed and RNG state (which checkpoints save: a resumed run replays the same
    samples). Per-request seeds would also crash vllm 0.32 on CPU as soon as a request is preempted
    ("CPU Generator does not use offset" in the model runner's bookkeeping)."""
    if params.stop and not stop_strings:
        raise EngineError(f"stop strings {list(params.stop)!r}: this vLLM engine was built without a tokenizer "
                          "to match them with (the trainer's could not be saved for it); use generation.engine: hf")
    kwargs = dict(n=params.n, max_tokens=params.max_new_tokens, logprobs=0, detokenize=False,
                  stop_token_ids=list(_ids(eos)) or None)
    if params.stop:
        kwargs.update(stop=list(params.stop), include_stop_str_in_output=True, detokenize=True,
                      skip_special_tokens=False)
    kwargs.update(repetition_penalty=params.repetition_penalty)
    if params.greedy:
        kwargs.update(temperature=0.0)
    else:
        kwargs.update(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k or 0, min_p=params.min_p)
    return [{"prompt_token_ids": list(p)} for p in prompts], vllm.SamplingParams(**kwargs)


def _ids(eos) -> tuple:
    return () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)


def to_completions(outputs, eos) -> list[Completion]:
    """Prompt i's n completions at [i*n, (i+1)*n), with the sampled tokens' log-probs (processed:
    after temperature, as the trainer computes them). A completion that ends with EOS is not truncated
    and not stopped by a string (EOS wins when it also completes one, as in the transformers engine); one
    that vLLM ended at a stop string (its stop_reason) ends with the token that completed it."""
    completions = []
    for i, out in enumerate(outputs):
        for c in sorted(out.outputs, key=lambda c: c.index):
            tokens = list(c.token_ids)
            lps = [_sampled_logprob(step, tok) for step, tok in zip(c.logprobs, tokens)] if c.logprobs else None
            ended = bool(tokens) and tokens[-1] in _ids(eos)
            reason = getattr(c, "stop_reason", None)
            stopped_by = reason if isinstance(reason, str) and not ended else None
            completions.append(Completion(i, tokens, not ended and stopped_by is None, lps, stopped_by=stopped_by))
    return completions


def _sampled_logprob(step, token: int) -> float:
    entry = step.get(token) if hasattr(step, "get") else step[token]
    return float(entry.logprob if hasattr(entry, "logprob") else entry)


def _shutdown(llm, keep_default_group: bool) -> None:
    """Tear an engine down now (not whenever it is garbage-collected). vLLM's shutdown destroys torch's
    default process group; with keep_default_group (a group vLLM found, not made) only vLLM's own state
    goes."""
    internals = vllm_internals()
    with internals.keep_default_group() if keep_default_group else contextlib.nullcontext():
        internals.engine_core(llm).shutdown()


def _dist_initialized() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


@contextlib.contextmanager
def _eager_compile():
    """vLLM's sampler helpers are torch.compile'd; run them eagerly (no compile on the first generate)."""
    with torch.compiler.set_stance("force_eager"):
        yield



class OwnWeightsEngine:
    """vLLM with its own copy of the weights (loaded from a model folder), same settings and interface as
    VLLMEngine: the comparison point for scripts/bench_rollout.py, not used in training."""

    def __init__(self, path: str, eos_token_id, kv_cache_memory_bytes: int = DEFAULT_KV_CACHE_BYTES,
                 dtype: str = "float32", seed: int = 0):
        saved = _save_process_state()
        try:
            self.llm = vllm.LLM(model=path, skip_tokenizer_init=True, dtype=dtype, seed=seed, enforce_eager=True,
                                kv_cache_memory_bytes=kv_cache_memory_bytes, logprobs_mode="processed_logprobs")
        finally:
            _restore_process_state(saved)
        self.eos = eos_token_id

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        requests, sps = to_requests(prompts, params, self.eos)
        with _eager_compile():
            return to_completions(self.llm.generate(requests, sps, use_tqdm=False), self.eos)
