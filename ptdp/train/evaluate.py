"""Validation loss with every parallel layout: the training schedule's forward half, without gradients.

The forward-only action list is the training schedule's forwards, in the same order, with communication
placed for that list (``build_schedule(..., forward_only=True)``): striking the backwards out of the
training list would keep batches cut for them, which NCCL can hang on. The one executor runs it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ptdp.data import get_microbatch
from ptdp.observability import flight_recorder
from ptdp.parallel.collectives import group_size
from ptdp.parallel.pipeline.executor import run_schedule
from ptdp.parallel.vocab.stage import VocabStage
from ptdp.schedule.actions import virtual_stage
from ptdp.schedule.registry import build_schedule
from ptdp.schedule.vocab import vocab_barriers
from ptdp.train.state import TrainState
from ptdp.train.step import cp_shard, language_model_loss


class ForwardOnlyStage:
    """A pipeline stage that runs its chunks without autograd and keeps only the last stage's losses."""

    def __init__(self, chunks: Sequence[nn.Module], rank: int, p: int, first_input, loss_fn,
                 placement: str = "loop"):
        self.chunks, self.rank, self.p, self.placement = list(chunks), rank, p, placement
        self.first_input, self.loss_fn = first_input, loss_fn
        self.losses: dict[int, Tensor] = {}

    def forward(self, chunk: int, microbatch: int, input: Tensor | None) -> Tensor | None:
        stage = virtual_stage(self.rank, chunk, self.p, self.placement)
        x = self.first_input(microbatch) if stage == 0 else input
        with torch.no_grad():
            y = self.chunks[chunk](x)
            if stage == self.p * len(self.chunks) - 1:
                self.losses[microbatch] = self.loss_fn(y, microbatch)
                return None
        return y


def evaluate(trainer: TrainState, dataset, eval_iters: int,
             interrupted: Callable[[], bool] | None = None) -> float | None:
    """Mean loss over ``eval_iters`` global batches of ``dataset`` (the same batches every time).
    ``interrupted`` (collective: every rank calls it after each batch and gets the same answer) cuts the
    evaluation short for a Ctrl-C or SIGTERM: then None, no partial loss."""
    cfg, state, m = trainer.config, trainer.state, trainer.num_microbatches
    tr = cfg.training
    par = trainer.config.parallel
    barriers = vocab_barriers(par)  # issue 24: the forward-only list with the S and T (loss only) passes
    actions = build_schedule(par.schedule, state.dims.pp, par.virtual_size, m, state.pp_rank, forward_only=True,
                             vocab_barriers=barriers)
    for chunk in trainer.chunks:
        chunk.eval()
    total = 0.0
    try:
        for k in range(eval_iters):
            # A heartbeat per batch: a long evaluation is progress, not a hang (--hang-timeout-s), whatever
            # the layout (with p = 1 it issues no communication the flight recorder would see until the end).
            flight_recorder.record("evaluation", action=f"validation batch {k + 1}/{eval_iters}")
            batches = {
                j: get_microbatch(dataset, k, tr.global_batch_size, state.dp_rank, state.dims.dp,
                                  tr.micro_batch_size, j).to(state.device)
                for j in range(m)
            }

            def loss_fn(logits: Tensor, j: int, batches=batches) -> Tensor:
                return language_model_loss(logits, cp_shard(batches[j][:, 1:], state), state.tp_group) / m

            stage = ForwardOnlyStage(trainer.chunks, state.pp_rank, state.dims.pp,
                                     lambda j, batches=batches: cp_shard(batches[j][:, :-1], state), loss_fn,
                                     state.placement)
            if barriers:
                stage = VocabStage(trainer.chunks, state.pp_rank, state.dims.pp, len(trainer.chunks),
                                   lambda j, batches=batches: cp_shard(batches[j][:, :-1], state),
                                   lambda j, batches=batches: cp_shard(batches[j][:, 1:], state), 1.0 / m, m,
                                   state.placement, barriers, state.pp_group,
                                   state.tp_group, state.pipeline_ranks(), par.sequence_parallel, forward_only=True)
            with torch.no_grad():
                run_schedule(actions, stage, trainer.comm, param_sync=trainer.grads.param_sync)
            total += float(sum(stage.losses.values()))
            if interrupted is not None and interrupted():
                return None
    finally:
        for chunk in trainer.chunks:
            chunk.train()
    loss = torch.tensor(total / eval_iters, dtype=torch.float64, device=state.device)
    if group_size(state.pp_group) > 1:
        dist.all_reduce(loss, group=state.pp_group)
    dp_cp = state.dp_cp_group  # CP ranks: the same samples, other tokens
    if group_size(dp_cp) > 1:
        dist.all_reduce(loss.div_(group_size(dp_cp)), group=dp_cp)
    return loss.item()


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 700.0))
