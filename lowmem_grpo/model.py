"""Load the base model (4-bit NF4 or not), attach LoRA, and expose what the trainer needs from it.

One model is both the policy (adapters on) and the reference (inside `reference_mode`, adapters off):
no second copy of the weights. The trainer never asks the model for logits: `hidden_states` runs the
decoder only, and `lm_head_params` hands the head's weight to the chunked log-prob kernel.
"""

from __future__ import annotations

import contextlib
import json
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from .hub import model_path_problem, tokenizer_files_problem, weights_problem
from .internals import bnb_internals, quiet_bitsandbytes_kernels_warning
from .recipe import LoraConfig, ModelConfig

# Before bitsandbytes is first imported (by peft, or by transformers loading a 4-bit model), which is when
# it logs that the optional `kernels` package is absent: a line that reads as an error, and is not one.
quiet_bitsandbytes_kernels_warning()

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(Exception):
    pass


class AdapterLoadError(ModelLoadError):
    """A saved adapter that cannot be loaded: a damaged folder, or one made for another base model."""


try:   # what transformers 5 raises for a config.json field of the wrong type or value (as memory.py reads it)
    from huggingface_hub.errors import StrictDataclassError
    _CONFIG_CHECK_ERRORS: tuple = (StrictDataclassError,)
except ImportError:   # an older huggingface_hub: configs are not checked so
    _CONFIG_CHECK_ERRORS = ()


def _cannot_load(cfg: ModelConfig, what: str, exc: Exception) -> ModelLoadError:
    """One line for transformers' failure to load the tokenizer or the model (`what`)."""
    name = cfg.name_or_path
    if "trust_remote_code" in str(exc):
        # transformers says "pass the argument trust_remote_code=True", with a hub URL made of a local path (found
        # by a red team): the recipe's field is what the user sets
        return ModelLoadError(f"model.name_or_path={name!r}: its config names model code of its own (auto_map), which "
                              "runs only with model.trust_remote_code: true in the recipe; set it only for a model "
                              "whose code you trust")
    why = exc.__cause__ if isinstance(exc, _CONFIG_CHECK_ERRORS) and exc.__cause__ else exc
    return ModelLoadError(f"model.name_or_path={name!r}: cannot load {what} ({' '.join(str(why).split())})")


def load_tokenizer(cfg: ModelConfig):
    from transformers import AutoTokenizer

    if problem := model_path_problem(cfg.name_or_path):
        raise ModelLoadError(problem)
    folder = Path(cfg.name_or_path).expanduser()
    # without them transformers builds an empty tokenizer, or asks for sentencepiece: neither says what is missing
    if folder.is_dir() and (problem := tokenizer_files_problem(folder)):
        raise ModelLoadError(f"model.name_or_path={cfg.name_or_path!r}: {problem}")
    try:
        tok = AutoTokenizer.from_pretrained(cfg.name_or_path, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError, *_CONFIG_CHECK_ERRORS) as exc:
        raise _cannot_load(cfg, "a tokenizer", exc) from None
    # a vocabulary of special tokens alone (found by a red team): every prompt would render to no tokens
    if len(tok) == 0 or not tok.encode("0123456789", add_special_tokens=False):
        raise ModelLoadError(f"model.name_or_path={cfg.name_or_path!r}: the tokenizer turns text into no tokens (it "
                             f"holds {len(tok)}, its special tokens at most): its vocabulary file is missing or empty")
    if problem := made_up_eos(tok, folder if folder.is_dir() else None):
        raise ModelLoadError(f"model.name_or_path={cfg.name_or_path!r}: {problem}")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    # Left padding: generation appends to the right of every prompt.
    tok.padding_side = "left"
    return tok


def made_up_eos(tok, folder: Optional[Path] = None) -> Optional[str]:
    """Why the tokenizer's end-of-sequence token is one transformers made up as it loaded the tokenizer, or None.

    Found by a red team: with no eos_token in tokenizer_config.json, transformers 5.19 takes the tokenizer class's
    default (Qwen2Tokenizer's '<|endoftext|>') and, where the vocabulary lacks it, adds it as a new token (in the
    class's __init__, `add_tokens(all_special_tokens)`). The model never learned that id: no completion would stop
    (or, past the embedding's rows, the first forward fails). A token is made up when it is neither in the
    vocabulary's model nor among the added tokens the folder saved (tokenizer_config.json's added_tokens_decoder,
    added_tokens.json, tokenizer.json's added_tokens). Only a tokenizers-backed tokenizer is judged (the others:
    None). `folder`: the local model folder, to say what its files declare."""
    eos = tok.eos_token
    backend = getattr(tok, "backend_tokenizer", None)
    if eos is None or backend is None or backend.model.token_to_id(eos) is not None:
        return None
    saved = {str(t) for t in (tok.init_kwargs.get("added_tokens_decoder") or {}).values()}
    if eos in saved or eos in _tokenizer_json_added(tok, folder):
        return None
    why = "the tokenizer's files name no eos_token in its vocabulary"
    if folder:
        why = "tokenizer_config.json names no eos_token"
        for file in ("tokenizer_config.json", "special_tokens_map.json"):   # (the second: where older files kept it)
            if declared := _declared(folder, file, "eos_token"):
                why = f"{file}'s eos_token {declared!r} is not in it"
                break
    model_eos = _model_eos(tok, folder) if folder else ""
    return (f"the tokenizer's end-of-sequence token {eos!r} is not in the folder's vocabulary: transformers added it as "
            f"a new token (id {tok.eos_token_id}) as it loaded the tokenizer, because {why}. The model never learned "
            "it, so no completion would stop before max_new_tokens. Set \"eos_token\" in tokenizer_config.json to "
            f"the model's end-of-sequence token{model_eos}")


def _tokenizer_json_added(tok, folder: Optional[Path]) -> set[str]:
    """The added tokens (their text) of the tokenizer.json the tokenizer came from; a hub model's from the cache."""
    path = folder / "tokenizer.json" if folder else None
    if path is None:
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(str(tok.name_or_path), "tokenizer.json")
            path = Path(cached) if isinstance(cached, str) else None
        except Exception:   # not a hub id, an unreadable cache: nothing more is known
            path = None
    try:
        added = json.loads(path.read_text(encoding="utf-8")).get("added_tokens") if path else None
        return {t["content"] for t in added or [] if isinstance(t, dict) and isinstance(t.get("content"), str)}
    except (OSError, ValueError, AttributeError):
        return set()


def _declared(folder: Path, file: str, key: str):
    """`key` of the folder's JSON `file` (a special token's text where it is stored as {"content": ...}), or None."""
    try:
        value = json.loads((folder / file).read_text(encoding="utf-8")).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    return value.get("content") if isinstance(value, dict) else value


def _model_eos(tok, folder: Path) -> str:
    """' (generation_config.json's eos_token_id 2 is '</s>')', or what says that no model file names one."""
    for file in ("generation_config.json", "config.json"):
        ids = _declared(folder, file, "eos_token_id")
        ids = [ids] if isinstance(ids, int) else ids if isinstance(ids, list) else []
        ids = [i for i in ids if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(tok)]
        if ids:
            named = ", ".join(f"{i} is {tok.convert_ids_to_tokens(i)!r}" for i in ids)
            return f" ({file}'s eos_token_id {named})"
    return " (neither generation_config.json nor config.json names its eos_token_id either)"


def load_base_model(cfg: ModelConfig, quantized: Optional[bool] = None, device: Optional[str] = None):
    """The base causal LM. quantized=None follows the recipe (model.load_in_4bit)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quantized = cfg.load_in_4bit if quantized is None else quantized
    dtype = DTYPES[cfg.compute_dtype]
    # output_loading_info: the keys the weights lack, which transformers initialises at random with a warning only;
    # ignore_mismatched_sizes: shapes that differ from the config's are reported there too, not raised (refused below)
    kwargs = dict(dtype=dtype, trust_remote_code=cfg.trust_remote_code, output_loading_info=True,
                  ignore_mismatched_sizes=True)
    if problem := model_path_problem(cfg.name_or_path):
        raise ModelLoadError(problem)
    folder = Path(cfg.name_or_path).expanduser()
    if folder.is_dir() and (problem := weights_problem(folder)):
        raise ModelLoadError(f"model.name_or_path={cfg.name_or_path!r}: cannot load the model: {problem}")
    target = device or default_device()
    # A mixture's routed experts load in compute dtype (3-D tensors, which bitsandbytes leaves) and are stored in
    # NF4 only then (experts4bit.py): they are staged in host memory, so that the device never holds them unquantized.
    staged = quantized and cfg.quantize_experts and _routed_experts(cfg)
    if quantized:
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=dtype,
            bnb_4bit_use_double_quant=cfg.double_quant,
        )
        kwargs["device_map"] = {"": "cpu" if staged else target}
    from safetensors import SafetensorError

    try:
        model, info = AutoModelForCausalLM.from_pretrained(cfg.name_or_path, **kwargs)
    except (OSError, ValueError, *_CONFIG_CHECK_ERRORS) as exc:
        raise _cannot_load(cfg, "the model", exc) from None
    except RuntimeError as exc:   # what transformers raises after its load report; any other (out of memory) as it is
        if not str(exc).startswith(("Error(s) in loading state_dict", "We encountered some issues during automatic "
                                                                      "conversion")):
            raise
        raise _cannot_load(cfg, "the model", exc) from None
    except SafetensorError as exc:   # a weights file cut short or damaged: safetensors' error names no file
        raise ModelLoadError(f"model.name_or_path={cfg.name_or_path!r}: cannot load the model: "
                             f"{unreadable_weights(cfg.name_or_path) or 'a weights file'} is unreadable, truncated or "
                             f"corrupt ({' '.join(str(exc).split())})") from None
    if problem := loading_problem(model, info):
        raise ModelLoadError(f"model.name_or_path={cfg.name_or_path!r}: {problem}")
    if staged:
        from .experts4bit import quantize_experts

        quantize_experts(model, device=target)   # (a layout it does not handle stays: memory.experts_note says so)
        if target != "cpu":   # GPU-only path (bitsandbytes moves 4-bit weights as they are): not run in CI
            model.to(target)
    if quantized:
        disable_cpu_4bit_repack(model)
    elif device:
        model.to(device)
    return model


def loading_problem(model, info: dict) -> Optional[str]:
    """Why a loaded model is not the one its weights hold (found by a red team: each trained silently), or None:
    parameters of the config's shape that the weights lack (misnamed keys, a missing layer or head: transformers
    initialises them at random, and says so in a warning only), or weights whose shapes are not the config's (a
    config.json from another model). `info`: from_pretrained's output_loading_info, whose missing keys leave out what
    is missing by design (a tied head, buffers). A 4-bit load records no shape mismatch (transformers 5.19 compares
    shapes only without a quantizer): there the loaded layers are compared with their declared sizes."""
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        unexpected = sorted(info.get("unexpected_keys") or ())
        named = f"; and {len(unexpected)} key(s) of the weights match no parameter, e.g. {unexpected[0]!r}" \
            if unexpected else ""
        return (f"the weights lack {len(missing)} of the model's parameters ({', '.join(missing[:5])}"
                f"{', ...' if len(missing) > 5 else ''}){named}: transformers would initialise them at random. "
                "The weights are incomplete, or of another model than config.json describes")
    mismatched = sorted(info.get("mismatched_keys") or ()) or _quantized_mismatches(model)
    if mismatched:
        shown = ", ".join(f"{key} {list(got)} in the weights, {list(want)} by config.json"
                          for key, got, want in mismatched[:3])
        return (f"config.json's shapes do not match the weights ({shown}{', ...' if len(mismatched) > 3 else ''}): "
                "the config is from another model; use the config.json that came with these weights")
    return None


def _quantized_mismatches(model) -> list[tuple[str, tuple, tuple]]:
    """(weight name, loaded shape, declared shape) of each embedding or linear layer whose weight is not the size
    the module declares (a 4-bit layer's weight is packed: its quant_state keeps the shape it was quantized from)."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Embedding):
            want = (module.num_embeddings, module.embedding_dim)
        elif isinstance(module, torch.nn.Linear):   # (bitsandbytes' Linear4bit is one)
            want = (module.out_features, module.in_features)
        else:
            continue
        weight = getattr(module, "weight", None)
        state = getattr(weight, "quant_state", None)
        got = getattr(state, "shape", None) or getattr(weight, "shape", None)
        if got is not None and tuple(got) != want:
            found.append((f"{name}.weight", tuple(got), want))
    return found


def unreadable_weights(name_or_path: str) -> Optional[str]:
    """The first *.safetensors file of a local model folder whose header safetensors cannot read (which also checks
    the file's length), or None."""
    from .checkpoint import safetensors_problem

    folder = Path(name_or_path).expanduser()
    if not folder.is_dir():
        return None
    return next((str(f) for f in sorted(folder.glob("*.safetensors")) if safetensors_problem(f) is not None), None)


def _routed_experts(cfg: ModelConfig) -> bool:
    """Whether the model's config declares routed experts, before loading it."""
    from transformers import AutoConfig

    from .experts4bit import routed_experts

    try:
        config = AutoConfig.from_pretrained(cfg.name_or_path, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError):   # the load below says what is wrong
        return False
    return routed_experts(getattr(config, "text_config", None) or config) > 1


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def disable_cpu_4bit_repack(model) -> int:
    """Stop bitsandbytes from repacking 4-bit weights in place on CPUs with AVX512-BF16.

    bitsandbytes 0.50.2 (nn/modules.py, Linear4bit.forward) converts the weight to a CPU-packed format on
    the first forward that is in eval mode without grad (our rollouts and reference pass). After that,
    backward through the layer raises (layers with bias) or silently returns no input gradient (layers
    without), which would freeze every LoRA adapter below it. The flag is undocumented: it is set through
    `bnb_internals()` (lowmem_grpo/internals.py), which checks that Linear4bit still reads it;
    tests/test_model.py::test_4bit_backward_after_eval_forward guards the behaviour.
    """
    if "bitsandbytes" not in sys.modules:  # then the model has no 4-bit layer
        return 0
    bnb = bnb_internals()
    n = 0
    for module in model.modules():
        if isinstance(module, bnb.Linear4bit):
            bnb.disable_cpu_repack(module)
            n += 1
    return n


def attach_lora(model, cfg: LoraConfig, gradient_checkpointing: bool = True):
    from peft import LoraConfig as PeftLoraConfig, get_peft_model

    if gradient_checkpointing:
        # Non-reentrant checkpointing needs no input that requires grad (the 4-bit base has none).
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    peft_cfg = PeftLoraConfig(
        r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, bias="none",
        target_modules=cfg.target_modules, task_type="CAUSAL_LM",
    )
    names = [name for name, _ in model.named_parameters()]
    try:
        with warnings.catch_warnings():
            # peft 0.21 maps 'all-linear' onto transformers 5's fused MoE experts and doubles the fused gate_up_proj's
            # rank by a rank/alpha pattern of its own; it then warns that this pattern matched nothing, though the
            # doubled rank is there (tests/test_memory.py counts it). Not the user's doing, and nothing is wrong.
            warnings.filterwarnings("ignore", message=r"The following (rank|alpha)_pattern keys did not match any "
                                                      r"targeted module and were ignored: \['[^']*gate_up_proj'\]")
            policy = get_peft_model(model, peft_cfg)
    except ValueError as exc:   # peft's NoMatchingPeftModuleError: no module has such a name
        raise ModelLoadError(f"lora.target_modules={cfg.target_modules}: {str(exc).splitlines()[0]} This model's linear "
                             f"layers are named {', '.join(linear_names(model))}; or write 'all-linear'") from None
    _keep_found_target_parameters(policy.peft_config["default"], names)
    return policy


def _keep_found_target_parameters(config, names: list[str]) -> None:
    """Drop from the adapter's config the target_parameters that matched no parameter of the base (peft 0.21 sets
    a mixture's experts for 'all-linear', which are buffers once stored in NF4, experts4bit.py), and their rank
    and alpha patterns. Saved as they are, a load onto a base that has them (export's unquantized one) would add
    untrained adapters there, and warn of their missing weights."""
    targets = list(getattr(config, "target_parameters", None) or [])
    kept = [t for t in targets if any(n == t or n.endswith("." + t) for n in names)]
    if kept == targets:
        return
    config.target_parameters = kept or None
    gone = [t for t in targets if t not in kept]
    for patterns in (config.rank_pattern, config.alpha_pattern):
        for key in [k for k in patterns if any(k.endswith(t) for t in gone)]:
            del patterns[key]


def linear_names(model) -> list[str]:
    """The distinct last names of the model's linear layers (4-bit or not), the LM head aside: what
    lora.target_modules may name."""
    head = _base(model).get_output_embeddings()
    names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules()
             if isinstance(m, torch.nn.Linear) and m is not head}
    return sorted(names)


def load_adapter(base, adapter_path: str, model_name: str, is_trainable: bool = True):
    """PeftModel.from_pretrained(base, adapter_path), with an adapter it cannot load as one line (AdapterLoadError)
    rather than peft's traceback: a damaged folder is found before the load (checkpoint.adapter_problem)."""
    from peft import PeftModel

    from .checkpoint import adapter_problem

    if problem := adapter_problem(Path(adapter_path)):
        raise AdapterLoadError(problem)
    try:
        return PeftModel.from_pretrained(base, adapter_path, is_trainable=is_trainable)
    except Exception as exc:  # a size mismatch or missing target modules: an adapter of another base model
        first = " ".join(line.strip() for line in str(exc).strip().splitlines()[:2])[:300]  # torch: a header, then what
        raise AdapterLoadError(f"{adapter_path} does not load onto model.name_or_path={model_name!r} (was it trained "
                               f"on another base model?): {type(exc).__name__}: {first}") from None


def load_policy(model_cfg: ModelConfig, lora_cfg: LoraConfig, adapter_path: Optional[str] = None):
    """(peft model, tokenizer): the policy and, with adapters disabled, the reference."""
    if getattr(model_cfg, "backend", "transformers") == "unsloth":
        return load_unsloth_policy(model_cfg, lora_cfg, adapter_path)
    tokenizer = load_tokenizer(model_cfg)
    base = load_base_model(model_cfg)
    if problem := vocabulary_problem(base, tokenizer) or stop_token_problem(base, tokenizer):
        raise ModelLoadError(f"model.name_or_path={model_cfg.name_or_path!r}: {problem}")
    if adapter_path:
        if model_cfg.gradient_checkpointing:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model = load_adapter(base, adapter_path, model_cfg.name_or_path)
    else:
        model = attach_lora(base, lora_cfg, model_cfg.gradient_checkpointing)
    if model_cfg.disable_dropout:
        disable_dropout(model)
    return model, tokenizer


def vocabulary_problem(model, tokenizer) -> Optional[str]:
    """Why the tokenizer's ids do not all fit the model's input embedding, or None. Found by a red team: a
    tokenizer with more tokens than the embedding has rows (one of another model, tokens added without resizing the
    embedding, an end-of-sequence token transformers made up) failed at the first forward with an IndexError."""
    rows = _base(model).get_input_embeddings().weight.shape[0]
    named = {"eos": tokenizer.eos_token_id, "pad": tokenizer.pad_token_id}
    past = {k: i for k, i in named.items() if isinstance(i, int) and i >= rows}
    if len(tokenizer) <= rows and not past:
        return None
    eos = f" (eos {tokenizer.eos_token!r} = {tokenizer.eos_token_id})" if tokenizer.eos_token_id is not None else ""
    return (f"the tokenizer has {len(tokenizer)} tokens{eos} and the model's embedding {rows} rows: ids from {rows} on "
            "index no row. The tokenizer's files are another model's, or tokens were added to it without resizing the "
            "model's embedding; use the tokenizer that came with the model")


def disable_dropout(model) -> int:
    """model.disable_dropout: zero the base model's dropout layers and its attention modules' `attention_dropout`
    (which transformers' attention functions read in training mode), the LoRA adapters' own dropout left to
    lora.dropout. Returns how many were non-zero."""
    changed = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Dropout) and "lora_dropout" not in name and module.p > 0:
            module.p, changed = 0.0, changed + 1
        rate = getattr(module, "attention_dropout", None)
        if isinstance(rate, float) and rate > 0:
            module.attention_dropout, changed = 0.0, changed + 1
    return changed


def load_unsloth_policy(model_cfg: ModelConfig, lora_cfg: LoraConfig, adapter_path: Optional[str] = None):
    """model.backend: unsloth. Unsloth's FastLanguageModel (its kernels, its 4-bit loading) with peft LoRA
    adapters, as (peft model, tokenizer) like load_policy, and under load_policy's rules: the tokenizer is
    load_tokenizer's (its checks, pad token and left padding; Unsloth's own tokenizer is not used, as Unsloth
    flips its padding side between training and generation), the tokenizer must fit the embedding and the model
    must have a stop token (vocabulary_problem, stop_token_problem), 'all-linear' is every linear layer but the
    LM head (linear_names, what peft's 'all-linear' takes), and a recipe setting Unsloth cannot honour is refused
    (_unsloth_setting_problem). NVIDIA GPU only: Unsloth refuses to import without one. The glue is checked on CPU
    against a stand-in `unsloth` module (tests/test_unsloth_backend.py), read from Unsloth 2026.7.x; Unsloth itself
    has never run here. The result is a peft model, so reference_mode (Unsloth's LoRA kernels skip disabled
    adapters), the chunked log-probs and the vLLM engine apply unchanged in principle."""
    if not torch.cuda.is_available():
        raise ModelLoadError("model.backend=unsloth needs an NVIDIA GPU (Unsloth refuses to import without one); "
                             "use model.backend: transformers")
    try:
        from unsloth import FastLanguageModel
    except Exception as exc:  # ImportError, or Unsloth's own refusal to run on this machine
        raise ModelLoadError(f"model.backend=unsloth is not available ({type(exc).__name__}: {exc}); install it on a GPU "
                             "machine with pip install -e '.[unsloth]', or use model.backend: transformers") from None
    tokenizer = load_tokenizer(model_cfg)
    if problem := _unsloth_setting_problem(model_cfg):
        raise ModelLoadError(problem)
    folder = Path(model_cfg.name_or_path).expanduser()
    if folder.is_dir() and (problem := weights_problem(folder)):
        raise ModelLoadError(f"model.name_or_path={model_cfg.name_or_path!r}: cannot load the model: {problem}")
    # "unsloth": Unsloth's checkpointing, which keeps the checkpointed layer inputs in host memory (for a context
    # under 512 tokens Unsloth uses plain checkpointing instead)
    checkpointing = "unsloth" if model_cfg.gradient_checkpointing else False
    loading = dict(model_name=model_cfg.name_or_path, load_in_4bit=model_cfg.load_in_4bit,
                   dtype=DTYPES[model_cfg.compute_dtype], trust_remote_code=model_cfg.trust_remote_code,
                   use_gradient_checkpointing=checkpointing,
                   use_exact_model_name=True)   # not Unsloth's pre-quantized copy of a hub model: the one named
    if (positions := _unsloth_positions(model_cfg)) is not None:
        loading["max_seq_length"] = positions
    base, _ = FastLanguageModel.from_pretrained(**loading)
    if problem := vocabulary_problem(base, tokenizer) or stop_token_problem(base, tokenizer):
        raise ModelLoadError(f"model.name_or_path={model_cfg.name_or_path!r}: {problem}")
    if adapter_path:
        model = load_adapter(base, adapter_path, model_cfg.name_or_path)
        # what Unsloth's own from_pretrained does with a saved adapter: its LoRA kernels and checkpointing
        model = FastLanguageModel.patch_peft_model(model, use_gradient_checkpointing=checkpointing)
    else:
        targets = linear_names(base) if lora_cfg.target_modules == "all-linear" else list(lora_cfg.target_modules)
        model = FastLanguageModel.get_peft_model(
            base, r=lora_cfg.r, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout, bias="none",
            target_modules=targets, use_gradient_checkpointing=checkpointing, random_state=_unsloth_random_state())
    _keep_checkpointing_through_generate(model)
    if model_cfg.disable_dropout:
        disable_dropout(model)
    return model, tokenizer


def _unsloth_setting_problem(cfg: ModelConfig) -> Optional[str]:
    """A model setting that Unsloth's loader would silently not apply, or None."""
    if cfg.load_in_4bit and not cfg.double_quant:
        return ("model.double_quant=false is not available with model.backend=unsloth: Unsloth's 4-bit loading always "
                "quantizes the scales a second time and takes no setting for it; set model.double_quant: true, or use "
                "model.backend: transformers")
    if cfg.load_in_4bit and cfg.quantize_experts and _routed_experts(cfg):
        return ("model.quantize_experts=true is not available with model.backend=unsloth: only the transformers path "
                "stores a mixture's routed experts in NF4 and freezes them (lowmem_grpo/experts4bit.py); Unsloth loads "
                "them its own way and may put LoRA on them. Set model.quantize_experts: false to train this mixture "
                "of experts through Unsloth, or use model.backend: transformers")
    return None


def _unsloth_positions(cfg: ModelConfig) -> Optional[int]:
    """Unsloth's max_seq_length for this model: its config's max_position_embeddings (None where it names none).
    Unsloth (FastLlamaModel.from_pretrained, 2026.7) truncates a forward's input to max_seq_length, and for a
    max_seq_length past max_position_embeddings it raises max_position_embeddings and stretches RoPE linearly,
    in place of the model's own scaling. Its default, 2048, did the one to a longer model and the other to a
    shorter one. With the model's own positions, neither happens."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(cfg.name_or_path, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError, *_CONFIG_CHECK_ERRORS) as exc:
        raise _cannot_load(cfg, "its config", exc) from None
    most = getattr(text_config(config), "max_position_embeddings", None)
    return most if isinstance(most, int) and not isinstance(most, bool) and most > 0 else None


def _unsloth_random_state() -> int:
    """Unsloth's get_peft_model reseeds every generator (transformers.set_seed) with its random_state, 3407 unless
    given: the adapters would start alike whatever the recipe's seed. Drawn from torch's stream instead, which the
    trainer has seeded from the recipe's seed, as the transformers path's adapters are."""
    return int(torch.randint(0, 2**31 - 1, ()).item())


def _keep_checkpointing_through_generate(model) -> None:
    """Unsloth's generate (unsloth_fast_generate) switches the model to inference, which turns gradient
    checkpointing off in every module, and turns it back on only when the model was in training mode: the rollouts
    run in eval mode (eval_mode), so training would go on without checkpointing after the first rollout. The
    modules' flags are put back after each call, whatever it did."""
    generate = model.generate

    def generate_keeping_checkpointing(*args, **kwargs):
        flags = [(m, m.gradient_checkpointing) for m in model.modules() if hasattr(m, "gradient_checkpointing")]
        try:
            return generate(*args, **kwargs)
        finally:
            for module, flag in flags:
                module.gradient_checkpointing = flag

    model.generate = generate_keeping_checkpointing


@contextlib.contextmanager
def reference_mode(model):
    """pi_ref: the same model with every LoRA adapter disabled."""
    with model.disable_adapter():
        yield


def stop_token_ids(model, tokenizer) -> tuple[int, ...]:
    """The token ids that end a completion: the tokenizer's EOS first, then any other the model's
    generation_config.json lists. Instruct models end a turn with a token their tokenizer may not call EOS
    (Gemma's <end_of_turn>, Phi-3's <|end|>, Llama 3's <|eot_id|> in older tokenizer files); without it
    every completion would run on to max_new_tokens and count as truncated."""
    listed = getattr(getattr(_base(model), "generation_config", None), "eos_token_id", None)
    listed = [listed] if isinstance(listed, int) else list(listed or [])
    ids = ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []) + listed
    return tuple(dict.fromkeys(i for i in ids if isinstance(i, int) and not isinstance(i, bool) and i >= 0))


def stop_token_problem(model, tokenizer) -> Optional[str]:
    """Why no completion could stop (no stop token at all: the tokenizer has no eos_token, the model's generation
    config no eos_token_id), or None. Found by a red team: every completion ran to max_new_tokens, without a word."""
    if stop_token_ids(model, tokenizer):
        return None
    return ("neither the tokenizer nor the model names an end-of-sequence token (tokenizer_config.json has no "
            "eos_token; generation_config.json and config.json no eos_token_id), so no completion would stop before "
            "max_new_tokens. Set \"eos_token\" in tokenizer_config.json to the model's end-of-sequence token")


@contextlib.contextmanager
def eval_mode(model):
    """Eval (no LoRA dropout) for rollouts and no-grad passes; restores the previous mode."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def _base(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


@dataclass
class LMHead:
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    scale: float = 1.0                # the final-logit transform (logit_transform)
    softcap: Optional[float] = None


def lm_head_params(model) -> LMHead:
    head = _base(model).get_output_embeddings()
    weight = getattr(head, "weight", None)
    if weight is None or weight.dim() != 2:
        raise ModelLoadError("the model's output embedding has no plain 2-D weight; chunked log-probs need one")
    return LMHead(weight, getattr(head, "bias", None), *logit_transform(_base(model).config))


# model_type -> the factor a causal LM multiplies its logits by, as transformers 5.19's modeling code does it.
# A new architecture that transforms its logits otherwise is caught at start-up by check_logit_head.
_LOGIT_SCALE = {
    **dict.fromkeys(("cohere", "cohere2", "cohere2_moe"), lambda c: c.logit_scale),
    **dict.fromkeys(("granite", "granitemoe", "granitemoeshared", "granitemoehybrid", "granite_swa", "granitemoe_swa",
                     "minicpm3"), lambda c: 1.0 / c.logits_scaling),   # (minicpm3 divides the hidden state: the same)
    "hyperclovax": lambda c: c.logits_scaling,   # the same key as Granite's, multiplied
    "falcon_h1": lambda c: c.lm_head_multiplier,
}


def text_config(config):
    """The language model's part of a config (a multimodal model's text_config; else the config itself)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def context_tokens(model) -> Optional[int]:
    """The most tokens (prompt + completion) the model takes: its config's max_position_embeddings, or the longer
    context its RoPE scaling makes (context_limit: one rule for this, estimate and validate), or None where the
    config does not say."""
    return context_limit(getattr(model, "config", None))


# RoPE types whose scaling sets a longer context than max_position_embeddings: those for which transformers 5
# (modeling_rope_utils.standardize_rope_params) records the pretraining length, original_max_position_embeddings, and
# `factor` times it is the context they extend to (YaRN; Llama 3's and LongRoPE's configs already give that as
# max_position_embeddings), and dynamic NTK, which rescales past max_position_embeddings (dynamic_rope_update) to
# `factor` times it (vLLM's max_model_len). Not "linear": whether max_position_embeddings already counts its factor is
# the model's convention (Gemma 3's does; vLLM makes it an exception).
CONTEXT_ROPE_TYPES = ("yarn", "llama3", "longrope", "dynamic")


def context_limit(config) -> Optional[int]:
    """The most tokens (prompt + completion) a model takes, from its config (its text_config): max_position_embeddings,
    or the longer context its RoPE scaling makes (CONTEXT_ROPE_TYPES); None where the config does not say. One rule
    for context_tokens (data rows, the transformers engine), estimate and validate: a red team found a YaRN
    config (factor 8 on 512 positions) held to 512 tokens."""
    text = text_config(config)
    most = getattr(text, "max_position_embeddings", None)
    if not isinstance(most, int) or isinstance(most, bool) or most <= 0:
        return None
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None)   # (transformers 5; before)
    nested = [p for p in rope.values() if isinstance(p, dict)] if isinstance(rope, dict) else []
    for params in ([rope] if isinstance(rope, dict) and not nested else nested):   # per layer type (Gemma 3's)
        kind = params.get("rope_type", params.get("type"))
        factor, original = params.get("factor"), params.get("original_max_position_embeddings", most)
        if kind in CONTEXT_ROPE_TYPES and all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
                                              for v in (factor, original)):
            most = max(most, int(factor * original))
    return most


def context_text(config) -> str:
    """The model's context as context_limit finds it, for a message: 'max_position_embeddings=N', or with RoPE
    scaling that extends it 'context of N tokens, by its rope scaling of max_position_embeddings=M'."""
    most = getattr(text_config(config), "max_position_embeddings", None)
    limit = context_limit(config)
    if limit == most:
        return f"max_position_embeddings={most}"
    return f"context of {limit} tokens, by its rope scaling of max_position_embeddings={most}"


def logit_transform(config) -> tuple[float, Optional[float]]:
    """(scale, softcap): what the model's forward does to the LM head's output before anyone samples from it,
    logits = softcap * tanh(scale * head(h) / softcap) (Gemma 2-4 soft-cap; Cohere and Granite scale). The
    chunked log-prob kernel must do the same, or the trained policy is not the one sampled."""
    text = text_config(config)
    scale = _LOGIT_SCALE.get(getattr(text, "model_type", ""), lambda c: 1.0)(text)
    softcap = getattr(text, "final_logit_softcapping", None)
    return float(scale), (float(softcap) if softcap else None)


PROBE_TOKENS = 16


def check_logit_head(model) -> Optional[float]:
    """Start-up check that the chunked log-probs (decoder + lm_head_params + the kernel) equal log_softmax of
    the model's own forward logits, on PROBE_TOKENS fixed tokens: an architecture whose forward transforms
    its logits in a way logit_transform does not know is refused here, instead of training a policy other
    than the one the engine samples from. Allowed: 1e-3 nats, plus what bf16/fp16 logits round away.
    Returns the largest difference (nats), or None where the forward returns no full logits to compare with
    (Unsloth's patched forward may leave them out)."""
    from .logprobs import selective_log_softmax

    vocab = _base(model).get_output_embeddings().weight.shape[0]
    device = next(model.parameters()).device
    ids = (torch.arange(1, PROBE_TOKENS + 1, device=device) * 7919 % vocab)[None]   # spread over the vocabulary
    with torch.no_grad(), eval_mode(model):
        logits = getattr(model(input_ids=ids), "logits", None)
        if not isinstance(logits, torch.Tensor) or tuple(logits.shape[:2]) != (1, PROBE_TOKENS) \
                or logits.shape[-1] < vocab:
            return None
        logits = logits[0, :-1, :vocab]
        want = torch.log_softmax(logits.float(), dim=-1).gather(1, ids[0, 1:, None])[:, 0]
        head = lm_head_params(model)
        got = selective_log_softmax(hidden_states(model, ids)[0, :-1], head.weight, ids[0, 1:], bias=head.bias,
                                    scale=head.scale, softcap=head.softcap)
    gap = float((got - want).abs().max())
    # The model's forward may round its logits to bf16/fp16 (8 or 11 significant bits); the kernel's are fp32.
    # So there a log-prob may be off by twice a logit's rounding, |z| * 2^-8 at the most (bf16).
    exact = logits.dtype in (torch.float32, torch.float64)
    tolerance = 1e-3 if exact else 1e-3 + 2 ** -7 * float(logits.float().abs().max())
    if not gap <= tolerance:
        config = _base(model).config
        raise ModelLoadError(
            f"model type {getattr(config, 'model_type', '?')!r}: the chunked log-probs differ from the model's own "
            f"by up to {gap:.3g} nats (allowed {tolerance:.3g}): its forward transforms the LM head's logits in a way "
            "lowmem-grpo does not know (known: a scale as Cohere and Granite apply, a soft-cap as Gemma's "
            "final_logit_softcapping), so training would update a policy other than the one sampled")
    return gap


def hidden_states(model, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                  position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Final hidden states [batch, seq, d] from the decoder alone: the LM head is never applied here.

    attention_mask: [batch, seq] 0/1 (padding), or [batch, seq, seq] bool, which key each query may see
    (a group's completions behind one copy of their prompt, docs/algorithm.md §12). transformers takes a
    4-D mask as it is: bool (True = attend) for sdpa, additive for eager; other kernels take no such mask."""
    decoder = _base(model).get_decoder()
    if attention_mask is not None and attention_mask.dim() == 3:
        kind = attention_kind(model)
        if kind == "sdpa":
            attention_mask = attention_mask[:, None]
        elif kind == "eager":
            dtype = next(p.dtype for p in decoder.parameters() if p.is_floating_point())
            attention_mask = torch.zeros(attention_mask.shape, dtype=dtype, device=attention_mask.device).masked_fill_(
                ~attention_mask, torch.finfo(dtype).min)[:, None]
        else:
            raise ValueError(f"a per-query attention mask needs sdpa or eager attention, not {kind!r}")
    out = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def attention_kind(model) -> str:
    """The model's attention implementation ("sdpa", "eager", "flash_attention_2", ...)."""
    return getattr(_base(model).config, "_attn_implementation", None) or "eager"


def takes_shared_prompts(model, row_width: int) -> bool:
    """Whether a micro-batch may lay out a group's completions behind one copy of their prompt (§12), in rows
    of at most `row_width` tokens: the attention implementation must take a per-query mask, and positions must
    come from position ids. And no layer may keep a narrower sliding window: transformers applies a given
    per-query mask as it is, window or not, so a completion would see further back than the model does."""
    if loaded_by_unsloth(model):   # its training forward drops the attention mask that layout needs
        return False
    window = sliding_window(model)
    return attention_kind(model) in ("sdpa", "eager") and (window is None or window >= row_width)


def loaded_by_unsloth(model) -> bool:
    """Whether Unsloth loaded the model (model.backend: unsloth): its loader records its version in the config."""
    return getattr(getattr(_base(model), "config", None), "unsloth_version", None) is not None


def sliding_window(model) -> Optional[int]:
    """The attention window of the model's sliding-window layers (Mistral, Gemma 2 and 3, Phi-3, Qwen2 with
    use_sliding_window), or None where every layer sees the whole sequence: as transformers 5.19 reads the
    config (a `layer_types` list names the sliding layers; Qwen's `use_sliding_window` switches it on)."""
    text = text_config(_base(model).config)
    window = getattr(text, "sliding_window", None)
    if not window or getattr(text, "use_sliding_window", True) is False:
        return None
    types = getattr(text, "layer_types", None)
    if types is not None and not any("sliding" in t for t in types):
        return None
    return int(window)


def trainable_parameters(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]
