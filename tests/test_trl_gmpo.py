"""lowmem_grpo.trl's GMPOConfig / GMPOTrainer: TRL's trl.experimental.gmpo as a drop-in. The recipe is clip gmpo
with GMPOConfig's log-space epsilons and sequence_mean (TRL's GMPO number), the per-class defaults (GMPOConfig's
epsilon 0.4) read right from this module's config and from TRL's own, and what GMPO cannot carry refused by name."""

from __future__ import annotations

import pytest

from lowmem_grpo.recipe import recipe_from_dict
from lowmem_grpo.trl import (GMPOConfig, GMPOTrainer, GRPOConfig, GRPOTrainer, TRLCompatError, _given_settings,
                              recipe_from_trl)
from test_trl_api import SPEC, _args, digit_reward


def _recipe(settings: dict, variant: str = "gmpo") -> dict:
    return recipe_from_trl(settings, model="m", train_path="t.jsonl", reward_specs=SPEC, train_rows=10,
                           variant=variant)


def _trls_gmpo_config(**settings):
    pytest.importorskip("trl")
    from trl.experimental.gmpo import GMPOConfig as TRLGMPOConfig

    return TRLGMPOConfig(output_dir="out", bf16=False, **settings)


def test_gmpo_epsilons_are_the_log_space_bounds_and_the_loss_is_trls():
    a = _recipe({"epsilon": 0.3})["algorithm"]
    assert (a["clip"], a["aggregation"]) == ("gmpo", "sequence_mean")
    assert a["gmpo_epsilon_low"] == a["gmpo_epsilon_high"] == 0.3           # epsilon_high None: epsilon
    assert not {"epsilon_low", "epsilon_high", "sequence_epsilon_low", "cispo_max_weight"} & set(a)
    a = _recipe({"epsilon": 0.3, "epsilon_high": 0.5})["algorithm"]
    assert (a["gmpo_epsilon_low"], a["gmpo_epsilon_high"]) == (0.3, 0.5)
    recipe_from_dict(_recipe({"epsilon": 0.3, "epsilon_high": 0.5}))


def test_gmpo_ignores_loss_type_and_the_kl_bias_correction_as_trls_does():
    # TRL's GMPOTrainer never reads loss_type (any string runs) nor use_bias_correction_kl (its KL is plain k3)
    for loss_type in ("grpo", "cispo", "sapo", "not-a-loss"):
        assert _recipe({"loss_type": loss_type})["algorithm"]["clip"] == "gmpo"
    a = _recipe({"beta": 0.04})["algorithm"]
    assert a["kl_target"] == "ref" and a["beta"] == 0.04 and a["kl_ratio_weight"] is False
    # nor vLLM's importance sampling correction (on by default): the recipe gets none
    assert "sampler_correction" not in _recipe({"use_vllm": True})["algorithm"]
    assert _recipe({"beta": 0.04}, variant="grpo")["algorithm"]["kl_ratio_weight"] is True   # GRPO's still is


def test_this_modules_gmpo_config_defaults_epsilon_to_0_4_and_grpo_reads_it_as_trl():
    config = GMPOConfig("out")
    assert config.epsilon == 0.4 and config.epsilon_high is None
    a = _recipe(_given_settings(config))["algorithm"]
    assert a["gmpo_epsilon_low"] == a["gmpo_epsilon_high"] == 0.4
    # GMPOTrainer given a plain GRPOConfig (TRL allows it): its epsilon 0.2, as a log-space bound
    assert _recipe(_given_settings(GRPOConfig("out")))["algorithm"]["gmpo_epsilon_low"] == 0.2
    # GRPOTrainer given a GMPOConfig (as TRL's): the ratio clip at 0.4
    assert _recipe(_given_settings(config), variant="grpo")["algorithm"]["epsilon_low"] == 0.4


def test_trls_own_gmpo_config_is_read_with_its_own_defaults():
    a = _recipe(_given_settings(_trls_gmpo_config()))["algorithm"]
    assert a["gmpo_epsilon_low"] == a["gmpo_epsilon_high"] == 0.4           # GMPO's default, not GRPO's 0.2
    a = _recipe(_given_settings(_trls_gmpo_config(epsilon=0.3)))["algorithm"]
    assert a["gmpo_epsilon_low"] == a["gmpo_epsilon_high"] == 0.3
    a = _recipe(_given_settings(_trls_gmpo_config(epsilon=0.2, epsilon_high=0.6)))["algorithm"]
    assert (a["gmpo_epsilon_low"], a["gmpo_epsilon_high"]) == (0.2, 0.6)    # 0.2 set: GMPO's 0.4 not kept
    from trl import GRPOConfig as TRLGRPOConfig

    assert "epsilon" not in _given_settings(TRLGRPOConfig(output_dir="out", bf16=False))   # GRPO's unchanged


def test_what_gmpo_cannot_carry_is_refused_naming_the_gmpo_config_setting():
    with pytest.raises(TRLCompatError) as info:
        _recipe({"delta": 2.0, "importance_sampling_level": "sequence", "top_entropy_quantile": 0.5,
                 "vllm_importance_sampling_mode": "token_truncate", "entropy_coef": 0.01})
    message = str(info.value)
    for name in ("delta=2.0", "importance_sampling_level='sequence'", "top_entropy_quantile=0.5",
                 "vllm_importance_sampling_mode='token_truncate'", "entropy_coef=0.01"):
        assert f"GMPOConfig: {name}" in message, (name, message)
    assert "TRL's GMPOTrainer takes only the high-entropy tokens" in message
    for settings in ({"delta": 2.0}, {"importance_sampling_level": "sequence"}, {"top_entropy_quantile": 0.5}):
        _recipe(settings, variant="grpo")   # GRPO's recipe takes each


def test_gmpo_trainer_trains_a_step_and_its_no_args_folder_is_trls(tiny_model_dir, tmp_path, monkeypatch):
    rows = [{"prompt": f"{a}+1=", "answer": str(a + 1)} for a in range(4)]
    trainer = GMPOTrainer(model=str(tiny_model_dir), reward_funcs=[digit_reward], train_dataset=rows,
                          args=_args(tmp_path, epsilon=0.3, logging_steps=1), log=lambda *a: None)
    a = trainer.recipe.algorithm
    assert (a.clip, a.aggregation, a.gmpo_epsilon_low, a.gmpo_epsilon_high) == ("gmpo", "sequence_mean", 0.3, 0.3)
    out = trainer.train()
    assert out.global_step == 1 and out.training_loss == out.training_loss
    monkeypatch.chdir(tmp_path)   # no args: TRL's GMPOConfig(f"{model_name}-GMPO"), epsilon 0.4
    trainer = GMPOTrainer(model=str(tiny_model_dir), reward_funcs=digit_reward, train_dataset=rows, log=lambda *a: None)
    assert trainer.output_dir.name == f"{tiny_model_dir.name}-GMPO"
    assert isinstance(trainer.args, GMPOConfig) and trainer.recipe.algorithm.gmpo_epsilon_low == 0.4
    assert type(GRPOTrainer(model=str(tiny_model_dir), reward_funcs=digit_reward, train_dataset=rows,
                            log=lambda *a: None).args) is GRPOConfig
