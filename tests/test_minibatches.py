"""algorithm.minibatches (docs/algorithm.md §7): a batch of rollouts cut into mini-batches, an optimizer update
each, mu passes over them."""

import pytest
import torch

from lowmem_grpo import diagnostics as diag
from lowmem_grpo.batch import minibatches, trained_completions
from lowmem_grpo.metrics import PhaseTimer, read_metrics
from lowmem_grpo.model import trainable_parameters
from lowmem_grpo.recipe import RecipeError, recipe_from_dict
from lowmem_grpo.rollout.turns import prompt_ids
from lowmem_grpo.optim import make_optimizer
from lowmem_grpo.train import Trainer

from conftest import QUIET, recipe_dict


def test_cut_in_order_into_near_equal_parts():
    assert minibatches(list(range(8)), 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert minibatches(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert minibatches([4, 9], 5) == [[4], [9]]           # never an empty mini-batch
    assert minibatches([3, 1, 2], 1) == [[3, 1, 2]]


def test_a_pass_row_averages_numbers_and_keeps_flags_and_the_stop():
    rows = [{"loss": 1.0, "kl": None, "nonfinite": False, "update/stop": None},
            {"loss": 3.0, "kl": None, "nonfinite": True, "update/stop": None},
            {"update/stop": "unclipped_fraction", "update/unclipped_fraction": 0.1}]
    assert diag.mean_row(rows) == {"loss": 2.0, "kl": None, "nonfinite": True, "update/stop": "unclipped_fraction",
                                   "update/unclipped_fraction": 0.1}
    one = {"loss": 0.7, "grad_norm": 1.5, "update/stop": None}
    assert diag.mean_row([one]) == one                    # minibatches = 1: the update's own row


def _plain_logprobs(model, prompt: list, completion: list, temperature: float) -> torch.Tensor:
    """log pi(o_t | q, o_<t) by one full forward and log_softmax: the obviously-correct reference."""
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1: len(prompt) + len(completion) - 1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def test_each_update_is_the_plain_loss_of_its_mini_batch_at_the_weights_then(tiny_model_dir, tiny_data, tmp_path):
    """Two mini-batches, one pass: the trainer's weights after its two updates equal a plain loop's: log-probs
    by a full forward, each mini-batch's token-mean clipped loss against the rollout weights' log-probs,
    backward, clip the norm, AdamW step; the second mini-batch seen at the weights the first update left."""
    eps = 0.2
    r = recipe_from_dict(recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run",
                                     algorithm={"kl_target": "none", "aggregation": "token_mean", "minibatches": 2,
                                                "epsilon_low": eps, "epsilon_high": eps},
                                     train={"steps": 1, "prompts_per_step": 2, "micro_batch_size": 3},
                                     generation={"num_generations": 4, "max_new_tokens": 4, "temperature": 0.9},
                                     optimizer={"lr": 3e-2}))
    t = Trainer(r, **QUIET)
    examples = t.select_prompts()
    drawn = t.rollout(examples, PhaseTimer())
    adv = t.advantages(drawn.result).view(-1)
    keep = trained_completions(drawn.result.total, 4, False)
    assert adv[keep].abs().sum() > 0, "no contrast: the test would compare two non-updates"
    params = trainable_parameters(t.model)
    start = [p.detach().clone() for p in params]

    # the trainer
    parts = [t.pack(drawn.examples, drawn.completions, adv, part) for part in minibatches(keep, 2)]
    t.no_grad_logprobs([mb for part in parts for mb in part])
    row = t.run_updates(parts)
    assert row["update/mu_ran"] == 2 and t.scheduler.last_epoch == 2
    ours = [p.detach().clone() for p in params]

    # the plain loop, from the same start
    with torch.no_grad():
        for p, s in zip(params, start):
            p.copy_(s)
    optimizer = make_optimizer(params, r.optimizer)
    seqs = {i: (prompt_ids(drawn.completions[i], drawn.examples[drawn.completions[i].prompt_index]),
                list(drawn.completions[i].token_ids)) for i in keep}
    with torch.no_grad():
        old = {i: _plain_logprobs(t.model, *seqs[i], 0.9) for i in keep}
    for part in (keep[: len(keep) // 2], keep[len(keep) // 2:]):
        optimizer.zero_grad()
        tokens = sum(len(seqs[i][1]) for i in part)
        loss = 0
        for i in part:
            ratio = torch.exp(_plain_logprobs(t.model, *seqs[i], 0.9) - old[i])
            a = adv[i].item()
            loss = loss - torch.minimum(ratio * a, ratio.clamp(1 - eps, 1 + eps) * a).sum() / tokens
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, r.optimizer.max_grad_norm)
        optimizer.step()
    plain = [p.detach().clone() for p in params]

    moved = max((o - s).abs().max().item() for o, s in zip(ours, start))
    assert moved > 1e-3
    assert max((o - q).abs().max().item() for o, q in zip(ours, plain)) < 1e-4 * moved


def _rows(run):
    return [row for row in read_metrics(run) if "loss" in row or "update/stop" in row]


def test_a_run_makes_mu_times_minibatches_updates_a_step(tiny_model_dir, tiny_data, tmp_path):
    d = recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run", train={"steps": 2},
                    algorithm={"kl_target": "mirror", "beta_mirror": 0.05, "mu": 2, "minibatches": 3},
                    optimizer={"schedule": "linear"})
    t = Trainer(recipe_from_dict(d), **QUIET)
    t.fit()
    rows = _rows(tmp_path / "run")
    assert [r["update/mu_ran"] for r in rows] == [6, 6]
    assert t.scheduler.last_epoch == 2 * 6
    assert all(r["kl/mirror"] is not None and r["loss"] is not None for r in rows)


@pytest.mark.parametrize("algorithm, key, words", [
    ({"kl_target": "mirror", "beta_mirror": 0.1}, "kl_target", "minibatches = 1"),
    ({"early_stop_unclipped_fraction": 0.5}, "early_stop_unclipped_fraction", "set mu > 1"),
    ({"early_stop_min_improvement": 0.1, "minibatches": 2}, "early_stop_min_improvement", "with mu = 1"),
    ({"minibatches": 9}, "algorithm.minibatches", "at most 8"),
])
def test_what_needs_several_updates_names_the_field(tiny_model_dir, tiny_data, tmp_path, algorithm, key, words):
    with pytest.raises(RecipeError) as err:
        recipe_from_dict(recipe_dict(tiny_model_dir, tiny_data, tmp_path, algorithm={"beta": 0.04, **algorithm}))
    assert key in str(err.value) and words in str(err.value)
    # a second update per step, by either knob, makes the first three valid
    if "minibatches" not in algorithm:
        recipe_from_dict(recipe_dict(tiny_model_dir, tiny_data, tmp_path, algorithm={**algorithm, "minibatches": 2}))
