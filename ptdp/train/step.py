"""One training iteration: the schedule's forwards and backwards, gradient syncs, clip and step.

    forward and backward of the m microbatches (the rank's action list: a pipeline schedule when p > 1)
    the post-backward gradient synchronisations the assembly returned, in order
    clip the global gradient norm; the optimizer step with Megatron's learning-rate schedule
    the loss on every rank (``Assembly.reduce_loss``, shared with evaluation)

What each parallelism adds to this (its actions and their handlers, its stage, its gradient syncs, the
model's step hooks) comes from ``ptdp.parallel.assembly``; this module names none of them.
"""

from __future__ import annotations

import torch

from ptdp.observability.timeline import span
from ptdp.optim import learning_rate
from ptdp.parallel.pipeline.executor import ScheduleStats, run_schedule
from ptdp.train.batches import Microbatches
from ptdp.train.state import TrainState


def forward_backward(trainer: TrainState, iteration: int,
                     batch: int | None = None) -> tuple[torch.Tensor, ScheduleStats]:
    """Forward and backward of all m microbatches by this rank's pipeline schedule.

    ``batch``: which of the trainer's batches (``BatchFormat.global_batch_size`` samples each) to read,
    by default ``iteration - 1``; a fault-tolerant replica group reads shares of the global batch
    (``ptdp.train.replicas``).

    Returns the mean loss (non-zero on the last stage only) and what the executor measured. Each
    microbatch's loss is scaled by 1/m, so the accumulated gradients are those of the mean loss, and by
    the fp16 loss scale (a power of two, divided out of the returned loss exactly).
    """
    run, m = trainer.assembly, trainer.plan.m
    scale = trainer.optimizer.loss_scale
    for hook in run.step_hooks:
        hook.before_schedule(scale / m)
    index = iteration - 1 if batch is None else batch
    batches = Microbatches(trainer.data.train, index, trainer.batch_format, trainer.plan.groups, m)
    stage = run.make_stage(batches, loss_scale=scale)
    recorder = trainer.timeline.record if trainer.timeline else None
    # Saved activations are the same every iteration: count them (a hook per saved tensor) only once.
    count = trainer.peak_activation_bytes is None
    stats = run_schedule(trainer.schedule, stage, trainer.comm, run.handlers, recorder=recorder,
                         count_saved_bytes=count, device=trainer.plan.groups.device)
    if count:
        trainer.peak_activation_bytes = stats.peak_saved_bytes
    stats.peak_saved_bytes = trainer.peak_activation_bytes
    loss = total_loss(stats.losses, trainer.plan.groups.device)
    return (loss / scale if scale != 1.0 else loss), stats


def total_loss(losses: dict, device: torch.device) -> torch.Tensor:
    """The sum of the microbatch losses as a 0-dim fp32 tensor on ``device``, without reading them on the
    host: the executor keeps them as detached device tensors (plain floats are accepted too)."""
    values = [losses[k] for k in sorted(losses)]
    if not values:  # not the last stage
        return torch.zeros((), dtype=torch.float32, device=device)
    if all(isinstance(v, torch.Tensor) for v in values):
        return torch.stack([v.reshape(()).float() for v in values]).sum()
    return torch.tensor(float(sum(float(v) for v in values)), dtype=torch.float32, device=device)


def train_step(trainer: TrainState, iteration: int) -> dict:
    cfg = trainer.config
    # Megatron steps the LR schedule only on successful updates: an fp16 overflow skips the iteration and
    # leaves the schedule where it was (skipped_iterations is restored from checkpoints).
    lr = learning_rate(iteration - trainer.optimizer.skipped_iterations, cfg.optimizer, cfg.training.train_iters)
    for group in trainer.optimizer.param_groups:
        group["lr"] = lr
    trainer.assembly.start_iteration(trainer.plan.m)  # zero; --overlap-grad-reduce counts backwards
    loss, stats = forward_backward(trainer, iteration)
    for sync in trainer.assembly.grad_syncs:
        with span(trainer.timeline, sync.name):
            sync()
    with span(trainer.timeline, "optimizer_step", "compute"):  # unscale, clip, step, sharded params gathered
        grad_norm, _ = trainer.optimizer.step()
    loss = trainer.assembly.reduce_loss(loss)  # summed over the pipeline, averaged over the replicas
    # "loss" and "grad_norm" stay 0-dim device tensors: the host does not wait for the GPU here.
    # read_records turns them into floats (and adds the pipeline metrics) once per logged iteration.
    record = {"loss": loss, "lr": lr, "grad_norm": grad_norm, "loss_scale": trainer.optimizer.loss_scale,
              "skipped_iterations": trainer.optimizer.skipped_iterations, "schedule_stats": stats}
    for hook in trainer.assembly.step_hooks:
        record |= hook.after_step()
    return record
