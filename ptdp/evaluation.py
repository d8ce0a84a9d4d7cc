"""Validation loss with every parallel layout: the training schedule's forward half, without gradients.

The forward-only action list is the training schedule's forwards, in the same order, with communication
placed for that list (``build_schedule(..., forward_only=True)``): striking the backwards out of the
training list would keep batches cut for them, which NCCL can hang on. The one executor runs it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .data import get_microbatch
from .model import language_model_loss
from .pipeline.executor import run_schedule
from .pipeline.schedules import build_schedule, virtual_stage
from .tensor_parallel.mappings import group_size


class ForwardOnlyStage:
    """A pipeline stage that runs its chunks without autograd and keeps only the last stage's losses."""

    def __init__(self, chunks: Sequence[nn.Module], rank: int, p: int, first_input, loss_fn):
        self.chunks, self.rank, self.p = list(chunks), rank, p
        self.first_input, self.loss_fn = first_input, loss_fn
        self.losses: dict[int, Tensor] = {}

    def forward(self, chunk: int, microbatch: int, input: Tensor | None) -> Tensor | None:
        stage = virtual_stage(self.rank, chunk, self.p)
        x = self.first_input(microbatch) if stage == 0 else input
        with torch.no_grad():
            y = self.chunks[chunk](x)
            if stage == self.p * len(self.chunks) - 1:
                self.losses[microbatch] = self.loss_fn(y, microbatch)
                return None
        return y


def evaluate(trainer, dataset, eval_iters: int) -> float:
    """Mean loss over ``eval_iters`` global batches of ``dataset`` (the same batches every time)."""
    cfg, state, m = trainer.config, trainer.state, trainer.num_microbatches
    tr = cfg.training
    par = trainer.config.parallel
    actions = build_schedule(par.schedule, state.dims.pp, par.virtual_size, m, state.pp_rank, forward_only=True)
    for chunk in trainer.chunks:
        chunk.eval()
    total = 0.0
    try:
        for k in range(eval_iters):
            batches = {
                j: get_microbatch(dataset, k, tr.global_batch_size, state.dp_rank, state.dims.dp,
                                  tr.micro_batch_size, j).to(state.device)
                for j in range(m)
            }

            def loss_fn(logits: Tensor, j: int, batches=batches) -> Tensor:
                return language_model_loss(logits, batches[j][:, 1:], state.tp_group) / m

            stage = ForwardOnlyStage(trainer.chunks, state.pp_rank, state.dims.pp,
                                     lambda j, batches=batches: batches[j][:, :-1], loss_fn)
            run_schedule(actions, stage, trainer.comm)
            total += float(sum(stage.losses.values()))
    finally:
        for chunk in trainer.chunks:
            chunk.train()
    loss = torch.tensor(total / eval_iters, dtype=torch.float64, device=state.device)
    if group_size(state.pp_group) > 1:
        dist.all_reduce(loss, group=state.pp_group)
    if group_size(state.dp_group) > 1:
        dist.all_reduce(loss.div_(state.dims.dp), group=state.dp_group)
    return loss.item()


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 700.0))
