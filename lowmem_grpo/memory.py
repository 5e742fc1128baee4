"""A memory model: predicted peak memory of a run, as a breakdown a user can act on.

The peak is the memory that lives for the whole run (runtime, base weights, LoRA parameters, optimizer
state) plus the largest of three phases, which never overlap:

  rollout   the engine's KV cache for prompts_per_step x G sequences, the sampling logits, the prefill
  eval      the same for greedy decoding of up to 64 held-out prompts at once
  train     LoRA gradients, one micro-batch's checkpointed layer inputs, one layer's recomputation in
            backward (its activations and their gradients), and one tile of the log-prob kernel

Given a budget, the two decoding phases run in waves (`decode_waves`): a rollout decodes at most as many
sequences per generate call as fit beside the static memory, and eval at most as many as also keep it no
larger than the rollout's wave or the train phase, so a fixed batch of held-out prompts never sets the peak.

Every term is a count of tensors the code really allocates (sizes from the model's config and the
recipe), not a fit to measurements; scripts/bench_memory.py prints the prediction beside the measured
peak. A mixture of experts adds what transformers 5 and peft make of it: routed experts that 4-bit loading
leaves in compute dtype, the adapters peft puts on them (counted on the model, or on a meta-device copy), and
each MoE layer's experts merged with their LoRA delta while that layer computes. With an environment (docs/algorithm.md §20) a completion holds the model's turns and the
environment's observations, up to environment.max_total_tokens in all: that, not generation.max_new_tokens,
is the completion length every phase is sized with (KV cache, activations, log-prob rows). On CPU the peak is the process's RSS, so the runtime term is the resident size of Python and the
libraries once a first step has run: imports (~230 MiB), the code and allocator pages that loading a
model, generating and the first backward touch (~300 MiB); measured on Linux x86-64, torch 2.13 CPU.
On CUDA the prediction is torch.cuda.max_memory_allocated, which excludes the CUDA context (~0.5 GiB
more in nvidia-smi).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import NamedTuple, Optional

from .recipe import LORA_LINEARS
from .rollout.base import EVAL_BATCH, largest_wave, wave_plan  # EVAL_BATCH: prompts a greedy-eval call decodes

GiB, MiB = 2**30, 2**20
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
CPU_RUNTIME_BYTES = 530 * MiB   # Python + libraries resident after the first training step (see docstring)


class MemoryModelError(Exception):
    pass


class UnknownArchitecture(MemoryModelError):
    """A causal LM whose layers the memory model does not count (GPT-2's, multi-head latent attention): train runs it,
    without waves or a predicted peak; validate does not refuse it, estimate cannot answer for it."""


try:   # what transformers 5 raises for a config field of the wrong type or value, as it reads config.json
    from huggingface_hub.errors import StrictDataclassError
    _CONFIG_CHECK_ERRORS: tuple = (StrictDataclassError,)
except ImportError:   # an older huggingface_hub: configs are not checked so
    _CONFIG_CHECK_ERRORS = ()


class Linear(NamedTuple):
    """A linear layer of the decoder: its last name (what lora.target_modules matches), its sizes, and which
    decoder layers have it: every one ('attention'), the dense ones or the MoE ones."""

    name: str
    n_in: int
    n_out: int
    kind: str


@dataclass
class ModelShape:
    """What the memory model needs from a decoder-only (LLaMA/Qwen/Mistral-style) config, a mixture of experts
    included (Mixtral, OLMoE, Qwen2/3-MoE, GLM-4-MoE)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int        # a dense layer's MLP width
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    logit_softcap: bool = False   # Gemma's final_logit_softcapping: the log-prob kernel's backward holds one more tile
    # A mixture of experts: transformers 5 keeps each MoE layer's routed experts as two 3-D tensors (gate/up and
    # down, [experts, out, in]) and routes each token to experts_per_token of them.
    experts: int = 0                     # routed experts per MoE layer; 0: a dense model
    experts_per_token: int = 0
    expert_intermediate: int = 0         # one routed expert's MLP width
    shared_expert_intermediate: int = 0  # the always-on shared expert's width (Qwen2-MoE, GLM-4-MoE): linear layers
    shared_expert_gate: bool = False     # Qwen2-MoE's Linear(hidden, 1) in front of its shared expert
    moe_layers: int = 0                  # how many decoder layers are MoE layers (the others are dense)

    @classmethod
    def from_config(cls, config) -> "ModelShape":
        """The shape of a config's decoder. MemoryModelError, one line naming the config field and what is allowed,
        for a config that is no decoder-only causal LM (`causal_lm_problem`) or whose sizes no model can have."""
        from .model import text_config

        if problem := causal_lm_problem(config):
            raise MemoryModelError(problem)
        config = text_config(config)   # a multimodal model's language part
        if getattr(config, "kv_lora_rank", None) is not None:
            # Multi-head latent attention (DeepSeek-V2/V3, MiniCPM3, ...), found counted as LLaMA's by a red team. In
            # transformers 5.19 its cache holds kv_lora_rank + qk_rope_head_dim values a layer and token, but each
            # layer's attention then expands all of it to every head's keys and values (measured on a tiny DeepSeek-V3:
            # ~8x the whole cache at each decode step), and its linears are not LLaMA's: no term here counts that.
            raise UnknownArchitecture(
                f"config.json: kv_lora_rank is {config.kv_lora_rank!r}: multi-head latent attention (DeepSeek-V2/V3's), "
                "which the memory model does not count; allowed: LLaMA-style attention (num_key_value_heads x head_dim "
                "keys and values a layer)")
        try:
            heads = _whole(config, "num_attention_heads")
            hidden = _whole(config, "hidden_size")
            layers = _whole(config, "num_hidden_layers")
            vocab = _whole(config, "vocab_size")
            kv = _whole(config, "num_key_value_heads", optional=True) or heads
            if heads % kv:
                raise MemoryModelError(f"config.json: num_attention_heads ({heads}) is not a multiple of "
                                       f"num_key_value_heads ({kv}); allowed: a divisor of num_attention_heads")
            head_dim = _whole(config, "head_dim", optional=True)
            if head_dim is None and hidden < heads:
                raise MemoryModelError(f"config.json: hidden_size ({hidden}) is smaller than num_attention_heads "
                                       f"({heads}), so a head would have no dimensions; allowed: hidden_size >= "
                                       "num_attention_heads, or a head_dim")
            experts = _experts(config)
            # the dense layers' MLP width; a mixture whose every layer is a MoE layer may leave it out
            dense = layers - experts.get("moe_layers", 0)
            inter = _whole(config, "intermediate_size") if dense else _whole(config, "intermediate_size", optional=True) or 0
            return cls(
                vocab_size=vocab, hidden_size=hidden, num_layers=layers,
                num_heads=heads, num_kv_heads=kv, head_dim=head_dim or hidden // heads,
                intermediate_size=inter,
                tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
                attention_bias=bool(getattr(config, "attention_bias", config.model_type == "qwen2")),
                logit_softcap=bool(getattr(config, "final_logit_softcapping", None)),
                **experts,
            )
        except AttributeError as exc:
            raise UnknownArchitecture(f"the memory model knows decoder-only LLaMA-style configs; this one lacks {exc}") from None

    @property
    def dense_layers(self) -> int:
        return self.num_layers - self.moe_layers

    def layers(self, kind: str) -> int:
        """How many decoder layers have a linear of this kind."""
        return {"attention": self.num_layers, "dense": self.dense_layers, "moe": self.moe_layers}[kind]

    def linears(self) -> list[Linear]:
        """The linear layers of the decoder layers, each kind once (what bitsandbytes quantizes, LoRA may target)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        out = [Linear("q_proj", h, q, "attention"), Linear("k_proj", h, kv, "attention"),
               Linear("v_proj", h, kv, "attention"), Linear("o_proj", q, h, "attention")]
        for kind, width in (("dense", self.intermediate_size), ("moe", self.shared_expert_intermediate)):
            if self.layers(kind) and width:
                out += [Linear("gate_proj", h, width, kind), Linear("up_proj", h, width, kind),
                        Linear("down_proj", width, h, kind)]
        if self.moe_layers and self.shared_expert_gate:
            out.append(Linear("shared_expert_gate", h, 1, "moe"))
        return out

    def widest_kind(self) -> str:
        """'dense' or 'moe': the kind of decoder layer whose recomputation holds the most (the train phase's)."""
        if not self.moe_layers:
            return "dense"
        if not self.dense_layers:
            return "moe"
        return "moe" if self.mlp_values("moe") > self.mlp_values("dense") else "dense"

    def widest_layer(self) -> list[Linear]:
        """The linear layers of one decoder layer of the widest kind."""
        return [l for l in self.linears() if l.kind in ("attention", self.widest_kind())]

    def expert_params(self) -> int:
        """The routed experts' weights, all MoE layers: gate/up and down of every expert."""
        return self.moe_layers * self.experts * 3 * self.hidden_size * self.expert_intermediate

    def mlp_values(self, kind: Optional[str] = None) -> int:
        """Values per token that one decoder layer's MLP keeps for backward, in a layer of this kind (default: the
        widest). Dense: gate, up and their product. MoE (transformers' loop over experts): for each routed copy of
        the token its gathered input, gate/up, their product and the weighted output; the shared expert's gate, up
        and product; the router's logits and fp32 probabilities (3 values of 2 bytes an expert)."""
        kind = kind or self.widest_kind()
        if kind == "dense":
            return 3 * self.intermediate_size
        return (self.experts_per_token * (2 * self.hidden_size + 3 * self.expert_intermediate)
                + 3 * self.shared_expert_intermediate + 3 * self.experts)

    def mlp_grad_width(self) -> int:
        """The widest MLP gradient in flight per token in one layer's backward (a layer of the widest kind)."""
        if self.widest_kind() == "dense":
            return self.intermediate_size
        return self.experts_per_token * self.expert_intermediate + self.shared_expert_intermediate


def _experts(config) -> dict:
    """ModelShape's mixture-of-experts fields from a config (empty for a dense model). Which layers are MoE:
    Qwen2/3-MoE's mlp_only_layers and decoder_sparse_step, GLM-4-MoE's first_k_dense_replace. A value no model
    can have (decoder_sparse_step 0, which transformers divides by) is a MemoryModelError naming the field."""
    from .experts4bit import routed_experts

    try:
        experts = routed_experts(config)
    except (TypeError, ValueError):
        raise MemoryModelError("config.json: the number of routed experts (num_experts, num_local_experts or "
                               "n_routed_experts) is no whole number") from None
    if experts <= 1:
        return {}
    per_token = _whole(config, "num_experts_per_tok")
    if per_token > experts:
        raise MemoryModelError(f"config.json: num_experts_per_tok is {per_token}, more than the {experts} routed "
                               f"experts; allowed: 1 to {experts}")
    width = _whole(config, "moe_intermediate_size", optional=True) or _whole(config, "intermediate_size")
    shared = _whole(config, "shared_expert_intermediate_size", optional=True, least=0) or \
        (_whole(config, "n_shared_experts", optional=True, least=0) or 0) * width
    only = getattr(config, "mlp_only_layers", None) or ()
    if not isinstance(only, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise MemoryModelError(f"config.json: mlp_only_layers is {only!r}; allowed: a list of layer indices")
    dense_only = set(only)
    step = _whole(config, "decoder_sparse_step", optional=True) or 1
    first_sparse = _whole(config, "first_k_dense_replace", optional=True, least=0) or 0
    moe = sum(1 for i in range(config.num_hidden_layers)
              if i not in dense_only and (i + 1) % step == 0 and i >= first_sparse)
    return dict(experts=experts, experts_per_token=per_token, expert_intermediate=width,
                shared_expert_intermediate=shared, shared_expert_gate=shared > 0 and config.model_type == "qwen2_moe",
                moe_layers=moe)


def _whole(config, name: str, optional: bool = False, least: int = 1):
    """config.<name> as a whole number >= least (None where `optional` and it is missing or null); else
    MemoryModelError naming the field and what is allowed. AttributeError where it is missing and required."""
    value = getattr(config, name, None) if optional else getattr(config, name)
    if value is None and optional:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value >= least:
        return value
    raise MemoryModelError(f"config.json: {name} is {value!r}; allowed: a whole number >= {least}"
                           + (" (or leave it out)" if optional else ""))


# The class names (config.json's "architectures") of a model that generates text: a causal LM, or a multimodal
# model around one (its text_config is the language model)
CAUSAL_HEADS = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration", "WithLMHead", "WithLMHeadModel")


def causal_lm_problem(config) -> Optional[str]:
    """Why a config is no decoder-only causal language model, which is what the trainer trains and the memory model
    counts, or None. Decided from what config.json says: an encoder-decoder (is_encoder_decoder); "architectures"
    that name no text-generating class (BertForMaskedLM, ViTModel); without architectures, a model_type that
    transformers' AutoModelForCausalLM (or its image-text-to-text models) has no class for, or an encoder family
    (a masked LM: BERT, RoBERTa, ...) that is not set up as a decoder (is_decoder: true)."""
    from transformers.models.auto import modeling_auto as auto

    kind = getattr(config, "model_type", None) or "?"
    allowed = ("allowed: a decoder-only causal language model (config.json's architectures ending in ForCausalLM, or "
               "ForConditionalGeneration for a multimodal one)")
    if getattr(config, "is_encoder_decoder", False) is True:
        return f"config.json: model_type {kind!r} is an encoder-decoder model (is_encoder_decoder: true); {allowed}"
    archs = getattr(config, "architectures", None) or []
    names = [a for a in archs if isinstance(a, str)] if isinstance(archs, (list, tuple)) else []
    if names and not any(a.endswith(CAUSAL_HEADS) for a in names):
        return f"config.json: architectures {names} names no causal language model; {allowed}"
    if kind in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES and getattr(config, "is_decoder", False) is not True:
        return (f"config.json: model_type {kind!r} is an encoder (a masked language model, not set up as a decoder: "
                f"is_decoder is not true); {allowed}")
    auto_map = getattr(config, "auto_map", None)
    remote = isinstance(auto_map, dict) and "AutoModelForCausalLM" in auto_map   # trust_remote_code's own class
    if not names and not remote and kind not in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES \
            and kind not in auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return (f"config.json: model_type {kind!r} is no causal language model transformers knows (AutoModelForCausalLM "
                f"has no class for it, and config.json names no architectures); {allowed}")
    return None


@dataclass
class Workload:
    """The recipe's numbers that set memory, in one place (see `workload_from_recipe`)."""

    quantized: bool = True
    double_quant: bool = True
    compute_bytes: int = 2
    lora_r: int = 16
    lora_targets: tuple[str, ...] = LORA_LINEARS
    optimizer: str = "adamw"
    prompts_per_step: int = 4
    num_generations: int = 8
    micro_batch_size: int = 4
    prompt_tokens: int = 512
    completion_tokens: int = 256   # with an environment: environment.max_total_tokens (model + environment tokens)
    chunk_tokens: int = 1024
    chunk_vocab: int = 8192
    gradient_checkpointing: bool = True
    offload_activations: bool = False  # checkpointed layer inputs in host memory (CUDA; offload.py)
    bf16_autocast: bool = False  # the decoder's training passes under bf16 autocast (model.autocast)
    eval_prompts: int = 0
    engine: str = "hf"
    kv_cache_bytes: Optional[int] = None  # vLLM: the recipe's explicit KV budget
    device: str = "cuda"
    environment: bool = False  # multi-turn rollouts: completion_tokens is environment.max_total_tokens
    entropy_grad: bool = False  # an entropy bonus (algorithm.entropy_coef or entropy_target): its gradient's tile
    # What peft's adapters are, counted on the model or a meta-device copy (`experts_census`), since peft decides it
    # (it maps gate/up/down and 'all-linear' onto a mixture's fused experts and the router; other families name their
    # linears otherwise). None: the formula (lora_targeted), which knows LLaMA's layer names only.
    lora_params: Optional[int] = None
    lora_on_experts: bool = False  # then each MoE layer's forward holds its experts merged with their LoRA delta
    experts_nf4: bool = False      # the routed experts in NF4 (experts4bit.py), found on the model as lora_params is


@dataclass
class Estimate:
    static: dict[str, int]
    phases: dict[str, dict[str, int]]
    peak_phase: str = ""
    peak: int = 0
    notes: list[str] = field(default_factory=list)
    waves: Optional["Waves"] = None   # with a budget: the decoding phases' wave sizes

    def phase_label(self, phase: str) -> str:
        """'rollout phase', or with waves that split it 'rollout phase (8 seqs in 4 waves of 2)'."""
        split = self.waves is not None and phase in ("rollout", "eval") and self.waves.split(phase)
        return f"{phase} phase" + (f" ({self.waves.describe(phase)})" if split else "")

    def lines(self) -> list[str]:
        names = list(self.static) + [n for parts in self.phases.values() for n in parts]
        w = max(len(n) for n in names + [self.phase_label(p) for p in self.phases]) + 4
        out = [f"  {name:<{w}} {fmt(b):>10}" for name, b in self.static.items()]
        for phase, parts in self.phases.items():
            mark = "  <- peak" if phase == self.peak_phase else ""
            out.append(f"  {self.phase_label(phase):<{w}} {fmt(sum(parts.values())):>10}{mark}")
            out += [f"    {name:<{w - 2}} {fmt(b):>10}" for name, b in parts.items()]
        out.append(f"  {'predicted peak':<{w}} {fmt(self.peak):>10}  (static + {self.peak_phase} phase)")
        return out + [f"  note: {n}" for n in self.notes]


def fmt(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.0f} MiB"


def parse_size(text: str) -> int:
    """'8GiB', '8GB', '7.5G', '512MiB', '1e9' -> bytes (GB and G are read as GiB, as GPU makers mean)."""
    t = text.strip().upper().replace(" ", "")
    for suffix, mult in (("GIB", GiB), ("GB", GiB), ("G", GiB), ("MIB", MiB), ("MB", MiB), ("M", MiB), ("B", 1)):
        if t.endswith(suffix):
            t, m = t[: -len(suffix)], mult
            break
    else:
        m = 1
    try:
        size = int(float(t) * m)
    except (ValueError, OverflowError):   # OverflowError: 'inf', '1e400' (float reads them, int cannot)
        size = 0
    if size <= 0:
        raise MemoryModelError(f"cannot read a memory size from {text!r}: expected a positive size, e.g. 8GiB or "
                               "512MiB") from None
    return size


# ----------------------------------------------------------------------------------------------------
# The terms
# ----------------------------------------------------------------------------------------------------

def base_weight_bytes(s: ModelShape, w: Workload) -> int:
    """Linear layers at 4 bits (+ one absmax per 64 weights: fp32, or 8-bit plus a second-level fp32 per 256
    blocks with double quantization), everything else (embeddings, an untied head, norms, a mixture's routers
    and routed experts) in compute dtype. The experts are 3-D tensors, not linear layers, so bitsandbytes leaves
    them unquantized (transformers 5.19, bitsandbytes 0.50.2; tests/test_memory.py checks it on a loaded model),
    unless experts4bit.py stores them in NF4: 4 bits and an fp32 absmax per 64 weights."""
    linear = sum(l.n_in * l.n_out * s.layers(l.kind) for l in s.linears())
    if w.quantized:
        absmax = linear / 64 * (1 + 4 / 256) if w.double_quant else linear / 64 * 4
        linear_b = linear / 2 + absmax
    else:
        linear_b = linear * w.compute_bytes
    head = 0 if s.tie_word_embeddings else s.vocab_size * s.hidden_size
    bias = s.num_layers * (s.num_heads + 2 * s.num_kv_heads) * s.head_dim if s.attention_bias else 0
    routers = s.moe_layers * s.experts * s.hidden_size
    other = s.vocab_size * s.hidden_size + head + (2 * s.num_layers + 1) * s.hidden_size + bias + routers
    return int(linear_b + other * w.compute_bytes + experts_bytes(s, w))


SAVED_BYTES = 2   # bytes per weight of a published checkpoint (bf16)


def experts_bytes(s: ModelShape, w: Workload) -> float:
    """The routed experts' weights: in compute dtype, or NF4 (experts4bit.py: 4 bits, an fp32 absmax per 64)."""
    return s.expert_params() * ((0.5 + 4 / 64) if w.experts_nf4 else w.compute_bytes)


def lora_targeted(w: Workload, linear: Linear) -> bool:
    """Whether the recipe's LoRA adapts this linear layer: 'all-linear' is peft's, every linear but the head."""
    return w.lora_targets == ("all-linear",) or linear.name in w.lora_targets


def lora_params(s: ModelShape, w: Workload) -> int:
    """LoRA's A and B of every targeted linear layer. A count made on the model (w.lora_params, a mixture of
    experts) wins."""
    if w.lora_params is not None:
        return w.lora_params
    return sum(w.lora_r * (l.n_in + l.n_out) * s.layers(l.kind) for l in s.linears() if lora_targeted(w, l))


def optimizer_bytes_per_param(name: str) -> float:
    # AdamW: exp_avg and exp_avg_sq in fp32. 8-bit AdamW: one byte each (+ block scales, ~1%).
    return 8.0 if name == "adamw" else 2.02


def merged_experts_bytes(s: ModelShape, w: Workload) -> int:
    """peft adapts a mixture's routed experts (3-D tensors) by a parametrization: each forward of an MoE layer
    builds the layer's experts plus their LoRA delta as one new tensor, alive until that layer's backward is done."""
    return s.experts * 3 * s.hidden_size * s.expert_intermediate * w.compute_bytes if w.lora_on_experts else 0


def experts_census(model) -> dict:
    """Of a peft model on a mixture of experts: its trainable parameters, whether any of them adapts a routed
    expert, whether its experts are in NF4 (the Workload fields lora_params, lora_on_experts, experts_nf4)."""
    found = [(name, p.numel()) for name, p in model.named_parameters() if p.requires_grad]
    return {"lora_params": sum(n for _, n in found), "lora_on_experts": any(".experts." in name for name, _ in found),
            "experts_nf4": any(hasattr(m, "nf4_shapes") for m in model.modules())}


def experts_census_from_config(config, model_cfg, lora_cfg) -> dict:
    """`experts_census` of the recipe's model on a copy built on the meta device (no memory, no weights), its
    experts stored as loading stores them: for a mixture of experts, whose adapters peft decides."""
    import torch
    from transformers import AutoModelForCausalLM

    from .experts4bit import quantize_experts
    from .model import attach_lora

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=model_cfg.trust_remote_code)
    if model_cfg.load_in_4bit and model_cfg.quantize_experts:
        quantize_experts(model)
    return experts_census(attach_lora(model, lora_cfg, gradient_checkpointing=False))


def kv_cache_bytes(s: ModelShape, w: Workload, seqs: int, tokens: int) -> int:
    return 2 * s.num_layers * s.num_kv_heads * s.head_dim * tokens * seqs * w.compute_bytes


def decode_phase(s: ModelShape, w: Workload, seqs: int, label: str) -> dict[str, int]:
    """transformers generate: a KV cache for every sequence, the prefill's activations, and per decode step
    fp32 logits of the last position plus the sampler's copies (processed scores, probabilities)."""
    tokens = w.prompt_tokens + w.completion_tokens
    if w.engine == "vllm" and w.kv_cache_bytes is not None:
        # vLLM allocates its KV budget once and its scheduler already decodes in waves that fit it; `seqs`
        # (max_num_seqs, a wave) bounds only the rows it prefills and samples at once.
        kv = w.kv_cache_bytes
    else:
        kv = kv_cache_bytes(s, w, seqs, tokens)
    prefill = seqs * w.prompt_tokens * (4 * s.hidden_size + s.mlp_values()) * w.compute_bytes
    logits = 3 * seqs * s.vocab_size * 4
    merged = merged_experts_bytes(s, w)
    return {f"{label} KV cache ({seqs} seqs x {tokens} tok)": kv, f"{label} prefill activations": prefill,
            f"{label} sampling logits": logits, **({f"{label} one layer's experts merged with LoRA": merged} if merged else {})}


def train_phase(s: ModelShape, w: Workload, n_lora: int) -> dict[str, int]:
    b, t, h = w.micro_batch_size, w.prompt_tokens + w.completion_tokens, s.hidden_size
    i, mlp = s.mlp_grad_width(), s.mlp_values()
    cb = w.compute_bytes
    qkv = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
    # Inside one decoder layer, what autograd keeps for backward: the norms' outputs, q/k/v, the attention
    # output, the MLP's (ModelShape.mlp_values), the LoRA branches' r-wide intermediates; backward then holds one
    # hidden-size and one intermediate-size gradient at a time. sdpa's flash path keeps one logsumexp per head and
    # row (no T x T matrix).
    per_token_layer = (4 * h + qkv + mlp + 7 * w.lora_r) + (h + i)  # saved for backward + gradients in flight
    one_layer = b * t * per_token_layer * cb
    # With a 16-bit compute dtype, one layer's backward also holds copies (seen on CUDA with a tensor-level trace
    # of the recomputed layer, docs/benchmarks.md): transformers' RMSNorm computes in fp32 and keeps its fp32
    # input (two norms), peft casts each LoRA input to the adapters' fp32 and keeps that copy for lora_A's
    # backward, and the widest such copy's gradient is in flight. Under bf16 autocast (model.autocast, §24)
    # lora_A keeps a bf16 input instead: a copy per LoRA module on CPU (peft still casts there, autocast casts
    # back), the layer's own activation on CUDA. So that share is counted at 2 bytes a value: exact on CPU, the
    # safe side on CUDA, where the trace's peak fell by 141 of these 208 KiB per token at Llama-3.1-8B's width.
    lora_in = sum(l.n_in for l in s.widest_layer() if lora_targeted(w, l))
    lora_copy_bytes = 2 if w.bf16_autocast else 4
    copies = b * t * (4 * 2 * h + lora_copy_bytes * (lora_in + i)) if cb < 4 else 0
    if w.quantized:
        one_layer += max(l.n_in * l.n_out for l in s.linears()) * cb  # bitsandbytes dequantizes one weight at a time
    one_layer += merged_experts_bytes(s, w)
    layers_kept = s.num_layers if w.gradient_checkpointing else s.num_layers * per_token_layer / h
    if offloaded(w):
        layers_kept = 2  # offload.py: one input on its way to host memory (forward) or back (backward), one in use
    checkpointed = int(b * t * h * cb * (layers_kept + 2))  # + embeddings output and final norm output
    n_tok = b * w.completion_tokens
    rows = min(w.chunk_tokens, n_tok)
    # The kernel works in place: forward keeps two fp32 tiles alive (logits and their exp, for the entropy),
    # backward one, plus one for the entropy bonus's gradient and one for a soft-capped head's slope. A head
    # stored in a narrower dtype is cast to fp32 one vocabulary chunk at a time.
    tiles = max(2, 1 + int(w.entropy_grad) + int(s.logit_softcap))
    tile = tiles * rows * min(w.chunk_vocab, s.vocab_size) * 4
    if cb != 4:
        tile += min(w.chunk_vocab, s.vocab_size) * h * 4
    kernel_io = n_tok * h * (4 + 4) + n_tok * 4 * 8  # hidden rows in fp32 + their grad; per-token vectors
    kept = f"checkpointed layer inputs (micro-batch {b} x {t} tok{', 2 layers on device' if offloaded(w) else ''})"
    return {"LoRA gradients (fp32)": n_lora * 4, kept: checkpointed,
            "one layer's recomputation + grads": int(one_layer),
            **({"one layer's copies (fp32 norms, LoRA inputs)": copies} if copies else {}),
            f"log-prob tile ({rows} x {min(w.chunk_vocab, s.vocab_size)})": tile,
            "log-prob rows and grads": kernel_io}


def offloaded(w: Workload) -> bool:
    """Whether train.offload_activations moves anything: with checkpointing, on CUDA (on a CPU it is a no-op)."""
    return w.offload_activations and w.gradient_checkpointing and w.device == "cuda"


def offloaded_host_bytes(s: ModelShape, w: Workload) -> int:
    """Pinned host memory that offload holds at the end of a micro-batch's forward: every layer's input, and
    the final norm's input and its fp32 copy (as the checkpointed term counts them)."""
    t = w.prompt_tokens + w.completion_tokens
    return w.micro_batch_size * t * s.hidden_size * w.compute_bytes * (s.num_layers + 2) if offloaded(w) else 0


HOST_HEADROOM = 0.2   # of the machine's available RAM, left to the trainer's own growth and everything else


def host_memory_problem(s: ModelShape, w: Workload, available: int, processes: int = 1) -> Optional[str]:
    """Why offload's pinned host memory (offloaded_host_bytes, per process) would not fit in `available` bytes
    of this machine's RAM, or None. Pinned pages cannot be swapped, so past what is free the run ends by the
    kernel's OOM killer (or a failed cudaHostAlloc) mid-step, not with an error: checked before step 1."""
    need = offloaded_host_bytes(s, w) * processes
    room = int(available * (1 - HOST_HEADROOM))
    if need <= room:
        return None
    each = f" ({processes} processes x {fmt(need // processes)})" if processes > 1 else ""
    return (f"train.offload_activations: the layer inputs of a micro-batch of {w.micro_batch_size} x "
            f"{w.prompt_tokens + w.completion_tokens} tokens need {fmt(need)} of pinned CPU memory{each}, and this "
            f"machine has {fmt(available)} available ({fmt(room)} once {HOST_HEADROOM:.0%} is left to the rest); "
            f"pinned memory cannot be swapped out. Lower train.micro_batch_size or the completion length, free "
            f"RAM, or set train.offload_activations: false.")


def static_terms(s: ModelShape, w: Workload) -> dict[str, int]:
    """What lives for the whole run: runtime (CPU), base weights, LoRA parameters, optimizer state."""
    n_lora = lora_params(s, w)
    static = {}
    if w.device == "cpu":
        static["runtime (python + torch, CPU RSS)"] = CPU_RUNTIME_BYTES
    kept = (", experts NF4" if w.experts_nf4 else ", experts unquantized") if s.experts else ""
    static["base weights" + (f" (NF4 linears{kept})" if w.quantized else "")] = base_weight_bytes(s, w)
    static[f"LoRA parameters ({n_lora / 1e6:.1f}M, fp32)"] = n_lora * 4
    static[f"optimizer state ({w.optimizer})"] = int(n_lora * optimizer_bytes_per_param(w.optimizer))
    return static


@dataclass(frozen=True)
class Waves:
    """Sequences one generate call decodes at once in each decoding phase (a wave), sized to a budget."""

    rollout: int       # of rollout_seqs (prompts_per_step x G, one step's sequences)
    eval: int          # of eval_seqs (held-out prompts, one greedy sequence each); 0 without held-out prompts
    rollout_seqs: int
    eval_seqs: int
    rollout_calls: int = 1   # generate calls a rollout takes (rollout.base.wave_plan)

    def split(self, phase: str) -> bool:
        """Whether the budget makes this phase decode in smaller calls than it would without one (a rollout:
        one call; eval: calls of EVAL_BATCH prompts)."""
        if phase == "rollout":
            return self.rollout < self.rollout_seqs
        return 0 < self.eval < min(EVAL_BATCH, self.eval_seqs)

    def describe(self, phase: str) -> str:
        if phase == "rollout":
            calls, size, total = self.rollout_calls, self.rollout, self.rollout_seqs
        else:  # the trainer's eval batches: calls of `eval` prompts, the last one smaller
            calls, size, total = -(-self.eval_seqs // self.eval), self.eval, self.eval_seqs
        return f"{total} seqs in {calls} waves of {'at most ' if calls * size != total else ''}{size}"

    @property
    def max_batch_sequences(self) -> Optional[int]:
        """The engine's cap (EngineConfig.max_batch_sequences): the most sequences any generate call decodes;
        None when no phase is split, so that the engines run exactly as without waves."""
        if not (self.split("rollout") or self.split("eval")):
            return None
        return max(self.rollout, self.eval)


def _largest(most: int, ok) -> int:
    """The largest k in 1..most with ok(k) (ok is monotone: true up to some k, false after); 1 if none."""
    lo, hi = 1, max(1, most)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


def fit_sequences(s: ModelShape, w: Workload, budget: int, most: int) -> int:
    """The most sequences (1..most) one decode call may hold with static + that call <= budget; 1 when even
    one does not fit (the estimate then shows by how much)."""
    static = sum(static_terms(s, w).values())
    return _largest(most, lambda k: static + sum(decode_phase(s, w, k, "").values()) <= budget)


def decode_waves(s: ModelShape, w: Workload, budget: int) -> Waves:
    """The rollout's wave: its prompts_per_step x G sequences in the fewest generate calls that fit the budget
    beside the static memory, made as even as they can be (rollout.base.wave_plan: the engine splits the same
    way under this cap). Eval's: the most of min(EVAL_BATCH, eval_prompts) that also keep the eval phase no
    larger than the rollout's wave or the train phase, so eval never sets the peak by its batch. At least 1
    each (with held-out prompts). Under vLLM the wave is max_num_seqs: the KV term is vLLM's own budget."""
    rollout_seqs = w.prompts_per_step * w.num_generations
    fit = fit_sequences(s, w, budget, rollout_seqs)
    rollout = largest_wave(w.prompts_per_step, w.num_generations, fit)
    calls = len(wave_plan(w.prompts_per_step, w.num_generations, fit))
    if not w.eval_prompts:
        return Waves(rollout, 0, rollout_seqs, 0, calls)
    static = sum(static_terms(s, w).values())
    cap = max(sum(decode_phase(s, w, rollout, "").values()), sum(train_phase(s, w, lora_params(s, w)).values()))

    def ok(k: int) -> bool:
        phase = sum(decode_phase(s, w, k, "").values())
        return static + phase <= budget and phase <= cap

    return Waves(rollout, _largest(min(EVAL_BATCH, w.eval_prompts), ok), rollout_seqs, w.eval_prompts, calls)


def estimate(s: ModelShape, w: Workload, budget: Optional[int] = None) -> Estimate:
    """The peak and its breakdown. With a budget the decoding phases are sized at their waves
    (`decode_waves`); None: one rollout call of all its sequences and eval calls of EVAL_BATCH prompts."""
    n_lora = lora_params(s, w)
    static = static_terms(s, w)
    waves = decode_waves(s, w, budget) if budget is not None else None
    phases = {"rollout": decode_phase(s, w, waves.rollout if waves else w.prompts_per_step * w.num_generations,
                                      "rollout")}
    if w.eval_prompts:
        phases["eval"] = decode_phase(s, w, waves.eval if waves else min(EVAL_BATCH, w.eval_prompts), "eval")
    phases["train"] = train_phase(s, w, n_lora)
    if s.experts and w.experts_nf4 and w.device == "cpu":
        # model.load_base_model stages a mixture in host memory: every expert in compute dtype until it is quantized,
        # beside the checkpoint's own bytes of them, memory-mapped and read once (bf16, as models are published). On
        # a GPU that is host memory, not the device's. Measured: a 4-layer, 64-expert mixture's CPU peak was its load,
        # 37% over the steps' (scripts/bench_memory.py, docs/benchmarks.md).
        staged = s.expert_params() * (w.compute_bytes + SAVED_BYTES) - experts_bytes(s, w)
        phases["load"] = {"a mixture's experts in compute dtype and as read, before NF4 (staged load)": int(staged)}
    peak_phase = max(phases, key=lambda p: sum(phases[p].values()))
    est = Estimate(static, phases, peak_phase, sum(static.values()) + sum(phases[peak_phase].values()), waves=waves)
    if w.device == "cuda":
        est.notes.append(f"CUDA: this is torch's allocated peak; nvidia-smi shows ~{fmt(CUDA_CONTEXT)} more (CUDA context)")
    if offloaded(w):
        est.notes.append(f"train.offload_activations: {fmt(offloaded_host_bytes(s, w))} of pinned CPU memory holds "
                         f"the checkpointed layer inputs during the update (preflight checks it against the RAM "
                         f"available)")
    return est


# ----------------------------------------------------------------------------------------------------
# From a recipe, and advice when it does not fit
# ----------------------------------------------------------------------------------------------------

def completion_tokens(recipe) -> int:
    """The longest completion a recipe samples: generation.max_new_tokens, or with an environment its
    max_total_tokens (model turns and observations together; a turn alone is capped at max_new_tokens)."""
    if recipe.environment.name:
        return recipe.environment.max_total_tokens
    return recipe.generation.max_new_tokens


def micro_batch_completions(recipe, processes: int = 1) -> int:
    """The completions a micro-batch holds at most: train.micro_batch_size, or fewer where one process's share of a
    step's completions is smaller (batch.pack never fills one past them; a larger micro_batch_size was counted as
    given, found by a red team)."""
    return min(recipe.train.micro_batch_size, process_prompts(recipe, processes) * recipe.generation.num_generations)


def process_prompts(recipe, processes: int = 1) -> int:
    """The prompts one process samples a step: train.prompts_per_step shared among the processes (§21)."""
    return max(1, recipe.train.prompts_per_step // processes)


def workload_from_recipe(recipe, prompt_tokens: int, device: str, processes: int = 1) -> Workload:
    """One process's workload; with several processes (docs/algorithm.md §21) each samples prompts_per_step /
    processes prompts a step and evaluates its share of the held-out prompts."""
    r = recipe
    eval_prompts = r.train.eval_max_prompts if (r.data.eval_path or r.data.eval_fraction) else 0
    targets = ("all-linear",) if r.lora.target_modules == "all-linear" else tuple(r.lora.target_modules)
    return Workload(
        quantized=r.model.load_in_4bit, double_quant=r.model.double_quant,
        compute_bytes=DTYPE_BYTES[r.model.compute_dtype], lora_r=r.lora.r, lora_targets=targets,
        optimizer=r.optimizer.name, prompts_per_step=process_prompts(r, processes),
        num_generations=r.generation.num_generations, micro_batch_size=micro_batch_completions(r, processes),
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens(r),
        chunk_tokens=r.train.logprob_chunk_tokens, chunk_vocab=r.train.logprob_chunk_vocab,
        gradient_checkpointing=r.model.gradient_checkpointing, offload_activations=r.train.offload_activations,
        bf16_autocast=r.model.bf16_autocast,
        eval_prompts=-(-eval_prompts // processes), engine=r.generation.engine,
        kv_cache_bytes=r.generation.kv_cache_memory_bytes, device=device, environment=bool(r.environment.name),
        entropy_grad=r.algorithm.entropy_coef > 0 or r.algorithm.entropy_target is not None)


def model_workload(recipe, model, prompt_tokens: int, device: str, processes: int = 1) -> tuple[ModelShape, Workload]:
    """The shape and workload of a loaded model under a recipe: its LoRA counted on the model itself (peft decided
    what its adapters are; the name rule knows only LLaMA's layer names), as estimate_recipe counts it. A dense model
    with nothing to train (eval's) keeps the rule's count of the recipe's LoRA."""
    shape = ModelShape.from_config(model.config)
    workload = workload_from_recipe(recipe, prompt_tokens, device, processes)
    census = experts_census(model)
    if shape.experts or census["lora_params"]:
        workload = replace(workload, **census)
    return shape, workload


@dataclass
class Advice:
    fits: bool
    lines: list[str]
    micro_batch_size: Optional[int] = None
    chunk_tokens: Optional[int] = None


def advise(s: ModelShape, w: Workload, budget: int) -> Advice:
    """The largest micro-batch and log-prob tile that fit in `budget`, or the recipe fields to change."""
    est = estimate(s, w, budget)   # decoding in waves sized to the budget, as the trainer does
    if est.peak <= budget:
        best_mb = w.micro_batch_size
        for mb in range(w.micro_batch_size, w.prompts_per_step * w.num_generations + 1):
            if estimate(s, replace(w, micro_batch_size=mb), budget).peak <= budget:
                best_mb = mb
        lines = [f"fits: predicted peak {fmt(est.peak)} of {fmt(budget)} ({100 * est.peak / budget:.0f}%)."]
        if best_mb > w.micro_batch_size:
            lines.append(f"train.micro_batch_size could go up to {best_mb} (fewer forward/backward passes per step).")
        return Advice(True, lines, best_mb, w.chunk_tokens)
    # Does not fit: shrink what the user can shrink without changing the algorithm: the largest micro-batch (from the
    # recipe's own down) with the largest log-prob tile (the recipe's or smaller) that fit. A red team found the
    # search starting below the recipe's micro-batch: at 1 it tried nothing, and said "does not fit even with" a
    # setting that fit.
    chunks = sorted({ct for ct in (w.chunk_tokens, 512, 256, 128) if ct <= w.chunk_tokens}, reverse=True)
    for mb in range(w.micro_batch_size, 0, -1):
        for ct in chunks:
            if estimate(s, replace(w, micro_batch_size=mb, chunk_tokens=ct), budget).peak <= budget:
                change = [f"train.micro_batch_size: {mb}"] * (mb != w.micro_batch_size) + \
                         [f"train.logprob_chunk_tokens: {ct}"] * (ct != w.chunk_tokens)
                return Advice(False, [f"does not fit: predicted peak {fmt(est.peak)} > {fmt(budget)}.",
                                      f"set {' and '.join(change)} (same result, more passes)."], mb, ct)
    smallest = estimate(s, replace(w, micro_batch_size=1, chunk_tokens=chunks[-1]), budget)   # (tried above: too big)
    parts = dict(smallest.static)
    parts.update(smallest.phases[smallest.peak_phase])
    biggest = sorted(parts.items(), key=lambda kv: -kv[1])[:3]
    lines = [f"does not fit even with train.micro_batch_size: 1 and train.logprob_chunk_tokens: {chunks[-1]} "
             f"(predicted {fmt(smallest.peak)} > {fmt(budget)}). Largest terms:"]
    lines += [f"  {name}: {fmt(b)}" for name, b in biggest]
    lines.append("change one of: " + ", ".join(_each_field_once([_fields_for(name, w) for name, _ in biggest])))
    return Advice(False, lines)


def out_of_memory_advice(s: ModelShape, w: Workload, budget: Optional[int]) -> Advice:
    """What to change after a run really ran out of memory: `advise` where the memory model agrees the run does
    not fit in `budget`. Where it predicted a fit, what ran out is memory the model does not count: on CUDA
    mostly the caching allocator's fragmentation, which expandable segments avoid (PyTorch's CUDA semantics
    notes, "optimizing memory usage"), or another process on the card; and a micro-batch half the size leaves
    room (same result, more passes)."""
    if budget is None:
        return Advice(False, [])
    advice = advise(s, w, budget)
    if not advice.fits:
        return advice
    elsewhere = ("the caching allocator's fragmentation (set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) or "
                 "another process on the card" if w.device == "cuda" else "other processes on this machine")
    lines = [f"the memory model predicted {fmt(estimate(s, w, budget).peak)} of {fmt(budget)}: what ran out is "
             f"memory it does not count, most likely {elsewhere}."]
    half = w.micro_batch_size // 2
    if half >= 1:
        lines.append(f"set train.micro_batch_size: {half} for more room (same result, more passes).")
    return Advice(False, lines, half or None, w.chunk_tokens)


def _each_field_once(suggestions: list[str]) -> list[str]:
    """The suggestions with every recipe field named once: an alternative ('a / b', 'a or b') whose field an
    earlier suggestion named is dropped, and a suggestion left with none."""
    seen, out = set(), []
    for text in suggestions:
        kept = []
        for part in re.split(r" / | or ", text):
            key = (re.findall(r"[a-z_]+\.[a-z_]+", part) or [part])[0]
            if key not in seen:
                seen.add(key)
                kept.append(part)
        if kept:
            out.append(" / ".join(kept))
    return out


def _fields_for(term: str, w: Workload) -> str:
    if term.startswith("base weights"):
        return "model.load_in_4bit: true" if not w.quantized else "a smaller model.name_or_path"
    if "KV cache" in term or "sampling" in term or "prefill" in term:
        if "KV cache" in term and w.engine == "vllm" and w.kv_cache_bytes is not None:
            return "generation.kv_cache_memory_bytes (vLLM's KV budget)"
        # advise decodes in waves: what does not fit is one sequence, however many prompts_per_step x G make
        return f"{_length_field(w)} / data.max_prompt_tokens (shorter sequences)"
    if term.startswith("optimizer"):   # bitsandbytes' 8-bit AdamW runs on CUDA only
        return "optimizer.name: adamw_8bit or a smaller lora.r" if w.device == "cuda" else "a smaller lora.r"
    if term.startswith("LoRA"):
        return "a smaller lora.r"
    if term.startswith("runtime"):
        return "(fixed cost of the runtime)"
    if term.startswith("one layer's copies") and not w.bf16_autocast:
        return "model.autocast: true with model.compute_dtype: bfloat16 (no fp32 copies of the LoRA inputs)"
    if term.startswith("checkpointed") and w.device == "cuda" and w.gradient_checkpointing and not w.offload_activations:
        return "train.offload_activations: true (the layer inputs wait in CPU memory)"
    return f"{_length_field(w)} / data.max_prompt_tokens (shorter sequences)" + (
        "" if w.gradient_checkpointing else " or model.gradient_checkpointing: true")


def _length_field(w: Workload) -> str:
    return "environment.max_total_tokens" if w.environment else "generation.max_new_tokens"


# Of the GPU memory a process can reach, the share the memory model's figures (torch's allocated peak) may fill:
# the caching allocator rounds blocks and fragments, and that is outside the model (vLLM keeps 10% back by default
# for the same reason, gpu_memory_utilization 0.9).
ALLOCATOR_SLACK = 0.10
CUDA_CONTEXT = GiB // 2   # what nvidia-smi shows beyond torch's allocated memory: the CUDA context, its kernels


def card_budget(card: int) -> int:
    """device_budget on an idle card of `card` bytes: the CUDA context out, then ALLOCATOR_SLACK."""
    return int(max(0, card - CUDA_CONTEXT) * (1 - ALLOCATOR_SLACK))


def card_note(card: int) -> str:
    """For `lowmem-grpo estimate --memory SIZE` on CUDA: where the budget for a card of SIZE comes from."""
    return (f"budget: {fmt(card_budget(card))} of a {fmt(card)} card, as the trainer takes it on an idle one: its "
            f"CUDA context (~{fmt(CUDA_CONTEXT)}) and {ALLOCATOR_SLACK:.0%} for the allocator left out (a desktop "
            f"on the card takes more)")


def device_budget(device: str) -> Optional[int]:
    """What the memory model's peak may reach on this machine's GPU (cuda) or RAM (cpu); None without such a
    device. On CUDA: the memory this process can still get plus what its allocator already holds (so a desktop,
    another process and the CUDA context are left out), capped by torch.cuda.set_per_process_memory_fraction (a
    shared card), less ALLOCATOR_SLACK."""
    import torch

    if device == "cuda":
        if not torch.cuda.is_available():
            return None
        index = torch.cuda.current_device()
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda i=None: 1.0)(index)
        free, total = torch.cuda.mem_get_info(index)
        reachable = min(total * fraction, free + torch.cuda.memory_reserved(index))
        return int(reachable * (1 - ALLOCATOR_SLACK))
    import psutil

    return psutil.virtual_memory().total


def budget_note(device: str, budget: int) -> str:
    """One line on where `device_budget`'s figure comes from, for `lowmem-grpo estimate`."""
    if device != "cuda":
        return f"budget: {fmt(budget)}, this machine's RAM"
    import torch

    total = torch.cuda.mem_get_info(torch.cuda.current_device())[1]
    return (f"budget: {fmt(budget)} of this GPU's {fmt(total)}: the memory this process can reach (others' use and "
            f"the CUDA context left out), less {ALLOCATOR_SLACK:.0%} for the allocator's rounding and fragmentation")


def longest_prompt(recipe, tokenizer=None) -> tuple[int, str]:
    """Tokens in the longest prompt, training or held-out (data.eval_path; an eval_fraction split's are rows of
    data.train_path), as the trainer sizes every phase (Trainer.whole_run_memory_model), read from the data when it
    can be (else the recipe's cap). The held-out file was left out before (found by a red team)."""
    from .data import DataError, PromptSet
    from .model import ModelLoadError, load_tokenizer

    try:
        tokenizer = tokenizer or load_tokenizer(recipe.model)
        found = []
        for path, held_out in ((recipe.data.train_path, False), (recipe.data.eval_path, True)):
            if path:
                ps = PromptSet(path, recipe.data, tokenizer, held_out=held_out,   # a large source: its start-up sample
                               reset_fills=bool(recipe.environment.name))
                sample = f" (of the {ps.checked:,} rows checked)" if ps.checked < len(ps.source) else ""
                found.append((len(ps.longest_prompt()), f"longest prompt in {path}{sample}"))
        tokens, where = max(found, key=lambda f: f[0])
        return tokens, where + (", of the training and held-out prompts" if len(found) > 1 else "")
    except (DataError, ModelLoadError, OSError) as exc:
        return recipe.data.max_prompt_tokens, f"data.max_prompt_tokens (could not read the prompts: {exc})"


def read_config(model_cfg) -> tuple:
    """(config, shipped) of model.name_or_path as estimate and validate read it, no weights: transformers' AutoConfig,
    of the copy of its config.json that ships with the package for such a hub id (`shipped`, read offline; else
    None). ModelLoadError, one line naming model.name_or_path, where it cannot be read."""
    from transformers import AutoConfig

    from .hub import shipped_model_config
    from .model import ModelLoadError

    name = model_cfg.name_or_path
    shipped = shipped_model_config(name)  # a hub id whose config.json ships with the package: read offline
    try:
        config = AutoConfig.from_pretrained(shipped or name, trust_remote_code=model_cfg.trust_remote_code)
    except (OSError, ValueError, TypeError, KeyError, AttributeError, *_CONFIG_CHECK_ERRORS) as exc:
        # transformers 5 checks a config's fields as it reads them (huggingface_hub's strict dataclasses): the
        # cause names the field and what it expected, e.g. "Field 'vocab_size' expected int, got str"
        why = exc.__cause__ if isinstance(exc, _CONFIG_CHECK_ERRORS) and exc.__cause__ else exc
        raise ModelLoadError(f"model.name_or_path={name!r}: cannot read its config "
                             f"({' '.join(str(why).split())})") from None
    return config, shipped


def config_shape(config, name: str) -> ModelShape:
    """ModelShape.from_config, its error (of the same class) naming model.name_or_path."""
    try:
        return ModelShape.from_config(config)
    except MemoryModelError as exc:
        raise type(exc)(f"model.name_or_path={name!r}: {exc}") from None


def estimate_recipe(recipe, device: str, prompt_tokens: Optional[int] = None,
                    processes: int = 1, budget: Optional[int] = None) -> tuple[Estimate, ModelShape, Workload]:
    """The memory model for a recipe, per process: the model's config (no weights loaded) and its longest prompt;
    with a budget, decoding in waves sized to it (`estimate`)."""
    from .model import ModelLoadError

    name = recipe.model.name_or_path
    config, shipped = read_config(recipe.model)
    shape = config_shape(config, name)
    note = None
    if prompt_tokens is None and shipped:
        # A shipped shape means the model is no local folder: its tokenizer (and hf: data) would come from the
        # hub, which without a network costs ~25 s of retries before failing. The cap needs neither, and is an
        # upper bound: data.py rejects (or skips) every prompt longer than data.max_prompt_tokens.
        prompt_tokens = recipe.data.max_prompt_tokens
        note = "data.max_prompt_tokens, an upper bound (the prompts are measured when model.name_or_path is a local folder)"
    elif prompt_tokens is None:
        prompt_tokens, note = longest_prompt(recipe)
    workload = workload_from_recipe(recipe, prompt_tokens, device, processes)
    lora_note = None
    try:
        # peft's adapters counted on a meta-device copy, for every model: the name rule (lora_targeted) knows only
        # LLaMA's layer names, and counted none on GPT-NeoX's query_key_value/dense (found by a red team)
        census = experts_census_from_config(config, recipe.model, recipe.lora)
    except ModelLoadError:   # lora.target_modules names no layer of the model: as train says it (model.attach_lora)
        raise
    except Exception as exc:   # transformers builds the model from a config it did not check (on the meta device)
        why = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
        if shape.experts:   # peft decides a mixture's adapters: no rule to fall back on
            raise MemoryModelError(f"model.name_or_path={name!r}: transformers cannot build the model its config.json "
                                   f"describes ({why})") from None
        census = {}
        why = why.split(". ")[0][:300]   # (transformers' "Unrecognized configuration class" goes on to list them all)
        lora_note = (f"LoRA parameters: counted by LLaMA-style layer names ({', '.join(LORA_LINEARS)}), as transformers "
                     f"cannot build this model on the meta device ({why})")
    workload = replace(workload, **census)
    if lora_note and workload.lora_targets != ("all-linear",) and not lora_params(shape, workload):
        lora_note += f"; lora.target_modules={list(workload.lora_targets)} matches none of them"
    est = estimate(shape, workload, budget)
    if lora_note:
        est.notes.append(lora_note)
    if note:
        est.notes.insert(0, f"prompt length {prompt_tokens} tokens: {note}")
    if shipped:
        est.notes.insert(0, f"model shape: the shipped copy of {name}'s config.json (lowmem_grpo/model_configs; nothing downloaded)")
    if part := outside_text_config(config):
        est.notes.append(part)
    if context := context_note(config, prompt_tokens, recipe):
        est.notes.append(context)
    if shape.experts:
        est.notes.append(experts_note(shape, workload))
    return est, shape, workload


def outside_text_config(config) -> Optional[str]:
    """For a multimodal config (the language model in its text_config): a note that the rest is not counted."""
    from .model import text_config

    if text_config(config) is config:
        return None
    towers = [key.split("_")[0] for key in ("vision_config", "audio_config", "speech_config")
              if getattr(config, key, None) is not None]
    rest = f"its {' and '.join(towers)} tower" if towers else "the rest of the model"
    return (f"model shape: the language model of this {getattr(config, 'model_type', '?')} config (its text_config) "
            f"only; {rest} is not counted (its weights and activations come on top)")


def context_note(config, prompt_tokens: int, recipe, prompt_is: str = "the prompt length above") -> Optional[str]:
    """A prompt (`prompt_is` says which) and a completion that pass the model's context (`context_limit`), or None;
    estimate's and validate's note, and the trainer's at start-up (Trainer._note_context)."""
    from .model import context_limit, context_text

    limit = context_limit(config)
    need = prompt_tokens + completion_tokens(recipe)
    if limit is None or need <= limit:
        return None
    field = "environment.max_total_tokens" if recipe.environment.name else "generation.max_new_tokens"
    return (f"context: a prompt of {prompt_tokens} tokens ({prompt_is}) and a completion of "
            f"{field}={completion_tokens(recipe)} come to {need} tokens, past the model's {context_text(config)}: "
            f"lower them, or use a model with a longer context")


def experts_note(s: ModelShape, w: Workload) -> str:
    """What a mixture of experts costs that a dense model does not, for `estimate` and the trainer's start-up."""
    dtype = {4: "float32", 2: "16-bit"}[w.compute_bytes]
    text = (f"a mixture of {s.experts} experts, {s.experts_per_token} per token, in {s.moe_layers} of {s.num_layers} layers: "
            f"the routed experts hold {fmt(experts_bytes(s, w))}")
    if w.experts_nf4:
        text += (" in NF4 (model.quantize_experts), frozen: LoRA trains attention, the router and the dense and "
                 "shared MLPs")
    elif w.quantized:
        text += (f" in {dtype}: transformers stores them as 3-D tensors, which bitsandbytes does not quantize, and "
                 "model.quantize_experts is off or this layout is not one lowmem_grpo/experts4bit.py handles")
    if w.lora_on_experts:
        text += (f"; peft adapts them too ({lora_params(s, w) / 1e6:.1f}M LoRA parameters in all), and each MoE layer's "
                 f"forward builds its experts merged with LoRA ({fmt(merged_experts_bytes(s, w))}). To train attention "
                 f"only: lora.target_modules: [q_proj, k_proj, v_proj, o_proj]")
    return text


def peak_rss_mib() -> float:
    """This process's peak resident memory in MiB: VmHWM on Linux, getrusage's ru_maxrss elsewhere.

    Not ru_maxrss on Linux: across execve the kernel keeps the larger of the old and the new high-water
    mark, so a process started by a big parent (a benchmark that built the model, pytest) reports the
    parent's RSS as its own peak until it outgrows it. VmHWM belongs to the new address space alone."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration, ValueError, IndexError):
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB elsewhere


def return_freed_memory_to_os() -> bool:
    """CPU runs on Linux/glibc: give freed activation buffers back to the OS at once.

    glibc raises its mmap threshold each time a large block is freed (up to 32 MiB), after which blocks of
    that size come from the heap and stay resident when freed; a training step's activations then keep
    the process's RSS far above what is live (measured: 1,771 vs 835 MiB peak at 1,024 tokens in
    scripts/bench_memory.py's model). A fixed threshold (mallopt M_MMAP_THRESHOLD) turns the dynamic rule
    off. Returns False where this is not glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(-3, CPU_MMAP_THRESHOLD))  # M_MMAP_THRESHOLD = -3
    except (OSError, AttributeError):
        return False


# Blocks of at least this size are mmapped, so freed ones leave RSS. 4 MiB, not 1: every mmapped block
# is page-faulted afresh on each use, and at 1 MiB the quickstart's many 1-4 MiB activations made a step
# ~1.9x slower (scripts/bench_cpu_malloc.py: 1.35 vs 0.70 s/step, 0.70 with glibc's default) for ~150 MiB
# less peak. At 4 MiB the 1,024-token bench_memory peak is the same as at 1 MiB (854 vs 855 MiB; 1,692
# with the default).
CPU_MMAP_THRESHOLD = 4 << 20


def peak_memory_mib() -> float:
    """This process's peak memory in MiB: the CUDA allocator's high-water mark, or on CPU peak_rss_mib."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return peak_rss_mib()


def current_memory_mib() -> float:
    """This process's memory in use now, in MiB: what the CUDA allocator holds in tensors, or on CPU the resident set
    (VmRSS). Beside the peak, which only ever rises, it shows memory that a long run keeps and should not."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.memory_allocated() / 2**20
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
    except (OSError, StopIteration, ValueError, IndexError):   # (no /proc: the peak is the best figure there is)
        return peak_rss_mib()


def release_memory() -> None:
    """What a failed step held back to the device (CUDA's cache) or the OS, so that a checkpoint can be written."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    else:
        return_freed_memory_to_os()


def oom_gist(exc: BaseException) -> str:
    """An out-of-memory error's gist: its type and first two sentences (CUDA's text goes on for a paragraph)."""
    text = " ".join(str(exc).split())
    return type(exc).__name__ + (": " + ". ".join(text.split(". ")[:2]).rstrip(".") if text else "")
