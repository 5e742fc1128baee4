"""The recipe schema: every field, its default and its meaning, in one place.

A recipe is a YAML file. `load_recipe` parses it and validates it against `Recipe`; every problem is
reported at once, each with its key path (`algorithm.beta`) and what is allowed. Nothing else in the
package reads raw YAML: the rest of the code receives these typed objects.

The README's recipe reference is generated from this file (`python scripts/gen_recipe_reference.py`)
and a test checks the two agree.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator


class _Section(BaseModel):
    # extra="forbid": a misspelt key is an error, not a silently ignored default. allow_inf_nan=False: YAML's
    # .nan / .inf would pass every bound check (a NaN compares false) and make NaN rewards or losses.
    model_config = ConfigDict(extra="forbid", validate_default=True, protected_namespaces=(), allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value, info: ValidationInfo):
        # pydantic's lax mode reads true/false as 1/0: `train.steps: true` trained one step (found by a red team)
        if isinstance(value, bool) and info.field_name in cls.model_fields:
            kinds = _kinds(cls.model_fields[info.field_name].annotation)
            if bool not in kinds and kinds & {int, float}:
                raise ValueError("expected a number, not true or false")
        return value


def _kinds(annotation) -> set:
    """The plain types an annotation admits (int | None -> {int, NoneType}); {} for anything else."""
    if get_origin(annotation) is None:
        return {annotation} if isinstance(annotation, type) else set()
    return set().union(*(_kinds(a) for a in getattr(annotation, "__args__", ())))


class ModelConfig(_Section):
    name_or_path: str = Field("", description="Hugging Face model id or local folder of the base model.")
    load_in_4bit: bool = Field(True, description="Load the base in 4-bit NF4 through bitsandbytes (the low-memory path).")
    compute_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "bfloat16", description="dtype of the non-quantized weights and of 4-bit matmuls; use float32 on CPU.")
    autocast: bool = Field(
        True, description="With compute_dtype bfloat16, the decoder's log-prob passes (update, reference, old policy) "
        "run under torch.autocast in bfloat16, as transformers' Trainer does with bf16: the LoRA matmuls take the bf16 "
        "activations as they are instead of an fp32 copy of each input that peft would keep for backward (up to "
        "6 x hidden + 2 x intermediate fp32 values per token of a micro-batch); the log-prob kernel stays fp32 "
        "(docs/algorithm.md §24). No effect with float32, nor with float16, whose LoRA gradients would need loss "
        "scaling. Default true.")
    double_quant: bool = Field(True, description="bitsandbytes nested quantization of the 4-bit scales (saves ~0.4 bit/param).")
    quantize_experts: bool = Field(
        True, description="With load_in_4bit, a mixture of experts' routed experts in NF4 too (transformers keeps them "
        "as 3-D tensors, which bitsandbytes leaves in compute_dtype: most of an MoE's bytes); they are then frozen, and "
        "LoRA trains attention, the router and the dense/shared MLPs (lowmem_grpo/experts4bit.py). false: experts in "
        "compute_dtype, adapted by LoRA where lora.target_modules reaches them.")
    gradient_checkpointing: bool = Field(True, description="Recompute decoder activations in backward instead of storing them.")
    disable_dropout: bool = Field(
        True, description="Zero the base model's own dropout (its dropout layers and attention dropout; the adapters' is "
        "lora.dropout), so that the update's forward is the policy that sampled the batch and a ratio is 1 where "
        "nothing changed (docs/algorithm.md §1). Most current models have none; TRL's disable_dropout, whose default is "
        "false.")
    trust_remote_code: bool = Field(False, description="Allow model code from the model folder/hub (only for models you trust).")
    backend: Literal["transformers", "unsloth"] = Field(
        "transformers", description="Load through transformers + bitsandbytes + peft, or Unsloth's FastLanguageModel "
        "(NVIDIA GPU and the unsloth extra only; never run on a GPU: its glue is tested on CPU against a stand-in; "
        "double_quant false and quantize_experts on a mixture of experts are refused).")

    @field_validator("name_or_path")
    @classmethod
    def _home(cls, value: str) -> str:
        # '~/models/x' reached transformers as written, which took it for a hub id (found by a red team): expanded
        # here, once, so that train, eval and export all get the folder's path
        return str(Path(value).expanduser()) if value.startswith("~") else value

    @property
    def bf16_autocast(self) -> bool:
        """Whether the training passes' decoder runs under bf16 autocast (`autocast`): the one rule, read by the
        trainer and the memory model."""
        return self.autocast and self.compute_dtype == "bfloat16"


# The linear layers of a Llama-style decoder layer: what 'all-linear' adapts there (the memory model counts
# these).
LORA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraConfig(_Section):
    r: int = Field(16, ge=1, le=1024, description="LoRA rank.")
    alpha: float = Field(32.0, gt=0, description="LoRA scaling numerator: the update is (alpha / r) * B A.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA input (0 keeps rollouts and training on the same policy).")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="Module names to adapt, or 'all-linear' for every linear layer but the LM head.")

    @field_validator("target_modules")
    @classmethod
    def _some_modules(cls, value):
        if isinstance(value, list) and not value:  # peft refuses an empty list only once the model is loaded
            raise ValueError("is an empty list; name at least one module (e.g. [q_proj, v_proj]) or write 'all-linear'")
        return value


class DataConfig(_Section):
    train_path: str = Field("", description="Training prompts: a .jsonl, .csv or .parquet file, or a Hugging Face dataset split as hf:NAME[:CONFIG]@SPLIT (e.g. hf:openai/gsm8k:main@train; needs the data extra).")
    eval_path: str = Field("", description="Held-out prompts for evaluation (a file or hf:NAME[:CONFIG]@SPLIT); empty: eval_fraction's split of the training rows, or no evaluation.")
    prompt_field: str = Field("prompt", min_length=1, description="Row field holding the question/prompt text, or a list of chat messages ({role, content}: TRL's conversational format), which the tokenizer's chat template renders as they are.")
    answer_field: str = Field("answer", min_length=1, description="Row field holding the reference answer (text or a finite number); the rewards that read it (math, exact) take it from here alone, and rows need it only when such a reward is on.")
    template: str = Field("{prompt}", description="Python format string applied to each row to make the model input; fields by name.")
    chat_template: bool = Field(False, description="Wrap the templated prompt as a user message with the tokenizer's chat template (rows whose prompt is a list of messages always use it).")
    system_prompt: str = Field("", description="System message used with chat_template, and put first in a message-list prompt that has none.")
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict, description="Extra variables for the tokenizer's chat template, e.g. {enable_thinking: false} for Qwen3 (TRL's chat_template_kwargs); {}: none.")
    on_bad_row: Literal["error", "skip"] = Field("error", description="A row missing a field: stop with an error naming it, or skip and count it.")
    max_prompt_tokens: int = Field(512, ge=1, description="Prompts longer than this (in tokens) are an error, or skipped with on_bad_row=skip.")
    eval_fraction: float = Field(0.0, ge=0, lt=1, description="Without eval_path: hold out this share of the training source's distinct prompts (all their rows) as the held-out set, never trained on; 0: no split.")
    split_seed: int = Field(0, ge=0, description="Seed of the eval_fraction split (separate from seed, so runs with different seeds share one held-out set).")

    @field_validator("chat_template_kwargs")
    @classmethod
    def _own_keys(cls, extra: dict) -> dict:
        taken = sorted(set(extra) & {"conversation", "messages", "tokenize", "add_generation_prompt", "return_dict",
                                     "continue_final_message"})
        if taken:  # the trainer sets these itself
            raise ValueError(f"sets {', '.join(taken)}, which the trainer passes to apply_chat_template itself")
        return extra

    @field_validator("template")
    @classmethod
    def _template(cls, template: str) -> str:
        problem = _template_problem(template)
        if problem:
            raise ValueError(problem)
        return template

    @model_validator(mode="after")
    def _sources(self) -> "DataConfig":
        from .hub import HubSpecError, is_hub, parse

        problems = []
        for name in ("train_path", "eval_path"):
            value = getattr(self, name)
            if is_hub(value):
                try:
                    parse(value)
                except HubSpecError as exc:
                    problems.append((name, str(exc)))
        if self.eval_fraction and self.eval_path:
            problems.append(("eval_fraction", "splits the training rows only when eval_path is empty; "
                                              "set one of eval_path or eval_fraction"))
        if self.eval_path and _same_source(self.train_path, self.eval_path):   # found by a red team
            problems.append(("eval_path", f"is the same data as train_path ({self.eval_path!r} and "
                                          f"{self.train_path!r}): evaluation would score prompts the model trains on; "
                                          "name another file, or leave eval_path empty and set eval_fraction to hold "
                                          "out a share of them"))
        if problems:
            raise FieldProblems(problems)
        return self


def _same_source(a: str, b: str) -> bool:
    """Whether two data paths name one source: the same text, or one file by two paths (a link, '..')."""
    import os

    if a == b:
        return True
    try:
        return os.path.samefile(os.path.expanduser(a), os.path.expanduser(b))
    except (OSError, ValueError):   # either is not there (yet), or a hub split
        return False


def _template_problem(template: str) -> Optional[str]:
    """data.template's syntax, checked here so that `validate` reports it rather than every row at train time."""
    import string

    try:
        parts = [(name, conversion) for _, name, _, conversion in string.Formatter().parse(template) if name is not None]
        fields = [name for name, _ in parts]
        bad = [c for _, c in parts if c not in (None, "r", "s", "a")]  # parse() accepts any; format() would not
        if bad:
            raise ValueError(f"unknown conversion '!{bad[0]}' (allowed: !r, !s, !a)")
    except ValueError as exc:
        return (f"is not a valid format string ({exc}); row fields go in braces, e.g. 'Q: {{question}}\\nA:', "
                "and a literal brace is doubled ({{ or }})")
    if not fields:  # every row would render to the same prompt: training on it is silently meaningless
        return (f"names no row field ({template!r}), so every prompt would be the same text; "
                "put {prompt} or another row field in braces")
    positional = [f for f in fields if not f or f.split(".")[0].split("[")[0].isdigit()]
    if positional:
        return f"has a positional field {{{positional[0]}}}; fields are filled by name: {{prompt}} or another row field"
    return None


# The bound on |weight|. Found by a red team: a weight of 1e200 made totals whose group std overflowed, so every
# advantage was 0 (what user_code.MAX_SCORE = 1e100 prevents for the scores themselves). A score times 1e6 is at most
# 1e106: squared and summed over a group of 256 it stays far below float64's 1.8e308; and a weight a million times
# another's leaves that other function no say anyway.
MAX_REWARD_WEIGHT = 1e6


class RewardSpec(_Section):
    function: str = Field(..., description="A built-in reward (see the reward options table) or 'package.module:function'.")
    weight: float = Field(1.0, description="Weight of this reward in the sum that makes the total reward (within "
                          f"+-{MAX_REWARD_WEIGHT:.0f}).")
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="The reward's options: a built-in's are checked against its schema (the reward "
        "options table); a user function gets them as keyword arguments, each one a parameter it accepts.")
    convention: Literal["auto", "lowmem", "trl"] = Field(
        "auto", description="How a user function is called. lowmem: f(completions, *, prompts, rows, each kwarg), text, "
        "None = skip the completion. trl: as TRL's GRPOTrainer calls reward functions (keywords: prompts, completions, "
        "completion_ids, trainer_state, each dataset column by name; chat rows as message lists; None = does not apply). "
        "auto: lowmem when the function has a parameter named rows, else trl when it takes completions by keyword "
        "(else an error). Built-ins: auto or lowmem.")

    @field_validator("weight")
    @classmethod
    def _weight_bound(cls, value: float) -> float:
        if abs(value) > MAX_REWARD_WEIGHT:
            raise ValueError(f"must be within +-{MAX_REWARD_WEIGHT:.0f}: a total that large overflows the advantages' "
                             "standard deviation; rescale the weights")
        return value

    @field_validator("kwargs")
    @classmethod
    def _builtin_options(cls, kwargs: dict, info: ValidationInfo) -> dict:
        # imported here, not at the top: the rewards package uses this module's types
        from .rewards.options import option_problems

        function = info.data.get("function")
        problems = option_problems(function, kwargs) if isinstance(function, str) else []
        if problems:
            raise FieldProblems(problems)
        return kwargs

    @model_validator(mode="after")
    def _builtin_convention(self) -> "RewardSpec":
        from .rewards.options import BUILTINS

        if self.convention == "trl" and self.function in BUILTINS:
            raise FieldProblems([("convention", f"built-in reward {self.function!r} takes lowmem-grpo's convention; "
                                                "allowed here: auto, lowmem")])
        return self


class RewardsConfig(_Section):
    functions: list[RewardSpec] = Field(
        default_factory=lambda: [RewardSpec(function="math")],
        description="Reward functions; the total reward is their weighted sum (plus an environment's reward, "
        "docs/algorithm.md §20). Empty only with environment.name: rewards from the environment alone.")
    on_error: Literal["raise", "zero"] = Field(
        "raise", description="A reward function that raises or returns bad values: stop with an error, or score 0 and count it.")


class GenerationConfig(_Section):
    engine: Literal["hf", "vllm"] = Field("hf", description="Rollout engine: transformers generate, or in-process vLLM on the trainer's modules.")
    num_generations: int = Field(8, ge=2, le=256, description="G: completions sampled per prompt (a group).")
    max_new_tokens: int = Field(256, ge=1, description="Completion length cap; longer completions are cut and flagged truncated.")
    temperature: float = Field(1.0, gt=0, le=10, description="Sampling temperature (log-probs in the loss use the same one; docs/algorithm.md §11).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, description="Top-k sampling cut; 0 disables it.")
    repetition_penalty: float = Field(1.0, gt=0, description="Divides the positive logits (multiplies the negative ones) of every token already in the prompt or the completion, before temperature, as transformers and vLLM define it; 1 disables it. The trainer's log-probs do not apply it (as TRL's do not): algorithm.sampler_correction can weigh the difference.")
    min_p: float = Field(0.0, ge=0, le=1, description="Min-p sampling cut, after temperature: tokens below min_p x the most likely token's probability are dropped (Unsloth's GRPO notebooks use 0.1); 0 disables it.")
    kv_cache_memory_bytes: int = Field(
        1 << 30, ge=1 << 20, description="engine=vllm: bytes of KV cache, allocated once at start-up (vLLM would "
        "otherwise take most of the GPU, or of the machine on CPU); too small only makes vLLM preempt and recompute.")

    @model_validator(mode="after")
    def _engine_limits(self) -> "GenerationConfig":
        # vLLM raises a temperature in (0, 0.01) to 0.01 (its warning hidden): it would sample and report
        # log-probs at another temperature than the trainer's (found by a red team)
        if self.engine == "vllm" and self.temperature < VLLM_MIN_TEMPERATURE:
            raise FieldProblems([("temperature", f"is {self.temperature:g}, below {VLLM_MIN_TEMPERATURE:g}, the lowest "
                                                 "vLLM samples at (it raises a lower one to that, while the trainer's "
                                                 f"log-probs would use {self.temperature:g}); set temperature >= "
                                                 f"{VLLM_MIN_TEMPERATURE:g}, or use engine: hf")])
        return self


VLLM_MIN_TEMPERATURE = 0.01   # vllm/sampling_params.py's _MAX_TEMP (0.32)


class EnvironmentConfig(_Section):
    """docs/algorithm.md §20: multi-turn rollouts driven by an environment (either rollout engine)."""

    name: str = Field(
        "", description="The environment, as 'package.module:Class' (reset(row) -> first message or None; step(model_text) "
        "-> (observation, reward, done); a class attribute `stop` lists strings that end a model turn besides EOS), or "
        "python (the built-in tool: code between <python> and </python> runs in the sandbox; kwargs timeout_s, "
        "max_output_chars, memory_mb, allow_weak_sandbox, call_format: tags (default) or tool_call for the "
        "Hermes/Qwen <tool_call> JSON format; it gives no reward, so list reward functions); one instance per "
        "completion, driven by the trainer in training and eval (docs/algorithm.md §20). Empty (default): none, "
        "single-turn rollouts.")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the environment's constructor.")
    max_turns: int = Field(4, ge=1, description="At most this many model turns per completion; an episode the "
                                                "environment has not ended by then is cut (truncated).")
    max_total_tokens: int = Field(
        512, ge=1, description="At most this many tokens (model and environment) per completion; a model turn is "
        "also capped at generation.max_new_tokens. An episode that fills it is cut (truncated).")
    observation_max_tokens: int = Field(128, ge=1, description="An observation is cut to this many tokens before "
                                                               "it is appended.")
    observation_template: str = Field(
        "\n{observation}\n", description="How an observation is written into the completion (a Python format string "
        "with the one field {observation}); tokenized without special tokens.")
    step_timeout_s: float = Field(
        60.0, gt=0, description="A step() (or the constructor, reset() or counters()) that has not returned after "
        "this many seconds ends its episode as an environment error (counted in env/errors), so that user code "
        "cannot hang the run.")
    reward_weight: float = Field(
        1.0, description="Weight of the environment's summed reward in the total, as a reward function named "
        "'environment' (logged as reward/environment; a completion it gave no reward counts it as not applicable).")

    @model_validator(mode="after")
    def _fields(self) -> "EnvironmentConfig":
        problems = []
        from .environment import BUILTINS   # (here: the environment module reads this one's types)

        if self.name and ":" not in self.name and self.name not in BUILTINS:
            problems.append(("name", f"expected a built-in ({', '.join(sorted(BUILTINS))}) or 'package.module:Class' "
                                     f"(or empty for no environment), got {self.name!r}"))
        example = "e.g. '\\n{observation}\\n'"
        try:
            self.observation_template.format(observation="x")
            if "{observation}" not in self.observation_template:
                problems.append(("observation_template", f"must contain {{observation}}, {example}"))
        except (KeyError, IndexError, ValueError, AttributeError, TypeError) as exc:
            problems.append(("observation_template", f"must be a format string whose one field is {{observation}}, "
                                                     f"{example} (formatting it failed: {exc!r})"))
        if problems:
            raise FieldProblems(problems)
        return self


class FieldProblems(ValueError):
    """Cross-field problems of one section, each as (field, message), so that errors name the field."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        super().__init__("; ".join(f"{k}: {m}" for k, m in problems))


class AlgorithmConfig(_Section):
    """docs/algorithm.md §1-§18. The defaults are GRPO as DeepSeekMath wrote it (docs/algorithm.md §1)."""

    advantage: Literal["mean_std", "mean", "sign", "rloo"] = Field("mean_std", description="Group advantage (docs/algorithm.md §2): GRPO's mean_std, Dr. GRPO's mean, sign, or rloo.")
    sign_dead_band: float = Field(0.0, ge=0, description="advantage: sign only: rewards within this distance of the group mean get advantage 0.")
    kl_target: Literal["ref", "mirror", "both", "none"] = Field(
        "ref", description="KL penalty (docs/algorithm.md §4): to the reference (adapters off), to the policy that sampled the batch (mirror; needs mu > 1), both, or none (no reference pass).")
    beta: float = Field(0.04, ge=0, description="Weight of the KL to the reference; must be > 0 when kl_target is ref or both.")
    beta_mirror: float = Field(0.04, ge=0, description="Weight of the KL to the sampling policy; used when kl_target is mirror or both, where it must be > 0.")
    kl_ratio_weight: bool = Field(
        False, description="Multiply the KL to the reference by the importance ratio, with its gradient, so that the "
        "k3 term's gradient is beta * r * (lp - lp_ref), the unbiased reverse-KL gradient (DeepSeek-V3.2; TRL's "
        "use_bias_correction_kl, on by default there; docs/algorithm.md §4.4). Changes the gradient even at mu: 1.")
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k3", description="Per-token KL estimator (Schulman 2020; docs/algorithm.md §4): k1 = log-ratio, k2 = half squared log-ratio, k3 = GRPO's exp(-d) + d - 1.")
    clip: Literal["ratio", "target", "cispo", "sapo", "vespo", "gmpo"] = Field(
        "ratio", description="Surrogate clip (docs/algorithm.md §6, §14): ratio window [1 - epsilon_low, 1 + epsilon_high], target probabilities sqrt(pi_old) (A > 0) / pi_old^2 (A < 0) (needs mu > 1), cispo: a detached importance weight capped at cispo_max_weight times the log-prob, so that every token keeps a gradient, sapo: a soft sigmoid gate of the ratio in place of the clip (sapo_temperature_pos/neg), vespo: a detached Gamma-shaped weight of the completion's ratio (the product of its token ratios) times the log-prob (vespo_k_*/vespo_lambda_*; §14.2), or gmpo: the geometric mean of the completion's token ratios, each clipped in log space on its advantage's side (gmpo_epsilon_low/high), times the advantage (§14.3).")
    epsilon_low: float = Field(0.2, gt=0, lt=1, description="Ratio clip: lower bound is 1 - epsilon_low.")
    epsilon_high: float = Field(0.2, gt=0, description="Ratio clip: upper bound is 1 + epsilon_high ('clip-higher' uses > epsilon_low).")
    aggregation: Literal["sequence_mean", "token_mean", "constant", "sum", "sequence_sum"] = Field(
        "sequence_mean", description="How token losses become one number (docs/algorithm.md §5): the mean over completions of each one's token mean (sequence_mean), the mean over the batch's tokens (token_mean), the token sum over completions x max_new_tokens (constant), the plain sum (sum), or the mean over completions of each one's token sum (sequence_sum: LUSPO, a completion's loss times its length).")
    mu: int = Field(1, ge=1, le=64, description="Passes over a batch of rollouts, each an optimizer update per mini-batch; more than one update a step computes old log-probs once, without grad (docs/algorithm.md §7).")
    minibatches: int = Field(1, ge=1, le=64, description="Mini-batches a batch of rollouts is cut into, in order, an optimizer update each: a step makes mu x minibatches updates from one generation (TRL's steps_per_generation / gradient_accumulation_steps; docs/algorithm.md §7). Each update's loss is normalised over its own mini-batch.")
    early_stop_unclipped_fraction: float = Field(
        0.0, ge=0, le=1, description="mu > 1 (docs/algorithm.md §7): stop a batch's updates once the fraction of tokens with A != 0 not yet clipped falls below this; 0: off.")
    early_stop_min_improvement: Optional[float] = Field(
        None, ge=0, description="mu > 1 (docs/algorithm.md §7): stop a batch's updates once one improved the objective on the batch by less than this; null: off.")
    skip_zero_std_groups: bool = Field(False, description="Skip groups whose rewards are all equal (they give no policy gradient; docs/algorithm.md §9).")
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="advantage: mean_std only (docs/algorithm.md §17): divide by each group's reward std (group), "
        "by the whole batch's (batch), or not at all (none, the same as advantage: mean).")
    reward_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = Field(
        "sum_then_normalize", description="With several reward functions (docs/algorithm.md §17): advantages of the weighted "
        "sum of the rewards, or the weighted sum of each function's own group advantages, rescaled by its batch std (GDPO).")
    importance_sampling_level: Literal["token", "sequence"] = Field(
        "token", description="Importance ratio per token, or per sequence: GSPO's length-normalised sequence ratio, "
        "clipped per sequence with sequence_epsilon_low/high (docs/algorithm.md §13).")
    sequence_epsilon_low: float = Field(3e-4, gt=0, lt=1, description="importance_sampling_level: sequence: lower clip bound 1 - this (the GSPO paper's 3e-4).")
    sequence_epsilon_high: float = Field(4e-4, gt=0, description="importance_sampling_level: sequence: upper clip bound 1 + this (the GSPO paper's 4e-4).")
    sapo_temperature_pos: float = Field(1.0, gt=0, description="clip: sapo (docs/algorithm.md §14): the gate's temperature for A > 0 (TRL's default).")
    sapo_temperature_neg: float = Field(1.05, gt=0, description="clip: sapo: the gate's temperature for A <= 0; higher fades a negative token's gradient faster as its ratio leaves 1 (TRL's default).")
    cispo_max_weight: float = Field(5.0, gt=1, description="clip: cispo (docs/algorithm.md §14): the detached importance weight is capped at this (ScaleRL's 5.0).")
    vespo_k_pos: float = Field(2.0, gt=0, description="clip: vespo (docs/algorithm.md §14.2): the power k of the weight phi(w) = exp(lambda + k log w - lambda w) for A >= 0; larger fades completions the policy made less likely (w < 1) faster (TRL's default).")
    vespo_lambda_pos: float = Field(3.0, gt=0, description="clip: vespo: the decay lambda of the weight for A >= 0; larger fades completions the policy made more likely (w > 1) faster (TRL's default).")
    vespo_k_neg: float = Field(3.0, gt=0, description="clip: vespo: the power k of the weight for A < 0 (TRL's default).")
    vespo_lambda_neg: float = Field(2.0, gt=0, description="clip: vespo: the decay lambda of the weight for A < 0 (TRL's default).")
    # GMPO's own bounds, not epsilon_low/high: those bound the ratio, [1 - eps, 1 + eps]; GMPO's bound the log-ratio,
    # [e^-eps, e^eps], with another default (0.4), so one key meaning either window by clip would mislead (§14.3)
    gmpo_epsilon_low: float = Field(0.4, gt=0, description="clip: gmpo (docs/algorithm.md §14.3): a token of a completion with A < 0 counts its log-ratio as at least -this, in log space: the ratio's lower bound is exp(-this), 0.67 at the default (TRL's GMPOConfig epsilon).")
    gmpo_epsilon_high: float = Field(0.4, gt=0, description="clip: gmpo: a token of a completion with A > 0 counts its log-ratio as at most this, in log space: the ratio's upper bound is exp(this), 1.49 at the default (TRL's GMPOConfig epsilon_high, which defaults to epsilon).")
    delta: Optional[float] = Field(
        None, description="clip: ratio: two-sided clip (docs/algorithm.md §14): the unclipped ratio term is capped at delta, "
        "which bounds the loss of a negative-advantage token whose ratio ran away; must be > 1 + epsilon_high; null: off.")
    sampler_correction: Literal["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = Field(
        "none", description="Correct for the gap between the rollout engine's log-probs and the trainer's at the same weights "
        "(docs/algorithm.md §15): weight each token's policy term by the ratio, per token or per sequence, capped at "
        "sampler_correction_max (truncate) or dropped outside [sampler_correction_min, sampler_correction_max] (mask). "
        "With clip: vespo the token_* weights enter its completion ratio instead (§14.2).")
    sampler_correction_min: float = Field(0.0, ge=0, description="sampler_correction *_mask: tokens (sequences) whose ratio is below this are dropped.")
    sampler_correction_max: float = Field(3.0, gt=0, description="sampler_correction: the truncation cap (truncate), or the ratio above which tokens (sequences) are dropped (mask).")
    off_policy_mask_threshold: Optional[float] = Field(
        None, ge=0, description="DeepSeek-V3.2's off-policy sequence mask (docs/algorithm.md §15; TRL's "
        "off_policy_mask_threshold): a completion with A < 0 whose mean log(pi_sampler / pi) over its tokens is above "
        "this gets no policy gradient (pi_sampler: the engine's log-probs, or the old policy's); null: off.")
    mask_truncated_completions: bool = Field(
        False, description="Leave completions cut at max_new_tokens out of the update (they keep their place in their "
        "group's advantage statistics; DAPO; docs/algorithm.md §16).")
    top_entropy_quantile: float = Field(
        1.0, gt=0, le=1, description="Only this top fraction of the batch's tokens by entropy (at the rollout weights) get "
        "policy gradient (docs/algorithm.md §16); 1: all. With mu = 1 it costs one no-grad forward.")
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus: the loss gets - entropy_coef x token entropy (docs/algorithm.md §16); 0: off. With entropy_target, the starting value.")
    entropy_target: Optional[float] = Field(
        None, gt=0, description="Adapt entropy_coef toward this mean token entropy (nats) after every step: coef += "
        "entropy_coef_lr x (target - entropy), kept >= 0 (docs/algorithm.md §16); null: a fixed coefficient.")
    entropy_coef_lr: float = Field(0.01, gt=0, description="entropy_target: the coefficient's step per nat of entropy gap.")
    dynamic_sampling: bool = Field(
        False, description="DAPO's dynamic sampling (docs/algorithm.md §18): after the step's rollouts, groups whose rewards "
        "are all equal are discarded and more prompts drawn and rolled out until the step holds prompts_per_step groups "
        "with contrast, or dynamic_sampling_max_draws more draws were made.")
    dynamic_sampling_max_draws: int = Field(
        4, ge=1, le=64, description="dynamic_sampling: at most this many extra draws of prompts_per_step prompts per step; "
        "a step that still lacks groups trains on those it found.")

    @field_validator("scale_rewards", mode="before")
    @classmethod
    def _trl_boolean(cls, value):
        # TRL's GRPOConfig also takes true (= group) and false (= none): its users' recipes keep working
        return {True: "group", False: "none"}.get(value, value) if isinstance(value, bool) else value

    @property
    def updates_per_step(self) -> int:
        """Optimizer updates a step makes (the learning-rate schedule counts them; TRL's global_step too)."""
        return self.mu * self.minibatches

    @model_validator(mode="after")
    def _combinations(self) -> "AlgorithmConfig":
        problems = []
        one = "with mu = 1 and minibatches = 1 the only update starts at the sampling policy (r = 1)"
        if self.kl_target in ("mirror", "both") and self.updates_per_step == 1:
            problems.append(("kl_target", f"{self.kl_target!r} penalises KL to the policy that sampled the batch, but "
                                          f"{one}: nothing to compare; set mu > 1, or kl_target ref or none"))
        if self.kl_target in ("ref", "both") and self.beta == 0:
            problems.append(("beta", f"must be > 0 with kl_target {self.kl_target!r}; "
                                     "for no KL to the reference set kl_target: none"))
        if self.kl_target in ("mirror", "both") and self.beta_mirror == 0:
            problems.append(("beta_mirror", f"must be > 0 with kl_target {self.kl_target!r}"))
        if self.kl_ratio_weight and self.kl_target not in ("ref", "both"):
            problems.append(("kl_ratio_weight", f"weights the KL to the reference, and kl_target {self.kl_target!r} has none"))
        if self.clip == "target":
            if self.updates_per_step == 1:
                problems.append(("clip", f"'target' never binds: {one}, short of every target; set mu > 1"))
            for name in ("epsilon_low", "epsilon_high"):  # compared with the default: a saved recipe lists every field
                if getattr(self, name) != type(self).model_fields[name].default:
                    problems.append((name, "is a bound of the ratio clip, which clip: target does not use"))
        if self.early_stop_unclipped_fraction > 0 and self.updates_per_step == 1:
            problems.append(("early_stop_unclipped_fraction", "stops the later of a batch's updates; with mu = 1 and "
                                                              "minibatches = 1 there are none: set mu > 1"))
        if self.early_stop_min_improvement is not None and self.mu == 1:   # a mini-batch against its last pass
            problems.append(("early_stop_min_improvement", "compares a pass over the batch with the one before; "
                                                           "with mu = 1 there is none: set mu > 1"))
        problems += self._new_option_problems()
        if problems:
            raise FieldProblems(problems)
        return self

    def _new_option_problems(self) -> list[tuple[str, str]]:
        """The combinations of the options of docs/algorithm.md §13-§18 that cannot work."""
        problems = []
        default = type(self).model_fields
        if self.scale_rewards != "group" and self.advantage != "mean_std":
            problems.append(("scale_rewards", f"applies to advantage mean_std only (got advantage {self.advantage!r})"))
        if self.importance_sampling_level == "sequence":
            if self.clip == "target":
                problems.append(("importance_sampling_level", "'sequence' with clip: target is not defined; use clip ratio, cispo or sapo"))
            if self.clip == "vespo":   # §14.2
                problems.append(("importance_sampling_level", "clip: vespo weights by the completion's own ratio (the "
                                                              "product of its token ratios) at any level; leave it token"))
            if self.clip == "gmpo":   # §14.3
                problems.append(("importance_sampling_level", "clip: gmpo takes the geometric mean of the completion's "
                                                              "clipped token ratios itself; leave it token"))
            for name in ("epsilon_low", "epsilon_high"):
                if getattr(self, name) != default[name].default:
                    problems.append((name, f"is the token-level clip bound; at importance_sampling_level sequence set "
                                           f"sequence_{name} instead"))
        else:
            for name in ("sequence_epsilon_low", "sequence_epsilon_high"):
                if getattr(self, name) != default[name].default:
                    problems.append((name, "is used only with importance_sampling_level: sequence"))
        if self.clip in ("cispo", "sapo", "vespo", "gmpo"):
            instead = "; its log-space bounds are gmpo_epsilon_low/high" if self.clip == "gmpo" else ""
            for name in ("epsilon_low", "epsilon_high"):
                if getattr(self, name) != default[name].default:
                    problems.append((name, f"is a bound of the ratio clip, which clip: {self.clip} does not use{instead}"))
        if self.clip != "cispo" and self.cispo_max_weight != default["cispo_max_weight"].default:
            problems.append(("cispo_max_weight", "is used only with clip: cispo"))
        if self.clip != "sapo":
            for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
                if getattr(self, name) != default[name].default:
                    problems.append((name, "is used only with clip: sapo"))
        if self.clip != "vespo":
            for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
                if getattr(self, name) != default[name].default:
                    problems.append((name, "is used only with clip: vespo"))
        elif self.sampler_correction.startswith("sequence_"):   # §14.2: VESPO takes the token correction into w
            problems.append(("sampler_correction", f"{self.sampler_correction!r} with clip: vespo: VESPO puts the "
                                                   "correction into its completion ratio token by token; use "
                                                   "token_truncate or token_mask"))
        problems += self._gmpo_problems()
        if self.delta is not None:
            if self.clip != "ratio":
                problems.append(("delta", f"caps the ratio clip's unclipped term; clip is {self.clip!r}"))
            else:
                bound = 1 + (self.sequence_epsilon_high if self.importance_sampling_level == "sequence" else self.epsilon_high)
                if self.delta <= bound:
                    problems.append(("delta", f"must be > 1 + the upper clip epsilon ({bound:g}), got {self.delta:g}"))
        if self.sampler_correction.endswith("_mask") and self.sampler_correction_min >= self.sampler_correction_max:
            problems.append(("sampler_correction_min", f"must be below sampler_correction_max ({self.sampler_correction_max:g})"))
        if self.dynamic_sampling and self.skip_zero_std_groups:
            problems.append(("skip_zero_std_groups", "dynamic_sampling already keeps zero-variance groups out of the "
                                                     "update (it replaces them); set one of the two"))
        return problems

    def _gmpo_problems(self) -> list[tuple[str, str]]:
        """GMPO's bounds only with clip: gmpo; and with it, no per-token weight of the policy term (§14.3): every token
        of a completion carries the completion's one term, and moves through its geometric mean whatever its own
        weight, so a token weight or mask would not do what §15's token_* modes and §16's token selection say."""
        default = type(self).model_fields
        if self.clip != "gmpo":
            return [(name, "is used only with clip: gmpo") for name in ("gmpo_epsilon_low", "gmpo_epsilon_high")
                    if getattr(self, name) != default[name].default]
        problems = []
        if self.sampler_correction.startswith("token_"):
            problems.append(("sampler_correction", f"{self.sampler_correction!r} weights single tokens, and with "
                                                   "clip: gmpo a token carries its completion's term; use "
                                                   "sequence_truncate or sequence_mask"))
        if self.top_entropy_quantile < 1:
            problems.append(("top_entropy_quantile", "selects tokens, and with clip: gmpo every token of a completion "
                                                     "moves through its geometric mean; leave it 1"))
        return problems


def algorithm_values(field: str) -> tuple[str, ...]:
    """The values algorithm.<field> may take: its Literal above, the one list of them (loss.py and advantages.py
    read it; tests check each value has its branch there)."""
    return get_args(AlgorithmConfig.model_fields[field].annotation)


class OptimizerConfig(_Section):
    name: Literal["adamw", "adamw_8bit"] = Field("adamw", description="AdamW (torch) or bitsandbytes 8-bit AdamW (GPU).")
    lr: float = Field(1e-5, gt=0, le=1, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.99), description="AdamW betas.")
    max_grad_norm: float = Field(1.0, ge=0, description="Clip the global gradient norm to this; 0 disables clipping.")
    schedule: Literal["constant", "linear", "cosine"] = Field("constant", description="Learning-rate schedule after warm-up.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps from 0 to lr.")

    @field_validator("betas", mode="before")
    @classmethod
    def _two_betas(cls, betas):   # else pydantic reports the missing one as "optimizer.betas.1: Field required"
        if not isinstance(betas, (list, tuple)) or len(betas) != 2:   # (the message adds a value not in a list)
            raise ValueError("needs two numbers [beta1, beta2], e.g. [0.9, 0.99]"
                             + (f"; got {list(betas)}" if isinstance(betas, (list, tuple)) else ""))
        return betas

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas):
        if not all(0 <= b < 1 for b in betas):  # torch.optim.AdamW would raise this only when the run starts
            raise ValueError(f"each beta must be >= 0 and < 1, got {list(betas)}")
        return betas


class TrainConfig(_Section):
    steps: int = Field(100, ge=1, description="Optimizer steps per mu (i.e. batches of rollouts) to run.")
    prompts_per_step: int = Field(4, ge=1, description="Prompts per batch; the batch holds prompts_per_step * num_generations completions.")
    micro_batch_size: int = Field(4, ge=1, description="Completions per forward/backward; gradients accumulate over micro-batches.")
    share_prompts: Literal["auto", False] = Field(
        "auto", description="auto: in the update's passes, a micro-batch's completions of one prompt share one copy of "
        "it (a per-query attention mask and position ids; same log-probs, fewer tokens) where that saves a fifth of "
        "the tokens and rows stay <= 512 wide, with sdpa or eager attention and no narrower sliding window "
        "(docs/algorithm.md §12); false: one row "
        "per completion.")
    offload_activations: bool = Field(
        False, description="With gradient checkpointing, keep each decoder layer's checkpointed input in pinned CPU "
        "memory between the forward and the backward (copied asynchronously on CUDA) instead of on the GPU: frees "
        "num_layers x micro_batch_size x sequence x hidden x 2 bytes of VRAM for long completions, at the cost of "
        "PCIe transfers (docs/algorithm.md §22). A no-op on CPU. Default false.")
    logprob_chunk_tokens: int = Field(1024, ge=1, description="Rows (tokens) per tile of the chunked log-prob kernel (docs/algorithm.md §10).")
    logprob_chunk_vocab: int = Field(8192, ge=1, description="Vocabulary columns per tile of the chunked log-prob kernel (a tile is chunk_tokens x chunk_vocab fp32: 32 MiB at the defaults).")
    preflight: bool = Field(True, description="Before step 1, one forward/backward at the longest prompt + max_new_tokens and a full micro-batch, so an out-of-memory shows at once, with advice.")
    eval_every: int = Field(0, ge=0, description="Evaluate held-out accuracy every N steps; 0: only at the end.")
    eval_max_prompts: int = Field(200, ge=1, description="Held-out prompts used per evaluation (greedy decoding).")
    eval_at_start: bool = Field(True, description="Evaluate the held-out set before the first step (the run's 'before' "
                                "accuracy); false: no step-0 eval. Default true.")
    update_diagnostics_every: int = Field(
        10, ge=0, description="Every N steps, after the update, recompute the batch's log-probs (one no-grad forward, "
        "about a tenth of a step) to log how far preferred and dispreferred completions moved (docs/algorithm.md §8); "
        "other steps' rows hold null there. 0: never. Default 10.")
    max_nonfinite_steps: int = Field(
        3, ge=1, description="Stop the run with an error after this many steps in a row whose loss or gradient is NaN/inf "
        "(each such step is skipped: no optimizer step; it is checkpointed as any other, with the weights unchanged); default 3.")
    collective_timeout_s: float = Field(
        1800.0, gt=0, description="Under torchrun (several processes, docs/algorithm.md §21): how long a process waits "
        "for the others at an exchange before it fails the job. Covers a process that hangs; one that exits or is "
        "killed is stopped by torchrun at once. Above the longest step phase one process can lag the others by "
        "(a rollout, an eval). Default 1800.")


class OutputConfig(_Section):
    dir: str = Field("runs/run", min_length=1, description="Run directory: metrics.jsonl, checkpoints/, recipe.yaml.")
    save_every: int = Field(50, ge=1, description="Write a checkpoint every N steps (and at the end).")
    keep_last: int = Field(2, ge=1, description="Checkpoints kept on disk; older ones are deleted after a new one is complete.")
    log_every: int = Field(1, ge=1, description="Print a summary line every N steps.")
    progress: Literal["auto", "bar", "lines"] = Field(
        "auto", description="auto (default): a live progress bar (rate, ETA) when stderr is a terminal, else only the "
        "summary lines; bar: always the bar; lines: never the bar.")
    tensorboard: Literal["auto", True, False] = Field(
        "auto", description="Write TensorBoard events to RUN/tensorboard: auto (default) = when tensorboard is installed; "
        "true = required (an error if not installed); false = off.")
    wandb_project: str = Field("", description="Weights & Biases project to log to (needs `pip install wandb`); empty (default): off.")
    samples_every: int = Field(
        10, ge=0, description="Every N steps, log a table of sample completions with their per-function rewards "
        "(RUN/samples.jsonl, plus TensorBoard/W&B when on); 0: off. Default 10.")


class Recipe(_Section):
    model: ModelConfig = Field(default_factory=ModelConfig, description="Base model and quantization.")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA adapters (the trained parameters).")
    data: DataConfig = Field(default_factory=DataConfig, description="Prompt data.")
    rewards: RewardsConfig = Field(default_factory=RewardsConfig, description="Verifiable rewards.")
    generation: GenerationConfig = Field(default_factory=GenerationConfig, description="Rollout sampling.")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="GRPO objective.")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="Optimizer and schedule.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Batch sizes and loop length.")
    output: OutputConfig = Field(default_factory=OutputConfig, description="Where the run writes.")
    environment: EnvironmentConfig = Field(default_factory=EnvironmentConfig, description="Multi-turn rollouts (an environment).")
    # le: numpy's seed (vLLM seeds it) takes 32 bits, torch.manual_seed 64; a larger one fails only at start-up
    seed: int = Field(0, ge=0, le=2**32 - 1, description="Seed for data order, sampling and initialisation.")

    @model_validator(mode="after")
    def _across_sections(self) -> "Recipe":
        from .rewards.options import BUILTINS, first_function_problem

        problems = []
        # a completion's most tokens: with an environment, the episode's (overlong's L_max defaults to it, and its own
        # options cannot see it)
        longest, longest_key = (self.generation.max_new_tokens, "generation.max_new_tokens")
        if self.environment.name:
            longest, longest_key = self.environment.max_total_tokens, "environment.max_total_tokens"
        for i, spec in enumerate(self.rewards.functions):
            check = BUILTINS[spec.function].budget_problem if spec.function in BUILTINS else None
            found = check(spec.kwargs, longest, longest_key) if check is not None else None
            if found:
                problems.append((f"rewards.functions.{i}.kwargs.{found[0]}", found[1]))
        first, _ = first_function_problem([f.function for f in self.rewards.functions], bool(self.environment.name))
        if first:   # (a note where the task's reward may be a user function's or the environment's: cli validate)
            problems.append(("rewards.functions.0.function", first))
        if self.environment.name and abs(self.environment.reward_weight) > MAX_REWARD_WEIGHT:
            problems.append(("environment.reward_weight", f"must be within +-{MAX_REWARD_WEIGHT:.0f}, as a reward "
                             f"function's weight (got {self.environment.reward_weight:g})"))
        problems += self._environment_problems()
        completions = self.train.prompts_per_step * self.generation.num_generations
        if self.algorithm.minibatches > completions:
            problems.append(("algorithm.minibatches", f"cuts a batch's {completions} completions (train.prompts_per_step "
                             f"x generation.num_generations) into {self.algorithm.minibatches} mini-batches: at most "
                             f"{completions}"))
        if self.train.offload_activations and not self.model.gradient_checkpointing:
            problems.append(("train.offload_activations", "moves the checkpointed layer inputs to CPU memory: it needs "
                             "model.gradient_checkpointing: true (without it every activation would cross PCIe)"))
        if self.train.offload_activations and self.model.backend == "unsloth":
            problems.append(("train.offload_activations", "unsloth's own gradient checkpointing already offloads "
                             "(model.backend: unsloth); set it false"))
        if problems:
            raise FieldProblems(problems)
        return self

    def _environment_problems(self) -> list[tuple[str, str]]:
        # (Either engine runs an environment: generation.engine is free here, docs/algorithm.md §20.)
        if not self.environment.name and not self.rewards.functions:
            return [("rewards.functions", "is empty: list at least one reward function, or set environment.name "
                                          "for rewards from an environment alone")]
        from .environment import BUILTINS   # (here: the environment module reads this one's types)

        # The built-in tool only runs code and never rewards (by design): with no function, no completion would
        # ever be scored, and every step would learn nothing.
        builtin_tool = BUILTINS.get(self.environment.name, self.environment.name) == BUILTINS["python"]
        if builtin_tool and not self.rewards.functions:
            return [("rewards.functions", f"is empty, and environment.name {self.environment.name!r} (the built-in "
                                          "Python tool) gives no reward: list at least one reward function that "
                                          "scores the completion (its text holds the calls and their outputs)")]
        return []


# Fields without a usable default. Checked on the raw mapping, so that they are reported together with
# every other problem (pydantic's after-validators only run once the fields themselves are valid).
REQUIRED = [
    ("model", "name_or_path", "is required: a Hugging Face model id or a local model folder"),
    ("data", "train_path", "is required: a .jsonl, .csv or .parquet file of prompts, or hf:NAME[:CONFIG]@SPLIT"),
]


def _missing_required(data: dict) -> list[tuple[str, str]]:
    out = []
    for section, key, msg in REQUIRED:
        node = data.get(section)
        if not isinstance(node, dict) or node.get(key) in (None, ""):
            out.append((f"{section}.{key}", msg))
    return out


class RecipeError(Exception):
    """A recipe that cannot be used. `problems` lists (key path, message) pairs, all of them."""

    def __init__(self, source: str, problems: list[tuple[str, str]]):
        self.source = source
        self.problems = problems
        lines = [f"{source}: {len(problems)} problem(s)"] + [f"  {k}: {m}" for k, m in problems]
        super().__init__("\n".join(lines))


def _allowed(err: dict) -> str:
    """What the user may write instead, from pydantic's error context."""
    ctx = err.get("ctx") or {}
    if err["type"] == "literal_error":
        return f"allowed: {ctx.get('expected')}"
    for key, word in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
        if key in ctx:
            return f"allowed: {word} {ctx[key]}"
    if err["type"] == "extra_forbidden":
        return "unknown key"
    return ""


def _problems_from(exc: ValidationError, data: dict) -> list[tuple[str, str]]:
    problems: list[tuple[str, str]] = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        # For Literal-or-list unions pydantic reports one error per branch, tagged in the path; the path a user
        # reads leaves the tags out. An unknown key is the user's own, last in the path, whatever it spells
        # ('literal[' too), and an empty or blank one is shown quoted.
        untagged = [p for p in loc if not p.startswith(("literal[", "list["))]
        key = ".".join(untagged)
        if err["type"] == "extra_forbidden":
            untagged = [p for p in loc[:-1] if not p.startswith(("literal[", "list["))]
            key = ".".join(untagged + [loc[-1] if loc[-1].strip() else repr(loc[-1])])
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, FieldProblems):  # a section's cross-field check: one problem per named field
            problems += [(f"{key}.{field}" if key else field, m) for field, m in cause.problems
                         if (f"{key}.{field}" if key else field, m) not in problems]
            continue
        msg = err["msg"]
        if err["type"] == "value_error":  # a field validator's own sentence, without pydantic's prefix
            msg = msg.removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            section = ".".join(loc[:-1])
            msg = f"unknown key (known keys{' in ' + section if section else ''}: {', '.join(_known_keys(loc[:-1]))})"
        else:
            extra = _allowed(err)
            got = err.get("input")
            if not isinstance(got, (dict, list)):
                msg = f"{msg} (got {got!r})"
            if err["type"] == "string_type" and got is None:   # null is no text: the empty one is ''
                msg = f"{msg}; for no value write ''"
            if extra and extra not in msg:
                msg = f"{msg}; {extra}"
        if (key, msg) not in problems:
            problems.append((key, msg))
    return problems


def _known_keys(loc: list[str]) -> list[str]:
    model: Any = Recipe
    for part in loc:
        if part.isdigit():
            continue
        field = model.model_fields.get(part)
        if field is None:
            return []
        ann = field.annotation
        inner = getattr(ann, "__args__", None)
        model = inner[0] if inner and isinstance(inner[0], type) and issubclass(inner[0], BaseModel) else ann
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return []
    return sorted(model.model_fields)


def recipe_from_dict(data: Any, source: str = "<recipe>") -> Recipe:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(source, [("<top level>", f"must be a mapping of sections, got {type(data).__name__}")])
    missing = _missing_required(data)
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as exc:
        raise RecipeError(source, missing + _problems_from(exc, data)) from None
    if missing:
        raise RecipeError(source, missing)
    return recipe


def load_recipe(path: str | Path, overrides: Optional[list[str]] = None) -> Recipe:
    """Read and validate a recipe file. `overrides` are 'a.b=value' strings (value parsed as YAML)."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(str(path), [("<file>", "is a directory, not a recipe file" if path.is_dir() else "not found")])
    try:
        data = yaml.load(path.read_bytes().decode("utf-8"), Loader=_UniqueKeyLoader)
    except UnicodeDecodeError as exc:
        raise RecipeError(str(path), [("<file>", f"not UTF-8 text (byte {exc.start}: {exc.reason}); save the recipe "
                                                 "as UTF-8")]) from None
    except OSError as exc:
        raise RecipeError(str(path), [("<file>", f"cannot be read ({exc.strerror or exc})")]) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "?"
        raise RecipeError(str(path), [("<yaml>", f"not valid YAML at {where}: {getattr(exc, 'problem', exc)}")]) from None
    data = data if data is not None else {}
    if isinstance(data, dict):  # else recipe_from_dict names the top level's problem
        for item in overrides or []:
            apply_override(data, item, str(path))
    recipe = recipe_from_dict(data, str(path))
    return _resolve_paths(recipe, path.parent)


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load, except that a key given twice in one mapping is an error: YAML keeps the last one, so a second
    `train:` section would silently drop every setting of the first."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # '<<: *anchor' merges, and may be overridden
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
                seen.setdefault(key, key_node.start_mark.line + 1)
            except TypeError:  # an unhashable key: the base class reports it
                continue
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first at line {first}); YAML would keep only the last one",
                    key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def apply_override(data: dict, item: str, source: str = "<override>") -> None:
    """One --set KEY=VALUE into the raw recipe `data`. KEY is a dotted path, a number in it an entry of a list
    (rewards.functions.0.weight). VALUE is read as YAML, except for a text field, which takes the text as written
    when YAML reads it as something else: 'Q: {prompt}' is a mapping to YAML, 'You are: helpful' one too."""
    if "=" not in item:
        raise RecipeError(source, [(item, "an override must look like section.key=value")])
    key, _, raw = item.partition("=")
    key = key.strip()
    parts = key.split(".")
    kind = _field_annotation(parts)
    if not raw.strip():   # YAML reads nothing as null, which no text field takes
        raise RecipeError(source, [(key, f"--set {key}= gives no value: {_no_value_hint(key, kind)}")])
    node = data
    for depth, part in enumerate(parts[:-1]):
        node = _override_child(node, part, parts[: depth + 1], wants_list=parts[depth + 1].isdigit(), source=source)
    value = _override_value(key, raw, kind, source)
    if isinstance(node, list):
        node[_list_index(node, parts[-1], parts[:-1], source)] = value
    elif isinstance(node, dict):
        node[parts[-1]] = value
    else:
        raise _not_a_section(node, parts, source)


TEXT_FIELDS = (str, Optional[str])


def _override_value(key: str, raw: str, kind, source: str):
    """The value of --set KEY=RAW, for a field of schema type `kind` (None: not a schema field)."""
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        if kind in TEXT_FIELDS:
            return raw
        raise RecipeError(source, [(key, f"value {raw!r} is not valid YAML: {getattr(exc, 'problem', None) or exc}")]) from None
    if kind in TEXT_FIELDS and not isinstance(value, str):
        if value is None and kind is str:   # 'null': the text "null" would be taken for a file or a prompt
            raise RecipeError(source, [(key, f"{raw!r} is no text and {key} takes text: "
                                             f"{_no_value_hint(key, kind)}, or --set '{key}=\"{raw}\"' for the word")])
        if value is not None:
            return raw   # a number, a mapping ('Q: {prompt}'), a list: the text as written is what was meant
    return value


def _no_value_hint(key: str, kind) -> str:
    """What to write for 'no value' in a field of schema type `kind` (shell-quoted, so that '' reaches YAML)."""
    if kind is str:   # e.g. data.eval_path: the empty string is "none" (no held-out file)
        return f"write --set \"{key}=''\" for an empty value"
    if kind is not None and type(None) in getattr(kind, "__args__", ()):
        return f"write --set {key}=null for none"
    return f"give a value, e.g. --set {key}=VALUE"


def _override_child(node, part: str, path: list[str], wants_list: bool, source: str):
    """node[part] on the way down a --set key: a missing section is created; a list is entered by index."""
    where = ".".join(path)
    if isinstance(node, list):
        return node[_list_index(node, part, path[:-1], source)]
    if not isinstance(node, dict):
        raise _not_a_section(node, path, source)
    if wants_list and not isinstance(node.get(part), list):
        state = "is not in the recipe (its default applies)" if node.get(part) is None else \
            f"is {type(node[part]).__name__} {node[part]!r}, not a list"
        raise RecipeError(source, [(where, f"{state}, so it has no numbered entry to set: set the whole list, e.g. "
                                           f"--set '{where}=[...]'")])
    if part not in node or node[part] is None:
        kind = _field_annotation(path)
        if kind is not None and not _holds_keys(kind):   # e.g. rewards.on_error.x: a value, not a section
            name = kind.__name__ if isinstance(kind, type) else str(kind).replace("typing.", "")
            raise RecipeError(source, [(where, f"is a value ({name}), not a section: it has no key to set; write "
                                               f"--set {where}=VALUE")])
        node[part] = {}
    return node[part]


def _not_a_section(node, path: list[str], source: str) -> RecipeError:
    """--set a.b.c=... where the recipe holds a value, not a mapping or list, at a.b."""
    return RecipeError(source, [(".".join(path), f"cannot set a key inside {'.'.join(path[:-1])}: it is "
                                                 f"{type(node).__name__} {node!r}, not a section")])


def _holds_keys(kind) -> bool:
    """Whether a field of schema type `kind` is a section or a mapping (so that KEY.sub can be set in it)."""
    return (isinstance(kind, type) and issubclass(kind, BaseModel)) or get_origin(kind) is dict or kind is Any


def _list_index(items: list, part: str, path: list[str], source: str) -> int:
    """The list entry a --set key names by number: 0 .. len-1, else an error saying which exist."""
    where = ".".join(path)
    if part.isdigit() and int(part) < len(items):
        return int(part)
    have = f"entries 0..{len(items) - 1}" if len(items) > 1 else ("entry 0" if items else "no entries")
    raise RecipeError(source, [(f"{where}.{part}", f"{where} is a list with {have}: no entry {part!r} (an entry is "
                                                   "named by its number; to add one, set the whole list)")])


def _field_annotation(parts: list[str]):
    """The schema type of the field at a --set key path (list entries by number), or None where the path leaves
    the schema (an unknown key, inside a free-form mapping such as rewards.functions.0.kwargs)."""
    model: Any = Recipe
    kind = None
    for part in parts:
        if part.isdigit():
            continue   # an entry of a list of sections: `model` is already the entry's section
        field = model.model_fields.get(part) if model is not None else None
        if field is None:
            return None
        kind = field.annotation
        sections = [a for a in getattr(kind, "__args__", ()) if isinstance(a, type) and issubclass(a, BaseModel)]
        model = kind if isinstance(kind, type) and issubclass(kind, BaseModel) else (sections[0] if sections else None)
    return kind


def prompts_share_problem(prompts_per_step: int, processes: int) -> Optional[str]:
    """Why a step's prompts cannot be shared among `processes` (each takes an equal share, docs/algorithm.md §21),
    or None: what `train --nproc` and `estimate --nproc` refuse."""
    if prompts_per_step % processes == 0:
        return None
    return (f"train.prompts_per_step={prompts_per_step} does not divide among {processes} processes: each takes an "
            f"equal share of a step's prompts; use a multiple of {processes}")


def _resolve_paths(recipe: Recipe, base: Path) -> Recipe:
    """Relative data paths (and a relative model.name_or_path folder) are read relative to the current directory
    when they exist there, else to the recipe's folder (so `recipes/x.yaml` can name `data/x.jsonl` shipped beside
    it)."""
    for attr in ("train_path", "eval_path"):
        value = getattr(recipe.data, attr)
        if value and not value.startswith("hf:") and not Path(value).is_absolute() and not Path(value).exists() and (base / value).exists():
            setattr(recipe.data, attr, str(base / value))
    # model.name_or_path by the same rule (found by a red team: a model folder beside the recipe, named relative to
    # it, was taken for a hub id)
    name = recipe.model.name_or_path
    if name and not Path(name).is_absolute() and not Path(name).exists() and (base / name).is_dir():
        recipe.model.name_or_path = str(base / name)
    return recipe


def recipe_to_yaml(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)


def field_reference() -> list[tuple[str, str, str, str]]:
    """(key path, type, default, meaning) for every leaf field, in declaration order: the README table."""
    rows = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                walk(ann, f"{prefix}{name}.")
                continue
            if name == "functions" and model is RewardsConfig:
                walk(RewardSpec, f"{prefix}{name}[].")
            if field.default_factory is not None:
                default = field.default_factory()
                default = [d.model_dump() if isinstance(d, BaseModel) else d for d in default] if isinstance(default, list) else default
            else:
                default = "(required)" if field.is_required() else field.default
            type_name = str(ann).replace("typing.", "").replace("<class '", "").replace("'>", "")
            # (a string with a newline, e.g. environment.observation_template, is shown escaped: one table row)
            shown = f"'{default}'" if isinstance(default, str) and default.isprintable() else repr(default)
            rows.append((prefix + name, type_name, shown,
                         field.description or ""))

    walk(Recipe, "")
    return rows
