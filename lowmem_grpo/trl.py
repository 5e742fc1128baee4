"""TRL's `GRPOTrainer` API on lowmem-grpo: a TRL training script runs here with its import changed.

    from lowmem_grpo.trl import GRPOConfig, GRPOTrainer      # was: from trl import GRPOConfig, GRPOTrainer

    trainer = GRPOTrainer(model="Qwen/Qwen2.5-1.5B-Instruct", reward_funcs=[my_reward], train_dataset=dataset,
                          args=GRPOConfig(output_dir="runs/x", learning_rate=1e-5, max_steps=200),
                          peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    trainer.train()
    trainer.save_model()       # the LoRA adapter, into output_dir

What happens: the arguments become a recipe (the README's "Coming from TRL" table, as code: `recipe_from_trl`),
checked like any other, with TRL's defaults where the script sets nothing (so `beta` is 0 and the loss is
`dapo`, as in TRL), and the trainer runs it: 4-bit base, LoRA, the chunked log-prob kernel. The datasets are
written to output_dir/data/ as JSON lines, and the trainer writes the recipe to output_dir/recipe.yaml: the folder
is an ordinary run (`lowmem-grpo report`, `eval`, `export`). The reward functions are called as TRL calls them
(convention: trl), each named as TRL names it (a partial by its function, a callable by its class). `args` may be
this module's `GRPOConfig` (an attribute a script reads without setting it: TRL's or transformers' default) or TRL's
own (its enums read by their values).

TRL's step counts are optimizer updates (num_iterations x steps_per_generation / gradient_accumulation_steps per
generation batch; below 1, a share of the run), a step here is one generation batch and its
algorithm.updates_per_step updates: max_steps, save_steps, logging_steps and eval_steps are converted. `save_model` writes
the tokenizer next to the adapter, as TRL's does. After train(), `state` (transformers' TrainerState: global_step,
log_history) reads the run's metrics.jsonl: an entry every logging_steps with the window's means, numbers only,
TRL's metric names beside ours (_RunLog), the train summary last. `model` is the trained policy, and `evaluate()`
runs the project's own greedy eval (lowmem_grpo/evaluate.py) on the eval set, returning eval_-prefixed metrics; the
run itself evaluates only where eval_strategy asks (before the first step only with eval_on_start), as TRL's does. A 4-bit NF4 `quantization_config` is read (its
nested quantization). transformers' TrainerCallbacks are called from the run's metrics (_CallbackSink: which
events, and which not).

What does not carry over is refused, naming it: a GRPOConfig setting with no equivalent here that the script
sets to something other than TRL's default (among them a generation batch that TRL would split into several
optimizer steps, push_to_hub, a report_to other than tensorboard or wandb), a model object (pass its id or
folder: the base is loaded in 4-bit here), a reward model given by name or as a model object, a processing_class
whose chat template (or vocabulary, or eos token) differs from the model folder's (the trainer loads the folder's),
a dataset column that is not JSON data, a dict of datasets, a dataset that is not a datasets.Dataset,
IterableDataset or list of dicts (a pandas DataFrame), an eval_strategy without an eval_dataset, a peft_config
that is not a peft.LoraConfig, LoRA options other than r, alpha, dropout and target modules, an 8-bit or FP4
quantization_config, generation_batch_size with steps_per_generation (as TRL), bf16 with fp16 (as transformers), a
max_steps that is not whole generation batches, a fresh train() into an output_dir holding a run, a resume with no
checkpoint there, no reward source (neither reward_funcs nor an environment with get_reward, as TRL), a dataset
'image' or 'images' column (TRL's images for a vision-language model), a model_init_kwargs dtype other than the one
bf16/fp16 choose (float32 and auto aside), a report_to integration that is not installed. The checks that do not
depend on each other are collected: one TRLCompatError lists every problem, one a line (_Refusals). TRL's own
trl/scripts/grpo.py runs (tests/test_trl_script.py); its `--resume_from_checkpoint true` arrives as the text "true",
read as True. TRL's experimental GMPO runs the same way (`from lowmem_grpo.trl import GMPOConfig, GMPOTrainer`, was
`from trl.experimental.gmpo import ...`): its recipe has algorithm.clip gmpo (recipe_from_trl's variant). Training
is LoRA only: without `peft_config`,
the recipe's default LoRA (r = 16, all linear layers).
Resuming a run goes through the same script (its functions are not importable from the recipe file).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import math
import os
import re
import sys
import types
from pathlib import Path
from typing import Any, Callable, Optional

from .data import ROW_SKIP_ADVICE
from .distributed import launched_size
from .recipe import Recipe, RecipeError, recipe_from_dict
from .rollout.base import EngineError
from .rewards import ROW_REWARD_KEYS, epochs_done
from .sinks import Sink, scalars, wandb_available
from .sources import DataError
from .user_code import importable_name


class TRLCompatError(ValueError):
    """A TRL argument that has no equivalent here, or a value that cannot be carried over. `problems`: one line per
    argument refused (several when independent checks were collected: _Refusals)."""

    def __init__(self, message: str, problems: Optional[list[str]] = None):
        super().__init__(message)
        self.problems = list(problems) if problems else [message]


def _refused(problems: list[str]) -> TRLCompatError:
    """One error for every problem found: a single one as it is, several one a line under a count, so that a script
    with three unsupported things learns all three in one run, not one a run (found by a red team)."""
    if len(problems) == 1:
        return TRLCompatError(problems[0])
    lines = "\n".join(f"  {p}" for p in problems)
    return TRLCompatError(f"{len(problems)} arguments cannot be run here (fix each):\n{lines}", problems)


class _Refusals:
    """The problems found so far by checks that do not depend on each other: check() runs one and keeps its refusal;
    gate() raises them all where the next check cannot run without an earlier one passing, stop() at the end."""

    def __init__(self):
        self.problems: list[str] = []

    def check(self, fn: Callable, *args, **kwargs):
        """fn's result, or None when it refused (its problems kept)."""
        try:
            return fn(*args, **kwargs)
        except TRLCompatError as exc:
            self.problems.extend(exc.problems)
            return None

    def add(self, *problems: str) -> None:
        self.problems.extend(problems)

    def gate(self, *problems: str) -> None:
        """Raise every problem found with `problems`, if there are any: the checks after a gate read what it checks."""
        if problems:
            raise _refused([*self.problems, *problems])

    def stop(self) -> None:
        """Raise every problem found, if any."""
        if self.problems:
            raise _refused(self.problems)


# TRL 1.16's GRPOConfig defaults for the settings mapped below (tests/test_trl_api.py checks them against the
# installed TRL's source). A script that leaves a setting alone gets TRL's value, not the recipe default.
TRL_DEFAULTS: dict[str, Any] = {
    "output_dir": None, "learning_rate": 1e-06, "lr_scheduler_type": "linear", "warmup_steps": 0,
    "weight_decay": 0.0, "adam_beta1": 0.9, "adam_beta2": 0.999, "max_grad_norm": 1.0, "optim": "default_optim",
    "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "num_train_epochs": 3.0, "max_steps": -1,
    "seed": 42, "logging_steps": 10, "save_steps": 500, "save_strategy": "steps", "logging_strategy": "steps",
    "save_total_limit": None, "gradient_checkpointing": True,
    "bf16": None, "fp16": False, "eval_strategy": "no", "eval_steps": None,
    "num_generations": 8, "max_completion_length": 512, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": None,
    "repetition_penalty": 1.0, "beta": 0.0, "use_bias_correction_kl": True, "num_iterations": 1, "epsilon": 0.2,
    "epsilon_high": None, "delta": None, "loss_type": "dapo", "importance_sampling_level": "token",
    "scale_rewards": "group", "multi_objective_aggregation": "sum_then_normalize", "reward_weights": None,
    "mask_truncated_completions": False, "top_entropy_quantile": 1.0, "entropy_coef": 0.0,
    "sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05, "off_policy_mask_threshold": None,
    "vespo_k_pos": 2.0, "vespo_lambda_pos": 3.0, "vespo_k_neg": 3.0, "vespo_lambda_neg": 2.0,
    "use_vllm": False, "vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": "sequence_mask",
    "vllm_importance_sampling_clip_min": None, "vllm_importance_sampling_clip_max": 3.0,
    "generation_batch_size": None, "steps_per_generation": None, "chat_template_kwargs": None,
    "shuffle_dataset": True, "report_to": "none", "trust_remote_code": False,
    "push_to_hub": False, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.3,
    "disable_dropout": False, "generation_kwargs": None, "vllm_importance_sampling_cap": None,
    "log_completions": False, "logging_first_step": False, "eval_on_start": False,
}
# TRL 1.16's GRPOConfig defaults for TRL's own settings that are not mapped above and that scripts read without
# setting them (trl/scripts/grpo.py: training_args.model_init_kwargs): what an unset one of them reads as (checked
# against the installed TRL as TRL_DEFAULTS is). remove_unused_columns is transformers', which TRL's config changes.
TRL_UNSET_DEFAULTS: dict[str, Any] = {
    "model_init_kwargs": None, "remove_unused_columns": False,
    "cast_lm_head_to_fp32": False, "num_generations_eval": None,
    "num_completions_to_print": None, "sync_ref_model": False, "ref_model_sync_steps": 512,
    "ref_model_mixup_alpha": 0.6, "vllm_server_host": "0.0.0.0", "vllm_server_port": 8000,
    "vllm_tensor_parallel_size": 1, "vllm_enable_sleep_mode": False, "router_aux_loss_coef": None,
    "ds3_gather_for_generation": True, "cache_implementation": None, "vllm_model_impl": "vllm",
    "vllm_structured_outputs_regex": None, "vllm_server_base_url": None, "vllm_server_timeout": 240.0,
    "vllm_group_port": 51216, "vllm_max_model_length": None, "use_adaptive_entropy": False, "entropy_coef_min": 0.0,
    "entropy_coef_max": 1.0, "entropy_coef_delta": 0.005, "entropy_target": 0.2, "log_multimodal": True,
    "log_unique_prompts": False, "log_completions_hub_repo": None, "use_transformers_continuous_batching": False,
    "transformers_continuous_batching_config": None, "use_transformers_paged": False,
}
# TRL settings with no equivalent here: accepted at TRL's default (TRL_UNSET_DEFAULTS: a script may spell one out),
# refused with the reason otherwise.
_SERVER = "a vLLM server in another process is not here: use_vllm runs vLLM in the trainer's process, on its modules"
_ENTROPY = ("TRL's adaptive entropy controller is not here: algorithm.entropy_target with algorithm.entropy_coef_lr "
            "adapts the bonus (another controller, the README's 'Coming from TRL')")
NOT_HERE: dict[str, str] = {
    "sync_ref_model": "the reference is the base model with the adapters off (no copy to sync); TRL itself refuses "
                      "sync_ref_model with a peft model",
    "ref_model_sync_steps": "sync_ref_model is not here", "ref_model_mixup_alpha": "sync_ref_model is not here",
    "router_aux_loss_coef": "a mixture's router aux loss is not added here",
    "ds3_gather_for_generation": "no DeepSpeed here", "vllm_tensor_parallel_size": "one GPU per process here",
    "cache_implementation": "the hf engine manages its own KV cache (decoded in waves, docs/algorithm.md §23)",
    "vllm_model_impl": "vLLM runs on the trainer's own modules here",
    "vllm_structured_outputs_regex": "structured outputs are not here",
    "vllm_max_model_length": "the engine's context is the longest prompt plus max_completion_length",
    "vllm_server_base_url": _SERVER, "vllm_server_host": _SERVER, "vllm_server_port": _SERVER,
    "vllm_server_timeout": _SERVER, "vllm_group_port": _SERVER,
    "use_adaptive_entropy": _ENTROPY, "entropy_coef_min": _ENTROPY, "entropy_coef_max": _ENTROPY,
    "entropy_coef_delta": _ENTROPY, "entropy_target": _ENTROPY,
    "log_completions_hub_repo": "completions are not uploaded: they are in output_dir/samples.jsonl",
    "use_transformers_continuous_batching": "transformers' continuous batching is not here",
    "transformers_continuous_batching_config": "transformers' continuous batching is not here",
    "use_transformers_paged": "transformers' paged attention is not here",
}
# generation_kwargs keys with a recipe key (TRL passes them over its own settings, to vLLM or transformers)
GENERATION_KWARGS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# Settings of earlier TRL (0.x) that 1.16's GRPOConfig dropped, still read from the scripts written for it: their
# value when unset is this module's (no limit, as 1.16 has none). warmup_ratio is earlier transformers' (4.x; 5
# dropped it for warmup_steps below 1), which the tutorials written for TRL 0.x set.
EARLIER_TRL: dict[str, Any] = {"max_prompt_length": None, "warmup_ratio": None}
# Settings that change nothing about training here (logging, hub, the dataloader, what TRL's own __post_init__
# fills in): accepted whatever their value.
IGNORED = {"run_name", "logging_dir", "report_to", "disable_tqdm",
           "remove_unused_columns", "dataloader_num_workers", "dataloader_pin_memory", "dataloader_drop_last",
           "hub_model_id", "hub_strategy", "hub_token", "hub_private_repo",
           "num_completions_to_print", "log_level", "log_level_replica", "accelerator_config", "debug",
           "pad_to_multiple_of", "overwrite_output_dir", "do_train", "do_eval", "use_cpu",
           "ddp_find_unused_parameters", "ddp_timeout", "save_only_model", "save_safetensors", "bf16_full_eval",
           "tf32", "gradient_checkpointing_kwargs", "model_init_kwargs", "cast_lm_head_to_fp32", "log_on_each_node",
           "per_device_eval_batch_size", "num_generations_eval",
           # transformers' Trainer does not read resume_from_checkpoint (it is for scripts: train()'s argument
           # resumes); TRL's RepeatSampler draws with seed, not data_seed; vLLM always sleeps between rollouts on CUDA
           # here (the README's table)
           "resume_from_checkpoint", "data_seed", "vllm_enable_sleep_mode",
           "log_multimodal", "log_unique_prompts",
           # the dataloader's workers, token counts in the logs, when the CUDA cache is emptied: flags a TRL command
           # line carries that change nothing trained (were refused as unknown, found by a red team)
           "dataloader_persistent_workers", "dataloader_prefetch_factor", "include_num_input_tokens_seen",
           "torch_empty_cache_steps"}
# TRL's loss_type -> (algorithm.aggregation, algorithm.clip); luspo is GSPO's clip with each completion's loss
# summed over its tokens (docs/algorithm.md §5), vespo TRL's dapo normaliser over VESPO's weight (§14.2)
LOSS_TYPES = {"grpo": ("sequence_mean", "ratio"), "dapo": ("token_mean", "ratio"), "bnpo": ("token_mean", "ratio"),
              "dr_grpo": ("constant", "ratio"), "sapo": ("sequence_mean", "sapo"), "cispo": ("token_mean", "cispo"),
              "luspo": ("sequence_sum", "ratio"), "vespo": ("token_mean", "vespo")}
VESPO_SETTINGS = ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")
SCHEDULES = {"linear": "linear", "constant": "constant", "cosine": "cosine", "constant_with_warmup": "constant"}
# report_to's integrations that have an output key here (TRL's default, "none", turns both off)
REPORTERS = ("tensorboard", "wandb")
# recipe key -> the argument it was made from, so that a recipe check's message names what the script wrote
FROM_TRL = {
    "generation.num_generations": "num_generations", "generation.max_new_tokens": "max_completion_length",
    **{f"generation.{k}": k for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")},
    "algorithm.beta": "beta", "algorithm.mu": "num_iterations", "algorithm.delta": "delta",
    "algorithm.epsilon_low": "epsilon", "algorithm.epsilon_high": "epsilon_high",
    "algorithm.sequence_epsilon_low": "epsilon", "algorithm.sequence_epsilon_high": "epsilon_high",
    "algorithm.cispo_max_weight": "epsilon_high", "algorithm.gmpo_epsilon_low": "epsilon",
    "algorithm.gmpo_epsilon_high": "epsilon_high", "algorithm.reward_aggregation": "multi_objective_aggregation",
    **{f"algorithm.{k}": k for k in ("importance_sampling_level", "scale_rewards", "mask_truncated_completions",
                                     "top_entropy_quantile", "entropy_coef", "sapo_temperature_pos",
                                     "sapo_temperature_neg", "off_policy_mask_threshold", *VESPO_SETTINGS)},
    "algorithm.sampler_correction": "vllm_importance_sampling_mode",
    "algorithm.sampler_correction_max": "vllm_importance_sampling_clip_max",
    "algorithm.sampler_correction_min": "vllm_importance_sampling_clip_min",
    "optimizer.lr": "learning_rate", "optimizer.warmup_steps": "warmup_steps", "optimizer.betas": "adam_beta1/2",
    "optimizer.weight_decay": "weight_decay", "optimizer.max_grad_norm": "max_grad_norm",
    "train.micro_batch_size": "per_device_train_batch_size", "train.steps": "max_steps",
    "train.eval_every": "eval_steps", "output.save_every": "save_steps", "output.keep_last": "save_total_limit",
    "output.log_every": "logging_steps", "output.samples_every": "log_completions",
    "data.chat_template_kwargs": "chat_template_kwargs",
    "data.max_prompt_tokens": "max_prompt_length", "lora.r": "peft_config.r", "lora.alpha": "peft_config.lora_alpha",
    "lora.dropout": "peft_config.lora_dropout", "lora.target_modules": "peft_config.target_modules",
    "optimizer.name": "optim", "model.name_or_path": "model", "model.compute_dtype": "bf16/fp16",
    "model.gradient_checkpointing": "gradient_checkpointing", "model.trust_remote_code": "trust_remote_code",
    "model.disable_dropout": "disable_dropout", "model.double_quant": "quantization_config.bnb_4bit_use_double_quant",
}
OPTIMIZERS = {"default_optim": "adamw", "adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_hf": "adamw",
              "adamw_8bit": "adamw_8bit", "adamw_bnb_8bit": "adamw_8bit", "paged_adamw_8bit": "adamw_8bit"}


class GRPOConfig:
    """TRL's GRPOConfig by its field names: what is given is kept, everything else is TRL's default. An attribute
    neither given nor in TRL_DEFAULTS reads as TRL's default (TRL_UNSET_DEFAULTS) or, for the rest of what TRL's
    config inherits, as transformers' TrainingArguments has it (local_rank, device, run_name, ...; its methods and
    properties, get_process_log_level() and train_batch_size among them, read this config's settings)."""

    # the defaults of a TRL subclass of GRPOConfig that differ from GRPOConfig's (TRL_DEFAULTS): given() reports
    # them as set, since recipe_from_trl fills in GRPOConfig's defaults for what is not
    _OWN_DEFAULTS: dict[str, Any] = {}

    def __init__(self, output_dir: Optional[str] = None, **settings):
        # output_dir may come first by position, as in TRL's own GRPOConfig(f"{model_name}-GRPO")
        self._given = _json_settings({**({"output_dir": output_dir} if output_dir is not None else {}), **settings})
        for name, value in {**TRL_DEFAULTS, **self._OWN_DEFAULTS, **self._given}.items():
            setattr(self, name, value)

    def __getattr__(self, name):
        # (only for names not set) a dunder or this class's own state is not transformers': copy and pickle probe them
        if name.startswith("__") or name in ("_given", "_defaults"):
            raise AttributeError(name)
        if name in TRL_UNSET_DEFAULTS:
            return TRL_UNSET_DEFAULTS[name]
        import inspect

        from transformers import TrainingArguments

        found = inspect.getattr_static(TrainingArguments, name, None)
        if inspect.isfunction(found):   # a method: on this config, so that it reads the settings given
            return types.MethodType(found, self)
        if isinstance(found, property):
            return found.fget(self)
        try:   # a field (or what its __post_init__ derived): its default
            return getattr(self._training_arguments(), name)
        except AttributeError:
            raise AttributeError(f"GRPOConfig has no attribute {name!r} (neither TRL's GRPOConfig nor transformers' "
                                 "TrainingArguments has it)") from None

    def _training_arguments(self):
        """transformers' TrainingArguments with its defaults (made on first use: importing transformers is slow)."""
        if "_defaults" not in vars(self):
            from transformers import TrainingArguments

            self._defaults = TrainingArguments(output_dir=self.output_dir or "trainer_output")
        return self._defaults

    def to_dict(self) -> dict:
        """Every setting, as TrainingArguments.to_dict() gives them: the defaults, then TRL's, then those set here
        (a *_token one masked, as there)."""
        mine = {k: f"<{k.upper()}>" if k.endswith("_token") and v is not None else _plain(v)
                for k, v in vars(self).items() if not k.startswith("_")}
        return {**self._training_arguments().to_dict(), **TRL_UNSET_DEFAULTS, **mine}

    def given(self) -> dict:
        """The settings given, as they are now: a script that changes one after making the config
        (args.max_steps = 10) means the new value, and one it adds is read (or refused) like the rest."""
        now = {k: v for k, v in vars(self).items() if not k.startswith("_")}
        return {k: v for k, v in now.items() if k in self._given or k not in TRL_DEFAULTS or v != TRL_DEFAULTS[k]}


class GMPOConfig(GRPOConfig):
    """TRL's experimental GMPOConfig (trl.experimental.gmpo): GRPOConfig's fields, with epsilon and epsilon_high
    bounding the token log-ratios in log space (algorithm.gmpo_epsilon_low/high) and epsilon 0.4 by default."""

    _OWN_DEFAULTS = {"epsilon": 0.4}


def _plain(value):
    """An enum setting as its value: transformers turns optim, lr_scheduler_type, eval_strategy, ... into enums
    (OptimizerNames.ADAMW_TORCH), which the tables here know by their values ("adamw_torch")."""
    return value.value if isinstance(value, enum.Enum) else value


def _given_settings(args) -> dict:
    """The settings a script gave: this module's GRPOConfig's own, or for TRL's GRPOConfig (a dataclass) every
    field whose value is not its class default; enums as their values."""
    if args is None:
        return {}
    if isinstance(args, GRPOConfig):
        return _json_settings({k: _plain(v) for k, v in args.given().items()})
    if isinstance(args, dict):
        return _json_settings({k: _plain(v) for k, v in args.items()})
    if dataclasses.is_dataclass(args):
        out, base = {}, _grpo_field_defaults(args)
        for f in dataclasses.fields(args):
            default = base.get(f.name, _field_default(f))
            value = getattr(args, f.name)
            if default is dataclasses.MISSING or value != default:
                out[f.name] = _plain(value)
        # TRL's __post_init__ fills in generation_batch_size from steps_per_generation or the reverse (it refuses
        # both given): the pair says one thing, which steps_per_generation alone says (recipe_from_trl refuses both)
        if "generation_batch_size" in out and "steps_per_generation" in out and args.generation_batch_size == \
                args.per_device_train_batch_size * getattr(args, "world_size", 1) * args.steps_per_generation:
            del out["generation_batch_size"]
        return out
    raise TRLCompatError(f"args: expected a GRPOConfig (this module's or TRL's) or a dict, got {type(args).__name__}")


def _field_default(f: dataclasses.Field):
    """A dataclass field's default (MISSING for a field without one)."""
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING


def _grpo_field_defaults(args) -> dict:
    """The defaults a TRL config's fields are read against: those of TRL's GRPOConfig where args is a subclass of it.
    TRL's GMPOConfig defaults epsilon to 0.4: left there, it is a setting for recipe_from_trl, which fills in
    GRPOConfig's 0.2 for what it is not given (and GRPOTrainer given that config clips the ratio at 0.4, as TRL's)."""
    grpo = next((c for c in type(args).__mro__ if c.__name__ == "GRPOConfig" and c.__module__.startswith("trl.")),
                type(args))
    return {f.name: _field_default(f) for f in dataclasses.fields(grpo)}


# TRL's GRPOConfig reads a str that starts with "{" as JSON in these (transformers' _VALID_DICT_FIELDS), as CLI-style
# scripts (TrlParser) pass them
JSON_SETTINGS = ("generation_kwargs", "chat_template_kwargs", "model_init_kwargs")


def _json_settings(settings: dict) -> dict:
    """`settings` with a JSON text in a JSON_SETTINGS setting read as TRL's GRPOConfig reads it (json.loads, then
    transformers' _convert_str_dict: "true"/"false" and digits as values); any other str stays, to be refused."""
    out = dict(settings)
    for name in JSON_SETTINGS:
        value = out.get(name)
        if isinstance(value, str) and value.startswith("{"):
            try:
                out[name] = _str_values(json.loads(value))
            except json.JSONDecodeError as exc:
                raise TRLCompatError(f"GRPOConfig: {name} is not valid JSON ({exc.msg} at character {exc.pos}): "
                                     f"{value!r:.60}") from None
    return out


def _str_values(value):
    """transformers' _convert_str_dict (training_args.py): in a mapping, recursively, a str "true"/"false" (any
    case) becomes a bool, one of digits an int, one of digits with one '.' a float."""
    if not isinstance(value, dict):
        return value
    out = {}
    for key, v in value.items():
        if isinstance(v, dict):
            v = _str_values(v)
        elif isinstance(v, str) and v.lower() in ("true", "false"):
            v = v.lower() == "true"
        elif isinstance(v, str) and v.isdigit():
            v = int(v)
        elif isinstance(v, str) and v.replace(".", "", 1).isdigit():
            v = float(v)
        out[key] = v
    return out


def _top_k(value):
    """TRL's top_k as the recipe's: -1 is vLLM's "off" (TRL passes it to vLLM as it is), 0 the recipe's."""
    return 0 if value is None or (value == -1 and not isinstance(value, bool)) else value


def _argument(key: str, settings: dict) -> str:
    """The script's argument that a recipe key was made from (FROM_TRL), generation_kwargs['top_k'] where that one
    set it (over top_k)."""
    name = key.removeprefix("generation.")
    kwargs = settings.get("generation_kwargs")
    if name != key and isinstance(kwargs, dict) and kwargs.get(name) is not None:
        return f"generation_kwargs[{name!r}]"
    return FROM_TRL.get(key, "reward_weights" if key.endswith(".weight") else key)


def _generation_batch(s: dict, processes: int = 1) -> int:
    """Completions in one generation batch (all processes') of TRL's settings `s` (defaults filled in), as TRL's
    __post_init__ derives it when generation_batch_size is unset: per_device_train_batch_size x processes x
    steps_per_generation (found by a red team: under torchrun a step had one process's batch)."""
    micro = s["per_device_train_batch_size"] * processes
    return s["generation_batch_size"] or micro * (s["steps_per_generation"] or s["gradient_accumulation_steps"])


def _batch_size_problems(s: dict) -> list[str]:
    """The batch sizes that are not whole numbers >= 1 (the batch arithmetic divides by them: found by a red team,
    a ZeroDivisionError)."""
    out = []
    for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation",
                 "generation_batch_size", "num_generations"):
        value = s[name]
        if not (value is None and name in ("steps_per_generation", "generation_batch_size")) and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1):
            out.append(f"GRPOConfig: {name} must be a whole number >= 1, got {value!r}")
    return out


def _minibatches(s: dict, processes: int) -> tuple[int, list[str]]:
    """The optimizer updates one generation batch makes (algorithm.minibatches), and why the generation batch cannot
    be split so (one line each)."""
    problems = []
    g, micro, accumulate = s["num_generations"], s["per_device_train_batch_size"], s["gradient_accumulation_steps"]
    steps_per_generation = s["steps_per_generation"]
    completions = _generation_batch(s, processes)
    if completions % (micro * processes):
        times = f" x {processes} processes" if processes > 1 else ""
        problems.append(f"GRPOConfig: generation_batch_size ({completions}) must be a multiple of "
                        f"per_device_train_batch_size ({micro}){times}, as in TRL")
    elif s["generation_batch_size"] and steps_per_generation is None:
        # TRL's __post_init__: a generation batch is generation_batch_size / (per_device_train_batch_size x
        # processes) micro-batches a process, taken as optimizer steps of gradient_accumulation_steps each
        steps_per_generation = completions // (micro * processes)
    # TRL makes an optimizer step every gradient_accumulation_steps micro-batches: a generation batch of
    # steps_per_generation micro-batches is that many / accumulate updates, here algorithm.minibatches
    minibatch_count = 1
    if steps_per_generation not in (None, accumulate) and not completions % (micro * processes):
        if steps_per_generation % accumulate:
            # (TRL's own GRPOConfig fills in both from either: name both)
            problems.append(f"GRPOConfig: steps_per_generation / generation_batch_size ({completions} completions, "
                            f"{steps_per_generation} micro-batches of per_device_train_batch_size={micro}) is not a "
                            f"multiple of gradient_accumulation_steps={accumulate}: TRL would let an optimizer step "
                            "take micro-batches of two generation batches; here each update is a whole share of one "
                            "(algorithm.minibatches): make steps_per_generation a multiple of "
                            "gradient_accumulation_steps, or leave generation_batch_size and steps_per_generation "
                            "unset")
        else:
            minibatch_count = steps_per_generation // accumulate
    if completions % g:
        problems.append(f"GRPOConfig: generation_batch_size ({completions} completions a step) must be a multiple of "
                        f"num_generations ({g})")
    return minibatch_count, problems


def _setting_problems(s: dict, eval_path: str) -> list[str]:
    """The settings (TRL's defaults filled in) with no equivalent here, each checked on its own, one line each."""
    out = []
    if s["loss_type"] not in LOSS_TYPES:
        out.append(f"loss_type: {s['loss_type']!r} is not here (allowed: {', '.join(LOSS_TYPES)})")
    if s["lr_scheduler_type"] not in SCHEDULES:
        out.append(f"lr_scheduler_type: {s['lr_scheduler_type']!r} is not here (allowed: {', '.join(SCHEDULES)})")
    if s["optim"] not in OPTIMIZERS:
        out.append(f"optim: {s['optim']!r} is not here (allowed: {', '.join(OPTIMIZERS)})")
    out += _report_to_problems(_report_to(s))
    if s["push_to_hub"]:   # TRL uploads each save; here nothing would reach the hub
        out.append("push_to_hub: not here; after trainer.save_model(), upload output_dir yourself "
                   "(huggingface_hub.upload_folder(repo_id=..., folder_path=output_dir)); TRL's script: drop "
                   "--push_to_hub")
    if s["vllm_mode"] != "colocate":   # (TRL reads it only with use_vllm; a script that sets it means to use it)
        out.append(f"vllm_mode: {s['vllm_mode']!r} is not here (a vLLM server in another process); use_vllm runs "
                   "vLLM in the trainer's own process, on its modules (TRL's 'colocate'): drop vllm_mode or set it to "
                   "'colocate'")
    if s["vllm_gpu_memory_utilization"] != TRL_DEFAULTS["vllm_gpu_memory_utilization"]:
        out.append(f"vllm_gpu_memory_utilization ({s['vllm_gpu_memory_utilization']}): vLLM's memory is not a share "
                   "of the GPU here: it shares the trainer's weights, and its KV cache is a size in bytes (the recipe "
                   "key generation.kv_cache_memory_bytes, 1 GiB by default); drop the setting")
    if not s["shuffle_dataset"]:
        out.append("shuffle_dataset: false is not here (the prompts are drawn in seeded epochs)")
    if s["save_strategy"] not in ("steps", "epoch", "no"):
        out.append(f"save_strategy: {s['save_strategy']!r} is not here (no metric_for_best_model): 'steps' "
                   "(save_steps), 'epoch' or 'no'")
    if s["logging_strategy"] not in ("steps", "epoch", "no"):   # (was ignored: logs every logging_steps)
        out.append(f"logging_strategy: {s['logging_strategy']!r} is not transformers' 'steps', 'epoch' or 'no'")
    if s["fp16"] and s["bf16"]:   # transformers' TrainingArguments refuses it; was run in float16 (found by a red team)
        out.append("bf16 and fp16: at most one of them can be True, as in transformers")
    if s["eval_on_start"] and s["eval_strategy"] == "no":   # the run evaluates only under an eval_strategy here
        out.append("eval_on_start=True with eval_strategy 'no': the run evaluates only with eval_strategy 'steps' or "
                   "'epoch' here; call trainer.evaluate() before train() instead")
    if s["eval_strategy"] != "no" and not eval_path:   # transformers' Trainer refuses it too
        out.append(f"eval_strategy: {s['eval_strategy']!r} needs an eval_dataset: pass eval_dataset to GRPOTrainer, "
                   "or set eval_strategy='no'")
    return [f"GRPOConfig: {p}" for p in out]


# GMPOConfig settings that TRL's GMPOTrainer reads nowhere (only GRPO's loss does): a script that changes one from
# its default means something that neither TRL's GMPO nor the recipe's does, so it is refused rather than dropped
GMPO_IGNORED = {"delta": "GMPO's log-space clip has no cap on the unclipped term",
                "importance_sampling_level": "GMPO takes the geometric mean of the token ratios itself",
                "entropy_coef": "GMPO's loss has no entropy bonus",
                "off_policy_mask_threshold": "GMPO's loss masks no off-policy completion",
                **{k: "GMPO's loss applies no vLLM importance sampling correction"
                   for k in ("vllm_importance_sampling_mode", "vllm_importance_sampling_clip_min",
                             "vllm_importance_sampling_clip_max", "vllm_importance_sampling_cap")}}


def _gmpo_problems(s: dict) -> list[str]:
    """The GMPOConfig settings (TRL's defaults filled in) that GMPO cannot carry over, one line each."""
    out = [f"GMPOConfig: {k}={s[k]!r}: TRL's GMPOTrainer ignores it ({why}): drop it"
           for k, why in GMPO_IGNORED.items() if s[k] != TRL_DEFAULTS[k]]
    if s["top_entropy_quantile"] < 1:   # TRL's GMPO keeps only high-entropy tokens in the mean; clip gmpo refuses it
        out.append(f"GMPOConfig: top_entropy_quantile={s['top_entropy_quantile']!r}: not here with GMPO (TRL's "
                   "GMPOTrainer takes only the high-entropy tokens into each geometric mean; here every token of a "
                   "completion moves through its mean): leave it 1.0")
    return out


def _compute_dtype(s: dict) -> str:
    """The dtype bf16/fp16 choose (TRL's bf16 defaults to True without fp16): the recipe's model.compute_dtype."""
    return "float16" if s["fp16"] else ("float32" if s["bf16"] is False else "bfloat16")


def _report_to(s: dict) -> list[str]:
    """report_to as a list of integration names (TRL's default, "none": none)."""
    report = s["report_to"]
    if report in (None, "none"):
        return []
    return [report] if isinstance(report, str) else [str(r) for r in report]


def _report_to_problems(report: list[str]) -> list[str]:
    """report_to's integrations that are not here, or not installed (transformers refuses a missing one when the
    Trainer is made; here the run refused it by its recipe key, output.wandb_project: found by a red team)."""
    from .sinks import tensorboard_available

    other = sorted(set(report) - {"all", "none", *REPORTERS})
    out = [f"report_to: {', '.join(other)} is not here (allowed: {', '.join(REPORTERS)}, all or none; every metric "
           "is in output_dir/metrics.jsonl)"] if other else []
    if "wandb" in report and not wandb_available():
        out.append("report_to: wandb is not installed: pip install wandb (and wandb login), or drop wandb from "
                   "report_to (--report_to none)")
    if "tensorboard" in report and not tensorboard_available():
        out.append("report_to: tensorboard is not installed: pip install tensorboard, or drop tensorboard from "
                   "report_to (--report_to none)")
    return out


def _max_steps_problem(s: dict, minibatch_count: int) -> Optional[str]:
    """Why max_steps is not whole generation batches (TRL's max_steps counts optimizer updates, num_iterations x
    minibatch_count of them a generation batch), or None. A step here is a whole generation batch: max_steps=3 at 2
    updates a batch ran 4 (found by a red team)."""
    per_step = s["num_iterations"] * minibatch_count
    if not (s["max_steps"] and s["max_steps"] > 0 and s["max_steps"] % per_step):
        return None
    lower, upper = s["max_steps"] // per_step * per_step, (s["max_steps"] // per_step + 1) * per_step
    return (f"GRPOConfig: max_steps={s['max_steps']} is not a multiple of the {per_step} optimizer updates a "
            f"generation batch makes (num_iterations={s['num_iterations']} x steps_per_generation / "
            f"gradient_accumulation_steps = {minibatch_count}); a run here makes whole generation batches: set "
            "max_steps to " + (f"{lower} or {upper}" if lower else f"{upper}"))


def recipe_from_trl(settings: dict, *, model: str, train_path: str, reward_specs: list[dict],
                    eval_path: str = "", lora: Optional[dict] = None, train_rows: int = 0, eval_rows: int = 0,
                    processes: int = 1, variant: str = "grpo") -> dict:
    """The recipe (as a dict) that runs what `settings` (GRPOConfig field -> value, the ones a script gave) ask for,
    TRL's defaults standing in for the rest, on `processes` processes (torchrun's, as accelerate's for TRL), for
    TRL's GRPOTrainer (variant "grpo") or its experimental GMPOTrainer ("gmpo"). Raises TRLCompatError naming each
    setting that cannot be carried over (all of them at once, one a line, where the checks do not depend on each
    other)."""
    settings = _json_settings(settings)
    gmpo = variant == "gmpo"
    if gmpo:   # TRL's GMPOTrainer reads no loss_type (its loss is its own, any value accepted): ignored here too
        settings = {k: v for k, v in settings.items() if k != "loss_type"}
    found = _Refusals()
    unknown = sorted(k for k in settings if k not in TRL_DEFAULTS and k not in EARLIER_TRL and k not in IGNORED
                     and k not in NOT_HERE)
    if unknown:
        found.add(f"GRPOConfig: {', '.join(unknown)} not supported by lowmem-grpo (the README's 'Coming from TRL' "
                  "lists what is, and under which recipe key)")
    for k in sorted(settings):
        if k in NOT_HERE and settings[k] != TRL_UNSET_DEFAULTS[k]:
            found.add(f"GRPOConfig: {k}={settings[k]!r}: {NOT_HERE[k]} (TRL's default, {TRL_UNSET_DEFAULTS[k]!r}, is "
                      "accepted)")
    settings = {k: v for k, v in settings.items() if k not in NOT_HERE and k not in unknown}
    s = {**TRL_DEFAULTS, **EARLIER_TRL, **settings}
    found.add(*_setting_problems(s, eval_path), *(_gmpo_problems(s) if gmpo else []))
    if not isinstance(s["disable_dropout"], bool):
        found.add(f"GRPOConfig: disable_dropout must be True or False, got {s['disable_dropout']!r:.60}")
    sampling = {}
    if s["generation_kwargs"] is not None and not isinstance(s["generation_kwargs"], dict):
        found.add(f"GRPOConfig: generation_kwargs must be a dict (TRL passes it as keyword arguments), got "
                  f"{type(s['generation_kwargs']).__name__} {s['generation_kwargs']!r:.60}")
    else:
        sampling = dict(s["generation_kwargs"] or {})
    if set(sampling) - set(GENERATION_KWARGS):
        found.add(f"GRPOConfig: generation_kwargs: {', '.join(sorted(set(sampling) - set(GENERATION_KWARGS)))} not "
                  f"here (allowed: {', '.join(GENERATION_KWARGS)}, the sampling settings a recipe has)")
    iterations_ok = isinstance(s["num_iterations"], int) and not isinstance(s["num_iterations"], bool) and \
        s["num_iterations"] >= 1
    if not iterations_ok:
        found.add(f"GRPOConfig: num_iterations must be a whole number >= 1, got {s['num_iterations']!r}")
    weights = s["reward_weights"] or [1.0] * len(reward_specs)
    if not isinstance(weights, (list, tuple)) or len(weights) != len(reward_specs):
        found.add(f"GRPOConfig: reward_weights: {len(weights) if isinstance(weights, (list, tuple)) else weights!r} "
                  f"weights for {len(reward_specs)} reward functions (one weight per reward function, as in TRL)")
    # the batch arithmetic below divides by these and reads them together: it cannot run past a bad one
    found.gate(*_batch_size_problems(s))
    if s["generation_batch_size"] is not None and s["steps_per_generation"] is not None:
        # TRL's GRPOConfig refuses both; here one silently won (found by a red team). TRL's own config object fills
        # in both: _given_settings leaves out the one it derived
        found.gate("GRPOConfig: generation_batch_size and steps_per_generation can not be both configured at the "
                   "same time, as in TRL: set one of them")
    g = s["num_generations"]
    completions = _generation_batch(s, processes)
    minibatch_count, batch_problems = _minibatches(s, processes)
    found.add(*batch_problems)
    if iterations_ok and not batch_problems and (problem := _max_steps_problem(s, minibatch_count)):
        found.add(problem)   # (it counts the updates a generation batch makes: only once those are known)
    found.stop()
    prompts_per_step = completions // g
    per_step = s["num_iterations"] * minibatch_count
    # TRL's max_steps (and every *_steps) counts optimizer updates, num_iterations x (steps_per_generation /
    # gradient_accumulation_steps) of them per generation batch; a step here is one generation batch and those
    # updates (the schedule and warm-up count the updates). An epoch is the whole generation batches of the data
    # (TRL's RepeatSampler drops a partial one).
    updates = s["max_steps"] if s["max_steps"] and s["max_steps"] > 0 else \
        max(1, math.ceil(s["num_train_epochs"] * max(1, train_rows // prompts_per_step) * per_step))
    steps = max(1, math.ceil(updates / per_step))

    def every(value) -> int:   # a *_steps count in steps here; below 1, transformers reads it as a share of the run
        value = math.ceil(updates * value) if 0 < value < 1 else int(value)
        return max(1, math.ceil(value / per_step))
    # TRL's GMPO loss averages each completion's term over the completions: sequence_mean gives its number
    # (tests/test_loss_options.py::test_gmpo_with_sequence_mean_is_trls_loss_and_clip_counts)
    aggregation, clip = ("sequence_mean", "gmpo") if gmpo else LOSS_TYPES[s["loss_type"]]
    log_every = max(1, train_rows // prompts_per_step) if s["logging_strategy"] == "epoch" else every(s["logging_steps"])
    dtype = _compute_dtype(s)
    algorithm = {
        "kl_target": "ref" if s["beta"] > 0 else "none", "mu": s["num_iterations"], "delta": s["delta"],
        "minibatches": minibatch_count,
        "aggregation": aggregation, "clip": clip, "importance_sampling_level": s["importance_sampling_level"],
        # TRL's normalize_then_sum normalises each function within its groups whatever scale_rewards says
        "scale_rewards": "group" if s["multi_objective_aggregation"] == "normalize_then_sum" else s["scale_rewards"],
        "reward_aggregation": s["multi_objective_aggregation"],
        "mask_truncated_completions": s["mask_truncated_completions"],
        "top_entropy_quantile": s["top_entropy_quantile"], "entropy_coef": s["entropy_coef"],
        "sapo_temperature_pos": s["sapo_temperature_pos"], "sapo_temperature_neg": s["sapo_temperature_neg"],
        "off_policy_mask_threshold": s["off_policy_mask_threshold"], **{k: s[k] for k in VESPO_SETTINGS}}
    if s["beta"] > 0:   # TRL's use_bias_correction_kl weights that KL (no KL, nothing to weight; GMPO's KL never)
        algorithm.update(beta=s["beta"], kl_ratio_weight=bool(s["use_bias_correction_kl"]) and not gmpo)
    # TRL's epsilon/epsilon_high bound whichever clip the loss uses; here each clip has its own keys
    low, high = s["epsilon"], s["epsilon"] if s["epsilon_high"] is None else s["epsilon_high"]
    if clip == "cispo":
        algorithm["cispo_max_weight"] = high   # TRL caps CISPO's weight at epsilon_high itself
    elif clip == "ratio" and s["importance_sampling_level"] == "sequence":
        algorithm.update(sequence_epsilon_low=low, sequence_epsilon_high=high)
    elif clip == "ratio":
        algorithm.update(epsilon_low=low, epsilon_high=high)
    elif clip == "gmpo":   # GMPOConfig's epsilons are log-space bounds of the token log-ratios
        algorithm.update(gmpo_epsilon_low=low, gmpo_epsilon_high=high)
    # TRL corrects only vLLM's samples, and only in GRPO's loss (GMPO's never reads the correction)
    if s["use_vllm"] and s["vllm_importance_sampling_correction"] and not gmpo:
        algorithm.update(sampler_correction=s["vllm_importance_sampling_mode"],   # (the cap: clip_max's old name)
                         sampler_correction_max=s["vllm_importance_sampling_cap"]
                         if s["vllm_importance_sampling_cap"] is not None else s["vllm_importance_sampling_clip_max"])
        if s["vllm_importance_sampling_clip_min"] is not None:
            algorithm["sampler_correction_min"] = s["vllm_importance_sampling_clip_min"]
    evaluate_every = 0
    if eval_path and s["eval_strategy"] == "steps":   # unset eval_steps: logging_steps, as transformers fills it in
        evaluate_every = every(s["eval_steps"] or s["logging_steps"])
    elif eval_path and s["eval_strategy"] == "epoch":
        evaluate_every = max(1, train_rows // prompts_per_step)
    report = _report_to(s)
    wandb = "wandb" in report or ("all" in report and wandb_available())
    return {
        "model": {"name_or_path": model, "compute_dtype": dtype, "gradient_checkpointing": s["gradient_checkpointing"],
                  "autocast": dtype == "bfloat16", "trust_remote_code": bool(s["trust_remote_code"]),
                  "disable_dropout": s["disable_dropout"]},
        # TRL's disable_dropout zeroes every dropout layer, the adapters' too
        "lora": {**(lora or {}), **({"dropout": 0.0} if s["disable_dropout"] else {})},
        # eval_strategy "no" (TRL's default): the run evaluates nothing, as TRL's; trainer.evaluate() still can
        "data": {"train_path": train_path, "eval_path": eval_path if s["eval_strategy"] != "no" else "",
                 "prompt_field": "prompt",
                 # earlier TRL cut a longer prompt from the left; here it is an error naming it
                 "max_prompt_tokens": s["max_prompt_length"] or 32768,
                 **({"chat_template_kwargs": s["chat_template_kwargs"]} if s["chat_template_kwargs"] else {})},
        "rewards": {"functions": [{**spec, "weight": float(w)} for spec, w in zip(reward_specs, weights)]},
        # generation_kwargs override TRL's own sampling settings, as in TRL; a temperature there is also the
        # log-probs' here (one temperature, docs/algorithm.md §11)
        "generation": {"engine": "vllm" if s["use_vllm"] else "hf", "num_generations": g,
                       "max_new_tokens": s["max_completion_length"], "temperature": s["temperature"],
                       "top_p": s["top_p"], "top_k": _top_k(s["top_k"]), "min_p": s["min_p"] or 0.0,
                       "repetition_penalty": s["repetition_penalty"],
                       **{k: _top_k(v) if k == "top_k" else v for k, v in sampling.items() if v is not None}},
        "algorithm": algorithm,
        "optimizer": {"name": OPTIMIZERS[s["optim"]], "lr": s["learning_rate"],
                      "schedule": SCHEDULES[s["lr_scheduler_type"]],
                      "warmup_steps": _warmup(s, updates),
                      "weight_decay": s["weight_decay"], "betas": [s["adam_beta1"], s["adam_beta2"]],
                      "max_grad_norm": s["max_grad_norm"]},
        "train": {"steps": steps, "prompts_per_step": prompts_per_step, "micro_batch_size": s["per_device_train_batch_size"],
                  "eval_every": evaluate_every,
                  # transformers evaluates before the first step only with eval_on_start (default False)
                  "eval_at_start": bool(s["eval_on_start"]),
                  # TRL evaluates every row of eval_dataset (the recipe's default: the first 200)
                  **({"eval_max_prompts": eval_rows} if eval_rows else {})},
        # save_strategy 'no': the run's last step only (save_model() exports it; TRL saves nothing)
        # logging_strategy 'epoch': every epoch's steps (as save_strategy); 'no': the summary line every logging_steps
        # still, log_history none (GRPOTrainer's _RunLog), nor TRL's completions table
        "output": {"dir": s["output_dir"] or "trainer_output",
                   "save_every": {"steps": every(s["save_steps"]), "epoch": max(1, train_rows // prompts_per_step),
                                  "no": steps}[s["save_strategy"]],
                   "keep_last": s["save_total_limit"] or 1_000_000, "log_every": log_every,
                   # TRL logs its completions table at each logging step with log_completions, else never
                   "samples_every": log_every if s["log_completions"] and s["logging_strategy"] != "no" else 0,
                   "tensorboard": "auto" if "all" in report else "tensorboard" in report,
                   # transformers' WandbCallback logs to $WANDB_PROJECT, else the project "huggingface"
                   "wandb_project": (os.environ.get("WANDB_PROJECT") or "huggingface") if wandb else ""},
        "seed": s["seed"],
    }


def _warmup(s: dict, updates: int) -> int:
    """Warm-up updates: transformers 5 reads a warmup_steps below 1 as a share of the run; transformers 4's
    warmup_ratio (a share) applies when warmup_steps is 0, as there. None (0) for lr_scheduler_type "constant",
    whose scheduler (transformers' get_scheduler) ignores warm-up; constant_with_warmup has it."""
    if s["lr_scheduler_type"] == "constant":
        return 0
    if 0 < s["warmup_steps"] < 1:
        return math.ceil(updates * s["warmup_steps"])
    if not s["warmup_steps"] and s["warmup_ratio"]:
        return math.ceil(updates * s["warmup_ratio"])
    return int(s["warmup_steps"])


# the LoraConfig fields that trl/scripts/grpo.py sets from its command line (trl's get_peft_config), by flag
PEFT_SCRIPT_FLAGS = {"use_dora": "--use_dora", "use_rslora": "--use_rslora",
                     "modules_to_save": "--lora_modules_to_save", "target_parameters": "--lora_target_parameters"}


def _lora_section(peft_config, model: str) -> dict:
    """A peft LoraConfig as the recipe's lora section (r, alpha, dropout, target modules); other options refused."""
    if peft_config is None:
        return {}
    from peft import LoraConfig

    # IA3, LoHa, LoKr, prompt tuning, a dict, even AdaLora (a LoraConfig subclass) crashed below on a field they lack
    # or their own checks (found by a red team): only a plain LoraConfig is read
    if type(peft_config) is not LoraConfig:
        raise TRLCompatError(f"peft_config: {type(peft_config).__name__} is not supported: lowmem-grpo trains LoRA "
                             "adapters only (peft.LoraConfig)")
    allowed = {"r", "lora_alpha", "lora_dropout", "target_modules", "task_type", "bias", "inference_mode",
               "base_model_name_or_path", "revision"}
    baseline = type(peft_config)()   # as peft fills it in (its own __post_init__), for a config that sets nothing
    changed = sorted(f.name for f in dataclasses.fields(peft_config)
                     if f.name not in allowed and getattr(peft_config, f.name) != getattr(baseline, f.name))
    if changed or getattr(peft_config, "bias", "none") != "none":
        flags = [PEFT_SCRIPT_FLAGS[name] for name in changed if name in PEFT_SCRIPT_FLAGS]
        raise TRLCompatError(f"peft_config: {', '.join(changed or ['bias'])} not supported by lowmem-grpo (LoRA with r, "
                             "lora_alpha, lora_dropout and target_modules)"
                             + (f"; TRL's script: drop {' '.join(flags)}" if flags else ""))
    targets = peft_config.target_modules
    if targets is None:   # peft's per-architecture default, as get_peft_model would pick it
        from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
        from transformers import AutoConfig

        targets = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(AutoConfig.from_pretrained(model).model_type)
        if targets is None:
            raise TRLCompatError("peft_config.target_modules: peft has no default for this model; name the modules")
    if isinstance(targets, str) and targets != "all-linear":
        raise TRLCompatError(f"peft_config.target_modules: a regular expression ({targets!r}) is not supported; give "
                             "the module names or 'all-linear'")
    return {"r": peft_config.r, "alpha": float(peft_config.lora_alpha), "dropout": float(peft_config.lora_dropout),
            "target_modules": targets if isinstance(targets, str) else sorted(targets)}


def _is_stream(dataset, what: str) -> bool:
    """Whether the dataset is a datasets.IterableDataset (False: a datasets.Dataset or a list of dicts); anything
    else is refused, saying what to pass (a pandas DataFrame would be read by column, not by row)."""
    if isinstance(dataset, dict):   # a DatasetDict, or TRL's {name: eval set} (each evaluated on its own there)
        raise TRLCompatError(f"{what}: a dict of datasets ({', '.join(map(str, dataset))}) is not supported; pass "
                             f"one dataset (e.g. dataset['train'], or datasets.concatenate_datasets of them)")
    if isinstance(dataset, (list, tuple)):
        return False
    datasets = sys.modules.get("datasets")   # (imported already wherever one of its datasets exists)
    if datasets is not None and isinstance(dataset, (datasets.Dataset, datasets.IterableDataset)):
        return isinstance(dataset, datasets.IterableDataset)
    raise TRLCompatError(f"{what}: a {type(dataset).__name__} is not supported: pass a datasets.Dataset (from a "
                         "pandas DataFrame: datasets.Dataset.from_pandas(df)), a datasets.IterableDataset or a list "
                         "of dicts")


EMPTY_PROMPT = [{"role": "user", "content": ""}]   # TRL's prompt for a row without one, when an environment gives it
# the columns TRL reads as the prompt's images (a row's "images" a list, "image" one), for a vision-language model
IMAGE_COLUMNS = ("image", "images")
# a row's columns that TRL does not pass to the reward functions (a prompt-completion dataset's completion; the
# generated completion_ids are passed in the column's place): left out of the rows written (were passed, and a
# completion_ids column was an error)
UNPASSED_COLUMNS = ("completion", "completion_ids")


def _placeholder_rows(environment_factory, s: dict) -> list[dict]:
    """TRL's rows for a run without train_dataset, whose environment gives each prompt from reset(): a generation
    round's worth of empty prompts, cycled; TRL's errors where it has none."""
    if environment_factory is None:
        raise TRLCompatError("train_dataset: required unless an environment_factory gives the prompts (as in TRL)")
    if isinstance(environment_factory, dict):
        raise TRLCompatError("train_dataset: a dict environment_factory (several environments) needs a train_dataset "
                             "with an 'environment' column to route each row to its environment, as in TRL")
    if not s["max_steps"] or s["max_steps"] <= 0:
        raise TRLCompatError("train_dataset: without one (the environment's reset() gives the prompts), max_steps "
                             "must be set to a positive value, as in TRL")
    rows = _generation_batch(s, launched_size()) // s["num_generations"]
    return [{"prompt": EMPTY_PROMPT} for _ in range(max(1, rows))]


class _RowRules:
    """What a row needs beyond TRL's prompt: with an environment_factory the prompt may be left out (the
    environment gives it from reset(); an empty user message, as in TRL), and with several environments each row
    names one of them in its 'environment' column."""

    def __init__(self, environment_factory=None):
        from .tool_calls import ToolCallError, named_factories

        self.environment = environment_factory is not None
        try:
            names = list(named_factories(environment_factory))
        except ToolCallError as exc:
            raise TRLCompatError(f"GRPOTrainer: {exc}") from None
        self.names = names if isinstance(environment_factory, dict) else None

    def __call__(self, row: dict, n: int, what: str) -> dict:
        if not isinstance(row, dict) or ("prompt" not in row and not self.environment):
            raise TRLCompatError(f"{what} row {n}: expected a mapping with a 'prompt' column, as TRL requires")
        for column in IMAGE_COLUMNS:   # (was: a path trained on as text, silently; a PIL image "not JSON data")
            value = row.get(column)
            if value is not None and not (isinstance(value, (list, tuple)) and not value):
                raise TRLCompatError(f"{what} row {n}: column {column!r} holds "
                                     f"{'images' if column == 'images' else 'an image'}, which TRL gives a "
                                     "vision-language model with the prompt; lowmem-grpo trains text-only models: drop "
                                     f"the column (dataset.remove_columns({column!r})) to train on the text alone")
        if self.names is not None and row.get("environment") not in self.names:
            raise TRLCompatError(f"{what} row {n}: its 'environment' is {row.get('environment')!r}, not one of "
                                 f"environment_factory's names ({', '.join(map(repr, self.names))}), as TRL requires "
                                 "with several environments")
        row = {k: v for k, v in row.items() if k not in UNPASSED_COLUMNS}
        return row if "prompt" in row else {**row, "prompt": EMPTY_PROMPT}


def _write_rows(dataset, path: Path, what: str = "train_dataset", limit: Optional[int] = None,
                rules: Callable = _RowRules()) -> int:
    """A datasets.Dataset, IterableDataset (its first `limit` rows) or a list of dicts as JSON lines, each checked
    (and completed) by `rules`; the number of rows."""
    if _is_stream(dataset, what):   # streaming: as many rows as the run can draw, in the stream's order
        rows = (row for _, row in zip(range(limit) if limit else iter(int, 1), dataset))
    elif isinstance(dataset, (list, tuple)):
        rows = dataset
    else:
        rows = (dataset[i] for i in range(len(dataset)))
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            row = rules(row, n, what)
            for column, value in row.items():
                try:
                    json.dumps(value)
                except (TypeError, ValueError) as exc:
                    # the reward functions would get the value back as JSON gives it (text, not a datetime): refused
                    raise TRLCompatError(
                        f"{what} row {n}, column {column!r}: {type(value).__name__} is not JSON data ({exc}); the "
                        f"rows are written to {path.name} as JSON lines: convert the column to text or numbers "
                        f"(dataset.map), or drop it (dataset.remove_columns({column!r})); a dataset in numpy or "
                        "torch format: dataset.with_format(None)") from None
            f.write(json.dumps(row) + "\n")
            n += 1
    if not n:
        raise TRLCompatError(f"{what}: no rows")
    return n


def _write_train(dataset, out: Path, rules: "_RowRules", s: dict) -> int:
    """train_dataset as output_dir/data/train.jsonl: its rows (an IterableDataset's, those max_steps can draw;
    transformers requires max_steps for one)."""
    limit = None
    if _is_stream(dataset, "train_dataset"):
        if not s["max_steps"] or s["max_steps"] < 0:
            raise TRLCompatError("train_dataset: an IterableDataset needs max_steps (as in TRL)")
        limit = s["max_steps"] * _generation_batch(s, launched_size()) // s["num_generations"]
    return _write_rows(dataset, out / "data" / "train.jsonl", limit=limit, rules=rules)


def _write_datasets(found: "_Refusals", train_dataset, eval_dataset, environment_factory, s: dict,
                    out: Path) -> tuple[int, str, int]:
    """Both datasets written under output_dir/data/, each checked (its refusal kept in `found`): (train rows, the
    eval file or "" without eval_dataset, eval rows). A refused one counts 0 rows."""
    rules = found.check(_RowRules, environment_factory)
    if rules is None:   # (a row's environment is checked against the factories' names)
        return 0, "", 0
    n = 0 if train_dataset is None else (found.check(_write_train, train_dataset, out, rules, s) or 0)
    if eval_dataset is None:
        return n, "", 0
    path = out / "data" / "eval.jsonl"   # (named even when refused: eval_strategy's check reads that there is one)
    return n, str(path), found.check(_write_rows, eval_dataset, path, "eval_dataset", rules=rules) or 0


def _call_problems(unsupported: dict, optimizers, model) -> list[str]:
    """GRPOTrainer's arguments that are not here, one line each."""
    out = []
    if "rollout_func" in unsupported:   # (TRL's experimental hook: it replaces the trainer's own generation)
        out.append("GRPOTrainer: rollout_func is not supported by lowmem-grpo (its rollouts are the trainer's own): "
                   "for multi-turn rollouts pass tools= or environment_factory=, or write an environment "
                   "(lowmem_grpo/environment.py, the README's 'Environments and multi-turn rollouts')")
    if other := sorted(set(unsupported) - {"rollout_func"}):
        out.append(f"GRPOTrainer: {', '.join(other)} not supported by lowmem-grpo")
    if optimizers != (None, None):
        out.append("GRPOTrainer: optimizers is not supported (the recipe's optimizer section is)")
    if not isinstance(model, (str, Path)):
        out.append("model: pass the model's hub id or local folder, not a loaded model: lowmem-grpo loads the base in "
                   "4-bit itself (one copy is policy and reference)")
    return out


def _tool_environment(tools, environment_factory, model: str, trust_remote_code: bool, s: dict,
                      iterations) -> tuple[dict, Optional[dict]]:
    """TRL's tools / environment_factory as the recipe's environment section and data.chat_template_kwargs
    (lowmem_grpo/tool_calls.py)."""
    from .tool_calls import ToolCallError, trl_environment

    try:
        return trl_environment(tools, environment_factory, model=model, trust_remote_code=trust_remote_code,
                               chat_template_kwargs=s["chat_template_kwargs"] or None,
                               max_tool_calling_iterations=iterations, max_completion_length=s["max_completion_length"])
    except ToolCallError as exc:
        raise TRLCompatError(f"GRPOTrainer: {exc}") from None


def _callable_name(fn) -> str:
    """TRL's name for a reward function (trl.trainer.utils.get_callable_name): a partial's function's, a callable
    instance's class's, "<lambda>" for a lambda."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", type(fn).__name__)


def _reward_specs(reward_funcs) -> tuple[list[dict], Optional[types.ModuleType]]:
    """Each reward function as a recipe entry called TRL's way, labelled (reward/<label> in the metrics, TRL's
    rewards/<label>/mean in log_history) by TRL's name for it (Rewards._label renames one the metrics row keeps for the
    total, as mean, to mean_<i>). A function importable by its module and name is named so; any other (defined in a
    script's __main__, a partial, a callable instance) through a module made for this run, under TRL's name, or
    reward_<i> where that name is taken or is no identifier (a lambda's)."""
    funcs = _reward_list(reward_funcs)
    module = types.ModuleType(f"lowmem_grpo_trl_rewards_{id(funcs):x}")
    specs, taken = [], set()
    for i, fn in enumerate(funcs):
        if isinstance(fn, str) or not callable(fn) or _is_model(fn):
            what = f"a {type(fn).__name__} model" if _is_model(fn) else repr(fn)   # not a model's whole repr
            raise TRLCompatError(f"reward_funcs[{i}]: {what}: only reward functions are supported (a reward model "
                                 "by name is not, nor a loaded model: call your model from a function)")
        name, importable = _callable_name(fn), importable_name(fn)
        if importable and name not in taken:
            specs.append({"function": importable, "convention": "trl"})
            taken.add(name)
            continue
        attr = name if name.isidentifier() and name not in taken else f"reward_{i}"
        setattr(module, attr, fn)
        taken.add(attr)
        specs.append({"function": f"{module.__name__}:{attr}", "convention": "trl"})
    if len(vars(module)) > len(vars(types.ModuleType("x"))):
        sys.modules[module.__name__] = module
        return specs, module
    return specs, None


def _reward_list(reward_funcs) -> list:
    """TRL's reward_funcs as a list: one function, a list of them, or None (TRL 1.16's default: none, where the
    environment's get_reward() is the reward)."""
    if reward_funcs is None:
        return []
    return list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]


def _reward_environments(environment_factory) -> list[str]:
    """The class names of environment_factory's environments (one factory's, or a dict's) that define get_reward, as
    TRL finds it (a function on the environment's class) and names the reward column it makes of each; a factory
    that is not a class makes one instance to tell, as TRL probes one."""
    import inspect

    factories = environment_factory.values() if isinstance(environment_factory, dict) else [environment_factory]
    names: list[str] = []
    for factory in factories:
        if factory is None or not callable(factory):   # (tool_calls names a factory that is not callable)
            continue
        if not isinstance(factory, type):
            try:
                factory = type(factory())
            except Exception:   # its constructor's error is tool_calls' to name, at the probe
                continue
        if "get_reward" in dict(inspect.getmembers(factory, predicate=inspect.isfunction)) and \
                factory.__name__ not in names:
            names.append(factory.__name__)
    return names


def _check_reward_processing_classes(classes, reward_funcs) -> None:
    """TRL matches reward_processing_classes to reward_funcs one to one and ignores the entries of reward functions
    (they are for reward models, refused here), so all of them are ignored here; a count that does not match is
    TRL's error."""
    if classes is None:
        return
    classes = classes if isinstance(classes, list) else [classes]
    funcs = _reward_list(reward_funcs)
    if len(classes) != len(funcs):
        raise TRLCompatError(f"reward_processing_classes: {len(classes)} for {len(funcs)} reward functions (TRL "
                             "requires one per reward function; a function's entry is not used)")


def _is_model(fn) -> bool:
    """A torch module (a loaded reward model): callable, but not with TRL's reward-function keywords."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(fn, torch.nn.Module)


def _chat_template_problem(processing_class, model: str, trust_remote_code: bool) -> Optional[str]:
    """Why the script's tokenizer cannot stand in for the model folder's (the trainer loads the folder's own, so
    a chat template set on the script's tokenizer would be silently unused); None when they agree."""
    from transformers import AutoTokenizer

    given = getattr(processing_class, "tokenizer", processing_class)   # a processor holds its tokenizer
    own = AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code)
    if getattr(given, "chat_template", None) != getattr(own, "chat_template", None):
        return "its chat template"
    if len(given) != len(own):
        return f"its vocabulary ({len(given)} tokens, the folder's {len(own)})"
    if getattr(given, "eos_token_id", None) != getattr(own, "eos_token_id", None):   # where generation stops
        return f"its eos token ({given.eos_token!r}, the folder's {own.eos_token!r})"
    return None


class TrainOutput(dict):
    """What train() returns: the trainer's summary (a dict) that also reads as transformers' TrainOutput:
    .global_step (optimizer updates, as TRL counts them), .training_loss (the mean step loss), .metrics (the
    summary with what transformers logs at the end of train(): train_loss, train_runtime, epoch, ...)."""

    def __init__(self, summary: dict, global_step: int, training_loss: float, log: dict):
        super().__init__(summary)
        self.global_step, self.training_loss = global_step, training_loss
        self.metrics = {**summary, **log}


def _quantization(config, compute_dtype: str, dtype_named: bool = False) -> dict:
    """TRL's quantization_config (a transformers BitsAndBytesConfig, or its dict) as the recipe's model keys. The
    base is always loaded in 4-bit NF4 here: a config asking for that carries its nested quantization over; 8-bit,
    FP4 or another compute dtype than bf16/fp16 choose is refused."""
    if config is None:
        return {}
    get = config.get if isinstance(config, dict) else (lambda key, default=None: getattr(config, key, default))
    if get("load_in_8bit", False) or not get("load_in_4bit", False):
        raise TRLCompatError("quantization_config: only 4-bit is here (the base is always loaded in 4-bit NF4): "
                             "drop quantization_config, or pass BitsAndBytesConfig(load_in_4bit=True, "
                             "bnb_4bit_quant_type='nf4') (TRL's script: --load_in_4bit, not --load_in_8bit)")
    if get("bnb_4bit_quant_type", "fp4") != "nf4":   # (BitsAndBytesConfig's own default is fp4)
        raise TRLCompatError(f"quantization_config: bnb_4bit_quant_type={get('bnb_4bit_quant_type', 'fp4')!r} is not "
                             "here: the base is loaded in NF4; set bnb_4bit_quant_type='nf4' (TRL's script: "
                             "--bnb_4bit_quant_type nf4)")
    dtype = str(get("bnb_4bit_compute_dtype", None) or "float32").replace("torch.", "")
    # float32: BitsAndBytesConfig's default, not a choice; dtype_named: model_init_kwargs' dtype, refused already,
    # which TRL's script sets this one from
    if dtype not in ("float32", compute_dtype) and not dtype_named:
        raise TRLCompatError(f"quantization_config: bnb_4bit_compute_dtype={dtype} differs from the compute dtype "
                             f"bf16/fp16 choose ({compute_dtype}); here one dtype does both: set them alike "
                             "(TRL's script sets it from --dtype)")
    return {"load_in_4bit": True, "double_quant": bool(get("bnb_4bit_use_double_quant", False))}


def _revision_problem(kwargs: dict) -> Optional[str]:
    """Why model_init_kwargs' revision cannot be carried over, or None: TRL passes it to from_pretrained; here the
    model folder is loaded as it is (trl/scripts/grpo.py puts --model_revision there). Its attention implementation
    changes no result: ignored."""
    revision = kwargs.get("revision")
    if revision in (None, "main"):
        return None
    return (f"model_init_kwargs: revision={revision!r} is not here (the model folder is loaded as it is): download "
            "that revision (huggingface_hub.snapshot_download(model_id, revision=...)) and pass its folder as model "
            "(TRL's script: drop --model_revision)")


def _dtype_problem(kwargs: dict, compute_dtype: str) -> Optional[str]:
    """Why model_init_kwargs' dtype (trl/scripts/grpo.py's --dtype) cannot be carried over, or None. float32
    (ModelConfig's default) under bf16/fp16 is TRL's mixed precision, as the compute dtype is here; a half dtype that
    differs from bf16/fp16's was run in theirs, silently (found by a red team)."""
    dtype = str(kwargs.get("dtype") or kwargs.get("torch_dtype") or "auto").replace("torch.", "")
    if dtype in ("auto", "float32", compute_dtype):
        return None
    flag = {"bfloat16": "--bf16 true", "float16": "--fp16 true --bf16 false"}.get(dtype, "--bf16 or --fp16")
    return (f"model_init_kwargs: dtype={dtype} differs from the compute dtype bf16/fp16 choose ({compute_dtype}); here "
            f"one dtype does both: set them alike (TRL's script: --dtype {dtype} with {flag}), or drop dtype")


class _Accelerator:
    """The part of trainer.accelerator that TRL's scripts use (print, is_main_process, wait_for_everyone): this
    trainer is one process, or one of torchrun's (lowmem-grpo train --nproc)."""

    def __init__(self):
        self.process_index = int(os.environ.get("RANK", "0"))
        self.num_processes = int(os.environ.get("WORLD_SIZE", "1"))
        self.is_main_process = self.is_local_main_process = self.process_index == 0

    def print(self, *args, **kwargs) -> None:
        if self.is_main_process:
            print(*args, **kwargs)

    def wait_for_everyone(self) -> None:
        from . import distributed

        distributed.barrier(distributed.current(), "wait_for_everyone")


# TRL's names for the step metrics of this trainer that mean what TRL's do, beside this trainer's own in
# log_history and on_log (ours -> TRL's). Not here: num_tokens (no count of the prompts' tokens is kept),
# completions/min_length, max_length and the *_terminated_length (not logged), sampling/importance_sampling_ratio/*
# (measured at each update here, at the rollout there), cispo_clip_ratio (here a capped weight with any sign of A),
# vespo/phi_seq_mean (VESPO's weight is not in the row).
TRL_LOG_KEYS = {"loss": "loss", "grad_norm": "grad_norm", "lr": "learning_rate", "reward/mean": "reward",
                "reward/std": "reward_std", "kl": "kl", "entropy": "entropy",
                "completion/mean_length": "completions/mean_length",
                # truncated: no eos within max_completion_length, as TRL's clipped completions
                "completion/truncated_fraction": "completions/clipped_ratio"}
# transformers logs a window's last grad_norm and learning rate; everything else is the window's mean
_LAST_IN_WINDOW = ("grad_norm", "lr", "learning_rate")


def _trl_log_keys(recipe: Recipe) -> dict:
    """TRL_LOG_KEYS, with the metrics that mean what TRL's do only under some settings."""
    a, names = recipe.algorithm, dict(TRL_LOG_KEYS)
    if a.scale_rewards in ("group", "none") and a.reward_aggregation == "sum_then_normalize":
        names["zero_std_fraction"] = "frac_reward_zero_std"   # TRL's share of groups with std 0 (else the batch's)
    if a.clip == "ratio" and a.importance_sampling_level == "token":   # TRL's clip ratios (per token, its loss types)
        names.update({"clip/low": "clip_ratio/low_mean", "clip/high": "clip_ratio/high_mean",
                      "clip/fraction": "clip_ratio/region_mean"})
    if a.sampler_correction != "none":   # TRL logs the sampler's gap with its correction on
        names.update({"rollout/logprob_abs_diff": "sampling/sampling_logp_difference/mean",
                      "rollout/logprob_abs_diff_max": "sampling/sampling_logp_difference/max"})
    if a.entropy_coef:   # TRL logs its coefficient with the bonus on
        names["entropy/coef"] = "entropy_coef"
    if a.clip == "vespo":   # the mean weight over completions, as TRL's
        names["vespo/weight_mean"] = "vespo/phi_seq_mean"
    return names


def _is_step_row(row: dict) -> bool:
    """A step's metrics row (an evaluation's has only step and eval/* keys; a step row may also hold an eval's)."""
    return any(k != "step" and not k.startswith("eval/") for k in row)


def _step_loss(row: dict) -> float:
    """A step row's loss; 0.0 for a step that trained on nothing (every completion left out, e.g. truncated with
    mask_truncated_completions), whose row has no loss: TRL makes that step with loss 0. A non-finite step's NaN loss
    is NaN whether the row is live or read back from metrics.jsonl (which keeps it as null): it was 0.0 there, in
    log_history and train_loss (found by a red team)."""
    loss = row.get("loss")
    if loss is None:
        return math.nan if row.get("nonfinite") else 0.0
    return float(loss)


def _trl_values(row: dict, names: dict) -> dict:
    """A step row's values as TRL logs them: finite numbers only (sinks.scalars), each under its own name and TRL's
    (`names`), a reward function's as rewards/<name>/mean and /std, a log_metric(name, v) as name."""
    values = scalars({k: v for k, v in {**row, "loss": _step_loss(row)}.items() if not k.startswith("eval/")})
    values.update({trl: values[ours] for ours, trl in names.items() if ours in values})
    for key, value in list(values.items()):
        name = key[len("reward/"):]
        if key.startswith("reward/") and name not in ROW_REWARD_KEYS and "/" not in name:
            values[f"rewards/{name}/mean"] = value
            if f"{key}/std" in values:
                values[f"rewards/{name}/std"] = values[f"{key}/std"]
        elif key.startswith("reward_metric/"):   # TRL's _log_metric: under the name given (not over TRL's own)
            values.setdefault(key[len("reward_metric/"):], value)
    return values


def _tool_frequencies(row: dict, completions: int) -> dict:
    """TRL's tool metrics from a step row of a run with tools (lowmem_grpo/tool_calls.py counts each step's calls
    over its completions): tools/call_frequency, calls per completion, and tools/failure_frequency, the share of the
    calls that failed (an error or a timeout); {} without tools."""
    calls = row.get("env/tool_calls")
    if not isinstance(calls, (int, float)):
        return {}
    failed = (row.get("env/tool_errors") or 0) + (row.get("env/tool_timeouts") or 0)
    return {"tools/call_frequency": calls / max(1, completions), "tools/failure_frequency": failed / calls if calls else 0.0}


def _window_mean(window: list[dict]) -> dict:
    """One log entry from the steps since the last: each value's mean over the steps that have it, grad_norm and
    the learning rate the last step's (transformers' loss is the window's mean, TRL's metrics are)."""
    out = {}
    for key in dict.fromkeys(k for values in window for k in values):
        seen = [values[key] for values in window if key in values]
        out[key] = seen[-1] if key in _LAST_IN_WINDOW else sum(seen) / len(seen)
    return out


class _RunLog:
    """transformers' log_history of a run, from its metrics rows in order: a step's entry every output.log_every
    steps (TRL's logging_steps, an epoch's steps with logging_strategy 'epoch'; none with 'no': `logs`), its values
    averaged over the steps since the last (_window_mean), none forced at the last step, one after the first step
    with logging_first_step; an entry per evaluation (eval_accuracy, ...). The
    `state` property replays metrics.jsonl through one, _CallbackSink feeds one as the run writes its rows: the two
    cannot disagree."""

    def __init__(self, recipe: Recipe, epoch: Callable[[int], float], first: bool = False, logs: bool = True,
                 aliases: Optional[dict] = None):
        self.every, self.updates, self.epoch = recipe.output.log_every, recipe.algorithm.updates_per_step, epoch
        self.aliases = aliases or {}   # TRL's name -> the columns of ours whose mean it logs (_trl_reward_columns)
        self.logs = logs   # False: logging_strategy 'no', no step's entry (but logging_first_step's, as transformers)
        # TRL's logging_first_step (was ignored; found by a red team): after step 1, where transformers' logs update 1
        self.first = first
        self.names = _trl_log_keys(recipe)
        self.completions = recipe.train.prompts_per_step * recipe.generation.num_generations   # a step's batch
        self.entries: list[dict] = []
        self._window: list[dict] = []

    def add(self, row: dict) -> tuple[bool, Optional[dict], Optional[dict]]:
        """(whether the row is a step's, the step entry it completes, its evaluation's entry), the entries (None where
        the row makes none) appended to `entries`."""
        step, is_step, logs, evaluation = row["step"], _is_step_row(row), None, None
        if is_step:
            values = _trl_values(row, self.names)
            for trl, ours in self.aliases.items():
                seen = [values[k] for k in ours if k in values]
                if seen:
                    values[trl] = sum(seen) / len(seen)
            self._window.append({**values, **_tool_frequencies(row, self.completions)})
            if (self.logs and step % self.every == 0) or (self.first and step == 1):
                logs = self._entry(_window_mean(self._window), step)
                self._window = []
        if any(k.startswith("eval/") for k in row):   # as transformers names an evaluation's: eval_accuracy, ...
            found = scalars({k: v for k, v in row.items() if k.startswith("eval/")})
            evaluation = self._entry({f"eval_{k[len('eval/'):]}": v for k, v in found.items()}, step)
        self.entries += [e for e in (logs, evaluation) if e is not None]
        return is_step, logs, evaluation

    def _entry(self, values: dict, step: int) -> dict:
        return {**values, "epoch": self.epoch(step), "step": step * self.updates}


def _callback(callback):
    """A TrainerCallback instance (transformers also takes the class, and makes one)."""
    from transformers import TrainerCallback

    if isinstance(callback, type) and issubclass(callback, TrainerCallback):
        return callback()
    if not isinstance(callback, TrainerCallback):
        raise TRLCompatError(f"callbacks: {callback!r} is not a transformers TrainerCallback (or its class)")
    return callback


class _CheckpointNames(Sink):
    """transformers' names for the run's checkpoints: output_dir/checkpoint-<global step>, a link to the checkpoint
    (checkpoints/step-N, N x updates_per_step updates), made as each is written; a link whose checkpoint was rotated
    away goes. So `transformers.trainer_utils.get_last_checkpoint(output_dir)`, with which TRL's and open-r1's
    scripts find what to resume, finds the last one, and train(resume_from_checkpoint=it) resumes (found by a red
    team: it found none, and the script's rerun was refused). A name already taken by something else is left alone."""

    def __init__(self, output_dir: Path, updates_per_step: int):
        self.output_dir, self.updates = Path(output_dir), updates_per_step

    def write(self, row: dict) -> None:
        pass   # (names only: the rows are the other sinks')

    def saved(self, step: int, path: Path) -> None:
        link = self.output_dir / f"checkpoint-{step * self.updates}"
        try:
            if not link.exists() and not link.is_symlink():
                link.symlink_to(os.path.relpath(Path(path).resolve(), self.output_dir.resolve()),
                                target_is_directory=True)
            for old in self.output_dir.glob("checkpoint-*"):
                if old.is_symlink() and not old.exists():
                    old.unlink()
        except OSError:   # (a name for scripts' convenience: never the run's failure)
            pass


class _CallbackSink(Sink):
    """transformers' TrainerCallbacks, called from the run's events as transformers' Trainer calls them:
    on_train_begin before the first step; on_step_begin before each step; on_step_end after each step's row, then
    on_log where that row completes a logging window (_RunLog: every logging_steps, TRL's names); for an evaluation
    on_log then on_evaluate; on_save after a checkpoint is written; after the last step on_log with the train summary
    (train_runtime, train_loss, ...), then on_train_end. on_log gets the log_history entry without its step, as
    transformers passes it. A step here is algorithm.updates_per_step of TRL's updates (global_step counts them), so each
    event comes once a step where TRL's would come once an update. A callback that sets
    control.should_training_stop ends the run after that step, checkpointed, as a Ctrl-C does; should_evaluate and
    should_save evaluate and checkpoint after the step (the eval first, as transformers'). Not called (this loop
    is not transformers'): on_substep_end, the optimizer, epoch and prediction events."""

    def __init__(self, callbacks: list, args, trainer, tokenizer, run_log: _RunLog):
        from transformers import TrainerControl, TrainerState

        self.callbacks, self.args, self.trainer, self.run_log = callbacks, args, trainer, run_log
        r, per_step = trainer.recipe, run_log.updates
        self.state = TrainerState(max_steps=r.train.steps * per_step, logging_steps=r.output.log_every * per_step,
                                  save_steps=r.output.save_every * per_step, eval_steps=(r.train.eval_every or 0) * per_step,
                                  train_batch_size=r.train.micro_batch_size)
        self.state.log_history = run_log.entries
        self.control = TrainerControl()
        self.said_no_eval = False
        # transformers passes its dataloaders to every event too; this trainer has none (a callback may name them)
        self.objects = dict(model=trainer.model, processing_class=tokenizer, optimizer=trainer.optimizer,
                            lr_scheduler=trainer.scheduler, train_dataloader=None, eval_dataloader=None)

    def event(self, name: str, **kwargs) -> None:
        for callback in self.callbacks:
            result = getattr(callback, name)(self.args, self.state, self.control, **self.objects, **kwargs)
            if result is not None:
                self.control = result
        if self.control.should_training_stop:
            self.trainer.stop_requested = True
        # should_evaluate / should_save: this step's eval and checkpoint, taken once (they were ignored: a red
        # team's find); transformers clears them at each step's start
        if self.control.should_evaluate:
            self.trainer.eval_requested, self.control.should_evaluate = True, False
            if self.trainer.eval_set is None and not self.said_no_eval:
                self.said_no_eval = True
                self.trainer.log("[lowmem-grpo] a callback set control.should_evaluate, and this run has no held-out "
                                 "set to evaluate (eval_strategy 'no'); set eval_strategy='steps' (and eval_steps) "
                                 "with an eval_dataset")
        if self.control.should_save:
            self.trainer.save_requested, self.control.should_save = True, False

    def _at(self, step: int) -> None:
        self.state.global_step, self.state.epoch = step * self.run_log.updates, self.run_log.epoch(step)

    def step_begin(self, step: int) -> None:
        self._at(step - 1)   # as transformers': before the step, global_step counts the updates made so far
        self.control.should_log = self.control.should_evaluate = self.control.should_save = False   # (as its handler)
        self.event("on_step_begin")

    def saved(self, step: int, path) -> None:
        self._at(step)
        self.event("on_save")

    def write(self, row: dict) -> None:
        self._at(row["step"])
        is_step, logs, evaluation = self.run_log.add(row)
        if is_step:
            self.event("on_step_end")
        if logs is not None:
            self.on_log(logs)
        if evaluation is not None:
            self.on_log(evaluation)
            self.event("on_evaluate", metrics=_without_step(evaluation))

    def on_log(self, entry: dict) -> None:
        """on_log for an entry already in log_history (run_log.entries): transformers passes it without its step."""
        self.event("on_log", logs=_without_step(entry))


def _resume_flag(value):
    """train()'s resume_from_checkpoint as meant: TrainingArguments types it as a str, so TRL's script passes
    `--resume_from_checkpoint true` on as the text "true", which transformers would look for as a folder (found by a
    red team running trl/scripts/grpo.py: the rerun was refused as "true is not the last checkpoint"). Here "true"
    or "false" (any case) that names no folder is the bool."""
    if isinstance(value, str) and value.strip().lower() in ("true", "false") and not Path(value).exists():
        return value.strip().lower() == "true"
    return value


def _without_step(entry: dict) -> dict:
    return {k: v for k, v in entry.items() if k != "step"}


class GRPOTrainer:
    """TRL's GRPOTrainer(model, reward_funcs, args, train_dataset, eval_dataset, peft_config, tools,
    environment_factory), run by lowmem-grpo (tools and environment_factory: lowmem_grpo/tool_calls.py)."""

    _variant = "grpo"             # recipe_from_trl's: which of TRL's trainers this one stands for
    _default_config = GRPOConfig  # the config made for a script that passes no args, as TRL's trainer makes it

    def __init__(self, model, reward_funcs=None, args=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, reward_processing_classes=None, callbacks=None, optimizers=(None, None),
                 quantization_config=None, peft_config=None, tools=None, environment_factory=None,
                 log: Callable = print, **unsupported):
        # the checks that do not need an earlier one to pass keep their refusals in `found`, raised together (one
        # line each) where the next step reads what was refused: a script learns every problem in one run
        found = _Refusals()
        found.add(*_call_problems(unsupported, optimizers, model))
        if args is None:   # TRL's GRPOConfig(f"{model_name}-GRPO") (GMPOConfig, -GMPO) for a script that passes none
            args = self._default_config(f"{str(model).rstrip('/').split('/')[-1]}-{self._variant.upper()}")
        self._callbacks = [c for c in (found.check(_callback, c) for c in (callbacks or [])) if c is not None]
        try:   # every later check reads the settings: a config that cannot be read stops here
            settings = _given_settings(args)
        except TRLCompatError as exc:
            found.gate(*exc.problems)
        model_ok = isinstance(model, (str, Path))   # (the checks that load the model's folder need its name)
        s = {**TRL_DEFAULTS, **settings}
        if train_dataset is None:   # TRL: the environment gives each prompt from reset(); max_steps sets the length
            train_dataset = found.check(_placeholder_rows, environment_factory, s)
        found.check(_check_reward_processing_classes, reward_processing_classes, reward_funcs)
        init_kwargs = settings.get("model_init_kwargs") or {}
        dtype_problem = _dtype_problem(init_kwargs, _compute_dtype(s))
        found.add(*filter(None, [_revision_problem(init_kwargs), dtype_problem]))
        quantization = init_kwargs.get("quantization_config") if quantization_config is None else quantization_config
        quantized = found.check(_quantization, quantization, _compute_dtype(s), dtype_named=dtype_problem is not None)
        out = Path(settings.get("output_dir") or "trainer_output")
        remote = bool(settings.get("trust_remote_code"))
        if processing_class is not None and model_ok and \
                (problem := _chat_template_problem(processing_class, str(model), remote)):
            found.add(f"processing_class: {problem} differs from the tokenizer in {model}, which lowmem-grpo loads "
                      "itself: save yours into a copy of the model folder (processing_class.save_pretrained(folder)) "
                      "and pass that folder as model")
        n, eval_path, eval_rows = _write_datasets(found, train_dataset, eval_dataset, environment_factory, s, out)
        self._eval_path, self._eval_rows = eval_path, eval_rows   # evaluate()'s, whatever eval_strategy says
        rewards = found.check(_reward_specs, reward_funcs)
        specs, self._module = rewards or ([{} for _ in _reward_list(reward_funcs)], None)
        lora = found.check(_lora_section, peft_config, str(model)) if model_ok else None
        # TRL reads max_tool_calling_iterations only in its tool loop: with tools, environment.max_turns (below)
        iterations = settings.pop("max_tool_calling_iterations", None)
        d = found.check(recipe_from_trl, settings, model=str(model), train_path=str(out / "data" / "train.jsonl"),
                        processes=launched_size(), eval_path=eval_path, reward_specs=specs, lora=lora,
                        train_rows=n, eval_rows=eval_rows, variant=self._variant)
        environment = None
        if (tools or environment_factory is not None) and model_ok:   # TRL's tool calls (lowmem_grpo/tool_calls.py)
            environment = found.check(_tool_environment, tools, environment_factory, str(model), remote, s, iterations)
        owners = _reward_environments(environment_factory) if environment_factory is not None else []
        if rewards is not None and not specs and not owners:
            # TRL's error (found by a red team: with tools, or an environment without get_reward, the run trained
            # with no reward at all, every completion skipped; without either, the recipe's error named its key)
            found.add("reward_funcs: no reward source provided, as TRL refuses it: pass reward_funcs, or an "
                      "environment_factory whose environment defines a get_reward method")
        found.stop()   # the recipe below is made of everything above
        if environment is not None:
            d["environment"], d["data"]["chat_template_kwargs"] = environment
        d["output"]["dir"] = str(out)
        d["model"].update(quantized)
        try:
            self.recipe: Recipe = recipe_from_dict(d)
        except RecipeError as exc:   # named by the script's argument first, then by the recipe key it became
            lines = [f"  {_argument(k, settings)} ({k}): {m}" for k, m in exc.problems]
            raise TRLCompatError("these arguments cannot be run here:\n" + "\n".join(lines)) from None
        self.args, self.log, self.output_dir, self._processing_class = args, log, out, processing_class
        self.train_dataset, self.eval_dataset, self.train_rows = train_dataset, eval_dataset, n
        self._log_first = bool({**TRL_DEFAULTS, **settings}["logging_first_step"])   # (_RunLog's: not a recipe key)
        self._logs = {**TRL_DEFAULTS, **settings}["logging_strategy"] != "no"   # (_RunLog's too)
        # TRL's names for the reward columns (_trl_reward_columns): each function's get_callable_name, and the class
        # of the environment whose get_reward() is the environment's column
        funcs = _reward_list(reward_funcs)
        self._trl_reward_names, self._reward_environments = [_callable_name(f) for f in funcs], owners
        self._reward_columns: Optional[dict] = None
        self.accelerator = _Accelerator()
        self._model = None      # the policy: loaded on first use of .model, the trained one after train()
        self._trained = False   # whether output_dir's checkpoints are this trainer's (evaluate's adapter)
        self._evaluations: tuple[list, list] = ([], [])   # evaluate()'s results before / after train(), for log_history
        self._summary: Optional[dict] = None   # the last train()'s summary entry of log_history
        if peft_config is None:
            log("[lowmem-grpo] no peft_config: training LoRA with the recipe's defaults (r=16, all linear layers)")

    # -- what a script reads: model, processing_class, state ----------------------------------------------

    @property
    def processing_class(self):
        """The script's tokenizer, else the model folder's (as TRL loads it when none is given)."""
        if self._processing_class is None:
            from .model import load_tokenizer

            self._processing_class = load_tokenizer(self.recipe.model)
        return self._processing_class

    @property
    def model(self):
        """The policy (a peft model on the 4-bit base): after train(), the trained one; before, as training will
        start it, loaded on first use (train() loads its own: a change made to this one before train() is not
        trained on)."""
        if self._model is None:
            from . import checkpoint as ckpt
            from .model import load_policy

            last = ckpt.latest(self.output_dir) if self._trained else None
            self._model, _ = load_policy(self.recipe.model, self.recipe.lora,
                                         adapter_path=str(last / "adapter") if last else None)
        return self._model

    @property
    def state(self):
        """transformers' TrainerState of the run as metrics.jsonl has it: global_step and max_steps in optimizer
        updates (as TRL counts them), log_history with an entry per logging window and per evaluation (_RunLog),
        then the last train()'s summary, with evaluate()'s results before and after train() around them."""
        from transformers import TrainerState

        from .metrics import read_metrics

        per_step, r = self.recipe.algorithm.updates_per_step, self.recipe
        rows = read_metrics(self.output_dir) if self._trained else []
        run_log = self._run_log()
        for row in rows:
            run_log.add(row)
        done = max((row["step"] for row in rows), default=0)
        summary = [self._summary] if self._summary else []
        return TrainerState(epoch=self._epoch(done), global_step=done * per_step, max_steps=r.train.steps * per_step,
                            logging_steps=r.output.log_every * per_step, save_steps=r.output.save_every * per_step,
                            eval_steps=(r.train.eval_every or 0) * per_step, train_batch_size=r.train.micro_batch_size,
                            log_history=[*self._evaluations[0], *run_log.entries, *summary, *self._evaluations[1]])

    def _run_log(self) -> "_RunLog":
        return _RunLog(self.recipe, self._epoch, self._log_first, self._logs, self._trl_reward_columns())

    def _trl_reward_columns(self) -> dict:
        """{TRL's rewards/<name>/mean (and /std): the reward columns of this run that TRL logs under that name} where
        the names differ (found by a red team: log_history had rewards/reward_2/mean for a lambda, TRL's
        rewards/<lambda>/mean). TRL names a function by get_callable_name, so that two of one name share a key (the
        mean of their means), and the environment's get_reward() column by its class (one per class: with
        environments of several classes, the one column here has no TRL name); a label here is unique (reward_<i>,
        <name>_<i>) and the environment's column is 'environment'."""
        if self._reward_columns is None:
            from .rewards import Rewards

            try:
                labels = Rewards.from_recipe(self.recipe).names
            except Exception:   # (the run names the problem)
                labels = []
            pairs = list(zip(labels, self._trl_reward_names))
            if len(self._reward_environments) == 1 and "environment" in labels[len(self._trl_reward_names):]:
                pairs.append(("environment", self._reward_environments[0]))
            groups: dict[str, list[str]] = {}
            for label, name in pairs:
                groups.setdefault(name, []).append(label)
            self._reward_columns = {}
            for name, members in groups.items():
                if members != [name]:
                    self._reward_columns[f"rewards/{name}/mean"] = [f"reward/{m}" for m in members]
                    self._reward_columns[f"rewards/{name}/std"] = [f"reward/{m}/std" for m in members]
        return self._reward_columns

    def _in_trl_terms(self, message: str) -> str:
        """A data or engine error as the script knows its data: the dataset's row (0-based, as dataset[i]) for a line of the
        JSON lines written from it, TRL's argument for a recipe key, and no recipe-only advice (on_bad_row)."""
        data = self.output_dir / "data"
        for file, what in (("train.jsonl", "train_dataset"), ("eval.jsonl", "eval_dataset")):
            message = re.sub(rf"{re.escape(str(data / file))}:? row (\d+)(?: \(line \d+\))?",
                             lambda m: f"{what}[{int(m.group(1)) - 1}]", message)
            message = re.sub(rf"{re.escape(str(data / file))}:(\d+)", lambda m: f"{what}[{int(m.group(1)) - 1}]",
                             message)
        # (as the recipe's advice, only if some rows: a missing chat template fails every row, found by a red team)
        message = message.replace(f" ({ROW_SKIP_ADVICE})", " (fix that row; if only some rows are like this, drop "
                                  "them: dataset.filter(...))")
        message = message.replace("data.train_path: ", "").replace("data.eval_path: ", "")   # (the files written here)
        # the engine as the script chose it: use_vllm, not the recipe key (found by a red team)
        message = message.replace("use generation.engine: hf", "set use_vllm=False")
        message = re.sub(r"generation\.engine=(?:'?vllm'?)", "use_vllm=True", message)
        message = message.replace("generation.engine=hf", "use_vllm=False")
        for key, name in FROM_TRL.items():
            message = message.replace(f"{key}=", f"{name}=")
        return message

    def _epoch(self, step: int) -> float:
        """Epochs through the train set after `step` steps (generation batches), as TRL reports them."""
        return epochs_done(step, self.recipe.train.prompts_per_step, self.train_rows)

    def add_callback(self, callback) -> None:
        """transformers' Trainer.add_callback: a TrainerCallback (or its class) for the next train()."""
        self._callbacks.append(_callback(callback))

    def remove_callback(self, callback) -> None:
        """transformers' Trainer.remove_callback: by instance or by class."""
        self.pop_callback(callback)

    def pop_callback(self, callback):
        """transformers' Trainer.pop_callback: removes and returns the callback (the first of a class), or None."""
        for c in self._callbacks:
            if c is callback or (isinstance(callback, type) and type(c) is callback):
                self._callbacks.remove(c)
                return c
        return None

    def is_world_process_zero(self) -> bool:
        """transformers' Trainer.is_world_process_zero: whether this is the process that writes the run."""
        return self.accelerator.is_main_process

    def __getattr__(self, name):
        # (only for names not found otherwise) a TRL/transformers Trainer attribute this one does not have
        if name.startswith("_"):
            raise AttributeError(name)
        raise AttributeError(f"GRPOTrainer.{name}: not in lowmem-grpo's GRPOTrainer, which has train, evaluate, "
                             "save_model, log_metrics, save_metrics, save_state, add_callback, pop_callback, "
                             "remove_callback, is_world_process_zero, model, args, state, processing_class, "
                             "accelerator, recipe and output_dir")

    # -- train, evaluate, save ---------------------------------------------------------------------------

    def train(self, resume_from_checkpoint=None) -> "TrainOutput":
        """Run the recipe; resume_from_checkpoint=True (or the output dir) continues from its last checkpoint."""
        import time

        from .metrics import read_metrics
        from .train import Trainer

        resume_from_checkpoint = _resume_flag(resume_from_checkpoint)
        resume = bool(resume_from_checkpoint)
        if problem := self._start_problem(resume_from_checkpoint):
            raise TRLCompatError(problem)
        self._model = None   # the run loads its own policy: free the one .model may hold
        started = time.monotonic()
        try:
            trainer = Trainer(self.recipe, run_dir=self.output_dir if resume else None, resume=resume, log=self.log)
        except (DataError, EngineError) as exc:
            raise TRLCompatError(self._in_trl_terms(str(exc))) from None
        first = trainer.step   # the steps a resumed run had made (its metrics.jsonl now ends there)
        self._trained = True
        if trainer.world.main:
            trainer.metrics.sinks.append(_CheckpointNames(self.output_dir, self.recipe.algorithm.updates_per_step))
        callbacks = None
        if self._callbacks and trainer.world.main:
            callbacks = _CallbackSink(self._callbacks, self.args, trainer, trainer.tokenizer,
                                      self._run_log())
            for row in read_metrics(self.output_dir) if first else []:   # log_history and window as they were
                callbacks.run_log.add(row)
            trainer.metrics.sinks.append(callbacks)
            callbacks._at(first)   # a resumed run's state at its checkpoint, as transformers loads it before this event
            callbacks.event("on_train_begin")
        summary = trainer.fit()
        self._model = trainer.model
        rows = [row for row in read_metrics(self.output_dir) if _is_step_row(row) and row["step"] > first]
        self._summary = self._train_summary(rows, first, summary["step"], time.monotonic() - started)
        if callbacks is not None:
            callbacks.state.log_history.append(self._summary)
            callbacks.on_log(self._summary)
            callbacks.event("on_train_end")
        return TrainOutput(summary, global_step=self._summary["step"], training_loss=self._summary["train_loss"],
                           log=_without_step(self._summary))

    def _start_problem(self, resume_from_checkpoint) -> Optional[str]:
        """Why train(resume_from_checkpoint) cannot start in output_dir, in the script's terms, or None: checked here
        so that the advice is the script's (the run's own names its command line: --set, lowmem-grpo train)."""
        from . import checkpoint as ckpt

        last, held = ckpt.latest(self.output_dir), ckpt.earlier_run(self.output_dir)
        if isinstance(resume_from_checkpoint, (str, Path)):   # TRL resumes from the checkpoint named; here: the last
            named = Path(resume_from_checkpoint).resolve()
            if named not in (self.output_dir.resolve(), last and last.resolve()):
                return (f"resume_from_checkpoint: {resume_from_checkpoint} is not the last checkpoint of "
                        f"{self.output_dir} ({last or 'none'}); resuming continues from the last one: pass True (on "
                        "TRL's command line: --resume_from_checkpoint true), or move the later checkpoints out of the "
                        "way")
        # a run there that made no checkpoint (it failed before its first) can be neither resumed nor trained over:
        # the advice was to resume it, then to train without resuming (found by a red team: a loop)
        none_made = (f"the run there ({held}) made no checkpoint, so there is nothing to resume: delete that folder "
                     "or use another output_dir") if held or (self.output_dir / "recipe.yaml").is_file() else ""
        if resume_from_checkpoint and last is None:   # was a fresh run, silently (found by a red team)
            return (f"resume_from_checkpoint: no valid checkpoint found in output directory ({self.output_dir}), as in "
                    "transformers: " + (none_made or "call train() without it to start the run"))
        if not resume_from_checkpoint and last is not None:
            # a fresh run there would append to that run's metrics, and save_model() and a resume would take the
            # last checkpoint, which may be the earlier run's
            return (f"output_dir {self.output_dir} already holds a run ({held}): pass resume_from_checkpoint=True "
                    "(--resume_from_checkpoint true) to continue it, or use another output_dir (or delete that one)")
        if not resume_from_checkpoint and none_made:
            return f"output_dir {self.output_dir}: {none_made}"
        return self._resume_change_problem() if resume_from_checkpoint else None

    def _resume_change_problem(self) -> Optional[str]:
        """What this script changes of the settings a resumed run keeps (its checkpoints were made with them: the
        model, LoRA, the optimizer, the seed; lowmem_grpo/resume.py), named as the script names them, or None."""
        from . import resume as resume_rules
        from .recipe import load_recipe

        try:
            before = load_recipe(self.output_dir / "recipe.yaml")
        except Exception:   # (the run names an unreadable one)
            return None
        changed = resume_rules.resume_changes(resume_rules.fixed_values(before), resume_rules.fixed_values(self.recipe),
                                              log=lambda *a: None)
        if not changed:
            return None
        named = [f"{FROM_TRL.get(key, key)} {rest}" for key, rest in (c.split(" ", 1) for c in changed)]
        return (f"resume_from_checkpoint: a resumed run keeps what its checkpoints were made with; this one changes "
                f"{'; '.join(named)}: pass the first run's values again (TRL's script: its flags), or train into "
                "another output_dir")

    def _train_summary(self, rows: list[dict], first: int, done: int, runtime: float) -> dict:
        """transformers' log_history entry at the end of train(), of this call's steps (after `first`, up to
        `done`): train_runtime, train_samples_per_second (completions), train_steps_per_second (optimizer updates),
        total_flos (not counted here: 0), train_loss (the mean finite step loss, a step that trained on nothing 0;
        0 without any, as transformers' is), epoch."""
        r, per_step = self.recipe, self.recipe.algorithm.updates_per_step
        updates = (done - first) * per_step
        losses = [loss for loss in map(_step_loss, rows) if math.isfinite(loss)]
        return {"train_runtime": runtime,
                "train_samples_per_second": updates * r.train.prompts_per_step * r.generation.num_generations / runtime,
                "train_steps_per_second": updates / runtime, "total_flos": 0.0,
                "train_loss": sum(losses) / len(losses) if losses else 0.0,
                "epoch": self._epoch(done), "step": done * per_step}

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict:
        """Greedy held-out accuracy by the project's own eval (lowmem_grpo/evaluate.py, as `lowmem-grpo eval`, its
        greedy part what the trainer logs as eval/accuracy), of the policy as it stands: the last checkpoint after
        train(), the base before. On eval_dataset, else the trainer's. The metrics as transformers names them
        ({prefix}_accuracy, {prefix}_mean_reward, {prefix}_pass@1, ..., {prefix}_runtime); the completions go to
        output_dir/eval/."""
        import time

        from . import checkpoint as ckpt, distributed
        from .evaluate import run_eval

        # under torchrun, each process its share of the prompts and process 0 the files, as `eval --nproc` (§21):
        # every process ran the whole eval and wrote the same files (found by a red team)
        world = distributed.current()
        path, rows = Path(self._eval_path), self._eval_rows
        if eval_dataset is not None:
            path = self.output_dir / "data" / f"{metric_key_prefix}.jsonl"
            rows = distributed.gather(_write_rows(eval_dataset, path, "eval_dataset") if world.main else None, world)[0]
        elif not self._eval_path:
            raise TRLCompatError("evaluate: no eval_dataset (pass one to GRPOTrainer or to evaluate()), as in TRL")
        recipe = self.recipe.model_copy(update={
            "data": self.recipe.data.model_copy(update={"eval_path": str(path)}),
            "train": self.recipe.train.model_copy(update={"eval_max_prompts": rows})})
        last = ckpt.latest(self.output_dir) if self._trained else None
        step = ckpt.step_of(last) if last else 0
        started = time.monotonic()
        summary = run_eval(recipe, name=self.output_dir.name, adapter=str(last / "adapter") if last else None,
                           split="test", ks=(1,), log=self.log if world.main else (lambda *a, **k: None), world=world,
                           out_dir=str(self.output_dir / "eval" / f"step-{step:06d}-{metric_key_prefix}"))
        keys = ("accuracy", "mean_reward", "correct", "n", "prompts", "pass@1")
        metrics = {f"{metric_key_prefix}_{k}": summary[k] for k in keys if summary.get(k) is not None}
        metrics[f"{metric_key_prefix}_runtime"] = time.monotonic() - started
        per_step = recipe.algorithm.updates_per_step
        self._evaluations[self._trained].append({**metrics, "step": step * per_step})   # [0]: before train(), [1]: after
        return metrics

    def log_metrics(self, split: str, metrics: dict) -> None:
        """transformers' Trainer.log_metrics: the metrics, one a line (nested ones as they are)."""
        self.log(f"***** {split} metrics *****")
        for key in sorted(metrics):
            self.log(f"  {key} = {metrics[key]}")

    def save_metrics(self, split: str, metrics: dict, combined: bool = True) -> None:
        """transformers' Trainer.save_metrics: output_dir/{split}_results.json, and all_results.json merged."""
        if not self.is_world_process_zero():   # (as transformers': process 0 writes)
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        text = json.dumps(metrics, indent=4, sort_keys=True, default=str)
        (self.output_dir / f"{split}_results.json").write_text(text)
        if combined:
            path = self.output_dir / "all_results.json"
            merged = {**(json.loads(path.read_text()) if path.is_file() else {}), **metrics}
            path.write_text(json.dumps(merged, indent=4, sort_keys=True, default=str))

    def save_state(self) -> None:
        """transformers' Trainer.save_state: output_dir/trainer_state.json (the state above)."""
        if not self.is_world_process_zero():
            return
        self.state.save_to_json(str(self.output_dir / "trainer_state.json"))

    def end(self) -> None:
        """transformers' Trainer.end (5.18+): nothing to finish here (train() closed its sinks and engine)."""

    def save_model(self, output_dir: Optional[str] = None) -> Path:
        """The last checkpoint's LoRA adapter files into output_dir (default: the run's output_dir, as TRL saves)."""
        import shutil

        from . import checkpoint as ckpt, distributed
        from .export import ExportError, find_adapter

        if ckpt.latest(self.output_dir) is None:   # TRL would save the untrained model; here it is the base as it is
            raise TRLCompatError(f"save_model: {self.output_dir} has no checkpoint yet (the adapter saved is the "
                                 "run's last checkpoint): call train() first")
        adapter = find_adapter(self.output_dir)
        if problem := ckpt.adapter_problem(adapter):
            raise ExportError(f"checkpoint {adapter.parent.name} cannot be saved: {problem}")
        target = Path(output_dir) if output_dir else self.output_dir
        world = distributed.current()
        if world.main:   # (process 0 writes, as transformers'; every process copied before: found by a red team)
            shutil.copytree(adapter, target, dirs_exist_ok=True)
            # TRL's save_model writes the tokenizer too (AutoTokenizer.from_pretrained(output_dir) after training)
            self.processing_class.save_pretrained(str(target))
            self.log(f"[lowmem-grpo] adapter ({adapter.parent.name}) -> {target}")
        distributed.barrier(world, "saving the model")
        return target


class GMPOTrainer(GRPOTrainer):
    """TRL's experimental GMPOTrainer (trl.experimental.gmpo): GRPOTrainer's arguments, the recipe's clip gmpo. As
    TRL's, it takes a plain GRPOConfig too (its epsilon then is the log-space bound, 0.2 unless set)."""

    _variant = "gmpo"
    _default_config = GMPOConfig
