"""Partial gradients over the tensor-parallel group: summed once after the backward.

Some parameters are replicated on every tensor-parallel rank while each rank's gradient covers only part
of what the parameter acted on; their placements say ``partial_over=("tp",)`` (``ptdp.parallel.placement``,
recorded by the tensor- and expert-parallel apply steps from the model's sharding rules). Two cases:

- under sequence parallelism (Korthikanti et al., 2022) each rank runs the norms, the row-parallel biases
  and the MoE router on its own s/t tokens: its gradient is a partial sum over the tokens;
- a per-head norm of the queries or keys (Qwen3, Gemma 3, OLMo 2) acts on every head, and each rank holds
  a/t heads: its gradient is a partial sum over the heads, with or without sequence parallelism.

Summing them over the TP group makes them the full gradients again, equal on every TP rank (so the grad
norm counts them once, on TP rank 0). Run it after the data-parallel gradient sync (as Megatron's
``finalize_model_grads`` does), so it never races an overlapped DP reduction; sum over TP and average over
DP commute. With the distributed optimizer only this rank's DP shard is valid afterwards, and every TP
rank has the same shard layout, so the shard's elements are still summed correctly.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ptdp.parallel.collectives import all_reduce, group_size
from ptdp.parallel.placement import Placements


def tp_partial_grads(params: Iterable[nn.Parameter], placements: Placements) -> list[torch.Tensor]:
    """The gradients of those of ``params`` partial over TP, in their order: the fp32 ``main_grad`` where
    mixed precision keeps one."""
    grads = (main if (main := getattr(p, "main_grad", None)) is not None else p.grad
             for p in params if placements.partial_over(p, "tp"))
    return [g for g in grads if g is not None]


@torch.no_grad()
def all_reduce_tp_partial_grads(params: Iterable[nn.Parameter], tp_group, placements: Placements) -> None:
    """Sum the gradients that are partial over TP across the TP group, in one flat all-reduce."""
    grads = tp_partial_grads(params, placements)
    if not grads or group_size(tp_group) == 1:
        return
    flat = all_reduce(_flatten_dense_tensors(grads), tp_group)
    for grad, synced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
        grad.copy_(synced)
