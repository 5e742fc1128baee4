"""lowmem_grpo.trl: TRL's GRPOTrainer API. TRL's defaults as the installed TRL has them, the settings mapped onto
recipe keys as the README's "Coming from TRL" table states (by hand), what cannot carry over refused by name, and a
TRL-shaped script (a datasets.Dataset, reward functions called TRL's way, a peft LoraConfig) trained end to end."""

from __future__ import annotations

import functools
import json
import logging
import math
import re
from pathlib import Path

import pytest

from lowmem_grpo.metrics import read_metrics
from lowmem_grpo.recipe import recipe_from_dict
from lowmem_grpo.trl import (TRL_DEFAULTS, TRL_UNSET_DEFAULTS, GRPOConfig, GRPOTrainer, TRLCompatError, _given_settings,
                              _lora_section, _reward_specs, _trl_log_keys, recipe_from_trl)
from test_trl_options import _trl_configs

SPEC = [{"function": "m:f", "convention": "trl"}]


def _recipe(rows: int = 10, **settings) -> dict:
    return recipe_from_trl(settings, model="m", train_path="t.jsonl", reward_specs=SPEC, train_rows=rows)


def test_the_defaults_are_the_installed_trls():
    _, every = _trl_configs()
    defaults = {**TRL_DEFAULTS, **TRL_UNSET_DEFAULTS}
    wrong = {k: (v, every.get(k, "missing")) for k, v in defaults.items() if every.get(k, "missing") != v}
    assert not wrong, wrong


def test_a_script_that_sets_nothing_gets_trls_training():
    d = _recipe(rows=10)
    recipe_from_dict(d)
    a, o, t = d["algorithm"], d["optimizer"], d["train"]
    assert a["kl_target"] == "none" and "beta" not in a                       # beta 0.0
    assert (a["aggregation"], a["clip"]) == ("token_mean", "ratio")           # loss_type dapo
    assert (a["epsilon_low"], a["epsilon_high"]) == (0.2, 0.2)
    assert a.get("sampler_correction") is None                                # no vLLM, no correction
    assert (o["lr"], o["schedule"], o["betas"], o["name"]) == (1e-06, "linear", [0.9, 0.999], "adamw")
    assert (t["micro_batch_size"], t["prompts_per_step"], t["steps"]) == (8, 1, 30)   # 3 epochs of 10 prompts
    assert d["generation"]["max_new_tokens"] == 512 and d["generation"]["num_generations"] == 8
    assert (d["seed"], d["output"]["log_every"], d["output"]["save_every"]) == (42, 10, 500)


@pytest.mark.parametrize("settings, where, expected", [
    (dict(beta=0.04), ("algorithm", "kl_target"), "ref"),
    (dict(beta=0.04), ("algorithm", "kl_ratio_weight"), True),   # TRL's use_bias_correction_kl
    (dict(loss_type="grpo"), ("algorithm", "aggregation"), "sequence_mean"),
    (dict(loss_type="dr_grpo"), ("algorithm", "aggregation"), "constant"),
    (dict(loss_type="cispo", epsilon_high=5.0), ("algorithm", "cispo_max_weight"), 5.0),
    (dict(loss_type="sapo"), ("algorithm", "aggregation"), "sequence_mean"),   # TRL normalises sapo as grpo
    # luspo: GSPO's clip, each completion's token sum averaged over completions (docs/algorithm.md §5)
    (dict(loss_type="luspo"), ("algorithm", "aggregation"), "sequence_sum"),
    (dict(loss_type="luspo", importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4),
     ("algorithm", "sequence_epsilon_high"), 4e-4),
    # vespo: VESPO's weight (§14.2) under TRL's dapo normaliser
    (dict(loss_type="vespo"), ("algorithm", "clip"), "vespo"),
    (dict(loss_type="vespo"), ("algorithm", "aggregation"), "token_mean"),
    (dict(loss_type="vespo", vespo_lambda_neg=2.5), ("algorithm", "vespo_lambda_neg"), 2.5),
    (dict(loss_type="vespo", use_vllm=True, vllm_importance_sampling_mode="token_mask"),
     ("algorithm", "sampler_correction"), "token_mask"),
    (dict(importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4),
     ("algorithm", "sequence_epsilon_high"), 4e-4),
    (dict(epsilon=0.2, epsilon_high=0.28), ("algorithm", "epsilon_high"), 0.28),
    (dict(use_vllm=True), ("algorithm", "sampler_correction"), "sequence_mask"),
    (dict(use_vllm=True), ("generation", "engine"), "vllm"),
    (dict(per_device_train_batch_size=4, gradient_accumulation_steps=4, num_generations=8),
     ("train", "prompts_per_step"), 2),
    (dict(generation_batch_size=32, num_generations=8, gradient_accumulation_steps=4), ("train", "prompts_per_step"), 4),
    # several optimizer updates per generation batch: steps_per_generation / gradient_accumulation_steps of them
    (dict(steps_per_generation=4), ("algorithm", "minibatches"), 4),
    (dict(steps_per_generation=4), ("train", "prompts_per_step"), 4),      # 4 micro-batches of 8, G = 8
    (dict(generation_batch_size=32, num_generations=8), ("algorithm", "minibatches"), 4),
    (dict(steps_per_generation=4, gradient_accumulation_steps=2), ("algorithm", "minibatches"), 2),
    (dict(steps_per_generation=4, num_iterations=2, max_steps=24), ("train", "steps"), 3),   # 8 updates a step
    (dict(steps_per_generation=4, max_steps=40, save_steps=8), ("output", "save_every"), 2),
    # generation_kwargs' sampling settings override TRL's own, as in TRL
    (dict(top_p=0.5, generation_kwargs={"top_p": 0.9, "min_p": 0.05}), ("generation", "top_p"), 0.9),
    (dict(generation_kwargs={"top_p": 0.9, "min_p": 0.05}), ("generation", "min_p"), 0.05),
    # disable_dropout: every dropout layer, the adapters' too
    (dict(disable_dropout=True), ("model", "disable_dropout"), True),
    (dict(disable_dropout=True), ("lora", "dropout"), 0.0),
    (dict(), ("model", "disable_dropout"), False),   # TRL's default
    # the deprecated name of vllm_importance_sampling_clip_max (TRL 1.16 still reads it)
    (dict(use_vllm=True, vllm_importance_sampling_cap=2.0), ("algorithm", "sampler_correction_max"), 2.0),
    (dict(max_steps=7), ("train", "steps"), 7),
    (dict(optim="paged_adamw_8bit"), ("optimizer", "name"), "adamw_8bit"),
    (dict(adam_beta2=0.99), ("optimizer", "betas"), [0.9, 0.99]),
    (dict(bf16=False), ("model", "compute_dtype"), "float32"),
    (dict(save_total_limit=3), ("output", "keep_last"), 3),
    # TRL's own default mode and share, as tutorials spell them out: accepted (was "vllm_mode not supported")
    (dict(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3), ("generation", "engine"), "vllm"),
    # transformers 4's warmup_ratio (tutorials for TRL 0.x): a share of the run, as warmup_steps below 1 is now
    (dict(max_steps=10, warmup_ratio=0.2), ("optimizer", "warmup_steps"), 2),
    (dict(max_steps=10, warmup_steps=3, warmup_ratio=0.5), ("optimizer", "warmup_steps"), 3),   # steps win, as there
    # transformers' get_scheduler("constant") ignores warm-up (was: a ramp over warmup_steps); with_warmup has it
    (dict(lr_scheduler_type="constant", warmup_steps=5), ("optimizer", "warmup_steps"), 0),
    (dict(lr_scheduler_type="constant", warmup_ratio=0.5), ("optimizer", "warmup_steps"), 0),
    (dict(lr_scheduler_type="constant_with_warmup", warmup_steps=5), ("optimizer", "warmup_steps"), 5),
    # TRL's completions table: each logging step with log_completions, never without (its default; were ignored)
    (dict(log_completions=True, logging_steps=5), ("output", "samples_every"), 5),
    (dict(log_completions=True, logging_steps=10, steps_per_generation=2), ("output", "samples_every"), 5),
    (dict(), ("output", "samples_every"), 0),
])
def test_each_setting_lands_on_its_recipe_key(settings, where, expected):
    section, key = where
    d = _recipe(**settings)
    assert d[section][key] == expected
    recipe_from_dict(d)   # and the recipe is a valid one


@pytest.mark.parametrize("settings, named", [
    (dict(vllm_mode="server"), "vllm_mode: 'server' is not here .* drop vllm_mode"),
    (dict(use_vllm=True, vllm_gpu_memory_utilization=0.7), r"vllm_gpu_memory_utilization \(0.7\).*kv_cache_memory_bytes"),
    (dict(sync_ref_model=True), "sync_ref_model=True: the reference is the base model with the adapters off"),
    (dict(use_adaptive_entropy=True), "use_adaptive_entropy=True: .*algorithm.entropy_target"),
    (dict(vllm_server_port=9000), "vllm_server_port=9000: a vLLM server in another process is not here"),
    (dict(generation_kwargs={"suppress_tokens": [1]}), "generation_kwargs: suppress_tokens not here"),
    (dict(vllm_tensor_parallel_size=2), "vllm_tensor_parallel_size=2: one GPU per process here"),
    # the batch arithmetic's divisors, and generation_kwargs' type: named, not a ZeroDivisionError (found by a red team)
    (dict(steps_per_generation=0), "steps_per_generation must be a whole number >= 1, got 0"),
    (dict(per_device_train_batch_size=2.5), "per_device_train_batch_size must be a whole number >= 1"),
    (dict(generation_kwargs="temperature=0.5"), "generation_kwargs must be a dict"),
    (dict(disable_dropout="no"), "disable_dropout must be True or False, got 'no'"),
    # TRL would take an optimizer step's micro-batches from two generation batches
    (dict(steps_per_generation=3, gradient_accumulation_steps=2), "not a multiple of gradient_accumulation_steps=2"),
    (dict(report_to="trackio"), "report_to: trackio"),
    (dict(push_to_hub=True, hub_model_id="me/x"), "push_to_hub: not here"),   # was silently not uploaded
    (dict(per_device_train_batch_size=6, num_generations=4), "multiple of num_generations"),
    (dict(loss_type="reinforce"), "loss_type: 'reinforce' is not here"),
    (dict(shuffle_dataset=False), "shuffle_dataset"),
    # transformers' Trainer refuses it; was accepted, evaluating nothing
    (dict(eval_strategy="steps", eval_steps=1), "eval_strategy: 'steps' needs an eval_dataset: pass eval_dataset"),
    (dict(eval_strategy="epoch"), "eval_strategy: 'epoch' needs an eval_dataset"),
    # transformers' TrainingArguments refuses both; was run in float16 (found by a red team)
    (dict(bf16=True, fp16=True), "bf16 and fp16: at most one of them can be True, as in transformers"),
    # transformers would evaluate before the first step; here the run evaluates only under an eval_strategy
    (dict(eval_on_start=True), "eval_on_start=True with eval_strategy 'no': .*trainer.evaluate\\(\\) before train"),
])
def test_what_does_not_carry_over_is_refused_by_name(settings, named):
    with pytest.raises(TRLCompatError, match=named):
        _recipe(**settings)


def test_trls_own_config_object_is_read_by_what_it_sets(tmp_path):
    trl = pytest.importorskip("trl")
    args = trl.GRPOConfig(output_dir=str(tmp_path), bf16=False, learning_rate=1e-5, num_generations=4,
                          per_device_train_batch_size=4, max_steps=3, report_to="none")
    given = _given_settings(args)
    assert {"learning_rate", "num_generations", "max_steps", "output_dir"} <= set(given)
    d = recipe_from_trl(given, model="m", train_path="t", reward_specs=SPEC, train_rows=4)   # TRL's __post_init__ fills
    assert (d["optimizer"]["lr"], d["train"]["steps"], d["train"]["prompts_per_step"]) == (1e-5, 3, 1)


def test_trls_defaults_spelt_out_are_accepted(tmp_path):
    """A script may write TRL's default of a setting that has no equivalent here (sync_ref_model=False, ...): that
    asks for nothing, and is accepted (was: 'not supported'); TRL's own config with the deprecated
    vllm_importance_sampling_cap (its __post_init__ copies it to clip_max) is read as that cap."""
    trl = pytest.importorskip("trl")
    from lowmem_grpo.trl import NOT_HERE

    spelt = {name: TRL_UNSET_DEFAULTS[name] for name in NOT_HERE}
    d = recipe_from_trl(spelt, model="m", train_path="t", reward_specs=SPEC, train_rows=4)
    assert d == recipe_from_trl({}, model="m", train_path="t", reward_specs=SPEC, train_rows=4)
    args = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", use_vllm=True,
                          vllm_importance_sampling_cap=2.5, sync_ref_model=False, ds3_gather_for_generation=True)
    d = recipe_from_trl(_given_settings(args), model="m", train_path="t", reward_specs=SPEC, train_rows=4)
    assert d["algorithm"]["sampler_correction_max"] == 2.5


def test_trls_own_config_with_luspo_or_vespo_is_that_loss_here(tmp_path):
    """TRL's GRPOConfig(loss_type="vespo", vespo_*=...) and (loss_type="luspo") become the recipe the README's table
    states; TRL's vespo defaults are this recipe's; what TRL itself refuses or warns about with vespo (a sequence_*
    vLLM correction, importance_sampling_level sequence) is a recipe error named by TRL's argument."""
    trl = pytest.importorskip("trl")
    from lowmem_grpo.recipe import AlgorithmConfig, RecipeError
    from lowmem_grpo.trl import FROM_TRL

    def recipe(**settings):
        args = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", **settings)
        return recipe_from_trl(_given_settings(args), model="m", train_path="t", reward_specs=SPEC, train_rows=4)

    shape = {"vespo_k_pos": 1.5, "vespo_lambda_pos": 2.5, "vespo_k_neg": 0.5, "vespo_lambda_neg": 4.0}
    a = recipe_from_dict(recipe(loss_type="vespo", **shape)).algorithm
    assert (a.clip, a.aggregation, a.importance_sampling_level, a.sampler_correction) == ("vespo", "token_mean",
                                                                                          "token", "none")
    assert {k: getattr(a, k) for k in shape} == shape
    trls = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False)
    a = recipe_from_dict(recipe(loss_type="vespo")).algorithm
    for k in shape:
        assert getattr(trls, k) == getattr(a, k) == AlgorithmConfig.model_fields[k].default, k
    a = recipe_from_dict(recipe(loss_type="luspo", importance_sampling_level="sequence", epsilon=3e-4,
                                epsilon_high=4e-4)).algorithm
    assert (a.clip, a.aggregation, a.importance_sampling_level, a.sequence_epsilon_low, a.sequence_epsilon_high) == \
        ("ratio", "sequence_sum", "sequence", 3e-4, 4e-4)
    for settings, key in ((dict(use_vllm=True), "algorithm.sampler_correction"),   # TRL's default sequence_mask
                          (dict(importance_sampling_level="sequence"), "algorithm.importance_sampling_level")):
        with pytest.raises(RecipeError) as exc:
            recipe_from_dict(_recipe(loss_type="vespo", **settings))
        assert [k for k, _ in exc.value.problems] == [key]
    assert FROM_TRL["algorithm.sampler_correction"] == "vllm_importance_sampling_mode"
    assert all(FROM_TRL[f"algorithm.{k}"] == k for k in shape)


def test_trls_own_config_objects_enums_are_read_by_their_values():
    """transformers makes optim, lr_scheduler_type and eval_strategy enums: optim="paged_adamw_8bit" was refused as
    'OptimizerNames.PAGED_ADAMW_8BIT' is not here (allowed: ..., paged_adamw_8bit)."""
    trl = pytest.importorskip("trl")
    args = trl.GRPOConfig(output_dir="x", use_cpu=True, bf16=False, optim="paged_adamw_8bit",
                          lr_scheduler_type="cosine", eval_strategy="steps", eval_steps=1)
    given = _given_settings(args)
    assert [given[k] for k in ("optim", "lr_scheduler_type", "eval_strategy")] == ["paged_adamw_8bit", "cosine", "steps"]
    assert all(type(given[k]) is str for k in ("optim", "lr_scheduler_type", "eval_strategy"))
    d = recipe_from_trl(given, model="m", train_path="t", eval_path="e", reward_specs=SPEC, train_rows=4)
    assert (d["optimizer"]["name"], d["optimizer"]["schedule"], d["train"]["eval_every"]) == ("adamw_8bit", "cosine", 1)
    given = _given_settings(trl.GRPOConfig(output_dir="x", use_cpu=True, bf16=False, optim="adamw_torch_fused"))
    assert recipe_from_trl(given, model="m", train_path="t", reward_specs=SPEC, train_rows=4)["optimizer"]["name"] == "adamw"
    given = _given_settings(trl.GRPOConfig(output_dir="x", use_cpu=True, bf16=False, optim="adafactor"))
    with pytest.raises(TRLCompatError, match=r"optim: 'adafactor' is not here \(allowed: "):
        recipe_from_trl(given, model="m", train_path="t", reward_specs=SPEC, train_rows=4)


def test_an_attribute_a_script_reads_without_setting_it_is_trls_or_transformers_default():
    """trl/scripts/grpo.py reads training_args.model_init_kwargs and .resume_from_checkpoint, open-r1's script
    get_process_log_level(), local_rank, device, n_gpu, to_dict(): each raised AttributeError."""
    from transformers import TrainingArguments

    args = GRPOConfig("out", per_device_train_batch_size=2, log_level="info")
    assert (args.model_init_kwargs, args.remove_unused_columns) == (None, False)   # TRL's defaults
    reference = TrainingArguments(output_dir="out")
    assert (args.resume_from_checkpoint, args.run_name, args.local_rank) == (None, reference.run_name, -1)
    assert (args.device, args.n_gpu) == (reference.device, reference.n_gpu)
    assert args.get_process_log_level() == logging.INFO   # its methods read the settings given
    assert args.train_batch_size == 2 * max(1, reference.n_gpu)
    d = args.to_dict()
    assert (d["per_device_train_batch_size"], d["log_level"], d["logging_steps"], d["seed"]) == (2, "info", 10, 42)
    assert (d["model_init_kwargs"], d["adam_epsilon"]) == (None, reference.adam_epsilon)
    assert json.loads(args.to_json_string())["output_dir"] == "out"
    with pytest.raises(AttributeError, match="neither TRL's GRPOConfig nor transformers' TrainingArguments has it"):
        args.no_such_setting
    assert _given_settings(args) == {"output_dir": "out", "per_device_train_batch_size": 2, "log_level": "info"}


def length_reward(completions, target=3, **kwargs):
    return [-abs(target - len(c)) for c in completions]


class ExactMatch:
    def __call__(self, completions, answer, **kwargs):
        return [float(c.strip() == a) for c, a in zip(completions, answer)]


def test_reward_functions_are_labelled_by_trls_names_for_them():
    """TRL's get_callable_name: a partial by its function, a callable instance by its class (were reward_<i>); a
    lambda's "<lambda>" and a name already taken stay reward_<i>. A name of the metrics row's own keys is labelled
    by the recipe's one rule (Rewards._label: mean_<i>)."""
    from lowmem_grpo.recipe import RewardsConfig
    from lowmem_grpo.rewards import Rewards

    def mean(completions, **kwargs):   # reward/mean is the row's total
        return [0.0] * len(completions)

    funcs = [functools.partial(length_reward, target=4), ExactMatch(), lambda completions, **kw: [0.0],
             digit_reward, functools.partial(digit_reward), mean]
    specs, _ = _reward_specs(funcs)
    assert [spec["function"].rsplit(":", 1)[1] for spec in specs] == \
        ["length_reward", "ExactMatch", "reward_2", "digit_reward", "reward_4", "mean"]
    assert specs[3]["function"] == "test_trl_api:digit_reward"   # importable: named by its module
    assert Rewards(RewardsConfig(functions=specs), answer_field="answer").names == \
        ["length_reward", "ExactMatch", "reward_2", "digit_reward", "reward_4", "mean_5"]


def _constant(completions, value, **kwargs):
    return [float(value)] * len(completions)


def test_log_history_has_trls_names_for_the_reward_columns(tiny_model_dir, tmp_path):
    """log_history had rewards/reward_0/mean for a lambda (TRL's rewards/<lambda>/mean), rewards/mean_3/mean for a
    function named mean, and for two functions of one name the first's alone, where TRL logs the mean of both under
    that name (found by a red team). Ours stay beside TRL's."""
    def mean(completions, **kwargs):
        return [3.0] * len(completions)

    trainer = GRPOTrainer(model=str(tiny_model_dir), train_dataset=[{"prompt": f"{i}+1="} for i in range(2)],
                          reward_funcs=[lambda completions, **kw: [0.5] * len(completions),
                                        functools.partial(_constant, value=1), functools.partial(_constant, value=2),
                                        mean],
                          args=_args(tmp_path, logging_steps=1), log=lambda *a: None)
    trainer.train()
    entry = trainer.state.log_history[0]
    assert (entry["rewards/<lambda>/mean"], entry["rewards/_constant/mean"], entry["rewards/mean/mean"]) == (0.5, 1.5, 3.0)
    assert (entry["rewards/reward_0/mean"], entry["rewards/reward_2/mean"], entry["rewards/mean_3/mean"]) == (0.5, 2.0, 3.0)
    assert entry["rewards/_constant/std"] == 0.0


def test_trls_metric_names_stand_beside_ours_where_they_mean_the_same():
    def names(**settings):
        return _trl_log_keys(recipe_from_dict(_recipe(**settings)))
    default = names()
    assert {("completion/truncated_fraction", "completions/clipped_ratio"), ("zero_std_fraction", "frac_reward_zero_std"),
            ("clip/low", "clip_ratio/low_mean"), ("clip/high", "clip_ratio/high_mean"),
            ("clip/fraction", "clip_ratio/region_mean")} <= set(default.items())
    assert "rollout/logprob_abs_diff" not in default and "entropy/coef" not in default   # TRL logs them only when on
    assert "clip/low" not in names(loss_type="cispo", epsilon_high=5.0)   # TRL's cispo_clip_ratio counts A > 0 only
    assert "clip/low" not in names(importance_sampling_level="sequence")   # TRL's: a mean per sequence
    assert "zero_std_fraction" not in names(scale_rewards="batch")   # TRL's: whether the batch's std is 0
    assert names(entropy_coef=0.01)["entropy/coef"] == "entropy_coef"


# -- a TRL-shaped script --------------------------------------------------------------------------------

CALLS = []


def digit_reward(completions, answer, **kwargs):
    """As a TRL user writes one: completions, a dataset column by name, TRL's other keywords in kwargs."""
    CALLS.append({"n": len(completions), "answer": list(answer), "keys": sorted(kwargs),
                  "epochs": (kwargs["trainer_state"].epoch, kwargs["trainer_state"].num_train_epochs)})
    return [float(any(ch.isdigit() for ch in c)) for c in completions]


def test_a_trl_shaped_script_trains_and_saves_its_adapter(tiny_model_dir, tmp_path):
    from datasets import Dataset
    from peft import LoraConfig

    dataset = Dataset.from_list([{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(4) for b in range(3)])
    args = GRPOConfig(output_dir=str(tmp_path / "out"), bf16=False, learning_rate=1e-3, num_generations=2,
                      per_device_train_batch_size=4, max_completion_length=4, max_steps=2, logging_steps=1, save_steps=1)
    lines = []
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[digit_reward, lambda completions, **kw: [0.5] * len(completions)],
                          args=args, train_dataset=dataset, peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
                          log=lines.append)
    CALLS.clear()
    out = trainer.train()
    assert out["step"] == 2 and out.global_step == 2 and out.metrics["step"] == 2   # also transformers' TrainOutput
    assert isinstance(out.training_loss, float) and out.training_loss == out.training_loss
    assert CALLS and CALLS[0]["n"] == 4 and all(a.isdigit() for a in CALLS[0]["answer"])
    assert {"prompts", "completion_ids", "trainer_state"} <= set(CALLS[0]["keys"])
    assert [c["epochs"] for c in CALLS] == [(0.0, 1), (2 / 12, 1)]   # 2 prompts a step of 12, as TRL's trainer_state
    rows = [r for r in read_metrics(tmp_path / "out") if r.get("loss") is not None]
    assert len(rows) == 2 and all(r["reward/digit_reward"] is not None for r in rows)
    assert rows[0]["reward/reward_1"] == 0.5   # the lambda, through the run's own module
    recipe = (tmp_path / "out" / "recipe.yaml").read_text()
    assert "lr: 0.001" in recipe and "kl_target: none" in recipe and "convention: trl" in recipe
    assert json.loads((tmp_path / "out" / "data" / "train.jsonl").read_text().splitlines()[0]) == {"prompt": "0+0=", "answer": "0"}
    adapter = trainer.save_model()
    assert (adapter / "adapter_config.json").is_file()
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 4


SEEN_KWARGS = []


def kwargs_reward(completions, **kwargs):
    SEEN_KWARGS.append(kwargs)
    return [0.0] * len(completions)


def test_a_completion_column_is_not_passed_to_reward_functions_as_trl_passes_none(tiny_model_dir, tmp_path):
    """TRL passes every dataset column to the reward functions but prompt, completion and completion_ids (a
    prompt-completion dataset's): here completion was passed as a keyword, and a completion_ids column was an error
    for its clash with the generated ids TRL passes in its place (found by a red team)."""
    rows = [{"prompt": f"{i}+1=", "completion": str(i + 1), "completion_ids": [1, 2], "level": i} for i in range(2)]
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=kwargs_reward, train_dataset=rows,
                          args=_args(tmp_path), log=lambda *a: None)
    SEEN_KWARGS.clear()
    trainer.train()
    kwargs = SEEN_KWARGS[0]
    assert "completion" not in kwargs and len(kwargs["level"]) == 2
    assert len(kwargs["completion_ids"]) == 2 and kwargs["completion_ids"] != [[1, 2], [1, 2]]   # the generated ids


def test_a_loaded_model_or_a_reward_model_is_refused_with_what_to_do(tiny_model_dir, tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path))
    with pytest.raises(TRLCompatError, match="hub id or local folder"):
        GRPOTrainer(model=object(), reward_funcs=[digit_reward], args=args, train_dataset=[{"prompt": "x"}])
    with pytest.raises(TRLCompatError, match="reward model by name is not"):
        GRPOTrainer(model=str(tiny_model_dir), reward_funcs=["some/reward-model"], args=args,
                    train_dataset=[{"prompt": "x"}])


# -- what TRL means by its settings, where a plain copy of the value would do something else ------------------------


def test_trls_steps_count_optimizer_updates_num_iterations_per_generation_batch():
    """TRL's max_steps=8 at num_iterations=2 is 4 generation batches (8 updates); here a step is one generation
    batch with its mu updates, so train.steps is 4, and save/log/eval counts are in generation batches too."""
    d = _recipe(max_steps=8, num_iterations=2, save_steps=4, logging_steps=2, warmup_steps=2)
    assert (d["train"]["steps"], d["algorithm"]["mu"]) == (4, 2)
    assert (d["output"]["save_every"], d["output"]["log_every"]) == (2, 1)
    assert d["optimizer"]["warmup_steps"] == 2   # the schedule counts updates, as TRL's does
    # epochs: TRL's RepeatSampler takes the whole generation batches of the data, num_iterations updates each
    assert _recipe(rows=10, num_train_epochs=1, num_generations=2, per_device_train_batch_size=6)["train"]["steps"] == 3
    recipe_from_dict(d)


def test_a_step_count_below_one_is_a_share_of_the_run_as_in_transformers():
    """transformers 5 dropped warmup_ratio: warmup_steps=0.1 is 10% of the run (so are *_steps below 1)."""
    d = _recipe(max_steps=20, warmup_steps=0.1, save_steps=0.5, logging_steps=0.25)
    assert (d["optimizer"]["warmup_steps"], d["output"]["save_every"], d["output"]["log_every"]) == (2, 10, 5)
    recipe_from_dict(d)


def test_evaluation_follows_eval_strategy_with_transformers_fill_ins():
    def every(**settings):
        return recipe_from_trl(settings, model="m", train_path="t", eval_path="e", reward_specs=SPEC,
                               train_rows=12)["train"]["eval_every"]
    assert every(eval_strategy="steps", logging_steps=3, max_steps=9) == 3   # unset eval_steps: logging_steps
    assert every(eval_strategy="steps", eval_steps=2, max_steps=9) == 2
    assert every(eval_strategy="epoch", num_generations=2, per_device_train_batch_size=4) == 6   # 12 prompts, 2 a step
    assert every() == 0


def test_report_to_and_trust_remote_code_reach_the_recipe(monkeypatch):
    import importlib.util

    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    find_spec = importlib.util.find_spec
    # a missing integration is refused by report_to, as transformers refuses it (was: output.wandb_project at train())
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    with pytest.raises(TRLCompatError, match=r"^GRPOConfig: report_to: wandb is not installed: pip install wandb"):
        _recipe(report_to="wandb")
    from lowmem_grpo import sinks

    with monkeypatch.context() as m:
        m.setattr(sinks, "tensorboard_available", lambda: False)
        with pytest.raises(TRLCompatError, match=r"^GRPOConfig: report_to: tensorboard is not installed"):
            _recipe(report_to=["tensorboard"])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "wandb" else find_spec(name, *a))
    d = _recipe()
    assert (d["output"]["tensorboard"], d["output"]["wandb_project"]) == (False, "")   # TRL's report_to: none
    d = _recipe(report_to=["tensorboard", "wandb"], trust_remote_code=True)
    assert (d["output"]["tensorboard"], d["output"]["wandb_project"]) == (True, "huggingface")
    assert d["model"]["trust_remote_code"] is True
    monkeypatch.setenv("WANDB_PROJECT", "mine")
    assert _recipe(report_to="wandb")["output"]["wandb_project"] == "mine"
    recipe_from_dict(d)


def _args(tmp_path, **settings):
    return GRPOConfig(**{"output_dir": str(tmp_path / "out"), "bf16": False, "num_generations": 2,
                         "per_device_train_batch_size": 2, "max_completion_length": 2, "max_steps": 1, **settings})


def test_datasets_that_do_not_fit_json_lines_are_refused_naming_the_column(tiny_model_dir, tmp_path):
    import datetime

    from datasets import Dataset

    rows = Dataset.from_list([{"prompt": "1+1=", "when": datetime.datetime(2024, 1, 1)}] * 4)
    with pytest.raises(TRLCompatError, match=r"column 'when': datetime .*remove_columns\('when'\)"):
        GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[digit_reward], args=_args(tmp_path), train_dataset=rows)
    split = Dataset.from_list([{"prompt": "1+1="}] * 4).train_test_split(test_size=0.5)
    with pytest.raises(TRLCompatError, match=r"train_dataset: a dict of datasets \((test, train|train, test)\)"):
        GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[digit_reward], args=_args(tmp_path), train_dataset=split)
    with pytest.raises(TRLCompatError, match="eval_dataset: a dict of datasets"):
        GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[digit_reward], args=_args(tmp_path),
                    train_dataset=split["train"], eval_dataset={"a": split["test"]})
    frame = split["train"].to_pandas()   # was pandas' own KeyError: 0 (read by column)
    with pytest.raises(TRLCompatError, match=r"train_dataset: a DataFrame is not supported: .*Dataset\.from_pandas\(df\)"):
        GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[digit_reward], args=_args(tmp_path), train_dataset=frame)
    with pytest.raises(TRLCompatError, match="eval_dataset: a DataFrame is not supported"):
        GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[digit_reward], args=_args(tmp_path),
                    train_dataset=split["train"], eval_dataset=frame)


def test_an_image_column_is_refused_as_trl_reads_it_as_the_prompts_image(tiny_model_dir, tmp_path):
    """TRL gives a row's 'image' (or 'images') to a vision-language model with the prompt; here a path was a text
    column, trained on without its image, and a PIL image was "not JSON data: convert the column to text" (found by
    a red team). An empty or null one is no image, as in TRL."""
    from datasets import Dataset
    from PIL import Image

    def trainer(rows, **kw):
        return GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[digit_reward], args=_args(tmp_path),
                           train_dataset=rows, log=lambda *a: None, **kw)

    pictures = Dataset.from_list([{"prompt": "1+1=", "image": Image.new("RGB", (2, 2))}] * 4)
    with pytest.raises(TRLCompatError, match=r"^train_dataset row 0: column 'image' holds an image, which TRL gives a "
                                             r"vision-language model .*remove_columns\('image'\)\) to train on the "
                                             r"text alone$"):
        trainer(pictures)
    with pytest.raises(TRLCompatError, match=r"^train_dataset row 0: column 'images' holds images"):
        trainer([{"prompt": "1+1=", "images": ["cat.png"]}] * 4)
    with pytest.raises(TRLCompatError, match=r"^eval_dataset row 1: column 'image'"):
        trainer([{"prompt": "1+1="}] * 4, eval_dataset=[{"prompt": "1+1="}, {"prompt": "2+1=", "image": "cat.png"}])
    trainer([{"prompt": "1+1=", "image": None, "images": []}] * 4)


def test_a_streamed_dataset_is_written_up_to_what_max_steps_draws(tiny_model_dir, tmp_path):
    from datasets import IterableDataset

    stream = IterableDataset.from_generator(lambda: ({"prompt": f"{i}+1="} for i in range(100)))
    GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[digit_reward], args=_args(tmp_path, max_steps=3),
                train_dataset=stream)
    assert len((tmp_path / "out" / "data" / "train.jsonl").read_text().splitlines()) == 3   # 3 steps of 1 prompt
    with pytest.raises(TRLCompatError, match="IterableDataset needs max_steps"):
        GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[digit_reward], args=_args(tmp_path, max_steps=-1),
                    train_dataset=stream)


def test_a_reward_model_object_is_refused_before_the_run(tiny_model_dir, tmp_path):
    import torch

    with pytest.raises(TRLCompatError, match=r"reward_funcs\[1\]: a Linear model"):
        GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[digit_reward, torch.nn.Linear(2, 1)],
                    args=_args(tmp_path), train_dataset=[{"prompt": "1+1="}])


def test_a_tokenizer_whose_chat_template_would_go_unused_is_refused(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[digit_reward], args=_args(tmp_path),
                train_dataset=[{"prompt": "1+1="}], processing_class=tokenizer)   # the folder's own: fine
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(TRLCompatError, match="processing_class: its chat template differs"):
        GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[digit_reward], args=_args(tmp_path),
                    train_dataset=[{"prompt": [{"role": "user", "content": "1+1="}]}], processing_class=tokenizer)


def test_no_args_is_trls_model_name_grpo_folder(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=digit_reward, train_dataset=[{"prompt": "1+1="}],
                          log=lambda *a: None)
    assert trainer.output_dir.name == f"{tiny_model_dir.name}-GRPO"


def test_save_model_writes_the_tokenizer_and_resume_names_the_last_checkpoint(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=lambda completions, **kw: [len(c) for c in completions],
                          train_dataset=[{"prompt": "1+1="}] * 4,
                          args=_args(tmp_path, max_steps=2, save_steps=1, logging_steps=1), log=lambda *a: None)
    trainer.train()
    AutoTokenizer.from_pretrained(trainer.save_model(str(tmp_path / "final")))   # as TRL's save_model leaves it
    first = tmp_path / "out" / "checkpoints" / "step-000001"
    assert first.is_dir()
    with pytest.raises(TRLCompatError, match="resume_from_checkpoint: .* is not the last checkpoint"):
        trainer.train(resume_from_checkpoint=str(first))   # TRL would resume from step 1; here it would be step 2


def test_transformers_get_last_checkpoint_finds_the_last_checkpoint_and_train_resumes_from_it(tiny_model_dir, tmp_path):
    """TRL's and open-r1's scripts find what to resume with transformers' get_last_checkpoint(output_dir), which looks
    for checkpoint-<step> folders: it found none here (checkpoints/step-N), and the rerun was refused (found by a red
    team). Each checkpoint has that name too (a link, by global step), one rotated away loses it, and the script's
    train(resume_from_checkpoint=last) resumes."""
    from transformers.trainer_utils import get_last_checkpoint

    def make(steps):
        return GRPOTrainer(model=str(tiny_model_dir), reward_funcs=lambda completions, **kw: [len(c) for c in completions],
                           train_dataset=[{"prompt": "1+1="}] * 4, log=lambda *a: None,
                           args=_args(tmp_path, max_steps=steps, save_steps=1, save_total_limit=2))
    make(3).train()
    out = tmp_path / "out"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]   # 1: rotated away
    last = get_last_checkpoint(str(out))
    assert Path(last).resolve() == (out / "checkpoints" / "step-000003").resolve()
    again = make(4)
    assert again.train(resume_from_checkpoint=last).global_step == 4
    assert Path(get_last_checkpoint(str(out))).name == "checkpoint-4"


def test_earlier_trls_max_prompt_length_is_read_as_the_readme_maps_it():
    """TRL 0.x scripts set max_prompt_length (the README's table: data.max_prompt_tokens); 1.16 has no limit."""
    assert _recipe(max_prompt_length=256)["data"]["max_prompt_tokens"] == 256
    assert _recipe()["data"]["max_prompt_tokens"] == 32768


def test_a_value_the_recipe_refuses_is_named_by_the_scripts_argument(tiny_model_dir, tmp_path):
    with pytest.raises(TRLCompatError, match=r"  delta \(algorithm\.delta\): must be > 1"):
        GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[digit_reward], args=_args(tmp_path, delta=1.1),
                    train_dataset=[{"prompt": "1+1="}])
    with pytest.raises(TRLCompatError, match=r"temperature \(generation\.temperature\)"):
        GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[digit_reward], args=_args(tmp_path, temperature=0.0),
                    train_dataset=[{"prompt": "1+1="}])
    with pytest.raises(TRLCompatError, match="num_iterations must be a whole number"):
        _recipe(num_iterations=0)
    # a value that came from generation_kwargs is named so, not by the top-level argument it overrides
    with pytest.raises(TRLCompatError) as exc:
        GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[digit_reward], train_dataset=[{"prompt": "1+1="}],
                    args=_args(tmp_path, top_p=0.9, generation_kwargs={"top_k": -2, "top_p": 2.0}))
    assert sorted(str(exc.value).splitlines()[1:]) == [
        "  generation_kwargs['top_k'] (generation.top_k): Input should be greater than or equal to 0 (got -2); "
        "allowed: >= 0",
        "  generation_kwargs['top_p'] (generation.top_p): Input should be less than or equal to 1 (got 2.0); "
        "allowed: <= 1.0"]
    with pytest.raises(TRLCompatError, match=r"\n  top_k \(generation\.top_k\): Input should be greater"):
        GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[digit_reward], train_dataset=[{"prompt": "1+1="}],
                    args=_args(tmp_path, top_k=-2, generation_kwargs={"top_p": 0.5}))


def test_trls_top_k_minus_one_is_off_as_in_vllm():
    """Found by a red team: TRL passes top_k=-1 to vLLM, whose "off" it is; the recipe's off is 0 (was refused as
    below 0). Other negative values stay refused (vLLM refuses them too)."""
    for settings in (dict(top_k=-1, use_vllm=True), dict(top_k=-1), dict(top_k=5, generation_kwargs={"top_k": -1})):
        d = _recipe(**settings)
        assert d["generation"]["top_k"] == 0, settings
        assert recipe_from_dict(d).generation.top_k == 0
    assert _recipe(top_k=7)["generation"]["top_k"] == 7 and _recipe(generation_kwargs={"top_k": 3})["generation"]["top_k"] == 3


def test_json_text_in_trls_dict_settings_is_read_as_trls_config_reads_it():
    """Found by a red team: TRL's GRPOConfig (transformers' _VALID_DICT_FIELDS) reads generation_kwargs,
    chat_template_kwargs and model_init_kwargs given as JSON text (how TrlParser / CLI-style scripts pass them);
    here they were refused. Text that is not JSON stays refused, by name."""
    from lowmem_grpo.recipe import RecipeError

    args = GRPOConfig("out", generation_kwargs='{"top_k": 20, "min_p": "0.05"}',
                      chat_template_kwargs='{"enable_thinking": "false"}', model_init_kwargs='{"revision": "main"}')
    assert args.generation_kwargs == {"top_k": 20, "min_p": 0.05}           # as TRL's: the config holds the dict
    assert args.chat_template_kwargs == {"enable_thinking": False}
    d = recipe_from_trl(_given_settings(args), model="m", train_path="t", reward_specs=SPEC, train_rows=4)
    assert (d["generation"]["top_k"], d["generation"]["min_p"]) == (20, 0.05)
    assert recipe_from_dict(d).data.chat_template_kwargs == {"enable_thinking": False}
    assert _recipe(generation_kwargs='{"top_p": 0.5}')["generation"]["top_p"] == 0.5   # a dict of settings, too
    trl = pytest.importorskip("trl")
    theirs = trl.GRPOConfig(output_dir="x", use_cpu=True, bf16=False, report_to="none",
                            generation_kwargs='{"top_k": 20, "min_p": "0.05"}',
                            chat_template_kwargs='{"enable_thinking": "false"}')
    assert (theirs.generation_kwargs, theirs.chat_template_kwargs) == (args.generation_kwargs, args.chat_template_kwargs)
    with pytest.raises(TRLCompatError, match=r"GRPOConfig: generation_kwargs is not valid JSON \(Expecting"):
        GRPOConfig("out", generation_kwargs='{"top_k": 20')
    with pytest.raises(TRLCompatError, match="generation_kwargs must be a dict"):
        _recipe(generation_kwargs="top_k=20")
    with pytest.raises(RecipeError, match="chat_template_kwargs: Input should be a valid dictionary"):
        recipe_from_dict(_recipe(chat_template_kwargs="enable_thinking=false"))


# -- second audit: what TRL-shaped scripts from the docs and tutorials do around train() ------------------------


def test_settings_that_change_nothing_in_trls_grpo_are_accepted_as_such():
    """transformers' Trainer never reads args.resume_from_checkpoint (train()'s argument resumes), TRL's sampler
    draws with seed, not data_seed, and vLLM sleeps between rollouts. (eval_on_start is read: train.eval_at_start.)"""
    same = _recipe(data_seed=7, resume_from_checkpoint="out/checkpoint-5", vllm_enable_sleep_mode=True)
    assert same == _recipe()
    # nor the dataloader's workers, a token count in the logs, the CUDA cache's emptying (were refused as unknown)
    assert _recipe(dataloader_persistent_workers=True, dataloader_prefetch_factor=2, include_num_input_tokens_seen=True,
                   torch_empty_cache_steps=1) == _recipe()


def test_evaluation_is_of_every_eval_row_and_only_where_eval_strategy_asks_as_in_trl():
    def recipe(**settings):
        return recipe_from_trl(settings, model="m", train_path="t", eval_path="e", reward_specs=SPEC, train_rows=4,
                               eval_rows=300)
    d = recipe(eval_strategy="steps", eval_steps=1)
    assert (d["data"]["eval_path"], d["train"]["eval_max_prompts"]) == ("e", 300)   # the recipe's default: 200
    assert recipe()["data"]["eval_path"] == ""   # TRL's eval_strategy "no": the run evaluates nothing (evaluate() can)
    recipe_from_dict(d)


def test_a_config_changed_after_it_was_made_is_read_as_it_is_now():
    """args.max_steps = 3 after GRPOConfig(...) was silently dropped (only the constructor's were read)."""
    args = GRPOConfig("out", max_steps=10)   # output_dir by position, as TRL's own GRPOConfig(f"{name}-GRPO")
    args.max_steps, args.learning_rate, args.warmup_ratio = 3, 2e-5, 0.5
    given = _given_settings(args)
    assert [given[k] for k in ("output_dir", "max_steps", "learning_rate", "warmup_ratio")] == ["out", 3, 2e-5, 0.5]
    d = recipe_from_trl(given, model="m", train_path="t", reward_specs=SPEC, train_rows=4)
    assert (d["train"]["steps"], d["optimizer"]["lr"], d["optimizer"]["warmup_steps"]) == (3, 2e-5, 2)
    args.sync_ref_model = True
    with pytest.raises(TRLCompatError, match="sync_ref_model=True: "):
        recipe_from_trl(_given_settings(args), model="m", train_path="t", reward_specs=SPEC, train_rows=4)


def test_reward_processing_classes_of_functions_are_ignored_as_trl_ignores_them(tiny_model_dir, tmp_path):
    GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[digit_reward], args=_args(tmp_path),
                train_dataset=[{"prompt": "1+1="}], reward_processing_classes=[None])
    with pytest.raises(TRLCompatError, match="reward_processing_classes: 2 for 1 reward functions"):
        GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[digit_reward], args=_args(tmp_path),
                    train_dataset=[{"prompt": "1+1="}], reward_processing_classes=[None, None])


def test_callbacks_are_called_from_the_runs_metrics_and_can_stop_it(tiny_model_dir, tmp_path):
    """transformers' TrainerCallbacks (refused before): on_train_begin, per step on_step_begin, on_step_end and on_log
    with TRL's names, per evaluation on_evaluate and on_log, per checkpoint on_save (not called before), on_train_end;
    state.global_step in TRL's updates (x num_iterations); a callback that sets control.should_training_stop ends the
    run after that step, checkpointed."""
    from transformers import TrainerCallback

    class Record(TrainerCallback):
        def __init__(self):
            self.events = []

        def __getattribute__(self, name):
            if name.startswith("on_"):
                return lambda args, state, control, **kw: self.events.append(
                    (name, state.global_step, (kw.get("logs") or kw.get("metrics") or {}).get("loss")
                     if name in ("on_log", "on_evaluate") else None, "model" in kw))
            return super().__getattribute__(name)

    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            control.should_training_stop = state.global_step >= 4
            return control

    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(3) for b in range(3)]
    record = Record()
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[digit_reward], train_dataset=rows[:6],
                          eval_dataset=rows[6:], log=lambda *a: None, callbacks=[record, StopAt],
                          args=_args(tmp_path, num_iterations=2, max_steps=10, eval_strategy="steps", eval_steps=2,
                                     logging_steps=2, eval_on_start=True))
    assert trainer.pop_callback(StopAt) is not None and trainer.pop_callback(StopAt) is None
    trainer.add_callback(StopAt())
    out = trainer.train()
    names = [e[0] for e in record.events]
    assert names[0] == "on_train_begin" and names[-1] == "on_train_end" and all(e[3] for e in record.events)
    steps = [(e[1], e[2] is not None) for e in record.events if e[0] == "on_log"]
    assert [e[1] for e in record.events if e[0] == "on_step_end"] == [2, 4]   # stopped after 2 batches of 2 updates
    # eval_steps=logging_steps=2 updates is every step here: the step-0 eval (eval_on_start), then each step's log (with a loss) and
    # its eval, then the train summary (train_loss, no loss)
    assert steps == [(0, False), (2, True), (2, False), (4, True), (4, False), (4, False)], steps
    assert [e[1] for e in record.events if e[0] == "on_evaluate"] == [0, 2, 4]
    # transformers' order: on_step_begin with the updates made so far, ..., on_step_end; on_save after the
    # stopping step's checkpoint (save_steps is TRL's 500 updates: that is the only one)
    assert [e[1] for e in record.events if e[0] == "on_step_begin"] == [0, 2]
    assert [e[1] for e in record.events if e[0] == "on_save"] == [4]
    assert names.index("on_save") > max(i for i, n in enumerate(names) if n == "on_step_end")
    assert out.global_step == 4 and (tmp_path / "out" / "checkpoints").is_dir()
    with pytest.raises(TRLCompatError, match="callbacks: .* is not a transformers TrainerCallback"):
        GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[digit_reward], args=_args(tmp_path / "x"),
                    train_dataset=[{"prompt": "1+1="}], callbacks=[print])


def test_a_callbacks_should_save_and_should_evaluate_checkpoint_and_evaluate_after_that_step(tiny_model_dir, tmp_path):
    """control.should_save and control.should_evaluate set in on_step_end were ignored (found by a red team): as
    transformers does, that step is evaluated (on_evaluate called) and checkpointed, once; the flags are this step's."""
    from transformers import TrainerCallback

    class AskAtTwo(TrainerCallback):
        evaluated = []

        def on_step_end(self, args, state, control, **kw):
            control.should_save = control.should_evaluate = state.global_step == 2
            return control

        def on_evaluate(self, args, state, control, metrics=None, **kw):
            self.evaluated.append(state.global_step)

    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(3) for b in range(3)]
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[digit_reward], train_dataset=rows[:6],
                          eval_dataset=rows[6:], log=lambda *a: None, callbacks=[AskAtTwo],
                          args=_args(tmp_path, max_steps=4, eval_strategy="steps", eval_steps=100))   # (neither before 4)
    trainer.train()
    saved = sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir())
    assert saved == ["step-000002", "step-000004"], saved   # asked at 2; the last step's
    evals = [r["step"] for r in read_metrics(tmp_path / "out") if "eval/accuracy" in r]
    assert evals == [2, 4] and AskAtTwo.evaluated == [2, 4]   # asked at 2; the final eval
    # with eval_strategy 'no' the run holds no held-out set (TRL's), so there is nothing to evaluate: said once
    lines = []
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[digit_reward], train_dataset=rows[:6],
                          eval_dataset=rows[6:], log=lines.append, callbacks=[AskAtTwo],
                          args=_args(tmp_path / "no", max_steps=4))
    trainer.train()
    assert sum("control.should_evaluate" in line for line in lines) == 1, lines


def test_steps_per_generation_makes_several_updates_of_one_generation_batch(tiny_model_dir, tmp_path):
    """steps_per_generation=2 (one micro-batch each): a generation batch of 2 x 2 completions, two updates on it, so
    max_steps=4 TRL updates are 2 steps here, global_step counts the 4 updates, and the schedule made 4."""
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(3) for b in range(3)]
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[digit_reward], train_dataset=rows,
                          log=lambda *a: None, args=_args(tmp_path, steps_per_generation=2, max_steps=4))
    assert (trainer.recipe.algorithm.minibatches, trainer.recipe.train.prompts_per_step) == (2, 2)
    out = trainer.train()
    assert (out.global_step, trainer.state.global_step, trainer.recipe.train.steps) == (4, 4, 2)
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["update/mu_ran"] for r in rows if "update/mu_ran" in r] == [2, 2]


def test_a_4bit_quantization_config_is_read_and_any_other_refused(tiny_model_dir, tmp_path):
    """TRL's own grpo script passes quantization_config (a BitsAndBytesConfig) to GRPOTrainer: was 'not
    supported'. NF4 is what is loaded here, with the config's nested quantization; 8-bit and FP4 are refused."""
    import torch
    from transformers import BitsAndBytesConfig

    def trainer(quantization=None, **settings):
        return GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[digit_reward], args=_args(tmp_path, **settings),
                           train_dataset=[{"prompt": "1+1="}], quantization_config=quantization)
    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    model = trainer(nf4, bf16=True).recipe.model
    assert (model.load_in_4bit, model.double_quant, model.compute_dtype) == (True, False, "bfloat16")
    with pytest.raises(TRLCompatError, match="bnb_4bit_compute_dtype=bfloat16 differs .*float32"):
        trainer(nf4)   # bf16=False
    with pytest.raises(TRLCompatError, match="bnb_4bit_quant_type='fp4' is not here"):
        trainer(BitsAndBytesConfig(load_in_4bit=True))
    with pytest.raises(TRLCompatError, match="quantization_config: only 4-bit"):
        trainer(model_init_kwargs={"quantization_config": BitsAndBytesConfig(load_in_8bit=True)})
    with pytest.raises(TRLCompatError, match="model_init_kwargs: revision='v2' is not here"):
        trainer(model_init_kwargs={"revision": "v2"})


def test_a_tokenizer_with_another_eos_token_is_refused(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.eos_token = "x"   # generation would stop elsewhere than the folder's tokenizer has it stop
    with pytest.raises(TRLCompatError, match="processing_class: its eos token"):
        GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[digit_reward], args=_args(tmp_path),
                    train_dataset=[{"prompt": "1+1="}], processing_class=tokenizer)


def test_a_fresh_train_into_a_folder_holding_a_run_is_refused(tiny_model_dir, tmp_path):
    """Was: the fresh run appended to the earlier run's metrics.jsonl, and save_model() took the earlier run's
    step-3 checkpoint as the last one."""
    def trainer(steps):
        return GRPOTrainer(model=str(tiny_model_dir), reward_funcs=digit_reward, log=lambda *a: None,
                           train_dataset=[{"prompt": "1+1=", "answer": "2"}] * 4,
                           args=_args(tmp_path, max_steps=steps, save_steps=1))
    trainer(3).train()
    with pytest.raises(TRLCompatError, match=r"already holds a run \(checkpoints up to step-000003\).*resume_from"):
        trainer(2).train()
    assert [r["step"] for r in read_metrics(tmp_path / "out") if "loss" in r] == [1, 2, 3]


def test_evaluate_state_model_and_the_after_train_calls_of_trls_scripts(tiny_model_dir, tmp_path):
    """trainer.evaluate() (was missing), .state, .model, .processing_class, log_metrics / save_metrics / save_state,
    accelerator.print and end(), as TRL's docs and its own grpo script use them; steps are TRL's (x num_iterations)."""
    from peft import PeftModel
    from transformers import TrainerState

    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(3) for b in range(3)]
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[digit_reward], train_dataset=rows[:6],
                          eval_dataset=rows[6:], log=lambda *a: None,
                          args=_args(tmp_path, num_iterations=2, max_steps=4, logging_steps=1, save_steps=2,
                                     eval_strategy="steps", eval_steps=2, eval_on_start=True))
    before = trainer.evaluate()
    assert set(before) >= {"eval_accuracy", "eval_mean_reward", "eval_pass@1", "eval_runtime"}
    assert before["eval_prompts"] == 3
    out = trainer.train()
    after = trainer.evaluate()
    final = [r for r in read_metrics(tmp_path / "out") if "eval/accuracy" in r][-1]
    assert (after["eval_accuracy"], after["eval_mean_reward"]) == (final["eval/accuracy"], final["eval/mean_reward"])
    assert trainer.evaluate(eval_dataset=rows[:2], metric_key_prefix="test")["test_prompts"] == 2
    state = trainer.state
    assert isinstance(state, TrainerState) and (state.global_step, state.max_steps) == (4, 4) == (out.global_step, 4)
    steps = [e for e in state.log_history if "loss" in e]
    assert [e["step"] for e in steps] == [2, 4]   # 2 generation batches of 2 updates each
    assert {"reward", "learning_rate", "rewards/digit_reward/mean", "loss"} <= set(steps[0])
    evals = [e for e in state.log_history if "eval_accuracy" in e]
    assert evals[0]["step"] == 0 and evals[0] is state.log_history[0]   # evaluate() before train() comes first
    assert [e["step"] for e in evals[1:]] == [0, 2, 4, 4]   # the run's (eval_on_start, eval_steps, end), then evaluate()'s
    assert "test_accuracy" in state.log_history[-1]
    assert isinstance(trainer.model, PeftModel) and trainer.processing_class is not None
    assert out.metrics["train_loss"] == out.training_loss and out.metrics["epoch"] > 0
    trainer.save_metrics("train", out.metrics)
    trainer.save_state()
    assert json.loads((tmp_path / "out" / "trainer_state.json").read_text())["global_step"] == 4
    assert json.loads((tmp_path / "out" / "all_results.json").read_text())["train_loss"] == out.training_loss
    trainer.accelerator.print("done")
    trainer.end()
    with pytest.raises(AttributeError, match="GRPOTrainer.push_to_hub: not in lowmem-grpo's GRPOTrainer"):
        trainer.push_to_hub()


def test_evaluate_without_an_eval_set_is_trls_error(tiny_model_dir, tmp_path):
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[digit_reward], args=_args(tmp_path),
                          train_dataset=[{"prompt": "1+1="}], log=lambda *a: None)
    with pytest.raises(TRLCompatError, match="evaluate: no eval_dataset"):
        trainer.evaluate()
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[digit_reward], args=_args(tmp_path),
                          train_dataset=[{"prompt": "1+1=", "answer": "2"}], log=lambda *a: None,
                          eval_dataset=[{"prompt": "2+2=", "answer": "4"}])   # eval_strategy "no": evaluate() still can
    assert trainer.recipe.data.eval_path == "" and trainer.evaluate()["eval_prompts"] == 1


def test_save_model_before_train_says_to_train_first(tiny_model_dir, tmp_path):
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[digit_reward], args=_args(tmp_path),
                          train_dataset=[{"prompt": "1+1=", "answer": "2"}], log=lambda *a: None)
    with pytest.raises(TRLCompatError, match="save_model: .* has no checkpoint yet .*call train"):
        trainer.save_model(str(tmp_path / "final"))


# -- third audit: log_history and on_log as transformers and TRL log them ------------------------------------------


def _recorder():
    from transformers import TrainerCallback

    class Record(TrainerCallback):
        def __init__(self):
            self.logs, self.step_ends = [], []

        def on_log(self, args, state, control, logs=None, **kw):
            self.logs.append(dict(logs))

        def on_step_end(self, args, state, control, **kw):
            self.step_ends.append(state.global_step)

    return Record()


def test_log_history_and_on_log_come_every_logging_steps_with_the_windows_means(tiny_model_dir, tmp_path):
    """Were an entry per step whatever logging_steps said, holding lists, None, bools and strings."""
    record = _recorder()
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[digit_reward], callbacks=[record],
                          train_dataset=[{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(6)],
                          args=_args(tmp_path, max_steps=5, logging_steps=2), log=lambda *a: None)
    out = trainer.train()
    history = trainer.state.log_history
    assert [e["step"] for e in history] == [2, 4, 5]   # every 2 updates, none forced at the last, then the summary
    rows = {r["step"]: r for r in read_metrics(tmp_path / "out") if "loss" in r}
    assert history[0]["loss"] == pytest.approx((rows[1]["loss"] + rows[2]["loss"]) / 2)   # the window's mean
    assert history[1]["reward"] == pytest.approx((rows[3]["reward/mean"] + rows[4]["reward/mean"]) / 2)
    assert history[1]["grad_norm"] == rows[4]["grad_norm"]   # transformers logs the last step's
    summary = history[-1]
    assert set(summary) == {"train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos",
                            "train_loss", "epoch", "step"}
    assert summary["train_loss"] == pytest.approx(sum(r["loss"] for r in rows.values()) / 5) == out.training_loss
    assert record.logs == [{k: v for k, v in e.items() if k != "step"} for e in history]   # live and rebuilt agree
    assert record.step_ends == [1, 2, 3, 4, 5]
    assert all(type(v) in (int, float) and math.isfinite(v) for e in history for v in e.values()), history
    assert "sample" not in history[0] and "success_rate/hist" not in history[0] and "nonfinite" in history[0]


def test_a_step_that_trained_on_nothing_is_logged_with_loss_0_as_trl_logs_it(tiny_model_dir, tmp_path):
    """mask_truncated_completions with every completion truncated: the step's row has no loss. Was: no on_step_end,
    no on_log, an empty log_history and a training_loss of nan; TRL makes the step with loss 0 and logs it."""
    record = _recorder()
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[digit_reward], callbacks=[record],
                          train_dataset=[{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(4)],
                          args=_args(tmp_path, max_steps=2, logging_steps=1, max_completion_length=1,
                                     mask_truncated_completions=True), log=lambda *a: None)
    out = trainer.train()
    rows = [r for r in read_metrics(tmp_path / "out") if "lr" in r]
    assert len(rows) == 2 and all("loss" not in r and r["completion/truncated_fraction"] == 1 for r in rows)
    assert record.step_ends == [1, 2]
    assert [e.get("loss") for e in trainer.state.log_history] == [0.0, 0.0, None]   # (then the summary)
    assert out.training_loss == 0.0 and trainer.state.log_history[-1]["train_loss"] == 0.0


def test_a_non_finite_steps_loss_reads_alike_live_and_replayed_and_stays_out_of_train_loss(tiny_model_dir, tmp_path):
    """A NaN loss (a non-finite step: its row says nonfinite) was absent from a live on_log but 0.0 in the log_history
    replayed from metrics.jsonl (which keeps NaN as null), and train_loss averaged it in as 0 (a red team's find)."""
    from lowmem_grpo.metrics import json_line
    from lowmem_grpo.trl import _RunLog

    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[digit_reward], train_dataset=[{"prompt": "1+1="}],
                          args=_args(tmp_path, max_steps=2, logging_steps=1), log=lambda *a: None)
    rows = [{"step": 1, "loss": 0.5, "reward/mean": 0.2, "lr": 1e-5, "nonfinite": False},
            {"step": 2, "loss": float("nan"), "reward/mean": 0.2, "lr": 1e-5, "nonfinite": True},
            {"step": 3, "reward/mean": 0.2, "lr": 1e-5}]   # trained on nothing: no loss, TRL's 0
    stored = [json.loads(json_line(row)) for row in rows]   # as metrics.jsonl keeps them
    live, replayed = _RunLog(trainer.recipe, trainer._epoch), _RunLog(trainer.recipe, trainer._epoch)
    for row, back in zip(rows, stored):
        live.add(row)
        replayed.add(back)
    assert live.entries == replayed.entries
    assert [e.get("loss") for e in live.entries] == [0.5, None, 0.0]
    assert trainer._train_summary(stored, 0, 3, 1.0)["train_loss"] == 0.25   # (0.5 + 0) / 2: the NaN left out


def test_on_log_has_trls_names_for_what_this_trainer_logs_too(tiny_model_dir, tmp_path):
    """TRL's metric names beside ours, a reward's log_metric under its own name, rewards/<TRL's name>/mean, and no kl
    with beta 0 (was None)."""
    def counted(completions, log_metric, **kwargs):
        log_metric("mean_chars", sum(map(len, completions)) / len(completions))
        return [1.0] * len(completions)

    record = _recorder()
    trainer = GRPOTrainer(model=str(tiny_model_dir), callbacks=[record],
                          reward_funcs=[counted, functools.partial(length_reward, target=2), ExactMatch()],
                          train_dataset=[{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(4)],
                          args=_args(tmp_path, max_steps=1, logging_steps=1), log=lambda *a: None)
    trainer.train()
    logs, (row,) = record.logs[0], [r for r in read_metrics(tmp_path / "out") if "loss" in r]
    pairs = {"completions/clipped_ratio": "completion/truncated_fraction", "frac_reward_zero_std": "zero_std_fraction",
             "clip_ratio/low_mean": "clip/low", "clip_ratio/high_mean": "clip/high",
             "clip_ratio/region_mean": "clip/fraction", "mean_chars": "reward_metric/mean_chars"}
    assert {trl: logs.get(trl) for trl in pairs} == {trl: row[ours] for trl, ours in pairs.items()}
    assert {"rewards/counted/mean", "rewards/length_reward/mean", "rewards/ExactMatch/std"} <= set(logs)
    assert "kl" not in logs and row["kl"] is None
    assert "mean_chars" not in row   # metrics.jsonl keeps its own name



def test_a_resumed_runs_callbacks_see_the_log_history_the_state_rebuilds(tiny_model_dir, tmp_path):
    """The callbacks' state.log_history on resume starts from the run's earlier entries (as transformers' state
    restored from the checkpoint), and the logging window spans the resume as trainer.state's does."""
    from transformers import TrainerCallback

    class Keep(TrainerCallback):
        def on_train_begin(self, args, state, control, train_dataloader, eval_dataloader, **kw):
            self.begin = (state.global_step, train_dataloader, eval_dataloader)

        def on_train_end(self, args, state, control, **kw):
            self.history = list(state.log_history)

    def trainer(steps, callbacks=()):
        return GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[digit_reward], callbacks=list(callbacks),
                           train_dataset=[{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(4)],
                           args=_args(tmp_path, max_steps=steps, logging_steps=2, save_steps=1), log=lambda *a: None)
    trainer(3).train()
    keep = Keep()
    resumed = trainer(4, [keep])
    resumed.train(resume_from_checkpoint=True)
    assert [e["step"] for e in keep.history] == [2, 4, 4]   # step 4's window holds steps 3 and 4, then the summary
    assert keep.history == resumed.state.log_history
    # as transformers: the checkpoint's global_step at on_train_begin, and its dataloaders (None here) named in every
    # event (were 0, and missing: a TypeError for a callback naming them; found by a red team)
    assert keep.begin == (3, None, None)


def test_normalize_then_sum_normalises_within_groups_whatever_scale_rewards_says():
    """TRL's normalize_then_sum branch (grpo_trainer.py) normalises each function within its groups and ignores
    scale_rewards; here scale_rewards 'batch' or 'none' changed the per-function step (0.31 against TRL's 0.71 for
    one completion, an audit found). The recipe keeps group scaling under normalize_then_sum."""
    for scale in ("group", "batch", "none"):
        d = _recipe(multi_objective_aggregation="normalize_then_sum", scale_rewards=scale)
        assert (d["algorithm"]["reward_aggregation"], d["algorithm"]["scale_rewards"]) == ("normalize_then_sum", "group")
    assert _recipe(scale_rewards="batch")["algorithm"]["scale_rewards"] == "batch"


def test_a_data_error_names_the_datasets_row_and_trls_setting(tiny_model_dir, tmp_path):
    """Found by an audit: a prompt over max_prompt_length failed train() with the recipe's words ("over
    data.max_prompt_tokens=2 (set data.on_bad_row: skip ...)"), a key and a setting the script does not have. It
    names the dataset's row as dataset[i] and TRL's argument now."""
    rows = [{"prompt": "1+1="}, {"prompt": "12+34="}]
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[digit_reward], train_dataset=rows,
                          args=_args(tmp_path, max_prompt_length=2), log=lambda *a: None)
    with pytest.raises(TRLCompatError) as err:
        trainer.train()
    message = str(err.value)
    assert "train_dataset[0]: prompt is 5 tokens, over max_prompt_length=2 (fix that row; if only some rows are " \
        "like this, drop them: dataset.filter(...))" in message, message
    assert "data." not in message and "on_bad_row" not in message


def test_save_strategy_is_read_not_ignored():
    """It was ignored: checkpoints followed save_steps whatever it said. 'epoch' saves every epoch's steps, 'no' the
    run's last step only (which save_model() exports), 'best' (no metric_for_best_model here) is refused."""
    assert _recipe(rows=10, save_steps=2)["output"]["save_every"] == 2   # (steps: TRL's 8 prompts' batch of G = 8)
    d = _recipe(rows=24, per_device_train_batch_size=8, num_generations=4, save_strategy="epoch")
    assert d["output"]["save_every"] == 24 // d["train"]["prompts_per_step"]
    d = _recipe(rows=10, max_steps=7, save_strategy="no")
    assert d["output"]["save_every"] == d["train"]["steps"] == 7
    with pytest.raises(TRLCompatError, match="save_strategy: 'best' is not here"):
        _recipe(save_strategy="best")


def test_under_torchrun_a_generation_batch_is_every_processs_as_in_trl():
    """TRL's generation batch is per_device_train_batch_size x processes x steps_per_generation: under torchrun a
    step here had one process's batch (found by a red team), and per_device_train_batch_size=2 with G = 2 on two
    processes was refused (1 prompt a step among 2)."""
    def step(processes, **given):
        d = recipe_from_trl({"num_generations": 2, **given}, model="m", train_path="t", reward_specs=SPEC,
                            train_rows=64, processes=processes)
        return d["train"]["prompts_per_step"], d["train"]["micro_batch_size"], d["algorithm"].get("minibatches", 1)

    assert step(1, per_device_train_batch_size=4) == (2, 4, 1)
    assert step(2, per_device_train_batch_size=4) == (4, 4, 1)
    assert step(2, per_device_train_batch_size=2) == (2, 2, 1)
    assert step(2, per_device_train_batch_size=2, steps_per_generation=2) == (4, 2, 2)
    # generation_batch_size is the whole batch: 8 completions are 2 micro-batches of 2 in each of 2 processes
    assert step(2, per_device_train_batch_size=2, generation_batch_size=8) == (4, 2, 2)
    with pytest.raises(TRLCompatError, match=r"must be a multiple of per_device_train_batch_size \(2\) x 2 processes"):
        step(2, per_device_train_batch_size=2, generation_batch_size=6)


# -- fourth audit (a red team): what TRL or transformers refuse or honour, and lowmem_grpo.trl did not ---------------


@pytest.mark.parametrize("kind", ["IA3Config", "LoHaConfig", "LoKrConfig", "AdaLoraConfig", "PromptTuningConfig", "dict"])
def test_a_peft_config_that_is_not_a_plain_lora_config_is_refused_naming_its_class(kind):
    """IA3 crashed with AttributeError 'r', LoHa/LoKr with 'lora_alpha', AdaLoRA (a LoraConfig subclass) with its own
    ValueError, prompt tuning was refused as 'num_virtual_tokens not supported', a dict was a TypeError."""
    import peft

    made = {"IA3Config": lambda: peft.IA3Config(task_type="CAUSAL_LM"),
            "LoHaConfig": lambda: peft.LoHaConfig(r=4, target_modules=["q_proj"]),
            "LoKrConfig": lambda: peft.LoKrConfig(r=4, target_modules=["q_proj"]),
            "AdaLoraConfig": lambda: peft.AdaLoraConfig(init_r=4, total_step=10, target_modules=["q_proj"]),
            "PromptTuningConfig": lambda: peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
            "dict": lambda: {"r": 4, "lora_alpha": 8}}[kind]()
    with pytest.raises(TRLCompatError, match=rf"^peft_config: {kind} is not supported: lowmem-grpo trains LoRA adapters "
                                             r"only \(peft\.LoraConfig\)$"):
        _lora_section(made, "m")
    lora = _lora_section(peft.LoraConfig(r=4, lora_alpha=8, target_modules=["v_proj", "q_proj"]), "m")
    assert lora == {"r": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}


def test_generation_batch_size_with_steps_per_generation_is_refused_as_trl_refuses_it(tmp_path):
    """Both set was accepted and trained another batch than either says; TRL's GRPOConfig raises. TRL's own config
    object fills in both from the one given: that one is read, not refused."""
    trl = pytest.importorskip("trl")
    named = "generation_batch_size and steps_per_generation can not be both configured at the same time, as in TRL"
    with pytest.raises(TRLCompatError, match=named):
        _recipe(generation_batch_size=32, steps_per_generation=4)
    with pytest.raises(TRLCompatError, match=named):
        recipe_from_trl(_given_settings(GRPOConfig("out", generation_batch_size=16, steps_per_generation=2)),
                        model="m", train_path="t", reward_specs=SPEC, train_rows=4)
    with pytest.raises(ValueError, match="can not be both configured at the same time"):
        trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, generation_batch_size=32, steps_per_generation=4)
    for given in (dict(steps_per_generation=4), dict(generation_batch_size=32), dict()):
        theirs = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", **given)
        assert theirs.generation_batch_size and theirs.steps_per_generation   # (TRL's __post_init__ filled both)
        d, ours = (recipe_from_trl(settings, model="m", train_path="t", reward_specs=SPEC, train_rows=64)
                   for settings in (_given_settings(theirs), given))
        assert (d["train"], d["algorithm"]) == (ours["train"], ours["algorithm"]), given


def test_a_max_steps_of_part_of_a_generation_batch_is_refused_naming_the_nearest_whole_ones():
    """max_steps=3 at steps_per_generation=2 ran 4 updates (state.max_steps 4); transformers stops at exactly
    max_steps, which a run of whole generation batches cannot."""
    with pytest.raises(TRLCompatError, match=r"max_steps=3 is not a multiple of the 2 optimizer updates a generation "
                                             r"batch makes .*set max_steps to 2 or 4$"):
        _recipe(max_steps=3, steps_per_generation=2)
    with pytest.raises(TRLCompatError, match=r"max_steps=1 is not a multiple of the 4 .*set max_steps to 4$"):
        _recipe(max_steps=1, num_iterations=2, steps_per_generation=4, gradient_accumulation_steps=2)
    assert _recipe(max_steps=4, steps_per_generation=2)["train"]["steps"] == 2
    assert _recipe(max_steps=3)["train"]["steps"] == 3   # one update a generation batch: any max_steps


def test_resuming_with_no_checkpoint_is_transformers_error_not_a_fresh_run(tiny_model_dir, tmp_path):
    """train(resume_from_checkpoint=True) (or output_dir's path) with nothing to resume trained from scratch."""
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[digit_reward], train_dataset=[{"prompt": "1+1="}],
                          args=_args(tmp_path), log=lambda *a: None)
    for resume in (True, str(tmp_path / "out")):
        with pytest.raises(TRLCompatError, match=r"^resume_from_checkpoint: no valid checkpoint found in output "
                                                 r"directory \(.*out\), as in transformers"):
            trainer.train(resume_from_checkpoint=resume)
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_logging_first_step_logs_after_the_first_step_too(tiny_model_dir, tmp_path):
    """It was ignored: transformers' DefaultFlowCallback logs at global step 1 with it (here: after the first step,
    its window that step alone), then every logging_steps."""
    def run(name, **settings):
        record = _recorder()
        trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[digit_reward], callbacks=[record],
                              train_dataset=[{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(4)],
                              args=_args(tmp_path / name, max_steps=3, logging_steps=2, **settings), log=lambda *a: None)
        trainer.train()
        rows = {r["step"]: r for r in read_metrics(tmp_path / name / "out") if "loss" in r}
        return trainer.state.log_history, record, rows
    history, record, rows = run("first", logging_first_step=True)
    assert [e["step"] for e in history] == [1, 2, 3]   # step 1, step 2 (its window: step 2 alone), the summary
    assert (history[0]["loss"], history[1]["loss"]) == (rows[1]["loss"], rows[2]["loss"])
    assert record.logs == [{k: v for k, v in e.items() if k != "step"} for e in history]   # on_log as log_history
    history, _, _ = run("default")
    assert [e["step"] for e in history] == [2, 3]   # transformers' default: no entry at the first step


def test_logging_strategy_is_read_not_ignored(tiny_model_dir, tmp_path):
    """transformers' logging_strategy was accepted and ignored (found by a red team): a log every logging_steps
    whatever it said. 'epoch' logs every epoch's steps (as save_strategy 'epoch' saves), 'no' no step (but the
    first with logging_first_step, as transformers' DefaultFlowCallback) and no completions table."""
    assert _recipe(rows=10, logging_strategy="epoch", logging_steps=2)["output"]["log_every"] == 10   # 1 prompt a step
    assert _recipe(rows=10, logging_strategy="no", log_completions=True)["output"]["samples_every"] == 0
    with pytest.raises(TRLCompatError, match="logging_strategy: 'best' is not transformers' 'steps', 'epoch' or 'no'"):
        _recipe(logging_strategy="best")

    def logged(name, **settings):
        trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[digit_reward], log=lambda *a: None,
                              train_dataset=[{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(2)],
                              args=_args(tmp_path / name, max_steps=4, logging_steps=1, **settings))
        trainer.train()
        return [e["step"] for e in trainer.state.log_history if "loss" in e]
    assert logged("steps") == [1, 2, 3, 4]
    assert logged("epoch", logging_strategy="epoch") == [2, 4]   # 2 rows, 1 prompt a step
    assert logged("no", logging_strategy="no") == []
    assert logged("no_but_first", logging_strategy="no", logging_first_step=True) == [1]


def test_the_run_evaluates_before_the_first_step_only_with_eval_on_start(tiny_model_dir, tmp_path):
    """With eval_strategy 'steps' the run evaluated at step 0 too, where transformers does only with eval_on_start
    (default False): the recipe's train.eval_at_start (true by default, the CLI's 'before' accuracy) carries it."""
    from lowmem_grpo.recipe import TrainConfig

    assert TrainConfig().eval_at_start is True
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(3) for b in range(3)]

    def evaluated(name, **settings):
        trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[digit_reward], train_dataset=rows[:6],
                              eval_dataset=rows[6:], log=lambda *a: None,
                              args=_args(tmp_path / name, max_steps=2, eval_strategy="steps", eval_steps=1, **settings))
        assert trainer.recipe.train.eval_at_start is bool(settings.get("eval_on_start"))
        trainer.train()
        return [r["step"] for r in read_metrics(tmp_path / name / "out") if "eval/accuracy" in r]
    assert evaluated("default") == [1, 2]
    assert evaluated("on_start", eval_on_start=True) == [0, 1, 2]


# -- fourth audit: refusals collected, a run that made no checkpoint ------------------------------------------------


def test_independent_refusals_of_one_call_come_in_one_error_one_line_each(tiny_model_dir, tmp_path):
    """A script with several unsupported things learned them one run at a time (GRPOTrainer raised at the first)."""
    from peft import IA3Config

    with pytest.raises(TRLCompatError) as caught:
        GRPOTrainer(model=str(tiny_model_dir), reward_funcs=["some/reward-model"], train_dataset={"train": []},
                    args=_args(tmp_path, push_to_hub=True, optim="sgd", sync_ref_model=True),
                    optimizers=(object(), None), callbacks=[42], peft_config=IA3Config(), compute_metrics=len)
    problems = caught.value.problems
    for named in ("GRPOTrainer: compute_metrics not supported", "GRPOTrainer: optimizers is not supported",
                  "callbacks: 42 is not a transformers TrainerCallback", "train_dataset: a dict of datasets",
                  "reward_funcs\\[0\\]: 'some/reward-model': only reward functions", "peft_config: IA3Config",
                  "GRPOConfig: sync_ref_model=True", "GRPOConfig: optim: 'sgd'", "GRPOConfig: push_to_hub: not here"):
        assert sum(bool(re.match(named, p)) for p in problems) == 1, (named, problems)
    assert len(problems) == 9 and str(caught.value).splitlines()[1:] == [f"  {p}" for p in problems]
    assert str(caught.value).startswith("9 arguments cannot be run here (fix each):\n")
    # where later checks read an earlier one's result, the earlier one stops them (the batch arithmetic divides by
    # per_device_train_batch_size), with what was found before it
    with pytest.raises(TRLCompatError) as caught:
        _recipe(push_to_hub=True, per_device_train_batch_size=0, loss_type="nope")
    assert [p.split(":")[1].strip() for p in caught.value.problems] == [
        "loss_type", "push_to_hub", "per_device_train_batch_size must be a whole number >= 1, got 0"]


def test_a_run_that_made_no_checkpoint_is_neither_resumed_nor_trained_over_and_says_so(tiny_model_dir, tmp_path):
    """A first run that failed before its first checkpoint left its metrics: the rerun was told to resume, and the
    resume to train without resuming (found by a red team running trl/scripts/grpo.py)."""
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[digit_reward], train_dataset=[{"prompt": "1+1="}],
                          args=_args(tmp_path), log=lambda *a: None)
    (tmp_path / "out" / "metrics.jsonl").write_text('{"step": 1}\n')
    for resume in (None, True, "true"):
        with pytest.raises(TRLCompatError, match=r"the run there \(its metrics.jsonl\) made no checkpoint, so there is "
                                                 "nothing to resume: delete that folder or use another output_dir$"):
            trainer.train(resume_from_checkpoint=resume)


def test_an_engine_error_names_use_vllm_not_the_recipe_key(tiny_model_dir, tmp_path, monkeypatch):
    """Found by a red team: vLLM's refusals said 'generation.engine=vllm ...; use generation.engine: hf', a recipe
    key the script does not have (it set use_vllm), as a traceback out of train(). Now one TRLCompatError in the
    script's terms."""
    import lowmem_grpo.train as train_module
    from lowmem_grpo.rollout.base import EngineError

    def refuse(*args, **kwargs):
        raise EngineError("generation.engine=vllm is not available (no module named vllm); use generation.engine: hf")

    monkeypatch.setattr(train_module, "make_engine", refuse)
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[digit_reward], train_dataset=[{"prompt": "1+1="}],
                          args=_args(tmp_path), log=lambda *a: None)
    with pytest.raises(TRLCompatError) as err:
        trainer.train()
    assert str(err.value) == "use_vllm=True is not available (no module named vllm); set use_vllm=False"
