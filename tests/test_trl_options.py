"""The options of docs/algorithm.md §13-§18 in the training loop: each trains with its metrics present,
the sampler's log-probs reach the loss, truncated completions and zero-variance groups stay out of the
update, and dynamic sampling's extra draws are counted and replayed on resume.

The formulas themselves are checked against hand evaluations in tests/test_loss_options.py."""

from __future__ import annotations

import ast
import copy
import importlib.util
import re
from pathlib import Path

import pytest
import torch

from conftest import QUIET, recipe_dict, straight_and_resumed
from lowmem_grpo import train as train_mod
from lowmem_grpo.dynamic_sampling import extra_indices
from lowmem_grpo.metrics import read_metrics
from lowmem_grpo.recipe import RecipeError, recipe_from_dict
from lowmem_grpo.train import Trainer


def _recipe(tiny_model_dir, tiny_data, run_dir, algorithm=None, steps=2, train=None, **sections):
    d = recipe_dict(tiny_model_dir, tiny_data, run_dir, train={"steps": steps, "preflight": False, **(train or {})},
                    **sections)
    d["data"]["eval_path"] = ""  # the loop, not the accuracy
    d["algorithm"].update(algorithm or {})
    return d


# option set -> the keys that must hold a number in every step row that trained
OPTIONS = {
    "gspo": ({"importance_sampling_level": "sequence", "mu": 2}, ["clip/fraction"]),
    "gspo_delta": ({"importance_sampling_level": "sequence", "mu": 2, "delta": 1.5}, ["clip/fraction"]),
    "cispo": ({"clip": "cispo", "mu": 2}, ["clip/fraction"]),
    "sapo": ({"clip": "sapo", "mu": 2, "sapo_temperature_neg": 2.0}, ["clip/fraction"]),
    "delta": ({"delta": 1.5, "mu": 2}, ["clip/fraction"]),
    "token_truncate": ({"sampler_correction": "token_truncate"}, ["sampler/weight_mean", "sampler/masked_fraction"]),
    "token_mask": ({"sampler_correction": "token_mask", "sampler_correction_min": 0.5},
                   ["sampler/weight_mean", "sampler/masked_fraction"]),
    "sequence_truncate": ({"sampler_correction": "sequence_truncate"}, ["sampler/weight_mean"]),
    "sequence_mask": ({"sampler_correction": "sequence_mask", "mu": 2}, ["sampler/weight_mean", "sampler/masked_fraction"]),
    "mask_truncated": ({"mask_truncated_completions": True}, []),
    "top_entropy": ({"top_entropy_quantile": 0.2}, ["entropy/threshold", "entropy/kept_fraction"]),
    "top_entropy_mu2": ({"top_entropy_quantile": 0.5, "mu": 2}, ["entropy/threshold", "entropy/kept_fraction"]),
    "entropy_bonus": ({"entropy_coef": 0.01}, ["entropy/coef"]),
    "entropy_target": ({"entropy_coef": 0.01, "entropy_target": 5.0, "entropy_coef_lr": 0.1}, ["entropy/coef"]),
    "kl_ratio_weight": ({"kl_ratio_weight": True, "kl_target": "ref"}, ["kl/ref"]),
    "off_policy_mask": ({"off_policy_mask_threshold": 0.0, "mu": 2}, []),
    "scale_batch": ({"scale_rewards": "batch"}, []),
    "scale_none": ({"scale_rewards": "none"}, []),
    "normalize_then_sum": ({"reward_aggregation": "normalize_then_sum"}, []),
    "dynamic_sampling": ({"dynamic_sampling": True}, ["dynamic/draws", "dynamic/prompts_drawn"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_each_new_option_trains_with_its_metrics(tiny_model_dir, tiny_data, tmp_path, name):
    algorithm, keys = OPTIONS[name]
    d = _recipe(tiny_model_dir, tiny_data, tmp_path / "run", algorithm={"kl_target": "none", **algorithm},
                generation={"num_generations": 4, "max_new_tokens": 6})
    Trainer(recipe_from_dict(d), **QUIET).fit()
    rows = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert len(rows) == 2
    for row in rows:
        assert row["loss"] is not None and torch.isfinite(torch.tensor(row["loss"])), row["loss"]
        for key in keys:
            assert isinstance(row[key], (int, float)), (key, row[key])
    if name == "top_entropy":
        assert all(0.2 <= r["entropy/kept_fraction"] < 0.5 for r in rows)
    if name == "entropy_target":  # entropy below the 5-nat target: the coefficient grows step by step
        assert rows[0]["entropy/coef"] == 0.01 and rows[1]["entropy/coef"] > 0.01
        expected = 0.01 + 0.1 * (5.0 - rows[0]["entropy"])
        assert rows[1]["entropy/coef"] == pytest.approx(expected, rel=1e-12)


def test_the_hf_engine_reports_the_sampled_tokens_log_probs(tiny_model_dir, tiny_data, tmp_path):
    """The transformers engine's recorded log-probs are those the trainer computes at the same weights (no
    top-p/top-k: the same distribution), so the correction's weights start at 1 (§15)."""
    d = _recipe(tiny_model_dir, tiny_data, tmp_path / "run", algorithm={"sampler_correction": "token_mask"},
                generation={"num_generations": 4, "max_new_tokens": 6, "temperature": 0.7})
    Trainer(recipe_from_dict(d), **QUIET).fit()
    rows = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert all(r["rollout/logprob_abs_diff_max"] < 1e-4 for r in rows), [r["rollout/logprob_abs_diff_max"] for r in rows]
    assert all(abs(r["sampler/weight_mean"] - 1) < 1e-4 and r["sampler/masked_fraction"] == 0 for r in rows)


def test_sampler_mismatch_is_corrected_and_masked(tiny_model_dir, tiny_data, tmp_path, monkeypatch):
    """An engine whose reported log-probs are off by +-1 nat on alternate tokens: token_mask drops the
    tokens whose ratio e^1 or e^-1 falls outside [0.5, 2], token_truncate caps e^1 at the max."""
    from lowmem_grpo.rollout.hf import HFEngine

    real = HFEngine.generate

    def skewed(self, prompts, params):
        out = real(self, prompts, params)
        for c in out:
            c.logprobs = [lp + (1.0 if k % 2 else -1.0) for k, lp in enumerate(c.logprobs)]
        return out

    monkeypatch.setattr(HFEngine, "generate", skewed)
    seen = {}
    for mode in ("token_mask", "token_truncate"):
        d = _recipe(tiny_model_dir, tiny_data, tmp_path / mode, steps=1, generation={"num_generations": 4, "max_new_tokens": 6},
                    algorithm={"sampler_correction": mode, "sampler_correction_min": 0.5, "sampler_correction_max": 2.0})
        Trainer(recipe_from_dict(d), **QUIET).fit()
        seen[mode] = read_metrics(tmp_path / mode)[-2 if d["data"]["eval_path"] else -1]
    assert seen["token_mask"]["sampler/masked_fraction"] > 0.9       # every token's ratio is e or 1/e
    e = torch.e
    # truncate: tokens at ratio 1/e keep it, tokens at e are capped at 2 -> the mean lies strictly between
    assert 1 / e < seen["token_truncate"]["sampler/weight_mean"] < 2
    assert seen["token_truncate"]["sampler/masked_fraction"] == 0


def test_truncated_completions_stay_out_of_the_update(tiny_model_dir, tiny_data, tmp_path, monkeypatch):
    packed = []
    real = Trainer.pack

    def spy(self, examples, completions, advantages, keep):
        packed.append([completions[i].truncated for i in keep])
        return real(self, examples, completions, advantages, keep)

    monkeypatch.setattr(Trainer, "pack", spy)
    d = _recipe(tiny_model_dir, tiny_data, tmp_path / "run", steps=3, algorithm={"mask_truncated_completions": True},
                generation={"num_generations": 4, "max_new_tokens": 3})
    Trainer(recipe_from_dict(d), **QUIET).fit()
    rows = [r for r in read_metrics(tmp_path / "run") if "step" in r]
    assert any(r["completion/truncated_fraction"] > 0 for r in rows)  # there were some to leave out
    assert packed and not any(any(p) for p in packed)


def test_extra_draws_are_a_pure_function_of_seed_step_and_draw():
    a = extra_indices(1000, 8, step=5, draw=2, seed=3)
    assert a == extra_indices(1000, 8, step=5, draw=2, seed=3) and len(set(a)) == 8
    assert a != extra_indices(1000, 8, step=5, draw=1, seed=3) and a != extra_indices(1000, 8, step=6, draw=2, seed=3)
    assert sorted(extra_indices(5, 8, 0, 1, 0)) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError):
        extra_indices(10, 2, 0, 0, 0)


def _binary(d):
    """A binary reward with mixed odds on a random model, so that some groups have contrast and some not."""
    d["rewards"] = {"functions": [{"function": "user_rewards:even_code_sum"}]}
    return d


@pytest.mark.slow
def test_dynamic_sampling_trains_only_groups_with_contrast_and_counts_the_extra(tiny_model_dir, tiny_data, tmp_path,
                                                                                 monkeypatch):
    packed = []
    real = Trainer.pack

    def spy(self, examples, completions, advantages, keep):
        packed.append((len(examples), advantages.view(len(examples), -1).clone(), list(keep)))
        return real(self, examples, completions, advantages, keep)

    monkeypatch.setattr(Trainer, "pack", spy)
    d = _binary(_recipe(tiny_model_dir, tiny_data, tmp_path / "run", steps=4, algorithm={"dynamic_sampling": True},
                        generation={"num_generations": 4, "max_new_tokens": 2}, train={"prompts_per_step": 4}))
    Trainer(recipe_from_dict(d), **QUIET).fit()
    rows = [r for r in read_metrics(tmp_path / "run") if "step" in r]
    assert len(packed) == len(rows) == 4
    for (groups, adv, keep), row in zip(packed, rows):
        assert groups == 4 - row["dynamic/groups_short"]
        assert (adv.abs().sum(dim=1) > 0).all(), adv            # no zero-variance group reaches the update
        assert row["zero_std_fraction"] == 0
        assert row["dynamic/extra_rollouts"] == (row["dynamic/prompts_drawn"] - 4) * 4
        assert row["dynamic/prompts_drawn"] == 4 * (1 + row["dynamic/draws"])
    assert sum(r["dynamic/groups_discarded"] for r in rows) > 0   # the task has zero-variance groups to replace
    assert sum(r["dynamic/extra_rollouts"] for r in rows) > 0


@pytest.mark.slow
def test_dynamic_sampling_resumes_to_the_same_metrics(tiny_model_dir, tiny_data, tmp_path):
    d = _binary(_recipe(tiny_model_dir, tiny_data, tmp_path / "full", steps=4, algorithm={"dynamic_sampling": True},
                        generation={"num_generations": 4, "max_new_tokens": 2}, output={"save_every": 2}))
    full, cut, _ = straight_and_resumed(d, tmp_path)
    assert cut == full and sorted(full) == [1, 2, 3, 4]
    straight = {r["step"]: r for r in read_metrics(tmp_path / "full") if "loss" in r}
    resumed = {r["step"]: r for r in read_metrics(tmp_path / "cut") if "loss" in r}
    for step in (3, 4):
        for key in ("dynamic/prompts_drawn", "dynamic/groups_discarded", "reward/mean", "loss"):
            assert resumed[step][key] == straight[step][key], (step, key)


@pytest.mark.parametrize("algorithm, field", [
    ({"scale_rewards": "batch", "advantage": "rloo"}, "algorithm.scale_rewards"),
    ({"kl_ratio_weight": True, "kl_target": "none"}, "algorithm.kl_ratio_weight"),
    ({"importance_sampling_level": "sequence", "clip": "target", "mu": 2}, "algorithm.importance_sampling_level"),
    ({"importance_sampling_level": "sequence", "epsilon_high": 0.28}, "algorithm.epsilon_high"),
    ({"sequence_epsilon_low": 1e-3}, "algorithm.sequence_epsilon_low"),
    ({"clip": "cispo", "epsilon_low": 0.1}, "algorithm.epsilon_low"),
    ({"cispo_max_weight": 3.0}, "algorithm.cispo_max_weight"),
    ({"sapo_temperature_neg": 2.0}, "algorithm.sapo_temperature_neg"),
    ({"clip": "sapo", "epsilon_high": 0.28}, "algorithm.epsilon_high"),
    ({"delta": 1.1}, "algorithm.delta"),
    ({"delta": 2.0, "clip": "cispo"}, "algorithm.delta"),
    ({"sampler_correction": "token_mask", "sampler_correction_min": 3.0}, "algorithm.sampler_correction_min"),
    ({"dynamic_sampling": True, "skip_zero_std_groups": True}, "algorithm.skip_zero_std_groups"),
    ({"top_entropy_quantile": 0.0}, "algorithm.top_entropy_quantile"),
    ({"sampler_correction": "tokens"}, "algorithm.sampler_correction"),
    ({"vespo_k_pos": 1.0}, "algorithm.vespo_k_pos"),
    ({"clip": "vespo", "sampler_correction": "sequence_mask"}, "algorithm.sampler_correction"),
    ({"clip": "vespo", "epsilon_high": 0.28}, "algorithm.epsilon_high"),
])
def test_impossible_combinations_name_the_field(tiny_model_dir, tiny_data, tmp_path, algorithm, field):
    d = recipe_dict(tiny_model_dir, tiny_data, tmp_path)
    d["algorithm"] = copy.deepcopy(algorithm)
    with pytest.raises(RecipeError) as exc:
        recipe_from_dict(d)
    assert field in [k for k, _ in exc.value.problems], exc.value.problems


def test_defaults_leave_the_loss_unchanged(tiny_model_dir, tiny_data, tmp_path, monkeypatch):
    """The new options at their defaults pass nothing that changes the loss: grpo_token_loss sees token
    level, no delta, no policy weight, no entropy term."""
    calls = []
    real = train_mod.grpo_token_loss

    def spy(*args, **kwargs):
        calls.append({**vars(args[4]), **kwargs})   # the run's LossOptions and the batch's arguments
        return real(*args, **kwargs)

    monkeypatch.setattr(train_mod, "grpo_token_loss", spy)
    d = _recipe(tiny_model_dir, tiny_data, tmp_path / "run", steps=1)
    Trainer(recipe_from_dict(d), **QUIET).fit()
    assert calls and all(c["level"] == "token" and c["delta"] is None and c["pg_weight"] is None
                         and c["entropy"] is None and c["entropy_coef"] == 0 for c in calls)


# ----------------------------------------------------------------------------------------------------
# README "Coming from TRL" against the installed TRL's GRPOConfig (read from its source: importing trl is slow)

def _class_defaults(path: Path, name: str) -> dict:
    """{field: default} of the dataclass `name` in the file `path`: each annotated class attribute, its
    field(default=...) as a Python literal (the source text when it is not one; '(none)' without a default)."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ClassDef) and node.name == name:
            out = {}
            for st in node.body:
                if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
                    default = "(none)"
                    value = st.value
                    if isinstance(value, ast.Call):
                        value = next((kw.value for kw in value.keywords if kw.arg == "default"), None)
                    if value is not None:
                        try:
                            default = ast.literal_eval(value)
                        except ValueError:
                            default = ast.unparse(value)
                    out[st.target.id] = default
            return out
    raise AssertionError(f"no class {name} in {path}")


def _trl_configs() -> tuple[dict, dict]:
    """({GRPO-specific GRPOConfig field: default}, {every field GRPOConfig has: its default}) of the installed
    TRL; GRPO-specific: not a transformers TrainingArguments field."""
    trl, transformers = (importlib.util.find_spec(n) for n in ("trl", "transformers"))
    if trl is None:
        pytest.skip("trl is not installed (the test extra)")
    trl_dir, tf_dir = Path(trl.origin).parent / "trainer", Path(transformers.origin).parent
    training_args = _class_defaults(tf_dir / "training_args.py", "TrainingArguments")
    base = _class_defaults(trl_dir / "base_config.py", "_BaseConfig")
    grpo = _class_defaults(trl_dir / "grpo_config.py", "GRPOConfig")
    return ({k: v for k, v in grpo.items() if k not in training_args}, {**training_args, **base, **grpo})


def _trl_section() -> str:
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    return text.split("### Coming from TRL", 1)[1].split("\n## ", 1)[0]


def test_every_grpo_config_field_is_in_the_readmes_trl_section():
    """Each GRPO setting a TRL user knows is mapped to a recipe key in the table, or named as not here (yet)."""
    specific, _ = _trl_configs()
    named = set(re.findall(r"`(\w+)", _trl_section()))
    assert len(specific) > 50
    assert not sorted(set(specific) - named), sorted(set(specific) - named)


def test_the_trl_defaults_the_readme_states_are_trls():
    """The section's list of TRL defaults that are not ours ("`name: value`") holds TRL's actual defaults."""
    _, every = _trl_configs()
    section = _trl_section()
    assert "TRL defaults that are not ours" in section
    listed = section.split("TRL defaults that are not ours", 1)[1].split("\n\n", 1)[0]
    claims = re.findall(r"`(\w+): ([^`]+)`", listed)
    claims = [(k, v) for k, v in claims if k in every]   # (`algorithm.kl_target: ref` is ours)
    assert len(claims) >= 8, claims
    wrong = [(k, v, every[k]) for k, v in claims if str(every[k]) != v]
    assert not wrong, wrong


@pytest.mark.parametrize("value, meant", [(True, "group"), (False, "none"), ("batch", "batch")])
def test_trls_boolean_scale_rewards_is_read_as_trl_means_it(value, meant):
    from lowmem_grpo.recipe import AlgorithmConfig

    assert AlgorithmConfig(scale_rewards=value).scale_rewards == meant
