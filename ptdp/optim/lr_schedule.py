"""Megatron's learning-rate schedule, a pure function of the iteration (so resuming needs no state)."""

from __future__ import annotations

import math

from ptdp.config import OptimizerConfig


def learning_rate(iteration: int, cfg: OptimizerConfig, train_iters: int) -> float:
    """Megatron's schedule at 1-based ``iteration``: linear warm-up, then cosine/linear decay to min-lr."""
    warmup = cfg.lr_warmup_iters
    if warmup > 0 and iteration <= warmup:
        return cfg.lr * iteration / warmup
    if cfg.lr_decay_style == "constant":
        return cfg.lr
    decay_iters = cfg.lr_decay_iters or train_iters
    if iteration > decay_iters:
        return cfg.min_lr
    ratio = (iteration - warmup) / max(1, decay_iters - warmup)
    if cfg.lr_decay_style == "linear":
        coeff = 1.0 - ratio
    else:
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return cfg.min_lr + coeff * (cfg.lr - cfg.min_lr)
