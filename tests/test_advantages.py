import math

import torch

from lowmem_grpo.advantages import group_advantages, mode_options, zero_std_groups


def test_binary_rewards_give_the_contrastive_weights():
    """docs/algorithm.md §3: with R in {0,1} and success rate p, mean_std gives +sqrt((1-p)/p) and
    -sqrt(p/(1-p)). (Population std in that derivation; Bessel's correction scales both by sqrt((G-1)/G).)"""
    G = 8
    r = torch.tensor([[1.0, 1, 0, 0, 0, 0, 0, 0]])
    p = 2 / G
    adv = group_advantages(r, "mean_std")
    scale = math.sqrt((G - 1) / G)
    assert abs(adv[0, 0].item() - math.sqrt((1 - p) / p) * scale) < 1e-3
    assert abs(adv[0, 5].item() + math.sqrt(p / (1 - p)) * scale) < 1e-3


def test_variants():
    r = torch.tensor([[1.0, 2.0, 3.0, 6.0]])
    assert torch.allclose(group_advantages(r, "mean"), torch.tensor([[-2.0, -1.0, 0.0, 3.0]]))
    assert torch.allclose(group_advantages(r, "sign"), torch.tensor([[-1.0, -1.0, 0.0, 1.0]]))
    assert torch.allclose(group_advantages(r, "sign", dead_band=1.5), torch.tensor([[-1.0, 0.0, 0.0, 1.0]]))
    assert torch.allclose(group_advantages(r, "rloo"), torch.tensor([[1 - 11 / 3, 2 - 10 / 3, 3 - 3.0, 6 - 2.0]]))


def test_equal_rewards_and_skips():
    r = torch.tensor([[1.0, 1.0, 1.0], [0.0, float("nan"), 1.0], [float("nan"), 1.0, float("nan")]])
    adv = group_advantages(r)
    assert zero_std_groups(r).tolist() == [True, False, True]
    assert (adv[0] == 0).all() and (adv[2] == 0).all()
    assert adv[1, 1] == 0 and adv[1, 0] < 0 < adv[1, 2]


def test_sign_dead_band_is_a_recipe_option():
    from lowmem_grpo.recipe import AlgorithmConfig

    cfg = AlgorithmConfig(advantage="sign", sign_dead_band=0.3)
    r = torch.tensor([[1.0, 0.0, 0.6, 0.45]])  # mean 0.5125
    adv = group_advantages(r, cfg.advantage, **mode_options(cfg))   # (as the trainer passes it)
    assert adv.tolist() == [[1.0, -1.0, 0.0, 0.0]]
    assert mode_options(AlgorithmConfig(advantage="mean_std", sign_dead_band=0.3)) == {}
    assert group_advantages(r, "sign").tolist() == [[1.0, -1.0, 1.0, -1.0]]


def test_every_advantage_the_recipe_allows_has_a_function_and_a_kl_weight():
    """Found by a newcomer audit: a value added to algorithm.advantage (and to ADVANTAGES) passed validate and every
    test, then stopped a default run at its first step, in diagnostics.omega_sum ('unknown advantage mode'). Each
    value of the recipe's Literal has its function and its Omega (docs/algorithm.md §4.3)."""
    from lowmem_grpo.advantages import ADVANTAGES, SCALES
    from lowmem_grpo.diagnostics import omega_sum
    from lowmem_grpo.recipe import algorithm_values

    assert set(ADVANTAGES) == set(algorithm_values("advantage"))
    assert SCALES == algorithm_values("scale_rewards")
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    for mode in algorithm_values("advantage"):
        assert group_advantages(r, mode).shape == r.shape
        assert omega_sum(0.5, mode, group_size=4) > 0
