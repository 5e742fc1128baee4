"""The optimizer and its learning-rate schedule, as the recipe's optimizer section sets them."""

from __future__ import annotations

import math

import torch


def lr_lambda(schedule: str, warmup: int, total: int):
    """The schedule's factor on optimizer.lr after `step` updates: linear warmup, then linear, cosine or constant."""
    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        if schedule == "linear":
            return max(0.0, 1.0 - progress)
        if schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return 1.0
    return f


def make_optimizer(params, cfg):
    """torch AdamW, or bitsandbytes AdamW8bit (GPU-only: its kernels are CUDA; not run in CI)."""
    if cfg.name == "adamw_8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)


def make_scheduler(optimizer, cfg, updates: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The schedule over the run's `updates` optimizer updates (it counts every update, docs/algorithm.md §7)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.schedule, cfg.warmup_steps, updates))


def apply_settings(optimizer, scheduler, cfg) -> None:
    """After a resume loaded the optimizer's and the schedule's state: the recipe's lr, betas and weight decay,
    not the checkpoint's (torch's load_state_dict restores those, so a resume's --set optimizer.lr=... was
    silently ignored). The schedule's position is the checkpoint's."""
    scheduler.base_lrs = [cfg.lr] * len(optimizer.param_groups)
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group.update(lr=cfg.lr * factor(scheduler.last_epoch), initial_lr=cfg.lr, betas=tuple(cfg.betas),
                     weight_decay=cfg.weight_decay)
