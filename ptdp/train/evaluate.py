"""Validation loss with every parallel layout: the training schedule's forward half, without gradients.

The forward-only action list is the training schedule's forwards, in the same order, with communication
placed for that list (``build_schedule(..., forward_only=True)``, through the assembly): striking the
backwards out of the training list would keep batches cut for them, which NCCL can hang on. The one
executor runs it on the training step's stage in its forward-only mode.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ptdp.observability import flight_recorder
from ptdp.parallel.pipeline.executor import run_schedule
from ptdp.train.batches import Microbatches
from ptdp.train.state import TrainState


def never() -> bool:
    """The stop flag of a run that is never interrupted (a test, ``evaluate`` called on its own)."""
    return False


def evaluate(trainer: TrainState, dataset, eval_iters: int,
             interrupted: Callable[[], bool] = never) -> float | None:
    """Mean loss over ``eval_iters`` global batches of ``dataset`` (the same batches every time).
    ``interrupted`` (the run controller's stop flag, collective: every rank calls it after each batch and
    gets the same answer) cuts the evaluation short for a Ctrl-C or SIGTERM: then None, no partial loss."""
    run, groups = trainer.assembly, trainer.plan.groups
    actions = run.actions(forward_only=True)
    for chunk in trainer.chunks:
        chunk.eval()
    total = 0.0
    try:
        for k in range(eval_iters):
            # A heartbeat per batch: a long evaluation is progress, not a hang (--hang-timeout-s), whatever
            # the layout (with p = 1 it issues no communication the flight recorder would see until the end).
            flight_recorder.record("evaluation", action=f"validation batch {k + 1}/{eval_iters}")
            batches = Microbatches(dataset, k, trainer.batch_format, groups, trainer.plan.m)
            stage = run.make_stage(batches, forward_only=True)
            with torch.no_grad():
                run_schedule(actions, stage, trainer.comm, run.handlers, device=groups.device)
            total += float(sum(stage.losses.values()))
            if interrupted():
                return None
    finally:
        for chunk in trainer.chunks:
            chunk.train()
    loss = torch.tensor(total / eval_iters, dtype=torch.float64, device=groups.device)
    return run.reduce_loss(loss).item()


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 700.0))
