"""Optimizers and learning-rate schedules built from config.

Schedules are stepped once per optimizer step, so warmup is smooth and short runs behave; their
lengths are given in epochs and converted with the run's steps per epoch. `steplr`, `cosine` and
`none` are a `LambdaLR` of a closed-form factor (linear warmup, then the schedule); `onecycle` is
torch's `OneCycleLR`, whose rising phase plays the warmup.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, OneCycleLR

from accelexp.errors import ConfigError
from accelexp.schema import OptimizerConfig, SchedulerConfig


def build_optimizer(
    cfg: OptimizerConfig, params: Iterable[torch.nn.Parameter], lr: float, **kernels: bool
) -> torch.optim.Optimizer:
    """`lr` is given apart from `cfg`: the strategy may have scaled `cfg.lr` by the world size.
    `kernels` choose the step's implementation (`foreach=` / `fused=`, see `accelexp.speed`)."""
    if cfg.name == "sgd":
        return torch.optim.SGD(
            params,
            lr=lr,
            momentum=cfg.momentum,
            weight_decay=cfg.weight_decay,
            nesterov=cfg.nesterov,
            **kernels,
        )
    if cfg.name == "adamw":
        return torch.optim.AdamW(
            params,
            lr=lr,
            betas=tuple(cfg.betas),
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            **kernels,
        )
    raise ConfigError(f"optimizer.name={cfg.name!r} is unknown: expected sgd or adamw")


def lr_factor(cfg: SchedulerConfig, steps_per_epoch: int, epochs: int) -> Callable[[int], float]:
    """The lr multiplier at optimizer step `step` (0-based) for steplr / cosine / none."""
    warmup = round(cfg.warmup_epochs * steps_per_epoch)
    total = epochs * steps_per_epoch

    def factor(step: int) -> float:
        if step < warmup:
            return cfg.warmup_start_factor + (1 - cfg.warmup_start_factor) * step / warmup
        if cfg.name == "steplr":
            return cfg.gamma ** (step // (cfg.step_size * steps_per_epoch))
        if cfg.name == "cosine":
            progress = (step - warmup) / max(1, total - warmup)
            return cfg.min_lr_factor + (1 - cfg.min_lr_factor) * 0.5 * (
                1 + math.cos(math.pi * progress)
            )
        return 1.0

    return factor


def build_scheduler(
    cfg: SchedulerConfig, optimizer: torch.optim.Optimizer, steps_per_epoch: int, epochs: int
) -> LRScheduler:
    if cfg.name == "onecycle":
        pct_start = cfg.warmup_epochs / epochs if cfg.warmup_epochs > 0 else cfg.pct_start
        return OneCycleLR(
            optimizer,
            max_lr=[group["lr"] for group in optimizer.param_groups],
            total_steps=epochs * steps_per_epoch,
            pct_start=pct_start,
            div_factor=cfg.div_factor,
            final_div_factor=cfg.final_div_factor,
            cycle_momentum=False,  # keep optimizer.momentum / betas as configured
        )
    if cfg.name in ("steplr", "cosine", "none"):
        return LambdaLR(optimizer, lr_factor(cfg, steps_per_epoch, epochs))
    raise ConfigError(
        f"scheduler.name={cfg.name!r} is unknown: expected steplr, cosine, onecycle or none"
    )
